"""The runner's persistent int32 block tables (`engine.runners.block_tables`): each live sequence's row
holds exactly its block table through every way the list changes, only new entries are
copied, and `plan_step` reads its slots and blocks from the rows."""

from __future__ import annotations

import random

import torch

from actorserve.engine.scheduling.block_manager import BlockManager
from actorserve.engine.runners.block_tables import BlockTables
from actorserve.engine.runners.paged_attention import plan_step
from actorserve.engine.scheduling.sequence import Sequence


def _mirrors(tables: BlockTables, seqs: list[Sequence]) -> None:
    rows = [tables.row(s) for s in seqs]
    assert len(set(rows)) == len(rows), "two live sequences share a row"
    for s, r in zip(seqs, rows):
        assert tables.table[r, :len(s.block_table)].tolist() == s.block_table


def test_rows_follow_appends_frees_reallocation_and_replaced_lists():
    rng = random.Random(7)
    bm = BlockManager(64, 4)
    tables = BlockTables(4, width=2, rows=2)        # small: rows and width must grow
    live: list[Sequence] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.15 or not live:
            s = Sequence(f"r{step}", [rng.randrange(50) for _ in range(rng.randint(1, 9))])
            bm.match_prefix(s)
            if bm.allocate(s, s.num_uncomputed):
                live.append(s)
            else:
                bm.abort_match(s)
                bm.free(s)
        elif op < 0.6:                               # a step: computes and grows
            s = rng.choice(live)
            n = rng.randint(1, 6)
            if bm.allocate(s, n):
                s.num_computed += n
                s.output_ids.extend([1] * max(0, s.num_computed - s.num_tokens))
        elif op < 0.75:                              # retraction: freed, re-admitted to the same length
            s = rng.choice(live)
            length = s.num_computed
            bm.free(s)
            if not bm.allocate(s, max(1, length)):
                live.remove(s)
                tables.release(s)
        elif op < 0.8:                               # a list replaced wholesale, same length
            s = rng.choice(live)
            s.block_table = list(reversed(s.block_table))
        else:                                        # finished
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
            tables.release(s)
        _mirrors(tables, live)
    assert tables.table.shape[0] >= 2 and len(tables) == len(live)


def test_a_decode_copies_one_entry_per_new_block():
    bs = 16
    bm = BlockManager(64, bs)
    tables = BlockTables(bs)
    s = Sequence("r", list(range(1, 34)))            # 33 tokens: 3 blocks
    bm.allocate(s, s.num_uncomputed)
    plan_step([(s, s.num_uncomputed)], tables, 1)
    s.num_computed = s.num_tokens
    assert tables.copied == 3
    for t in range(200):                             # 200 decode steps
        s.output_ids.append(t)
        bm.allocate(s, 1)
        plan_step([(s, 1)], tables, 1)
        s.num_computed += 1
    assert len(s.block_table) == -(-233 // bs) == 15
    assert tables.copied == 15                       # each entry once, not once per step
    tables.release(s)
    assert len(tables) == 0


def test_plan_reads_slots_and_blocks_from_the_rows():
    rng = random.Random(3)
    bs = 4
    bm = BlockManager(256, bs)
    tables = BlockTables(bs, width=1, rows=1)
    seqs = [Sequence(f"r{i}", [rng.randrange(90) for _ in range(rng.randint(2, 40))]) for i in range(12)]
    for step in range(30):
        batch = []
        for s in seqs:
            if s.num_computed < len(s.prompt_ids):
                n = min(rng.randint(1, 9), s.num_uncomputed)
            else:
                s.output_ids.append(rng.randrange(90))
                n = 1
            if step % 7 == 3 and s is seqs[step % 12]:   # retract one now and then
                bm.free(s)
                n = s.num_uncomputed
            assert bm.allocate(s, n)
            batch.append((s, n))
        plan = plan_step(batch, tables, 2)
        want = [s.block_table[p // bs] * bs + p % bs
                for s, n in batch for p in range(s.num_computed, s.num_computed + n)]
        assert plan.slots.tolist() == want
        assert plan.slots.dtype == torch.long
        for c in plan.chunks:
            s = next(s for s, n in batch if n > 1 and plan.last_rows[batch.index((s, n))] == c.row + c.n - 1)
            assert c.blocks.tolist() == s.block_table[:c.blocks.numel()]
        for g in plan.decode:
            nb = g.blocks.numel() // g.rows.numel()
            for j, row in enumerate(g.rows.tolist()):
                s = batch[plan.last_rows.index(row)][0]
                need = -(-(s.num_computed + 1) // bs)
                assert g.blocks[j * nb:j * nb + need].tolist() == s.block_table[:need]
                assert int(g.mask[j].sum()) == s.num_computed + 1
        for s, n in batch:
            s.num_computed += n
