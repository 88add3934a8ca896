"""The quantized decode step's C glue (`engine.kernels.glue`, `csrc/glue.c`): the residual add + RMSNorm
and RoPE compute what HF's modules compute (RoPE and the add bit for bit, the norm up to the
order of its sum), it is used only where it copies the norm's arithmetic, and a q4 engine
decodes the same tokens with it as without it, family by family."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actorserve.engine.kernels import cbuild, glue, quant
from actorserve.engine.runners.families import apply_rope

pytestmark = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler to build the glue")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def g():
    lib = glue.load()
    assert lib is not None
    return lib


def _llama_norm(dtype: torch.dtype, seed: int):
    """HF's LlamaRMSNorm over 576 numbers with a weight that matters (seeded), in `dtype`."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(seed)
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_is_the_residual_add_then_hf_llama_rmsnorm(g, dtype):
    norm = _llama_norm(dtype, seed=0)
    for rows in (1, 3, 8):
        h = (torch.randn(rows, 576) * 4).to(dtype)
        wide = (torch.randn(rows, 700)).to(dtype)
        delta = wide[:, 50:626]                       # a row stride of its own
        want_h = h + delta
        with torch.inference_mode():
            want = norm(want_h)
        out = torch.empty(rows, 576, dtype=dtype)
        g.add_rmsnorm(h, delta, norm, out)
        assert torch.equal(h, want_h)                 # the add: bit for bit
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
        else:                                         # one bf16 ulp at most, and rarely
            diff = (out.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
            assert diff.max() <= 2 ** -7 and (out != want).float().mean() < 0.01
        plain = torch.empty_like(out)
        g.add_rmsnorm(h, None, norm, plain)           # no delta: h unchanged, only the norm
        assert torch.equal(h, want_h)
        with torch.inference_mode():
            torch.testing.assert_close(plain.float(), norm(h).float(), atol=0.02 if dtype != torch.float32 else 1e-6,
                                       rtol=0.02 if dtype != torch.float32 else 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_hf_silu_times_up(dtype):
    """The fused step's SiLU(gate) * up (`silu_mul`: 16 lanes at a time with its own e^x where
    the CPU has AVX-512, expf elsewhere and for a row's tail) against torch's, over gates from
    -120 to 120 (e^x past float32's range both ways) and rows whose width is not a multiple of
    16: float32 within a few ulp, bfloat16 equal but for rare one-ulp ties of the rounding."""
    import ctypes

    fn = quant._Lib().cdll.silu_mul
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    torch.manual_seed(3)
    rows, inter = 5, 1539
    gate = torch.randn(rows, inter) * 6
    gate[0, :241] = torch.linspace(-120, 120, 241)
    gu = torch.cat([gate, torch.randn(rows, inter) * 2], dim=1).to(dtype).contiguous()
    g, u = gu[:, :inter], gu[:, inter:]
    want = torch.nn.functional.silu(g) * u
    act = torch.full((rows, inter), float("nan"), dtype=dtype)
    fn(gu.data_ptr(), act.data_ptr(), inter, 1, rows, int(dtype == torch.bfloat16))     # rows 1..4
    assert act[0].isnan().all()                          # row 0 was not asked for
    fn(gu.data_ptr(), act.data_ptr(), inter, 0, 1, int(dtype == torch.bfloat16))
    assert not act.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(act, want, atol=1e-6, rtol=1e-6)
    else:
        diff = (act.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
        assert diff.max() <= 2 ** -7 and (act != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rd", [64, 32])             # full and partial rotary
def test_rope_in_place_is_bit_for_bit_hf_rope(g, dtype, rd):
    torch.manual_seed(1)
    T, nh, nkv, d = 5, 9, 3, 64
    qkv = torch.randn(T, (nh + 2 * nkv) * d).to(dtype)     # q, k, v side by side, as the group returns
    q = qkv[:, :nh * d].view(T, nh, d)
    k = qkv[:, nh * d:(nh + nkv) * d].view(T, nkv, d)
    v_before = qkv[:, (nh + nkv) * d:].clone()
    cos = torch.randn(T, 1, rd).to(dtype)
    sin = torch.randn(T, 1, rd).to(dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert g.rope(q, cos, sin) and g.rope(k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (nh + nkv) * d:], v_before)   # v untouched
    split_heads = torch.randn(T, d, nh).to(dtype).transpose(1, 2)     # heads not contiguous
    assert not g.rope(split_heads, cos, sin)
    assert not g.rope(torch.randn(T, nh, d), cos.double(), sin.double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_chunks_rows_over_threads_give_the_bits_of_one_thread(g, dtype):
    """`threads`: a prompt chunk's norms and RoPE with their rows over OpenMP threads compute
    every row as one thread does (rows a split of their own: 64, 65, 300; strided delta and
    output; partial rotary), and fewer than `MT_ROWS` rows stay on the caller."""
    assert glue.MT_ROWS == 64
    norm = _llama_norm(dtype, seed=3)
    for rows in (64, 65, 300):
        h = (torch.randn(rows, 576) * 4).to(dtype)
        delta = torch.randn(rows, 700).to(dtype)[:, 50:626]
        outs, hs = [], []
        for threads in (1, 2, 3):
            hh = h.clone()
            out = torch.empty(rows, 600, dtype=dtype)[:, :576]
            g.add_rmsnorm(hh, delta, norm, out, threads)
            outs.append(out)
            hs.append(hh)
        assert all(torch.equal(o, outs[0]) for o in outs) and all(torch.equal(x, hs[0]) for x in hs)
        with torch.inference_mode():
            torch.testing.assert_close(outs[0].float(), norm(h + delta).float(),
                                       atol=0.02 if dtype != torch.float32 else 1e-5, rtol=0.02)
        for rd in (64, 32):
            x = torch.randn(rows, 9, 64).to(dtype)
            cos, sin = torch.randn(rows, 1, rd).to(dtype), torch.randn(rows, 1, rd).to(dtype)
            want = apply_rope(x, cos, sin)
            for threads in (2, 3):
                y = x.clone()
                assert g.rope(y, cos, sin, threads)
                assert torch.equal(y, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_chunks_silu_times_up_is_torchs_on_any_split(g, dtype):
    """`silu_mul`: SiLU(gate) * up in place into gate, as torch's ``F.silu(g).mul_(u)`` rounds it
    (SiLU to the dtype first), whether gate and up are the halves of one product's output or two
    tensors; rows over 1-3 threads give the same bits (fewer than `MT_ROWS` stay on the caller);
    what it does not take (3-D, mixed dtypes, a strided row) it leaves untouched (None)."""
    for rows in (5, 64, 300):
        gu = (torch.randn(rows, 2 * 1536) * 3).to(dtype)
        want = F.silu(gu[:, :1536].clone()) * gu[:, 1536:]
        got = []
        for threads in (1, 2, 3):
            x = gu.clone()
            gate = x[:, :1536]
            assert g.silu_mul(gate, x[:, 1536:], threads) is gate
            got.append(gate.clone())
        assert all(torch.equal(y, got[0]) for y in got)
        tol = dict(atol=1e-2, rtol=1e-2) if dtype is torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[0].float(), want.float(), **tol)
        # differences are bf16's: its rounding of SiLU, not another arithmetic
        if dtype is torch.bfloat16:
            assert (got[0].float() - want.float()).abs().le(want.float().abs() * 2 ** -7 + 1e-6).float().mean() > 0.999
        sep_g, sep_u = gu[:, :1536].contiguous(), gu[:, 1536:].contiguous()
        assert torch.equal(g.silu_mul(sep_g, sep_u, 2), got[0])
    x = torch.randn(4, 8, 16).to(dtype)
    assert g.silu_mul(x, x.clone()) is None
    assert g.silu_mul(torch.randn(4, 16).to(dtype), torch.randn(4, 16).half()) is None
    strided = torch.randn(4, 32).to(dtype)[:, ::2]
    before = strided.clone()
    assert g.silu_mul(strided, strided.clone()) is None and torch.equal(strided, before)


def test_only_llama_style_norms_take_the_glue():
    import transformers as tr

    cfg = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2)
    llama = tr.LlamaForCausalLM(tr.LlamaConfig(**cfg))
    gemma = tr.GemmaForCausalLM(tr.GemmaConfig(**cfg, head_dim=16))
    assert glue.usable(list(llama.model.layers), torch.float32)
    assert not glue.usable(list(llama.model.layers), torch.bfloat16)     # weights of another dtype
    assert not glue.usable(list(gemma.model.layers), torch.float32)      # (1 + w) norms


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_final_norm_of_a_step_is_the_models_norm_through_the_glue(dtype):
    """`_final_norm`: the glue's norm where it copies the module (up to the order of its sum),
    the module itself where it does not (Gemma's 1 + w)."""
    from test_model_families import _build, make

    for arch in ("qwen2", "gemma"):
        model = _build(arch).to(dtype)
        model.actorserve_quant = quant.quantize_model(model, "q4")
        d, _ = make(model)
        eng = d.engine
        calls = []
        if eng.glue is not None:
            real = eng.glue.add_rmsnorm
            eng.glue.add_rmsnorm = lambda *a: (calls.append(1), real(*a))[1]
        x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
        got = eng._final_norm(x)
        want = eng.base.norm(x)
        assert bool(calls) == (arch == "qwen2")
        if arch == "qwen2":
            torch.testing.assert_close(got, want, atol=1e-5 if dtype is torch.float32 else 1e-2, rtol=1e-2)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_bias", "qwen2", "phi3", "phi3_partial", "gemma"])
def test_a_q4_engine_decodes_the_same_with_and_without_the_glue(arch):
    from test_model_families import PROMPTS, _build, make

    model = _build(arch)
    model.actorserve_quant = quant.quantize_model(model, "q4")
    runs = []
    for use in (True, False):
        d, rec = make(model)
        assert (d.engine.glue is not None) == (arch != "gemma")
        d.engine.fused = None                         # the glued path itself (fused: the next test)
        if not use:
            d.engine.glue = None
        calls = []
        if use and d.engine.glue is not None:
            real = d.engine._forward_glued
            d.engine._forward_glued = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
        seqs = [d.new(f"r{i}", p) for i, p in enumerate(PROMPTS)]
        runs.append((d.run(seqs, 8, chunk=5), rec.logits))
        if use and arch != "gemma":
            assert calls                              # the decode steps went through it
    (with_tokens, with_logits), (without_tokens, without_logits) = runs
    assert with_tokens == without_tokens
    for rid, steps in with_logits.items():
        torch.testing.assert_close(torch.stack(steps), torch.stack(without_logits[rid]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["q4", "q4a8"])
def test_the_fused_step_decodes_as_the_glued_one(arch, dtype, mode):
    """`fused_step`: every layer of a narrow step in one C call, for the Llama-shaped
    families (Llama, Qwen2 with its q/k/v biases); Qwen3 (per-head norms) and Phi-3 (one
    q/k/v weight) keep the glued path. Both quantized modes (q4a8: 8-bit activations). Steps
    with prompt chunks (alone and beside decode rows) are fused too: each chunk row attends
    as a decode row of its own length."""
    import transformers as tr
    from test_model_families import COMMON, PROMPTS, _build, make

    if arch == "llama":
        torch.manual_seed(0)
        cfg = {**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1}
        model = tr.LlamaForCausalLM(tr.LlamaConfig(**cfg, head_dim=32)).eval()
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 1.0)
    else:
        model = _build(arch)
    model = model.to(dtype)
    model.actorserve_quant = quant.quantize_model(model, mode)
    runs = []
    for fused in (True, False):
        d, rec = make(model)
        assert (d.engine.fused is not None) == (arch in ("llama", "qwen2"))
        if not fused:
            d.engine.fused = None
        steps = watch_steps(d.engine)
        seqs = [d.new(f"r{i}", p) for i, p in enumerate(PROMPTS)]
        runs.append((d.run(seqs, 8, chunk=5), rec.logits))
        if fused and arch in ("llama", "qwen2"):
            narrow = [(chunked, ok) for rows, chunked, ok in steps if rows <= d.engine.kernel_rows]
            assert all(ok for _, ok in narrow), steps       # every narrow step fused ...
            assert {c for c, _ in narrow} == {True, False}  # ... those with prompt chunks too
    (tokens, logits), (ref_tokens, ref_logits) = runs
    assert tokens == ref_tokens
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    off = []
    for rid, steps in logits.items():
        got, want = torch.stack(steps), torch.stack(ref_logits[rid])
        if mode == "q4a8":
            # the two paths' floats differ by an ulp here and there (C's expf in the SiLU), and
            # rounding an activation to 8 bits can turn an ulp into a step of 1/254 of its
            # group's range: most steps' logits agree as closely as q4's, a few by more
            diff = (got.float() - want.float()).abs().amax(dim=-1)
            assert diff.max() < 0.5, (rid, diff)
            off += (diff > tol).tolist()
        else:
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert sum(off) <= len(off) // 4, off


def watch_steps(engine):
    """Each step the engine runs, as (its rows, whether it computes a prompt chunk, whether the
    fused step ran it: None where it was not offered)."""
    steps, fused = [], engine.fused
    if fused is not None:
        real_run = fused.run
        fused.run = lambda *a: steps[-1].__setitem__(2, real_run(*a)) or steps[-1][2]
    real_execute = engine.execute

    def execute(batch):
        steps.append([sum(max(n, 0) for _, n in batch), any(n > 1 for _, n in batch), None])
        return real_execute(batch)
    engine.execute = execute
    return steps


def test_steps_up_to_the_kernel_width_are_fused_and_decode_as_the_glued_one():
    """bf16 activations on the dot-product path: decode steps wider than 8 rows take the fused
    step too (`quant.kernel_rows`: 64 rows where the q4 weights are in q4b16.c's superblocks,
    else 16, 8 a pass over each weight row), and decode the tokens of the glued path."""
    import transformers as tr
    from test_model_families import COMMON, make

    if quant._Lib().bf16_path(-1) != 1:
        pytest.skip("this CPU has no avx512_bf16: the kernels take 8 rows")
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(tr.LlamaConfig(**{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1},
                                               head_dim=32)).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0)
    model = model.to(torch.bfloat16)
    model.actorserve_quant = quant.quantize_model(model, "q4")
    width = quant.B16_ROWS if quant._Lib().b16 else quant.DOT_ROWS
    assert model.actorserve_quant.kernel_rows == width
    n = 40 if width > 40 else 12
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(3 + i % 5)] for i in range(n)]
    runs = []
    for fused in (True, False):
        d, rec = make(model, num_blocks=256)
        assert d.engine.kernel_rows == width
        widths = []
        if fused:
            real = d.engine.fused.run
            d.engine.fused.run = lambda plan, h, *a: (widths.append((h.shape[0], real(plan, h, *a))), widths[-1][1])[1]
        else:
            d.engine.fused = None
        runs.append((d.run([d.new(f"r{i}", p) for i, p in enumerate(prompts)], 6, chunk=64), rec.logits))
        if fused:
            assert (n, True) in widths                   # n decode rows in one fused call
    (tokens, logits), (ref_tokens, ref_logits) = runs
    assert tokens == ref_tokens
    for rid, steps in logits.items():
        torch.testing.assert_close(torch.stack(steps), torch.stack(ref_logits[rid]), atol=5e-2, rtol=5e-2)


def test_long_contexts_pause_the_step_pool_around_attention_and_decode_the_same():
    """Past `decode_kernel.PARALLEL_MIN_ELEMENTS` the attention kernel runs on OpenMP threads:
    the step pool sleeps through it (fused step in C, glued path in Python) and the tokens are
    those of the plain path."""
    import transformers as tr
    from actorserve.engine.kernels.decode_kernel import PARALLEL_MIN_ELEMENTS
    from test_model_families import make

    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096)
    model = tr.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0)
    model.actorserve_quant = quant.quantize_model(model, "q4")
    prompt = [(37 * i) % 250 + 3 for i in range(2100)]
    assert len(prompt) * 2 * 64 >= PARALLEL_MIN_ELEMENTS
    got = {}
    for mode in ("fused", "glued", "plain"):
        d, _ = make(model, num_blocks=160, block_size=16)
        assert d.engine.fused is not None and d.engine.glue is not None
        if mode != "fused":
            d.engine.fused = None
        if mode == "plain":
            d.engine.glue = d.engine.step_pool = None
        got[mode] = d.run([d.new("long", prompt)], 4, chunk=512)
    assert got["fused"] == got["glued"] == got["plain"]


