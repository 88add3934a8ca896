"""`BlockTables`: the runner's persistent int32 mirror of every live sequence's block table.

The scheduler's `BlockManager` owns each ``Sequence.block_table`` (a Python list it only ever
appends to or clears). The paged runner needs the same tables as tensors every step: to turn
positions into KV slots and to gather a decode group's blocks. Building them from the lists
each step costs a Python loop over every block of every member (a 2k-token context is 128
entries, 256 members are 32k list items per step). Instead each sequence gets a row of one
persistent ``[rows, width]`` int32 tensor the first time it is planned, and each step copies
in only the entries appended since the last one: a decode step touches a row once every
``block_size`` tokens. A cleared table (``BlockManager.free`` bumps ``Sequence.table_epoch``:
abort, retraction, finish) or a list replaced wholesale is copied again from the start.

Entries past a row's live length are stale block ids (or 0), never out of range: gathers may
read them as padding, which the attention masks out. Rows come back with `release`.
"""

from __future__ import annotations

import torch

from ..scheduling.sequence import Sequence


class BlockTables:
    def __init__(self, block_size: int, width: int = 64, rows: int = 16) -> None:
        self.block_size = block_size
        self.table = torch.zeros((rows, max(1, width)), dtype=torch.int32)
        # per sequence: [row, entries mirrored, the epoch and the list they were mirrored from]
        self._of: dict[Sequence, list] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self.copied = 0          # entries copied in from the lists, ever (what the mirroring costs)

    def __len__(self) -> int:
        return len(self._of)

    def row(self, seq: Sequence) -> int:
        """`seq`'s row, made to hold exactly its current block table (in the first
        ``len(seq.block_table)`` columns)."""
        entries = seq.block_table
        st = self._of.get(seq)
        if st is None:
            if not self._free:
                self._grow_rows()
            st = self._of[seq] = [self._free.pop(), 0, seq.table_epoch, entries]
        elif st[2] != seq.table_epoch or st[3] is not entries or len(entries) < st[1]:
            st[1], st[2], st[3] = 0, seq.table_epoch, entries
        n = len(entries)
        if n > st[1]:
            if n > self.table.shape[1]:
                self._grow_width(n)
            self.table[st[0], st[1]:n] = torch.tensor(entries[st[1]:n], dtype=torch.int32)
            self.copied += n - st[1]
            st[1] = n
        return st[0]

    def release(self, seq: Sequence) -> None:
        st = self._of.pop(seq, None)
        if st is not None:
            self._free.append(st[0])

    def _grow_rows(self) -> None:
        old = self.table
        self.table = torch.zeros((2 * old.shape[0], old.shape[1]), dtype=torch.int32)
        self.table[:old.shape[0]] = old
        self._free.extend(range(2 * old.shape[0] - 1, old.shape[0] - 1, -1))

    def _grow_width(self, need: int) -> None:
        old = self.table
        self.table = torch.zeros((old.shape[0], max(need, 2 * old.shape[1])), dtype=torch.int32)
        self.table[:, :old.shape[1]] = old
