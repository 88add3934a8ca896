"""The in-place decode attention kernel (`engine.kernels.decode_kernel`, `csrc/paged_decode.c`):
built here, equal to attending each sequence alone over exactly its own context, for both
cache dtypes, GQA groups, soft-capping, head sizes with and without a specialised copy, both
ways of splitting the work; and the fallback when it cannot be built."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from actorserve.engine.kernels import cbuild
from actorserve.engine.kernels import decode_kernel as dk
from actorserve.engine.runners.block_tables import BlockTables
from actorserve.engine.runners.paged_attention import PagedKV, paged_attention, plan_step
from actorserve.engine.scheduling.sequence import Sequence


needs_cc = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler to build the kernel "
                              "(make setup installs gcc where it can)")


def _reference(q, k_cache, v_cache, seq, ctx, bs, scale, softcap):  # type: ignore[no-untyped-def]
    """One sequence alone, float32: q [nkv, g, d] over its first `ctx` tokens."""
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(ctx)])
    k = k_cache[slots].float().transpose(0, 1)            # [nkv, L, d]
    v = v_cache[slots].float().transpose(0, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return torch.matmul(torch.softmax(s, dim=-1), v)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nkv,g,d,n_seqs,softcap", [
    (3, 3, 64, 9, None),        # SmolLM2's heads, many sequences: whole sequences per unit
    (2, 4, 128, 2, None),       # few sequences: a unit per head
    (1, 1, 80, 5, 30.0),        # no specialised copy for d = 80; soft-capped (Gemma2)
    (4, 1, 64, 3, 5.0),         # plain multi-head, a cap that bites
])
def test_kernel_equals_each_sequence_alone(dtype, nkv, g, d, n_seqs, softcap):
    kernel, why = dk.load("inplace")
    assert kernel is not None and why.startswith("inplace")
    _check_against_each_sequence_alone(kernel, dtype, nkv, g, d, n_seqs, softcap)


@needs_cc
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx2", "-mno-avx512f")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_portable_builds_compute_the_same(tmp_path, flags, dtype):
    """The vector code (GCC vector extensions, AVX-512 intrinsics where the CPU has them)
    built as for an AVX2-only and an SSE-only CPU: the same results, for the specialised head
    sizes (64, 128) and the plain one."""
    import ctypes
    path = cbuild.build("paged_decode", tmp_path, extra_flags=flags)
    kernel = dk.DecodeKernel(ctypes.CDLL(str(path)), path)
    for nkv, g, d, n_seqs, softcap in [(3, 3, 64, 9, None), (2, 4, 128, 2, 20.0), (1, 1, 80, 3, None)]:
        _check_against_each_sequence_alone(kernel, dtype, nkv, g, d, n_seqs, softcap)


def _check_against_each_sequence_alone(kernel, dtype, nkv, g, d, n_seqs, softcap):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    rng = random.Random(d + n_seqs)
    bs, nblocks = 4, 400
    kv = PagedKV(1, nblocks, bs, nkv, d, dtype)
    for t in (kv.k[0], kv.v[0]):
        t.copy_(torch.randn(t.shape) * 2)
    free = list(range(nblocks))
    rng.shuffle(free)
    ctxs = [rng.choice([1, 2, 3, 5, 17, 64, 301]) for _ in range(n_seqs)]
    seqs = []
    for i, c in enumerate(ctxs):
        s = Sequence(f"r{i}", list(range(1, c + 1)))
        s.block_table = [free.pop() for _ in range(-(-c // bs) + rng.randint(0, 2))]   # spare blocks too
        s.num_computed = c - 1
        seqs.append(s)
    plan = plan_step([(s, 1) for s in seqs], BlockTables(bs), g, inplace=True)
    assert len(plan.decode) == 1 and plan.decode[0].mask is None
    q = torch.randn(n_seqs, nkv * g, d).to(dtype)
    out = torch.empty(n_seqs, nkv * g * d, dtype=dtype)
    scale = d ** -0.5
    paged_attention(q, kv, 0, plan, out, scale, softcap, kernel)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for row, (s, c) in enumerate(zip(seqs, ctxs)):
        ref = _reference(q[row].float().view(nkv, g, d), kv.k[0], kv.v[0], s, c, bs, scale, softcap)
        torch.testing.assert_close(out[row].float(), ref.reshape(-1).to(dtype).float(), atol=tol, rtol=tol)


@needs_cc
def test_kernel_matches_the_gather_path_in_a_mixed_step():
    """Decodes beside a prefill chunk: the kernel path and the gather + SDPA path agree."""
    kernel, _ = dk.load("inplace")
    torch.manual_seed(1)
    bs, nkv, g, d = 4, 2, 3, 64
    kv = PagedKV(1, 128, bs, nkv, d)
    for t in (kv.k[0], kv.v[0]):
        t.copy_(torch.randn(t.shape))
    free = list(range(128))
    seqs = []
    for i, c in enumerate([9, 40, 3, 70]):
        s = Sequence(f"r{i}", list(range(1, c + 1)))
        s.block_table = [free.pop() for _ in range(-(-c // bs))]
        s.num_computed = c - 1 if i != 1 else 20        # r1 computes a 20-token chunk
        seqs.append(s)
    batch = [(s, 1 if i != 1 else 20) for i, s in enumerate(seqs)]
    outs = []
    for kern in (kernel, None):
        plan = plan_step(batch, BlockTables(bs), g, inplace=kern is not None)
        q = torch.randn(plan.num_tokens, nkv * g, d, generator=torch.Generator().manual_seed(5))
        out = torch.zeros(plan.num_tokens, nkv * g * d)
        paged_attention(q, kv, 0, plan, out, d ** -0.5, None, kern)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@needs_cc
def test_built_once_and_reused(tmp_path):
    first = dk.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert dk.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]      # no temporary left behind


def test_gather_when_asked_or_when_it_cannot_be_built(monkeypatch):
    assert dk.load("gather") == (None, "gather+sdpa (asked for)")
    with pytest.raises(ValueError, match="unknown decode attention"):
        dk.load("fast")
    monkeypatch.setattr(dk, "_loaded", {})
    monkeypatch.setattr(cbuild, "compiler", lambda: None)
    kernel, why = dk.load("auto")
    assert kernel is None and "no C compiler" in why and why.startswith("gather+sdpa")
    with pytest.raises(RuntimeError, match="cannot be built"):
        dk.load("inplace")
