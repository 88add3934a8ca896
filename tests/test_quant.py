"""Weight-only quantized decode (`engine.kernels.quant`, `csrc/qgemv.c`): the Q4_1 / Q8_0 layouts round
trip exactly on their own grids, the kernels equal a dense product with the dequantized
weights for 1..8 rows (and the step pool's split changes no bit), wider steps take the dense
weight, and on the default model (converted
from a Q4_1/Q8_0 GGUF) the quantized copies are its weights exactly and greedy decoding is
unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actorserve.engine.kernels import cbuild, quant
from actorserve.engine.runners import paths
from actorserve.engine.weights.dtype import cpu_bf16_flags

pytestmark = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler to build the kernels")


def _q4_grid(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Weights exactly on a Q4_1 grid: per group fp16 d and m, q in 0..15 with 0 and 15 used."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.05 + 1e-3).half().float()
    m = (torch.randn(n, k // 32, 1, generator=gen) * 0.1).half().float()
    return (q * d + m).reshape(n, k)


def test_q4_and_q8_round_trip_exactly_on_their_grids():
    gen = torch.Generator().manual_seed(0)
    w = _q4_grid(24, 96, gen)
    packed, d, m = quant.quantize_q4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 48) and d.dtype == torch.float16
    assert torch.equal(quant.dequantize_q4(packed, d, m), w)
    # byte j of a group: weight j low, weight j + 16 high
    q0 = torch.round((w[0, :32] - m[0, 0].float()) / d[0, 0].float()).to(torch.uint8)
    assert packed[0, :16].tolist() == (q0[:16] | (q0[16:] << 4)).tolist()
    qs = torch.randint(-127, 128, (8, 64), generator=gen).float()
    qs[:, 0] = 127
    qs[:, 32] = -127
    d8 = (torch.rand(8, 2, 1, generator=gen) * 0.01 + 1e-4).half().float()
    w8 = (qs.view(8, 2, 32) * d8).reshape(8, 64)
    q8, dd = quant.quantize_q8(w8)
    assert torch.equal(quant.dequantize_q8(q8, dd), w8)
    flat = torch.zeros(4, 32)                                  # a constant group: d = 0, no NaN
    assert torch.equal(quant.dequantize_q4(*quant.quantize_q4(flat)), flat)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_dense_product_of_the_dequantized_weights(kind, dtype):
    gen = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(160, 72, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(72, 160, generator=gen) * 0.1)
        lin.bias.copy_(torch.randn(72, generator=gen))
    ql = quant.QuantLinear(lin, kind, quant._Lib())
    deq = quant.dequantize_q4(ql.w.q, ql.w.d, ql.w.m) if kind == "q4" else quant.dequantize_q8(ql.w.q, ql.w.d)
    assert ql.err == (deq - lin.weight).abs().max().item() > 0         # random weights: lossy
    lin.to(dtype)
    ql.w.max_rows = 40          # every width through the kernel: 8 rows a pass, any remainder
    for rows in [*range(1, 2 * quant.MAX_ROWS + 2), 29, 40]:
        x = torch.randn(rows, 160, generator=gen).to(dtype)
        want = F.linear(x.float(), deq, lin.bias.float())
        got = ql(x)
        assert got.dtype == dtype and got.shape == (rows, 72)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=tol, rtol=tol)
        if rows > quant.MAX_ROWS and dtype == torch.float32:   # the same float path: bit for bit
            assert torch.equal(got[:quant.MAX_ROWS], ql(x[:quant.MAX_ROWS]))
    x3 = torch.randn(2, 3, 160, generator=gen).to(dtype)               # leading dims kept
    assert ql(x3).shape == (2, 3, 72)
    ql.w.max_rows = quant.KERNEL_ROWS
    wide = torch.randn(quant.KERNEL_ROWS + 1, 160, generator=gen).to(dtype)  # wider: the dense weight
    torch.testing.assert_close(ql(wide), F.linear(wide, lin.weight, lin.bias))


def test_the_kernels_widest_step_is_the_fused_steps_unless_set(monkeypatch):
    assert quant.KERNEL_ROWS == quant._kernel_rows() == quant.MAX_ROWS     # wider: packed dense
    assert quant.kernel_rows(torch.float32, True) == quant.kernel_rows(torch.bfloat16, False) == quant.MAX_ROWS
    assert quant.kernel_rows(torch.bfloat16, True) == quant.DOT_ROWS == 16  # bf16 dot products: 16
    monkeypatch.setenv("ACTORSERVE_Q4_ROWS", "24")
    assert quant._kernel_rows() == 24 == quant.kernel_rows(torch.bfloat16, True)


def _exact_and_lossy() -> torch.nn.Module:
    """A module with one linear whose weights are exact 4-bit blocks and one that is not."""
    torch.manual_seed(4)
    mod = torch.nn.Module()
    mod.exact, mod.lossy = torch.nn.Linear(64, 48), torch.nn.Linear(64, 48)
    with torch.no_grad():
        q, d, m = quant.quantize_q4(mod.exact.weight)
        mod.exact.weight.copy_(quant.dequantize_q4(q, d, m))
    return mod


def test_auto_quantizes_only_the_linears_whose_blocks_are_exact():
    mod = _exact_and_lossy()
    rep = quant.quantize_model(mod, "auto")
    assert rep.asked == "auto" and rep.mode == "q4" and rep.layers == 1 and rep.skipped == 1
    assert rep.max_rel_err <= quant.EXACT_TOL
    assert isinstance(mod.exact.forward, quant.QuantLinear)
    assert "forward" not in vars(mod.lossy)                  # untouched: the class's own forward
    assert rep.describe().startswith("auto -> q4: 1 linears")
    chosen = paths.phase_paths(rep, torch.bfloat16, "asked for")
    assert chosen[f"decode <= {quant.MAX_ROWS} rows"].startswith("q4/q8 C kernels")
    dots = "avx512_bf16 dot products" in chosen[f"decode <= {quant.MAX_ROWS} rows"]
    assert dots == ("avx512_bf16" in cpu_bf16_flags())          # the path the kernels take here
    assert (f"up to {quant.Q8_BF16_ROWS} rows" in chosen[f"decode <= {quant.MAX_ROWS} rows"]) == dots
    assert "dense bfloat16" in chosen["prefill"]
    assert f"at most {rep.kernel_rows} tokens with a prompt chunk runs as decode rows" in chosen["prefill"]
    kernel = "avx512_bf16" in cpu_bf16_flags() and cbuild.compiler() is not None
    assert chosen["prefill attention"].startswith("C kernel" if kernel else "torch")   # what runs here
    assert paths.phase_paths(rep, torch.float32, "asked for")["prefill attention"].startswith("torch SDPA")
    lossy_only = torch.nn.Module()
    lossy_only.lin = _exact_and_lossy().lossy
    assert quant.quantize_model(lossy_only, "auto") is None          # nothing exact: all dense
    assert "not exact" in paths.phase_paths(None, torch.float32, "asked for", "auto")["decode"]
    rep = quant.quantize_model(_exact_and_lossy(), "q4")               # q4 takes both, lossy or not
    assert rep.layers == 2 and rep.max_rel_err > 1e-3


def _linear(kind: str, n: int, k: int, seed: int) -> quant.QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
    return quant.QuantLinear(lin, kind, quant._Lib())


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_pool_splits_a_product_without_changing_a_bit(kind, dtype):
    ql = _linear(kind, 203, 96, seed=5)           # an odd N: the halves differ by a row
    pool = quant.StepPool(workers=1)
    for rows in range(1, quant.MAX_ROWS + 1):
        x = torch.randn(rows, 96).to(dtype)
        alone = ql(x)
        with pool:
            pooled = [ql(x) for _ in range(3)]
        assert all(torch.equal(p, alone) for p in pooled)
    assert pool.lib.qpool_active(0, 0) == 1       # the worker stays, asleep, for the next step


def test_the_step_pool_serves_one_product_at_a_time_and_others_run_beside_it():
    import threading

    qls = [_linear("q4", 256, 128, seed=s) for s in range(4)]
    xs = [torch.randn(2, 128) for _ in qls]
    want = [ql(x) for ql, x in zip(qls, xs)]
    got: dict[int, list[torch.Tensor]] = {}

    def work(i: int) -> None:
        got[i] = [qls[i](xs[i]) for _ in range(200)]

    with quant.StepPool(workers=1):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for i in range(4):
        assert len(got[i]) == 200 and all(torch.equal(y, want[i]) for y in got[i])


def _product_in_child(conn, ql: quant.QuantLinear, x: torch.Tensor) -> None:
    with quant.StepPool(workers=1):                 # no torch op here: torch's own OpenMP is not fork-safe
        y = ql(x)
    conn.send(torch.equal(y, ql(x)))


def test_a_forked_child_starts_its_own_step_pool():
    import multiprocessing as mp

    ql, x = _linear("q4", 128, 64, seed=7), torch.randn(1, 64)
    with quant.StepPool(workers=1):                 # the parent's worker exists before the fork
        ql(x)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_product_in_child, args=(child, ql, x))
    proc.start()
    try:
        assert parent.poll(120), "the child's product never finished (a pool copied from the parent?)"
        assert parent.recv() is True
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_bf16_activations_take_the_dot_product_path_and_agree_with_the_float_path():
    ql = _linear("q4", 203, 320, seed=9)
    lib = ql.lib
    if lib.bf16_path(-1) < 0:
        pytest.skip("this CPU has no avx512_bf16: only the float path is built")
    deq = quant.dequantize_q4(ql.w.q, ql.w.d, ql.w.m)
    ql.w.max_rows = 24         # wide steps too: 8 rows a pass
    for rows in [*range(1, quant.MAX_ROWS + 1), 9, 13, 24]:
        x = (torch.randn(rows, 320) * 2).bfloat16()
        want = F.linear(x.float(), deq, ql.module.bias.float())
        try:
            assert lib.bf16_path(0) == 0
            floats = ql(x)
        finally:
            assert lib.bf16_path(1) == 1
        dots = ql(x)
        for got in (floats, dots):
            torch.testing.assert_close(got.float(), want.bfloat16().float(), atol=2e-2, rtol=2e-2)
        # the same sums in another order: one bfloat16 rounding apart at most (and float32
        # rounding of sums of terms of about 1 near zero)
        diff = (dots.float() - floats.float()).abs()
        assert (diff <= floats.float().abs() * 2 ** -7 + 1e-4).all(), (rows, diff.max())


def test_the_b16_superblocks_hold_the_same_nibbles_and_multiply_any_width_like_the_row_kernel():
    """`repack_b16` regroups the q4 nibbles 16 output rows a superblock (`csrc/q4b16.c`): each
    dword's nibble s is weight 8j + 2s (low half) and 8j + 2s + 1 (high half). Products of
    bfloat16 rows through it equal the dense product with the dequantized weights and the row
    kernel's up to summation order, at every width (tiles of 12 and a remainder), with float32
    or bfloat16 outputs; the step pool's split changes no bit; float32 rows go dense."""
    ql = _linear("q4", 208, 352, seed=11)        # 13 blocks of 16 rows, 11 groups
    lib = ql.lib
    if not lib.b16:
        pytest.skip("this CPU has no avx512_bf16: the superblock kernel is not built")
    q, d, m = ql.w.q, ql.w.d, ql.w.m
    sb = quant.repack_b16(q, d, m)
    assert sb.shape == (13, 11, 320)
    qs = q.reshape(208, 11, 16).int()
    weights = torch.cat([qs & 0xF, qs >> 4], dim=-1)            # [N, G, 32] in order
    for blk, n, g, j, s_ in [(0, 0, 0, 0, 0), (3, 5, 7, 2, 3), (12, 15, 10, 3, 1)]:
        word = int(sb[blk, g, 64 * j + 4 * n: 64 * j + 4 * n + 4].view(torch.int32)[0]) & 0xFFFFFFFF
        row = 16 * blk + n
        assert (word >> (4 * s_)) & 0xF == weights[row, g, 8 * j + 2 * s_]
        assert (word >> (16 + 4 * s_)) & 0xF == weights[row, g, 8 * j + 2 * s_ + 1]
    assert torch.equal(sb[2, 4, 256:288].view(torch.float16), d[32:48, 4])
    assert torch.equal(sb[2, 4, 288:320].view(torch.float16), m[32:48, 4])
    w = quant._Weights(4, q, d, m, ql.w.bias)
    w.use_b16(rows=100)
    assert w.kind == 4 | quant.B16 and w.max_rows == 100
    ql.w.max_rows = 100                                  # the row kernel, 8 rows a pass
    deq = quant.dequantize_q4(q, d, m)
    pool = quant.StepPool(workers=1)
    for rows in [*range(1, 10), 16, 17, 33, 64, 71]:
        x = (torch.randn(rows, 352) * 2).bfloat16()
        want = F.linear(x.float(), deq, ql.module.bias.float())
        got, row = w.run(lib, x), ql(x)
        torch.testing.assert_close(got.float(), want.bfloat16().float(), atol=2e-2, rtol=2e-2)
        diff = (got.float() - row.float()).abs()
        assert (diff <= row.float().abs() * 2 ** -7 + 1e-4).all(), (rows, diff.max())
        with pool:
            assert torch.equal(w.run(lib, x), got)
        y = torch.empty(rows, 208)                        # float32 output
        assert lib.qgemv(w.kind, x.data_ptr(), 1, rows, 352, *w.ptrs, 208, w.bias_ptr, y.data_ptr(), 0, 1) == 0
        assert (y.bfloat16() - got).abs().max() <= want.abs().max() * 2 ** -7
    assert w.run(lib, torch.randn(3, 352)) is None      # float32 rows: the dense weight
    x = torch.randn(2, 352)
    assert lib.qgemv(w.kind, x.data_ptr(), 0, 2, 352, *w.ptrs, 208, None, torch.empty(2, 208).data_ptr(), 0, 1) == -1
    assert lib.qgemv(w.kind, x.bfloat16().data_ptr(), 1, 2, 352, *w.ptrs, 200, None,
                     torch.empty(2, 208).data_ptr(), 0, 1) == -1      # N not a multiple of 16


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_prefetching_the_weights_ahead_changes_no_bit(kind):
    """Products of one or two rows ask for the weights a few output rows ahead (never past
    their chunk's end); the results are the same bits with and without it, pooled or not."""
    ql = _linear(kind, 203, 576, seed=2)        # an odd N: the chunks end at odd rows
    lib = ql.lib
    assert lib.prefetch(-1) == 4
    pool = quant.StepPool(workers=1)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 2, 3):
            x = torch.randn(rows, 576).to(dtype)
            got = {}
            for ahead in (0, 4, 64):
                lib.prefetch(ahead)
                try:
                    with pool:
                        got[ahead] = (ql(x), ql(x[:1]))
                finally:
                    lib.prefetch(4)
            for ahead in (4, 64):
                assert all(torch.equal(a, b) for a, b in zip(got[ahead], got[0])), (dtype, rows, ahead)


