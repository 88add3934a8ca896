"""The prompt-chunk attention kernel (`engine.kernels.prefill_kernel`, `csrc/prefill_attn.c`):
causal attention within float32's reach, no key past the chunk read, a row's result its own,
strided query rows, GQA groups, both head sizes, chunks after cached context; and where it
cannot run (no avx512_bf16), torch's paths, said so."""

from __future__ import annotations

import ctypes

import pytest
import torch

from actorserve.engine.kernels import cbuild
from actorserve.engine.kernels import prefill_kernel as pk
from actorserve.engine.runners import prefill_attention as pa

KERNEL = pk.load("auto")[0] if cbuild.compiler() is not None else None
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the prefill kernel needs avx512_bf16 and a C compiler")


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int) -> torch.Tensor:
    """Float32 causal attention of q's rows (positions start..) over k / v's first start + n keys."""
    n, nh, _ = q.shape
    nkv = k.shape[1]
    kk = k[:start + n].float().transpose(0, 1).repeat_interleave(nh // nkv, 0)
    vv = v[:start + n].float().transpose(0, 1).repeat_interleave(nh // nkv, 0)
    s = q.float().transpose(0, 1) @ kk.transpose(1, 2) * scale
    later = torch.arange(start + n)[None] > torch.arange(start, start + n)[:, None]
    return (torch.softmax(s.masked_fill(later, float("-inf")), -1) @ vv).transpose(0, 1)


def _case(n: int, start: int, nkv: int, g: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    L = start + n + 16
    q = (torch.randn(n, nkv * g, d) * 2).bfloat16()
    k, v = (torch.randn(L, nkv, d) * 2).bfloat16(), torch.randn(L, nkv, d).bfloat16()
    k[start + n:], v[start + n:] = float("nan"), float("nan")          # past the chunk: never read
    return q, k, v


@needs_kernel
@pytest.mark.parametrize("n,start,nkv,g,d", [
    (256, 0, 3, 3, 64),         # SmolLM2's heads, one whole prompt
    (517, 0, 3, 3, 64),         # not a multiple of the 16-query units or the 16-key tiles
    (1, 0, 3, 3, 64),           # one token
    (100, 200, 2, 4, 128),      # after cached context, head size 128
    (33, 815, 4, 2, 64),        # a short chunk after a long context
    (17, 5, 1, 8, 128),         # a wide group, odd lengths
    (40, 0, 8, 1, 64),          # plain multi-head attention
])
def test_the_kernel_computes_causal_attention_and_reads_no_key_past_the_chunk(n, start, nkv, g, d):
    q, k, v = _case(n, start, nkv, g, d, seed=n + start)
    out = torch.empty(n, nkv * g, d, dtype=torch.bfloat16)
    assert KERNEL.takes(q, k, v, out)
    KERNEL.run(q, k, v, d ** -0.5, out, start)
    assert not out.isnan().any()
    err = (out.float() - _exact(q, k, v, d ** -0.5, start)).abs().max()
    assert err < 0.03, err                           # bf16 inputs, weights and output
    # the torch blocks' distance from float32 on the same case, for scale: the kernel is no further
    if start == 0 and n >= pa.MIN_ROWS or start and n >= pa.MIN_ROWS_AFTER:
        blocks = torch.empty_like(out)
        pa.causal_blocked(q, k, v, d ** -0.5, blocks, start)
        assert err <= 1.2 * (blocks.float() - _exact(q, k, v, d ** -0.5, start)).abs().max()


@needs_kernel
def test_a_rows_attention_is_its_own_and_query_rows_may_be_strided():
    """The first rows of a chunk give the same bits alone (units and register blocks are cut
    elsewhere); query rows inside a wider q/k/v product's output (a row stride of all three)
    give the bits of contiguous ones."""
    nkv, g, d, n = 3, 3, 64, 300
    q, k, v = _case(n, 0, nkv, g, d, seed=3)
    out = torch.empty(n, nkv * g, d, dtype=torch.bfloat16)
    KERNEL.run(q, k, v, 0.125, out)
    for rows in (1, 16, 37):
        head = torch.empty(rows, nkv * g, d, dtype=torch.bfloat16)
        KERNEL.run(q[:rows].clone(), k, v, 0.125, head)
        assert torch.equal(head, out[:rows])
    qkv = torch.zeros(n, (nkv * g + 2 * nkv) * d, dtype=torch.bfloat16)
    qkv[:, :nkv * g * d] = q.view(n, -1)
    strided = qkv[:, :nkv * g * d].view(n, nkv * g, d)
    assert strided.stride(0) != nkv * g * d and KERNEL.takes(strided, k, v, out)
    again = torch.empty_like(out)
    KERNEL.run(strided, k, v, 0.125, again)
    assert torch.equal(again, out)


@needs_kernel
def test_causal_takes_the_kernel_for_every_bf16_chunk_and_torch_for_the_rest(monkeypatch):
    q, k, v = _case(20, 0, 3, 3, 64, seed=5)
    assert pa.takes(q, 1) and pa.takes(q, 20, start=7)              # any length
    assert not pa.takes(q.float(), 4096)
    ran = []
    monkeypatch.setattr(pa, "causal_blocked", lambda *a: ran.append("blocks"))
    out = torch.empty(20, 9, 64, dtype=torch.bfloat16)
    pa.causal(q, k, v, 0.125, out)
    assert ran == []                                                   # the kernel took it
    odd = torch.randn(20, 9, 80).bfloat16()                            # a head size it is not built for
    assert not KERNEL.takes(odd, torch.zeros(36, 3, 80).bfloat16(), torch.zeros(36, 3, 80).bfloat16(),
                            torch.empty(20, 9, 80, dtype=torch.bfloat16))
    pa.causal(odd, torch.zeros(36, 3, 80).bfloat16(), torch.zeros(36, 3, 80).bfloat16(), 80 ** -0.5,
              torch.empty(20, 9, 80, dtype=torch.bfloat16))
    assert ran == ["blocks"]
    with pytest.raises(ValueError):
        KERNEL.run(q, k[:19], v[:19], 0.125, out)                    # fewer keys than positions


@pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler")
def test_without_avx512_bf16_prompt_chunks_keep_torchs_paths(tmp_path, monkeypatch):
    """Built as for a CPU without avx512_bf16 (an AVX2-only machine): the library says it
    cannot run, `auto` keeps torch's paths and says why, `kernel` is an error, and the torch
    thresholds decide which chunks take the blocks."""
    path = pk.build(tmp_path, extra_flags=("-mno-avx512bf16",))
    lib = ctypes.CDLL(str(path))
    assert lib.prefill_attn_supported() == 0
    q, k, v = _case(8, 0, 3, 3, 64, seed=1)
    out = torch.empty(8, 9, 64, dtype=torch.bfloat16)
    assert pk.PrefillKernel(lib, path)._fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0),
                                           8, 0, 9, 3, 64, 0.125, out.data_ptr(), out.stride(0), 1) == -2
    monkeypatch.setattr(pk, "_loaded", {})
    monkeypatch.setattr(pk, "build", lambda *a, **kw: path)
    kernel, why = pk.load("auto")
    assert kernel is None and "avx512_bf16" in why
    with pytest.raises(RuntimeError, match="avx512_bf16"):
        pk.load("kernel")
    assert not pa.takes(q, pa.MIN_ROWS - 1) and pa.takes(q, pa.MIN_ROWS)
    assert pk.load("blocks") == (None, "torch (asked for)")
    with pytest.raises(ValueError):
        pk.load("fast")
