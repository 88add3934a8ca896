"""``--dtype``: what ``auto`` picks, and that bfloat16 weights and KV keep the outputs: greedy
SmolLM2 tokens agree with float32 on a fixed prompt set, embeddings' cosine to float32 is at
least 0.999, and the sampler always sees float32 logits."""

from __future__ import annotations

import pytest
import torch

from actorserve.engine.weights.dtype import cpu_bf16_flags, resolve_dtype
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.engine.scheduling.sequence import Sequence

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time",
           "The three primary colours are", "import numpy as np\n", "My favourite food is",
           "The largest planet in the solar system is"]


def test_auto_picks_bf16_only_where_the_cpu_has_it():
    assert cpu_bf16_flags(CPUINFO) == ("amx_bf16", "avx512_bf16")
    assert cpu_bf16_flags("flags\t: fpu sse avx2\n") == ()
    assert resolve_dtype("float32") == (torch.float32, "asked for")
    assert resolve_dtype("bfloat16")[0] is torch.bfloat16
    dtype, why = resolve_dtype("auto")
    assert (dtype is torch.bfloat16) == bool(cpu_bf16_flags()) and why.startswith("auto")
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        resolve_dtype("fp8")


def greedy(engine, ids: list[int], n: int) -> list[int]:
    """Decode `n` greedy tokens with the paged runner (prefill, then one token a step)."""
    seq = Sequence("r", ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=n))
    need = -(-(len(ids) + n) // engine.kv.block_size)
    seq.block_table = list(range(need))
    out = []
    step = len(ids)
    for _ in range(n):
        [res] = engine.execute([(seq, step)])
        seq.num_computed += step
        seq.output_ids.append(res.token_id)
        out.append(res.token_id)
        step = 1
    return out


def forced_logits(engine, ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits of each step of decoding `tokens` after `ids` (teacher-forced: the engine's
    sampler is replaced by one that records the row and answers the given token)."""
    rows: list[torch.Tensor] = []
    feed = iter(tokens)

    def record(logits, seqs):
        rows.append(logits[0].clone())
        return [(next(feed), None, None)]

    keep, engine._sampler = engine._sampler, record
    try:
        greedy(engine, ids, len(tokens))
    finally:
        engine._sampler = keep
    return rows


@pytest.mark.model
def test_bf16_greedy_agrees_with_fp32_and_the_sampler_sees_fp32():
    """bf16 may flip a token only where fp32 itself was a close call: along fp32's greedy
    continuation (both engines fed the same tokens), every step where fp32's top-2 margin
    exceeds twice the largest logit difference bf16 makes there must pick the same token. The
    difference is measured, so the check holds for whatever matrix unit rounds the products
    (AMX tiles, avx512_bf16, or bf16 emulated on AVX2)."""
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.runners.runner import build_engine
    from actorserve.engine.sampling.sampling import sample

    seen: list[torch.dtype] = []

    def spy(logits, seqs):
        seen.append(logits.dtype)
        return sample(logits, seqs)

    model, tok, _ = load_model("default", threads=2, quantization="none")
    fp32 = build_engine(model, num_blocks=64, block_size=16)
    prompts = [tok.encode(p) for p in PROMPTS]
    ref = [greedy(fp32, p, 16) for p in prompts]
    model_bf16, _, _ = load_model("default", threads=2, dtype=torch.bfloat16, quantization="none")
    bf16 = build_engine(model_bf16, num_blocks=64, block_size=16, sampler=spy)
    assert bf16.kv.dtype is torch.bfloat16 and bf16.info.dtype == "bfloat16" and fp32.info.dtype == "float32"
    greedy(bf16, prompts[0], 2)
    assert set(seen) == {torch.float32}
    decided = agreed = steps = 0
    for ids, tokens in zip(prompts, ref):
        for a, b in zip(forced_logits(fp32, ids, tokens), forced_logits(bf16, ids, tokens)):
            steps += 1
            err = float((a - b).abs().max())
            assert err < 0.1 * float(a.max() - a.min()), err    # bf16 is close, whatever rounds it
            top2 = a.topk(2).values
            if float(top2[0] - top2[1]) > 2 * err:            # not a close call: it cannot flip
                decided += 1
                agreed += int(a.argmax() == b.argmax())
    assert agreed == decided, (agreed, decided)
    assert decided >= steps // 4, (decided, steps)             # the check is not vacuous


@pytest.mark.model
def test_bf16_embeddings_keep_their_direction():
    from actorserve.engine.pooling.encoder import load_encoder
    from actorserve.engine.scheduling.params import PoolingParams

    texts = ["a cat sat on the mat", "stock markets fell sharply today", "how do I bake bread?",
             "the mitochondria is the powerhouse of the cell"]
    vecs = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine, tok, _ = load_encoder("embed", threads=2, dtype=dtype)
        assert engine.info.dtype == str(dtype).removeprefix("torch.")
        seqs = [Sequence(f"e{i}", tok.encode(t), pooling=PoolingParams()) for i, t in enumerate(texts)]
        outs = engine.execute([(s, s.num_tokens) for s in seqs])
        vecs[dtype] = torch.stack([o.pooled for o in outs])
        assert vecs[dtype].dtype is torch.float32
    cos = torch.nn.functional.cosine_similarity(vecs[torch.float32], vecs[torch.bfloat16], dim=-1)
    assert bool((cos >= 0.999).all()), cos
