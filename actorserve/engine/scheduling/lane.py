"""`Lane`: a FIFO queue of waiting sequences with O(1) removal from anywhere.

The scheduler's waiting queues used to be deques: popping the head is O(1), but an abort
removes a sequence from the middle, which is a linear scan: n queued requests aborted one by
one in any order but arrival's (clients that disconnect, deadlines, a probe looked up in the
other lane first) cost O(n²) (`benchmarks/lane_removal.py`: 10,000 in random order, 0.56 s
with a deque, 0.011 s here). A `Lane` is an
``OrderedDict`` keyed by the sequence's identity: its doubly linked list keeps the order and
makes every operation the scheduler needs O(1): append at the tail, put back at the head
(retraction), pop or peek the head, and remove any member (`discard`). A plain ``dict`` would
not do: popping its head leaves a hole that every later look at the head walks over again.

A lane also keeps the sum of its members' prompt lengths (`tokens`): admission by queued
prompt tokens (``--max-queued-tokens``) reads it in O(1).

The surface is the subset of ``deque`` the scheduler and the batching policy use, with the
same meaning (``extendleft`` reverses its argument, as ``deque.extendleft`` does), so a
policy written against a deque reads the same; a sequence is in a lane at most once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any


def _tokens(seq: Any) -> int:
    ids = getattr(seq, "prompt_ids", None)
    return len(ids) if ids is not None else 0


class Lane:
    __slots__ = ("_items", "tokens")

    def __init__(self, items: Iterable[Any] = ()) -> None:
        self._items: OrderedDict[int, Any] = OrderedDict()
        self.tokens = 0             # prompt tokens of the members
        for seq in items:
            self.append(seq)

    def append(self, seq: Any) -> None:
        """Add `seq` at the tail."""
        key = id(seq)
        if key in self._items:
            raise ValueError(f"{seq!r} is already in the lane")
        self._items[key] = seq
        self.tokens += _tokens(seq)

    def appendleft(self, seq: Any) -> None:
        """Add `seq` at the head (it is served next)."""
        self.append(seq)
        self._items.move_to_end(id(seq), last=False)

    def extendleft(self, seqs: Iterable[Any]) -> None:
        """`appendleft` each in turn, as ``deque.extendleft``: the last one ends up first."""
        for seq in seqs:
            self.appendleft(seq)

    def peek(self) -> Any:
        """The head, left in place; IndexError when the lane is empty."""
        if not self._items:
            raise IndexError("peek from an empty lane")
        return next(iter(self._items.values()))

    def popleft(self) -> Any:
        """Remove and return the head; IndexError when the lane is empty."""
        if not self._items:
            raise IndexError("pop from an empty lane")
        seq = self._items.popitem(last=False)[1]
        self.tokens -= _tokens(seq)
        return seq

    def discard(self, seq: Any) -> bool:
        """Remove `seq` wherever it is; True if it was there. O(1)."""
        gone = self._items.pop(id(seq), None)
        if gone is None:
            return False
        self.tokens -= _tokens(gone)
        return True

    def rotate(self, n: int = 1) -> None:
        """As ``deque.rotate``: move `n` members from the tail to the head (negative: the other way)."""
        if len(self._items) < 2:
            return
        n %= len(self._items)
        for _ in range(n):
            key = next(reversed(self._items))
            self._items.move_to_end(key, last=False)

    def clear(self) -> None:
        self._items.clear()
        self.tokens = 0

    def __contains__(self, seq: object) -> bool:
        return self._items.get(id(seq)) is seq

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __repr__(self) -> str:
        return f"Lane({list(self._items.values())!r})"