def test_a_paused_step_pool_still_computes_and_resumes():
    from test_quant import _linear

    ql = _linear("q4", 256, 128, seed=3)
    x = torch.randn(2, 128)
    want = ql(x)
    pool = quant.StepPool(workers=1)
    with pool:
        with pool.paused():
            inside = ql(x)
        after = ql(x)
    assert torch.equal(inside, want) and torch.equal(after, want)


def test_a_narrow_step_wider_than_the_q8_heads_kernel_runs_the_head_dense_on_every_thread():
    """A bf16 q4 model's LM head is q8, whose kernel takes at most `Q8_B16_ROWS` rows
    (`Q8_BF16_ROWS` without avx512_bf16). A
    narrow step (the step pool spinning, torch on one thread) of more rows multiplies through
    the dense head on all the runner's threads, the pool asleep; a step the kernel takes keeps
    it there, on the pool."""
    import transformers as tr
    from test_model_families import COMMON

    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(tr.LlamaConfig(**{**COMMON, "num_attention_heads": 2,
                                                  "num_key_value_heads": 1}, head_dim=32)).eval()
    model = model.to(torch.bfloat16)
    model.actorserve_quant = quant.quantize_model(model, "q4")
    keep = torch.get_num_threads()
    torch.set_num_threads(2)               # a step pool (an earlier test may have left one thread)
    try:
        _narrow_head_steps(model)
    finally:
        torch.set_num_threads(keep)


