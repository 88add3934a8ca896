"""A tiny Qwen3 (random weights, built here from a `Qwen3Config` and saved to a temporary
folder with a tokenizer that has ``<think>`` / ``</think>`` as tokens and a chat template that
opens ``<think>``) loaded by the engine's own loader, served by the paged runner with
``--reasoning-parser qwen3``: the thinking budget forces ``</think>`` after exactly N reasoning
tokens, through the sampler, and the tokens after it are the model's own continuation of a
context that holds the forced ``</think>`` (its KV was computed like any other token's)."""

from __future__ import annotations

import json

import pytest
import torch

from actorserve.engine.scheduling.params import SamplingParams
from actorserve.engine.runners.runner import PagedLlamaRunner, build_engine
from actorserve.engine.text.tokenizer import TextTokenizer

from http_support import serve, settle

NAME = "tiny-qwen3"
# Qwen3 thinking models' template, short: the assistant turn opens <think>
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
ASK = [{"role": "user", "content": "Count to three."}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    import transformers as tr

    from actorserve.engine.weights.models import load_model, resolve_model

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tok = tr.AutoTokenizer.from_pretrained(str(resolve_model("tiny")), local_files_only=True)
    tok.add_tokens(["<think>", "</think>"])          # as Qwen3's: added, not special (kept in text)
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = tr.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, tie_word_embeddings=False)
    model = tr.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:      # the q/k norms matter
                p.normal_(1.0, 0.3)
        model.get_output_embeddings().weight.normal_(0, 1.0)    # spread logits: no near ties
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    model, hf_tok, _ = load_model(str(folder), threads=1)     # the engine's loader
    assert model.config.model_type == "qwen3"
    return model, hf_tok, TextTokenizer(hf_tok, generation_config=model.generation_config)


def test_the_paged_runner_takes_qwen3(qwen3):
    model, hf_tok, _ = qwen3
    assert isinstance(build_engine(model, num_blocks=16, block_size=16, tokenizer=hf_tok), PagedLlamaRunner)


def _teacher_forced(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].argmax(-1).tolist()


async def _generate(rt, prompt: list[int], **kw) -> list[int]:
    handle = rt.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, **kw))
    ids: list[int] = []
    async for out in handle.stream:
        ids.extend(out.token_ids)
    return ids


async def test_budget_forces_end_of_thinking_after_n_tokens(qwen3):
    model, hf_tok, tok = qwen3
    start, end = hf_tok.convert_tokens_to_ids("<think>"), hf_tok.convert_tokens_to_ids("</think>")
    prompt = tok.apply_chat_template(ASK)
    n = len(prompt)
    body = {"model": NAME, "messages": ASK, "temperature": 0, "max_tokens": 10, "ignore_eos": True}
    async with serve(qwen3, name=NAME, reasoning_parser="qwen3") as (http, rt):
        free = await _generate(rt, prompt)
        assert end not in free             # left alone, this model never closes its thinking
        out = await (await http.post("/v1/chat/completions", json=body)).json()
        msg = out["choices"][0]["message"]
        assert msg["content"] == "" and msg["reasoning_content"] == tok.decode(free), out
        assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 10

        for budget, field in ((3, "max_thinking_tokens"), (0, "thinking_token_budget"), (5, "thinking_budget")):
            ids = await _generate(rt, prompt, thinking_budget=budget, think_ids=(start, end), think_open=True)
            assert ids[:budget] == free[:budget] and ids[budget] == end      # forced right after N
            # after </think>, each token is the model's greedy pick on a context that holds it
            pred = _teacher_forced(model, prompt + ids)
            assert ids[budget + 1:] == pred[n + budget:n + len(ids) - 1]
            assert ids[budget + 1:] != free[budget + 1:]

            r = await http.post("/v1/chat/completions", json={**body, field: budget})
            out = await r.json()
            assert r.status == 200, out
            msg = out["choices"][0]["message"]
            assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget, out
            assert (msg["reasoning_content"] or "") == tok.decode(ids[:budget])
            assert (msg["reasoning_content"] or "") + "</think>" + msg["content"] == tok.decode(ids)

        chunks = []
        stream = await http.post("/v1/chat/completions", json={**body, "max_thinking_tokens": 3, "stream": True})
        async for line in stream.content:
            text = line.decode().strip()
            if text.startswith("data: {"):
                chunks.append(json.loads(text[6:])["choices"][0]["delta"])
        ids = await _generate(rt, prompt, thinking_budget=3, think_ids=(start, end), think_open=True)
        reasoning = "".join(d.get("reasoning_content") or "" for d in chunks)
        assert reasoning == tok.decode(ids[:3])
        assert reasoning + "</think>" + "".join(d.get("content") or "" for d in chunks) == tok.decode(ids)
        await settle(rt)