def test_the_superblocks_prefetch_changes_no_bit():
    """Products of 1-8 rows through the superblocks ask for the superblock some bytes on as they
    start each one (`b16_prefetch`, 2,048 by default; an address past the weights' end is only a
    hint, which never faults); the results are the same bits at any distance and without it, on
    the step pool or not, and wider products (which do not prefetch) likewise."""
    ql = _linear("q4", 208, 576, seed=5)
    lib = ql.lib
    if not lib.b16:
        pytest.skip("this CPU has no avx512_bf16: the superblock kernel is not built")
    assert lib.b16_prefetch(-1) == 2048
    w = quant._Weights(4, ql.w.q, ql.w.d, ql.w.m, ql.w.bias)
    w.use_b16(rows=16)
    pool = quant.StepPool(workers=1)
    for rows in (1, 2, 3, 4, 5, 8, 9, 13):
        x = (torch.randn(rows, 576) * 2).bfloat16()
        got = {}
        for ahead in (0, 2048, 1 << 16):
            assert lib.b16_prefetch(ahead) == ahead
            try:
                with pool:
                    got[ahead] = (w.run(lib, x), w.run(lib, x[:1]))
                got[ahead] += (w.run(lib, x),)
            finally:
                lib.b16_prefetch(2048)
        for ahead in (2048, 1 << 16):
            assert all(torch.equal(a, b) for a, b in zip(got[ahead], got[0])), (rows, ahead)