def _narrow_head_steps(model) -> None:
    from test_model_families import PROMPTS, make

    d, _ = make(model, num_blocks=512)        # 34 prompts where the head's kernel takes 32 rows
    eng = d.engine
    assert eng.step_pool is not None and eng.threads == 2
    head_rows = model.lm_head.forward.w.max_rows
    # q8b16.c's superblocks where the q4 weights take q4b16.c's (avx512_bf16), else the float loops
    b16 = model.lm_head.forward.w.sb16 is not None
    assert b16 == bool(model.actorserve_quant.b16)
    want = quant.Q8_B16_ROWS if b16 else quant.Q8_BF16_ROWS
    assert head_rows == min(want, eng.kernel_rows) and model.lm_head.forward.kind == "q8"
    seen = []
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.append((a[0].shape[0], torch.get_num_threads())))
    prompts = (PROMPTS * (head_rows + 2))[:head_rows + 2]
    seqs = [d.new(f"r{i}", p) for i, p in enumerate(prompts)]
    d.step([(s, s.num_uncomputed) for s in seqs])
    for n in (2, head_rows + 2, 2):
        seen.clear()
        d.step([(s, 1) for s in seqs[:n]])
        assert seen == [(n, eng.threads if n > head_rows else 1)], (n, seen)
    assert torch.get_num_threads() == eng.threads
