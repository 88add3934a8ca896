"""The model runners against transformers' own forward and generate.

Tiny fixture (random 1M-param Llama from `tinycoder`) for the fast tests; SmolLM2-135M for
one real chat prompt (marked ``model``). Models built from a config cover GQA, Qwen2
(attention biases) and an architecture only the HF fallback serves.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from actorserve.engine.weights import models
from actorserve.engine.scheduling.block_manager import BlockManager
from actorserve.engine.scheduling.params import PoolingParams
from actorserve.engine.runners.runner import HFFallbackRunner, PagedLlamaRunner, build_engine, supports_paged
from actorserve.engine.scheduling.sequence import Sequence

from engine_driver import Driver, RecordingGreedy

TINY_PROMPTS = [
    [1, 415, 2936, 9060, 285, 1142, 461, 10575, 754, 272, 17898, 3914, 28723],   # 13 tokens
    [1, 22, 4],
    [1, 28705, 13, 1270, 16116, 28732, 28711, 1329, 13, 2287, 513, 307, 523, 28705, 28750,
     28747, 604, 307, 13, 2287, 604, 16116, 28732, 28711, 28733, 28740, 28731],              # 27 tokens
]


@pytest.fixture(scope="module")
def tiny():
    model, tok, _ = models.load_model("tiny")
    return model, tok


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def make(model, *, num_blocks=64, block_size=4, runner=PagedLlamaRunner):
    rec = RecordingGreedy()
    eng = runner(model, num_blocks=num_blocks, block_size=block_size, sampler=rec)
    return Driver(eng, BlockManager(num_blocks, block_size)), rec


# -- greedy equality with generate -----------------------------------------------------------------
def test_greedy_batch_equals_generate_tiny(tiny):
    model, _ = tiny
    d, _ = make(model)
    got = d.run([d.new(f"r{i}", p) for i, p in enumerate(TINY_PROMPTS)], 10)
    for prompt, tokens in zip(TINY_PROMPTS, got):
        assert tokens == hf_greedy(model, prompt, 10)
    assert d.bm.stats().used_blocks == 0


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2"])
def test_greedy_equals_generate_config_models(arch):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=5000.0))
    with torch.no_grad():   # the default init is near-uniform; spread the logits apart
        model.lm_head.weight.normal_(0, 1.0)
    model.eval()
    assert supports_paged(model)
    prompts = [[3, 17, 250, 9, 44, 120, 7], [5, 6]]
    d, _ = make(model)
    got = d.run([d.new(f"r{i}", p) for i, p in enumerate(prompts)], 8)
    assert got == [hf_greedy(model, p, 8) for p in prompts]


def test_hf_fallback_equals_generate_tiny(tiny):
    model, _ = tiny
    d, _ = make(model, runner=HFFallbackRunner)
    got = d.run([d.new(f"r{i}", p) for i, p in enumerate(TINY_PROMPTS[:2])], 6, chunk=5)
    assert got == [hf_greedy(model, p, 6) for p in TINY_PROMPTS[:2]]


# -- prefix cache, chunked prefill, mixed steps ----------------------------------------------------
def test_prefix_cache_hit_matches_cold_run(tiny):
    model, _ = tiny
    prompt = TINY_PROMPTS[2]
    d, rec = make(model)
    d.run([d.new("first", prompt)], 1)                       # commits its full blocks, then frees
    warm = d.new("warm", prompt)
    # "first" computed all 27 prompt tokens, so 27 // 4 = 6 full blocks are cached; a 27-token
    # prompt may reuse all 6 (24 tokens) because 3 tokens are still left to compute.
    assert warm.num_cached == (len(prompt) // 4) * 4 == 24
    sibling = d.new("sibling", prompt[:20] + [99, 100, 101])  # shares the first 5 blocks
    assert sibling.num_cached == 20
    d.run([warm, sibling], 1)
    cold, cold_rec = make(model)
    cold.run([cold.new("warm", prompt, cached=False), cold.new("sibling", prompt[:20] + [99, 100, 101])], 1)
    for rid in ("warm", "sibling"):
        torch.testing.assert_close(rec.logits[rid][0], cold_rec.logits[rid][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rec.logits["warm"][0], hf_last_logits(model, prompt), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_equals_one_shot(tiny):
    model, _ = tiny
    prompt = TINY_PROMPTS[2]
    d, rec = make(model)
    seq = d.new("chunked", prompt)
    outs = d.step([(seq, 9)])
    assert outs[0].token_id is None and outs[0].pooled is None
    d.step([(seq, 9)])
    d.step([(seq, 9)])                                         # 27 = 3 x 9: reaches the end
    assert len(seq.output_ids) == 1
    got = d.run([seq], 6)
    one, one_rec = make(model)
    assert got == one.run([one.new("chunked", prompt)], 6)
    torch.testing.assert_close(rec.logits["chunked"][0], one_rec.logits["chunked"][0], atol=1e-5, rtol=1e-5)


def test_mixed_prefill_and_decode_step(tiny):
    model, _ = tiny
    d, _ = make(model)
    a, b = d.new("a", TINY_PROMPTS[0]), d.new("b", TINY_PROMPTS[1])
    d.step([(a, a.num_uncomputed), (b, b.num_uncomputed)])
    c = d.new("c", TINY_PROMPTS[2])
    while len(c.output_ids) < 5:                               # c prefills in chunks of 10 while a, b decode
        d.step([(a, 1), (c, min(10, c.num_uncomputed)), (b, 1)])
    alone = []
    for rid, prompt in zip("abc", TINY_PROMPTS):
        solo, _ = make(model)
        alone.append(solo.run([solo.new(rid, prompt)], 8))
    assert a.output_ids == alone[0][0][:len(a.output_ids)]
    assert b.output_ids == alone[1][0][:len(b.output_ids)]
    assert c.output_ids == alone[2][0][:len(c.output_ids)]
    assert len(a.output_ids) == len(b.output_ids) == 8


def test_zero_and_partial_members_get_empty_outputs(tiny):
    model, _ = tiny
    d, _ = make(model)
    s, idle = d.new("s", TINY_PROMPTS[0]), d.new("idle", TINY_PROMPTS[1])
    outs = d.step([(s, 4), (idle, 0)])
    assert [o.seq for o in outs] == [s, idle]
    assert all(o.token_id is None and o.pooled is None for o in outs)


# -- pooling rows and engine info ------------------------------------------------------------------
def test_pooling_rows_through_the_lm_head(tiny):
    model, _ = tiny
    d, _ = make(model)
    prompt = TINY_PROMPTS[0]
    score = Sequence("score", prompt, pooling=PoolingParams(task="score"))
    embed = Sequence("embed", prompt, pooling=PoolingParams(task="embed"))
    gen = d.new("gen", prompt, cached=False)
    outs = d.step([(score, len(prompt)), (gen, len(prompt)), (embed, len(prompt))])
    want = torch.log_softmax(hf_last_logits(model, prompt), dim=-1)
    assert outs[0].token_id is None and outs[0].pooled.dtype == torch.float32
    torch.testing.assert_close(outs[0].pooled, want, atol=1e-4, rtol=1e-4)
    assert outs[1].token_id is not None and outs[1].pooled is None
    assert outs[2].pooled.shape == (model.config.hidden_size,)
    assert abs(float(outs[2].pooled.norm()) - 1.0) < 1e-5


def test_engine_info_and_factory(tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    model, tok = tiny
    eng = build_engine(model, num_blocks=8, block_size=16, tokenizer=tok)
    assert isinstance(eng, PagedLlamaRunner)
    assert eng.info.model_name == "tiny-llama"
    assert eng.info.eos_token_ids == (2,)
    assert eng.info.max_model_len == 128                       # capped by the KV capacity
    assert eng.info.vocab_size == 32000
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)).eval()
    assert not supports_paged(gpt2)
    rec = RecordingGreedy()
    fallback = build_engine(gpt2, num_blocks=8, block_size=16, sampler=rec)
    assert isinstance(fallback, HFFallbackRunner)
    assert fallback.info.max_model_len == 64 and fallback.info.eos_token_ids == (0,)
    d = Driver(fallback, BlockManager(8, 16))
    d.run([d.new("g", [3, 4, 5])], 1)
    torch.testing.assert_close(rec.logits["g"][0], hf_last_logits(gpt2, [3, 4, 5]))


# -- model registry --------------------------------------------------------------------------------
def test_resolve_model_specs(tmp_path):
    tiny_dir = models.resolve_model("tiny")
    assert models.is_converted(tiny_dir) and models.served_name(tiny_dir) == "tiny-llama"
    assert models.resolve_model(str(tiny_dir)) == tiny_dir
    with pytest.raises(models.ModelNotFound):
        models.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(models.ModelNotFound):
        models.resolve_model(str(tmp_path))                   # a folder without config.json


def test_conversion_is_atomic(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    monkeypatch.setenv("ACTORSERVE_CACHE", str(tmp_path))
    gguf = models.embedded_source("tiny")

    def boom(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(PreTrainedTokenizerBase, "save_pretrained", boom)
        with pytest.raises(KeyboardInterrupt):
            models.convert_gguf(gguf, "tiny-llama")
    assert list(tmp_path.iterdir()) == []                     # no half cache left behind
    assert not models.is_converted(models.cache_dir_for(gguf, "tiny-llama"))
    assert models.cache_dir_for(gguf, "tiny-llama").parent == tmp_path


def test_models_cli_lists_embedded(capsys):
    import argparse

    from actorserve.engine.weights import models_cli

    p = argparse.ArgumentParser()
    models_cli.add_arguments(p)
    assert models_cli.run(p.parse_args([])) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "tiny-llama" in out
    assert models_cli.run(p.parse_args(["convert", "/no/such/model.gguf"])) == 2


# -- the real default model ------------------------------------------------------------------------
@pytest.mark.model
def test_smollm2_chat_greedy_equals_generate():
    model, tok, _ = models.load_model("default")
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids
    ref = hf_greedy(model, prompt, 16)
    d, _ = make(model, num_blocks=16, block_size=16)
    got = d.run([d.new("chat", prompt)], 16)[0]
    assert got[:len(ref)] == ref
    assert "Paris" in tok.decode(got, skip_special_tokens=True)
