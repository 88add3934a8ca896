"""Decode attention grouped by context length (`engine.runners.paged_attention`): the groups, and
attention over them equal to attending each sequence alone over exactly its own context."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from actorserve.engine.runners.block_tables import BlockTables
from actorserve.engine.runners.paged_attention import PagedKV, group_by_length, paged_attention, plan_step
from actorserve.engine.scheduling.sequence import Sequence


def test_groups_pad_to_at_most_twice_the_shortest_or_eight_blocks_more():
    needs = [1, 40, 2, 9, 41, 3, 90, 1]
    groups = group_by_length(needs)
    assert groups == [[0, 2, 3, 5, 7], [1, 4], [6]]
    for g in groups:
        assert g == sorted(g)
        lo, hi = min(needs[i] for i in g), max(needs[i] for i in g)
        assert hi <= 2 * lo or hi <= lo + 8
    assert sorted(i for g in groups for i in g) == list(range(len(needs)))
    assert group_by_length([5] * 6) == [list(range(6))]        # one length: one group, in order
    assert group_by_length([]) == []


def _seq(i: int, ctx: int, bs: int, free: list[int]) -> Sequence:
    seq = Sequence(f"r{i}", list(range(1, ctx + 1)))
    seq.block_table = [free.pop() for _ in range(-(-ctx // bs))]
    seq.num_computed = ctx - 1                 # the step computes its last token
    return seq


def test_grouped_decode_equals_each_sequence_alone():
    torch.manual_seed(0)
    rng = random.Random(1)
    bs, nkv, group, d, layers = 4, 2, 3, 8, 1
    kv = PagedKV(layers, 256, bs, nkv, d)
    for t in (kv.k[0], kv.v[0]):
        t.copy_(torch.randn_like(t))
    free = list(range(256))
    rng.shuffle(free)
    ctxs = [3, 5, 130, 4, 7, 260, 2, 64, 6]          # short ones beside two long ones
    seqs = [_seq(i, c, bs, free) for i, c in enumerate(ctxs)]
    batch = [(s, 1) for s in seqs]
    plan = plan_step(batch, BlockTables(bs), group)
    assert len(plan.decode) == 3 and not plan.chunks           # the long ones apart
    q = torch.randn(len(seqs), nkv * group, d)
    out = torch.empty(len(seqs), nkv * group * d)
    paged_attention(q, kv, 0, plan, out, scale=d ** -0.5)
    for row, s in enumerate(seqs):
        slots = torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(ctxs[row])])
        k = kv.k[0][slots].transpose(0, 1)                     # [nkv, L, d]
        v = kv.v[0][slots].transpose(0, 1)
        qr = q[row].view(nkv, group, d)
        ref = F.scaled_dot_product_attention(qr, k, v, scale=d ** -0.5).reshape(-1)
        torch.testing.assert_close(out[row], ref, atol=1e-5, rtol=1e-5)


def test_one_length_keeps_one_dense_group():
    bs = 4
    free = list(range(64))
    seqs = [_seq(i, 9, bs, free) for i in range(5)]
    plan = plan_step([(s, 1) for s in seqs], BlockTables(bs), 1)
    assert len(plan.decode) == 1 and plan.decode[0].dense
    assert plan.decode[0].rows.tolist() == list(range(5))


def test_a_step_lays_chunks_out_as_decode_rows_only_while_their_context_is_short():
    """`plan_step(..., inplace=True, decode_rows=N)`: a step of at most N tokens holding a fresh
    prompt's chunk is one dense decode group (every row attends at its own length); the tail of
    a long prompt, whose rows would read more than `DECODE_ROWS_CONTEXT` tokens in all, stays a
    chunk."""
    from actorserve.engine.runners import paged_attention as pa

    bs = 16
    free = list(range(400))
    dec = _seq(0, 30, bs, free)
    fresh = Sequence("fresh", list(range(1, 201)))
    fresh.block_table = [free.pop() for _ in range(-(-200 // bs))]
    plan = plan_step([(dec, 1), (fresh, 200)], BlockTables(bs), 1, inplace=True, decode_rows=256)
    assert not plan.chunks and len(plan.decode) == 1 and plan.decode[0].dense
    assert plan.decode[0].ctx.tolist() == [30, *range(1, 201)]
    tail = Sequence("tail", list(range(1, 1001)))
    tail.block_table = [free.pop() for _ in range(-(-1000 // bs))]
    tail.num_computed = 800                   # 200 rows at 801..1000: ~180k context tokens
    assert 200 * 800 + 200 * 201 // 2 > pa.DECODE_ROWS_CONTEXT
    plan = plan_step([(dec, 1), (tail, 200)], BlockTables(bs), 1, inplace=True, decode_rows=256)
    assert len(plan.chunks) == 1 and plan.chunks[0].start == 800 and len(plan.decode) == 1
    plan = plan_step([(dec, 1), (fresh, 200)], BlockTables(bs), 1, inplace=True, decode_rows=100)
    assert len(plan.chunks) == 1                # wider than decode_rows: a chunk too
