"""Model families (issue 13 part 4): tiny random models built from a config, each against
transformers' own forward and ``generate``.

Paged (`engine.runners.families`): Qwen3 (per-head q/k RMSNorm before RoPE), Qwen2 (q/k/v biases),
Gemma (scaled embedding, ``(1 + w)`` RMSNorm, gelu-tanh MLP), Gemma2 (sandwich norms,
soft-capped attention and final logits), Phi-3 (fused qkv and gate_up, also with partial
rotary): greedy tokens of a batch of prompts of different lengths with a chunked prefill
equal ``generate(do_sample=False)``, every step's logits equal one plain forward's, and so do
those of a prefix-cache hit. Fallback (`engine.runners.hf_fallback`): GPT-2, GPT-NeoX and Gemma3 (a
shape the paged runner does not take) with HF's KV cache: greedy tokens equal ``generate``,
a decode step feeds the model one token, a retraction (or a changed token) rebuilds the
cache from position 0, ``release`` drops it, prompt logprobs equal an independent forward.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from actorserve.engine.scheduling.block_manager import BlockManager
from actorserve.engine.scheduling.params import PoolingParams
from actorserve.engine.runners.runner import HFFallbackRunner, PagedLlamaRunner, build_engine, supports_paged

from engine_driver import Driver, RecordingGreedy

PROMPTS = [[3, 17, 250, 9, 44, 120, 7, 8, 91, 13, 200, 5, 66], [5, 6], [11, 12, 13, 14, 15, 16, 17]]
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _build(arch: str):
    import transformers as tr

    torch.manual_seed(0)
    if arch == "qwen3":
        model = tr.Qwen3ForCausalLM(tr.Qwen3Config(**COMMON, head_dim=16))
    elif arch == "qwen3_bias":
        model = tr.Qwen3ForCausalLM(tr.Qwen3Config(**COMMON, head_dim=32, attention_bias=True))
    elif arch == "qwen2":
        model = tr.Qwen2ForCausalLM(tr.Qwen2Config(**COMMON))
    elif arch == "gemma":
        model = tr.GemmaForCausalLM(tr.GemmaConfig(**COMMON, head_dim=16, hidden_act="gelu_pytorch_tanh"))
    elif arch == "phi3":
        model = tr.Phi3ForCausalLM(tr.Phi3Config(**COMMON, pad_token_id=0))
    elif arch == "phi3_partial":
        model = tr.Phi3ForCausalLM(tr.Phi3Config(**COMMON, pad_token_id=0, partial_rotary_factor=0.5))
    elif arch == "gemma2":
        model = tr.Gemma2ForCausalLM(tr.Gemma2Config(**COMMON, head_dim=16, sliding_window=128,
                                                     attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                                                     query_pre_attn_scalar=1))
    elif arch == "gemma3":
        model = tr.Gemma3ForCausalLM(tr.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=128))
    elif arch == "gpt2":
        model = tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=256, n_positions=256,
                                                 bos_token_id=0, eos_token_id=0))
    elif arch == "gpt_neox":
        model = tr.GPTNeoXForCausalLM(tr.GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                       num_hidden_layers=2, num_attention_heads=4,
                                                       max_position_embeddings=256))
    else:
        raise AssertionError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:     # make the norms (and Qwen3's q/k norms) matter
                p.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.3)
        model.get_output_embeddings().weight.normal_(0, 1.0)   # spread the logits: no near ties
    return model.eval()


PAGED = ["qwen3", "qwen3_bias", "qwen2", "gemma", "gemma2", "phi3", "phi3_partial"]
FALLBACK = ["gpt2", "gpt_neox", "gemma3"]


@pytest.fixture(scope="module", params=PAGED + FALLBACK)
def arch_model(request):
    return request.param, _build(request.param)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def make(model, *, num_blocks=64, block_size=4):
    rec = RecordingGreedy()
    eng = build_engine(model, num_blocks=num_blocks, block_size=block_size, sampler=rec)
    return Driver(eng, BlockManager(num_blocks, block_size)), rec


def test_family_is_routed(arch_model):
    arch, model = arch_model
    assert supports_paged(model) == (arch in PAGED)
    d, _ = make(model)
    assert isinstance(d.engine, PagedLlamaRunner if arch in PAGED else HFFallbackRunner)
    if arch.startswith("gemma") and arch != "gemma":
        assert d.engine.info.max_model_len == 128       # capped at the sliding window: full attention is exact


def test_batched_chunked_greedy_equals_generate(arch_model):
    _, model = arch_model
    d, rec = make(model)
    seqs = [d.new(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    got = d.run(seqs, 8, chunk=5)           # the 13-token prompt prefills in 3 chunks, beside decodes
    assert got == [hf_greedy(model, p, 8) for p in PROMPTS]
    for i, (p, toks) in enumerate(zip(PROMPTS, got)):
        ref = hf_logits(model, p + toks[:-1])          # every sampled step's logits, one forward
        seen = torch.stack(rec.logits[f"r{i}"])
        torch.testing.assert_close(seen, ref[len(p) - 1:], atol=1e-4, rtol=1e-4)


def test_prefix_cache_hit_equals_forward(arch_model):
    _, model = arch_model
    prompt = PROMPTS[0] + PROMPTS[2]                   # 20 tokens
    d, rec = make(model)
    d.run([d.new("first", prompt)], 1)
    warm = d.new("warm", prompt)
    sibling = d.new("sibling", prompt[:12] + [99, 100, 101])
    assert (warm.num_cached, sibling.num_cached) == (16, 12)
    got = d.run([warm, sibling], 4)
    assert got == [hf_greedy(model, prompt, 4), hf_greedy(model, prompt[:12] + [99, 100, 101], 4)]
    torch.testing.assert_close(rec.logits["warm"][0], hf_logits(model, prompt)[-1], atol=1e-4, rtol=1e-4)


# -- the fallback's KV cache -----------------------------------------------------------------------
def _record_inputs(monkeypatch, model) -> list[int]:
    lengths: list[int] = []
    forward = model.forward

    def spy(*a, **kw):
        lengths.append(int((kw["input_ids"] if "input_ids" in kw else a[0]).shape[1]))
        return forward(*a, **kw)

    monkeypatch.setattr(model, "forward", spy)
    return lengths


@pytest.mark.parametrize("arch", FALLBACK)
def test_fallback_feeds_only_new_tokens(arch, monkeypatch):
    model = _build(arch)
    d, _ = make(model)
    lengths = _record_inputs(monkeypatch, model)
    seq = d.new("a", PROMPTS[0])
    out = d.run([seq], 6, chunk=5, free=False)[0]
    assert lengths == [5, 5, 3, 1, 1, 1, 1, 1]          # chunks extend the cache, each decode one token
    assert d.engine.rebuilds == 1
    assert out == hf_greedy(model, PROMPTS[0], 6)
    assert seq in d.engine._caches
    d.finish(seq)
    assert seq not in d.engine._caches                   # release drops it


def test_fallback_rebuilds_after_retraction_and_changed_tokens(monkeypatch):
    model = _build("gpt2")
    d, rec = make(model)
    lengths = _record_inputs(monkeypatch, model)
    seq = d.new("a", PROMPTS[0])
    d.run([seq], 3, free=False)
    assert lengths == [13, 1, 1] and d.engine.rebuilds == 1
    d.bm.free(seq)                                       # retracted: the scheduler recomputes it all
    d.bm.match_prefix(seq)
    assert seq.num_computed == 12                        # 3 blocks from the prefix cache: not HF's
    d.step([(seq, seq.num_uncomputed)])                  # 13 + 3 tokens, from scratch
    assert lengths[-1] == 16 and d.engine.rebuilds == 2
    d.step([(seq, 1)])
    assert lengths[-1] == 1
    seq.output_ids[0] = (seq.output_ids[0] + 1) % 256   # not the tokens the cache holds any more
    d.step([(seq, 1)])
    assert lengths[-1] == seq.num_tokens - 1 and d.engine.rebuilds == 3
    ref = hf_logits(model, seq.token_ids()[:-1])[-1]
    torch.testing.assert_close(rec.logits["a"][-1], ref, atol=1e-4, rtol=1e-4)
    # a prefix-cache hit of the block manager means nothing to HF's cache: rebuilt from 0
    warm = d.new("warm", PROMPTS[0])
    assert warm.num_cached == 12
    d.step([(warm, warm.num_uncomputed)])
    assert lengths[-1] == 13 and d.engine.rebuilds == 4
    torch.testing.assert_close(rec.logits["warm"][0], hf_logits(model, PROMPTS[0])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [13, 4])
def test_fallback_prompt_logprobs_with_cache(chunk):
    model = _build("gpt_neox")
    ref = torch.log_softmax(hf_logits(model, PROMPTS[0]), dim=-1)
    d, _ = make(model)
    seq = d.new("p", PROMPTS[0], cached=False, prompt_logprobs=2, logprob_start_len=3)
    while True:
        out = d.step([(seq, min(chunk, seq.num_uncomputed))])[0]
        if out.token_id is not None:
            break
    pl = out.prompt_logprobs
    assert pl.start == 3 and pl.logprobs[0] is None
    want = [float(ref[p - 1, PROMPTS[0][p]]) for p in range(4, len(PROMPTS[0]))]
    torch.testing.assert_close(torch.tensor(pl.logprobs[1:]), torch.tensor(want), atol=1e-4, rtol=0)
    assert [t for t, _ in pl.top[1]] == ref[3].topk(2).indices.tolist()
    assert d.step([(seq, 1)])[0].prompt_logprobs is None


def test_fallback_pooling_beside_generation():
    model = _build("gpt2")
    d, _ = make(model)
    prompt = PROMPTS[2]
    from actorserve.engine.scheduling.sequence import Sequence

    score = Sequence("score", prompt, pooling=PoolingParams(task="score"))
    embed = Sequence("embed", prompt, pooling=PoolingParams(task="embed"))
    gen = d.new("gen", prompt, cached=False)
    outs = d.step([(score, len(prompt)), (gen, len(prompt)), (embed, len(prompt))])
    want = torch.log_softmax(hf_logits(model, prompt)[-1], dim=-1)
    torch.testing.assert_close(outs[0].pooled, want, atol=1e-4, rtol=1e-4)
    assert outs[1].token_id == int(want.argmax()) and outs[1].pooled is None
    assert outs[2].pooled.shape == (64,) and abs(float(outs[2].pooled.norm()) - 1.0) < 1e-5
