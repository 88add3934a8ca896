"""Quantized products of 8-bit activations (``--quantization q4a8``, `csrc/act8.c`): the kernels
compute exactly the integer arithmetic they promise (activations rounded to int8 per 32, exact
int32 group sums, float scales) for q4 and the q8 head, for 1..8 rows and an odd group count,
in the vectorised build and in the portable C one; the step pool changes no bit; the mode
really rounds the activations (it is not the bf16/float path); and on the default model the
whole engine runs it through the fused step and still decodes the prompts' first tokens as q4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actorserve.engine.kernels import cbuild, quant

pytestmark = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler to build the kernels")


def reference(x: torch.Tensor, w: quant._Weights) -> torch.Tensor:
    """What an act8 product computes, in float64: per row and 32-group, dx = max|x| / 127 and
    qx = round(x / dx) (half to even); q4: sum_g d dx sum(q qx) + m sum(x); q8: sum_g d dx sum(q qx)."""
    rows, K = x.shape
    G = K // 32
    xg = x.float().reshape(rows, G, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    qx = torch.round(xg * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))).double()
    dx = (amax / 127).double()[..., 0]                                   # [rows, G]
    N = w.N
    if w.bits == 4:
        p = w.q.reshape(N, G, 16)
        qw = torch.cat([p & 0xF, p >> 4], dim=-1).double()
    else:
        qw = (w.q ^ 0x80).view(torch.int8).reshape(N, G, 32).double()  # stored offset by 128
    isum = torch.einsum("rge,nge->rng", qx, qw)
    y = (isum * w.d.double()[None] * dx[:, None, :]).sum(-1)
    if w.bits == 4:
        y = y + (xg.double().sum(-1)[:, None, :] * w.m.double()[None]).sum(-1)
    if w.bias is not None:
        y = y + w.bias.double()
    return y


def _linear(kind: str, n: int, k: int, seed: int, lib: quant._Lib, act8: bool = True) -> quant.QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
        lin.bias.copy_(torch.randn(n, generator=gen))
    return quant.QuantLinear(lin, kind, lib, act8=act8)


@pytest.fixture(scope="module")
def portable() -> quant._Lib:
    """The same sources built without AVX-512: the portable C paths."""
    return quant._Lib(str(cbuild.build(quant.LIBRARY, extra_flags=("-mno-avx512f",))))


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act8_kernels_compute_the_int8_arithmetic(build, kind, dtype, request):
    lib = request.getfixturevalue("portable") if build == "portable" else quant._Lib()
    gen = torch.Generator().manual_seed(2)
    for N, K in ((72, 96), (80, 576)):               # 3 groups (one alone after a pair), 18
        ql = _linear(kind, N, K, seed=K, lib=lib)      # q4 with N = 80: the superblocks (q4n16.c)
        n16 = kind == "q4" and N % 16 == 0
        assert ql.w.act8 and ql.w.kind == (4 if kind == "q4" else 8) | quant.ACT8 | (quant.N16 if n16 else 0)
        if kind == "q8":                              # kept offset: q + 128 as uint8
            q8, _ = quant.quantize_q8(ql.module.weight)
            assert ql.w.q.dtype == torch.uint8 and torch.equal(ql.w.q.view(torch.int8) ^ -128, q8)
        wide = (13, 37) if n16 and quant._act8_simd() else ()   # prefill rows: vectorised builds
        for rows in [*range(1, quant.MAX_ROWS + 1), *wide]:
            x = torch.randn(rows, K, generator=gen) * torch.rand(rows, K, generator=gen) * 3
            x[0, 5] = 40.0                            # an outlier: its group's scale follows it
            x = x.to(dtype)
            want = reference(x, ql.w)
            got = ql(x)
            assert got.dtype == dtype and got.shape == (rows, N)
            if dtype == torch.float32:              # the same integers, float32 scaling
                torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
            else:                                   # and the bfloat16 rounding of the result
                torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=2 ** -7)


def test_act8_rounds_the_activations_and_stays_close_to_the_exact_product():
    lib = quant._Lib()
    plain, a8 = _linear("q4", 64, 576, 4, lib, act8=False), _linear("q4", 64, 576, 4, lib)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(0))    # seeded: deterministic
    deq = quant.dequantize_q4(plain.w.q, plain.w.d, plain.w.m)
    exact = F.linear(x, deq, plain.module.bias)
    y_plain, y_a8 = plain(x), a8(x)
    torch.testing.assert_close(y_plain, exact, atol=1e-4, rtol=1e-4)
    err = (y_a8 - exact).abs().max().item()
    assert 0 < err < 0.02 * exact.abs().max().item()     # rounded, about 1% of the range
    # wider steps (prefill): N a multiple of 16, so the superblock kernel takes them too (where
    # it is vectorised; the portable loops leave them to the dense weight)
    assert a8.w.sb is not None and a8.w.kind == 4 | quant.ACT8 | quant.N16
    # seeded (the suite's order must not matter): a float32 product landing within an ulp of a
    # rounding boundary of x / dx can round either way in the SIMD kernel and in the reference
    wide = torch.randn(100, 576, generator=torch.Generator().manual_seed(7))
    if quant._act8_simd():
        torch.testing.assert_close(a8(wide).double(), reference(wide, a8.w), atol=1e-4, rtol=1e-5)
    else:
        torch.testing.assert_close(a8(wide), F.linear(wide, a8.module.weight, a8.module.bias))
    odd = _linear("q4", 72, 576, 4, lib)                 # N = 72: the row kernel, and dense beyond
    assert odd.w.sb is None and odd.w.kind == 4 | quant.ACT8
    wide = torch.randn(quant.MAX_ROWS + 1, 576, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(odd(wide), F.linear(wide, odd.module.weight, odd.module.bias))


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("n", [203, 208])
def test_the_step_pool_splits_an_act8_product_without_changing_a_bit(kind, n):
    ql = _linear(kind, n, 96, seed=5, lib=quant._Lib())          # 208: 13 superblocks for q4
    pool = quant.StepPool(workers=1)
    for rows in range(1, quant.MAX_ROWS + 1):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        alone = ql(x)
        with pool:
            pooled = [ql(x) for _ in range(3)]
        assert all(torch.equal(p, alone) for p in pooled)


def test_quantize_model_q4a8_groups_act8_members_and_keeps_the_head_offset():
    from test_quant import _Attn

    torch.manual_seed(3)
    mod = _Attn()
    rep = quant.quantize_model(mod, "q4a8")
    assert rep.mode == "q4a8" and rep.layers == 6
    qkv = getattr(mod, quant.QKV_GROUP)
    assert qkv.w.act8 and all(ql.w.act8 for ql in qkv.members)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(9))
    for got, lin in zip(qkv(x), (mod.q_proj, mod.k_proj, mod.v_proj)):
        assert torch.equal(got, lin(x))                  # the group is its members' kernel calls
        torch.testing.assert_close(got, reference(x, lin.forward.w).float(), atol=1e-4, rtol=1e-5)


@pytest.mark.model
def test_default_model_q4a8_decodes_through_the_fused_step_and_starts_as_q4():
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.runners.runner import build_engine
    from test_dtype import PROMPTS, greedy

    model, tok, _ = load_model("default", threads=2, dtype=torch.bfloat16, quantization="q4")
    q4 = build_engine(model, num_blocks=64, block_size=16)
    prompts = [tok.encode(p) for p in PROMPTS]
    ref = [greedy(q4, p, 8) for p in prompts]
    amodel, _, _ = load_model("default", threads=2, dtype=torch.bfloat16, quantization="q4a8")
    rep = amodel.actorserve_quant
    assert rep.mode == "q4a8" and rep.layers == 211 and rep.max_rel_err == 0.0
    head = amodel.lm_head.forward
    assert head.kind == "q8" and head.w.act8 and head.w.q.dtype == torch.uint8
    engine = build_engine(amodel, num_blocks=64, block_size=16)
    assert engine.fused is not None
    got = [greedy(engine, p, 8) for p in prompts]
    # the activations' rounding moves the logits a little: the first tokens stay, later ones
    # may drift (docs/engine.md has the perplexity)
    assert sum(g[0] == r[0] for g, r in zip(got, ref)) >= len(PROMPTS) - 1, (got, ref)
    assert sum(g[:2] == r[:2] for g, r in zip(got, ref)) >= len(PROMPTS) // 2, (got, ref)
    engine.fused = None                                   # the glued path: the same tokens
    assert [greedy(engine, p, 8) for p in prompts[:3]] == got[:3]