def test_quantize_model_patches_the_linears_and_refuses_unknown_modes():
    with pytest.raises(ValueError, match="unknown quantization"):
        quant.quantize_model(torch.nn.Linear(32, 4), "q2")
    assert quant.quantize_model(torch.nn.Linear(32, 4), "none") is None


class _Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(96, 64, bias=True)
        self.k_proj = torch.nn.Linear(96, 32, bias=False)
        self.v_proj = torch.nn.Linear(96, 32, bias=True)
        self.gate_proj = torch.nn.Linear(96, 48, bias=False)
        self.up_proj = torch.nn.Linear(96, 48, bias=False)
        self.o_proj = torch.nn.Linear(64, 96, bias=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_projections_are_one_call_equal_to_their_members(dtype):
    torch.manual_seed(3)
    mod = _Attn().to(dtype)
    rep = quant.quantize_model(mod, "q4")
    assert rep.layers == 6
    qkv, gate_up = getattr(mod, quant.QKV_GROUP), getattr(mod, quant.GATE_UP_GROUP)
    assert qkv.sizes == [64, 32, 32] and gate_up.sizes == [48, 48]
    # the members' quantized tensors are views of the group's: nothing is held twice
    base = qkv.w.q.untyped_storage().data_ptr()
    assert [ql.w.q.untyped_storage().data_ptr() for ql in qkv.members] == [base] * 3
    assert qkv.members[1].w.q.data_ptr() == base + 64 * 48
    for rows in (1, 3, 8):
        x = torch.randn(rows, 96).to(dtype)
        parts = qkv(x)
        alone = (mod.q_proj(x), mod.k_proj(x), mod.v_proj(x))     # the members' own kernel calls
        assert [tuple(p.shape) for p in parts] == [(rows, 64), (rows, 32), (rows, 32)]
        for got, want in zip(parts, alone):
            assert torch.equal(got, want)
        g, u = gate_up(x)
        assert torch.equal(g, mod.gate_proj(x)) and torch.equal(u, mod.up_proj(x))
    assert qkv.w.max_rows == gate_up.w.max_rows == rep.kernel_rows     # the group as wide as its members
    wide = torch.randn(rep.kernel_rows + 1, 96).to(dtype)             # wider: each dense weight
    for got, lin in zip(qkv(wide), (mod.q_proj, mod.k_proj, mod.v_proj)):
        torch.testing.assert_close(got, F.linear(wide, lin.weight, lin.bias))
    assert not hasattr(torch.nn.Linear(32, 4), quant.QKV_GROUP)


def test_the_q8_superblocks_hold_the_same_bytes_and_multiply_like_the_dequantized_weight():
    """`repack_q8b16` regroups a q8 weight (an LM head kept as Q8_0) 16 output rows a superblock
    (`csrc/q8b16.c`): for pair p, the 16 rows' weight 2p, then their weight 2p + 1, then their
    d. Products of bfloat16 rows equal the dense product with the dequantized weights up to the
    output's rounding, at every width (tiles of 12 and a remainder), float32 or bfloat16 out,
    and every value of q (-128..127, exact as bf16); the step pool's split changes no bit; past
    `max_rows`, and for float32 rows, the dense weight."""
    ql = _linear("q8", 208, 352, seed=12)
    lib = ql.lib
    if not lib.b16:
        pytest.skip("this CPU has no avx512_bf16: the superblock kernel is not built")
    q, d = ql.w.q.clone(), ql.w.d
    q[5, :256] = torch.arange(-128, 128, dtype=torch.int8)      # every int8 value once
    sb = quant.repack_q8b16(q, d)
    assert sb.shape == (13, 11, 544)
    for blk, n, g, p in [(0, 0, 0, 0), (3, 5, 7, 9), (12, 15, 10, 15)]:
        row = 16 * blk + n
        assert int(sb[blk, g, 32 * p + n].view(torch.int8)) == int(q[row, 32 * g + 2 * p])
        assert int(sb[blk, g, 32 * p + 16 + n].view(torch.int8)) == int(q[row, 32 * g + 2 * p + 1])
    assert torch.equal(sb[2, 4, 512:544].view(torch.float16), d[32:48, 4])
    w = quant._Weights(8, q, d, None, ql.w.bias)
    assert w.b16_able()
    w.use_b16(rows=40)
    assert w.kind == 8 | quant.B16 and w.max_rows == 40
    deq = quant.dequantize_q8(q, d)
    pool = quant.StepPool(workers=1)
    for rows in [1, 2, 5, 11, 12, 13, 24, 33, 40]:
        x = (torch.randn(rows, 352) * 2).bfloat16()
        want = F.linear(x.float(), deq, ql.module.bias.float())
        y = torch.empty(rows, 208)                                   # float32 output: the sums
        assert lib.qgemv(w.kind, x.data_ptr(), 1, rows, 352, *w.ptrs, 208, w.bias_ptr, y.data_ptr(), 0, 1) == 0
        assert (y - want).abs().max() <= want.abs().max() * 1e-5, rows
        got = w.run(lib, x)                                          # bfloat16 output: y rounded
        assert torch.equal(got, y.bfloat16())
        with pool:
            assert torch.equal(w.run(lib, x), got)
    assert w.run(lib, torch.randn(41, 352).bfloat16()) is None      # past max_rows: dense
    assert w.run(lib, torch.randn(3, 352)) is None                   # float32 rows: dense


@pytest.mark.model
def test_a_bf16_load_and_reload_size_the_kernels_for_bf16():
    """A load quantizes from float32 and then casts (so does a weights reload): how wide a step
    the kernels take is the served dtype's (`widths.kernel_rows`), not float32's."""
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.weights.refit import load_from_disk
    from actorserve.engine.runners.runner import build_engine

    model, _, path = load_model("default", threads=2, dtype=torch.bfloat16, quantization="auto")
    lib = quant._Lib()
    dot = lib.bf16_path(-1) == 1
    want = quant.kernel_rows(torch.bfloat16, dot, dot and lib.b16)
    assert want == (quant.B16_ROWS if "avx512_bf16" in cpu_bf16_flags() else quant.MAX_ROWS)
    # with avx512_bf16 every q4 weight is in q4b16.c's superblocks (a group's members share its)
    b16 = "avx512_bf16" in cpu_bf16_flags()
    layer = model.model.layers[0]
    qkv = getattr(layer.self_attn, quant.QKV_GROUP)
    assert (qkv.w.sb16 is not None) == b16 and (layer.mlp.down_proj.forward.w.sb16 is not None) == b16
    if b16:
        assert qkv.w.kind == layer.mlp.down_proj.forward.w.kind == 4 | quant.B16
        k = layer.self_attn.k_proj.forward.w
        assert k.sb16.untyped_storage().data_ptr() == qkv.w.sb16.untyped_storage().data_ptr()
        head_w = model.lm_head.forward.w                   # q8, in q8b16.c's superblocks
        assert head_w.kind == 8 | quant.B16 and head_w.sb16 is not None
    # the LM head (the GGUF's tied q8 embedding): up to Q8_B16_ROWS rows in the superblocks, else
    # no dot path and at most Q8_BF16_ROWS rows
    head = quant.Q8_B16_ROWS if b16 else min(want, quant.Q8_BF16_ROWS)
    assert model.lm_head.forward.kind == "q8"
    assert model.actorserve_quant.kernel_rows == want
    assert model.model.layers[0].mlp.down_proj.forward.w.max_rows == want
    assert model.lm_head.forward.w.max_rows == head
    engine = build_engine(model, num_blocks=64, block_size=16)
    assert engine.kernel_rows == want
    assert load_from_disk(engine, str(path)) > 0     # a reload quantizes from float32 again
    assert model.actorserve_quant.kernel_rows == want
    assert model.lm_head.forward.w.max_rows == head
    assert model.model.layers[-1].self_attn.o_proj.forward.w.max_rows == want
    assert (model.model.layers[-1].self_attn.o_proj.forward.w.sb16 is not None) == b16


def test_a_q8_weight_with_bf16_activations_is_narrower_than_q4s(monkeypatch):
    """q8 products have no bf16 dot path, so the packed dense weight takes them from
    `Q8_BF16_ROWS` + 1 rows on; q4's width and float32's are `kernel_rows`."""
    monkeypatch.delenv("ACTORSERVE_Q4_ROWS", raising=False)
    assert quant.weight_rows(8, torch.bfloat16, True) == quant.Q8_BF16_ROWS < quant.DOT_ROWS
    for dot in (True, False):
        assert quant.weight_rows(4, torch.bfloat16, dot) == quant.kernel_rows(torch.bfloat16, dot)
        assert quant.weight_rows(8, torch.bfloat16, dot) == min(quant.Q8_BF16_ROWS,
                                                                quant.kernel_rows(torch.bfloat16, dot))
        assert quant.weight_rows(8, torch.float32, dot) == quant.kernel_rows(torch.float32, dot)


@pytest.mark.model
def test_default_model_q4_is_its_own_weights_and_decodes_the_same():
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.runners.runner import build_engine
    from test_dtype import PROMPTS, greedy

    model, tok, _ = load_model("default", threads=2)
    dense = build_engine(model, num_blocks=64, block_size=16)
    prompts = [tok.encode(p) for p in PROMPTS]
    ref = [greedy(dense, p, 16) for p in prompts]
    qmodel, _, _ = load_model("default", threads=2, quantization="auto")     # the default
    rep = qmodel.actorserve_quant
    assert rep.asked == "auto" and rep.mode == "q4"                # its weights are exact blocks
    assert rep.layers == 211 and rep.skipped == 0                  # 210 linears + the LM head
    assert rep.max_rel_err == 0.0                                  # the GGUF's own Q4_1 / Q8_0
    assert rep.quant_bytes < 0.2 * rep.dense_bytes
    calls = []
    head = qmodel.lm_head.forward
    qmodel.lm_head.forward = lambda x: (calls.append(x.shape[0]), head(x))[1]
    engine = build_engine(qmodel, num_blocks=64, block_size=16)
    assert (engine.step_pool is not None) == (torch.get_num_threads() > 1)
    assert engine.fused is not None                                # decode steps: one C call
    got = [greedy(engine, p, 16) for p in prompts]
    assert got == ref
    engine.step_pool = engine.fused = None                         # the same without pool and fusion
    assert [greedy(engine, p, 16) for p in prompts[:2]] == ref[:2]
    assert calls and max(calls) <= quant.MAX_ROWS
