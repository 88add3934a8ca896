"""Reasoning models over HTTP with a scripted engine (the fake engine answering a fixed token
script) and a real tokenizer that has ``<think>`` / ``</think>`` as tokens: ``--reasoning-parser``
splits chat answers into ``reasoning_content`` and ``content``, streamed and not, through the
official `openai` client; SGLang's ``separate_reasoning`` / ``stream_reasoning``;
``enable_thinking`` through ``chat_template_kwargs``; the Responses API's reasoning items and
events; ``usage`` reasoning tokens; the budget's refusals."""

from __future__ import annotations

import contextlib
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI

from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig, ServerConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.http.edge import serve_cli
from actorserve.http.edge.app import build_app

from http_support import assert_error

NAME = "scripted-qwen3"
# Qwen3's chat template, in short: thinking unless enable_thinking is false, which closes an
# empty <think></think> in the prompt
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
THOUGHT = "Two and two: four, surely."
ANSWER = "The answer is 4."


def thinking_tokenizer(template: str = TEMPLATE):
    """The tiny model's tokenizer with Qwen3's tags added as (non-special) tokens, as Qwen3's
    own tokenizer has them: they stay in the decoded text."""
    from transformers import AutoTokenizer

    from actorserve.engine.weights.models import resolve_model
    from actorserve.engine.text.tokenizer import TextTokenizer

    hf = AutoTokenizer.from_pretrained(str(resolve_model("tiny")), local_files_only=True)
    hf.add_tokens(["<think>", "</think>"])
    return TextTokenizer(hf, chat_template=template)


def _scripted(script, vocab, eos):
    """The fake engine answering every request with `script`, then EOS, token by token."""
    engine = FakeEngine(vocab_size=vocab, eos_token_id=eos, block_size=16)
    engine.token_after = lambda ids: 1          # a generated row (prefill chunks give None)
    real = engine.execute

    def execute(batch):
        outs = real(batch)
        for (seq, _n), out in zip(batch, outs):
            if out.token_id is not None:
                k = len(seq.output_ids)
                out.token_id = script[k] if k < len(script) else eos
        return outs
    engine.execute = execute
    return engine


@contextlib.asynccontextmanager
async def serve(text: str, *, parser: str | None = "qwen3", tok=None):
    tok = tok or thinking_tokenizer()
    script = tok.encode(text, add_special_tokens=False)
    engine = _scripted(script, len(tok.hf), tok.hf.eos_token_id)
    rt = Runtime(engine, config=SchedulerConfig(step_in_thread=False))
    app = build_app(rt, tok, ServerConfig(reasoning_parser=parser), NAME)
    async with TestServer(app, host="127.0.0.1", port=0) as server:
        async with TestClient(server) as http:
            oa = AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0)
            try:
                yield http, oa
            finally:
                await oa.close()


ASK = [{"role": "user", "content": "What is 2 + 2?"}]


async def test_chat_splits_reasoning_from_content_non_streamed_and_streamed():
    async with serve(f"<think>{THOUGHT}</think>\n\n{ANSWER}") as (http, oa):
        out = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100)
        msg = out.choices[0].message
        assert msg.content == f"\n\n{ANSWER}" and out.choices[0].finish_reason == "stop"
        extra = msg.model_extra
        assert extra["reasoning_content"] == THOUGHT and extra["reasoning"] == THOUGHT
        details = out.usage.completion_tokens_details
        n_thought = len(thinking_tokenizer().encode(THOUGHT, add_special_tokens=False))
        assert details.reasoning_tokens == n_thought
        assert out.usage.model_extra["reasoning_tokens"] == n_thought

        stream = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100, stream=True,
                                                  stream_options={"include_usage": True})
        order, thought, content, usage = [], "", "", None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            r = (delta.model_extra or {}).get("reasoning_content")
            if r:
                assert delta.model_extra["reasoning"] == r
                thought += r
                order.append("r")
            if delta.content:
                content += delta.content
                order.append("c")
        assert thought == THOUGHT and content == f"\n\n{ANSWER}"
        assert order.count("r") > 1, "reasoning streams as it comes, not in one piece"
        assert order == sorted(order, key=lambda k: k == "c")          # all reasoning, then content
        assert usage.completion_tokens_details.reasoning_tokens == n_thought


async def test_an_answer_without_think_is_content_and_a_cut_one_is_reasoning():
    async with serve(ANSWER) as (http, oa):
        out = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100)
        assert out.choices[0].message.content == ANSWER
        assert out.choices[0].message.model_extra["reasoning_content"] is None
        assert out.usage.completion_tokens_details.reasoning_tokens == 0
    async with serve(f"<think>{THOUGHT}</think>{ANSWER}") as (http, oa):
        out = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=5)
        c = out.choices[0]
        assert c.finish_reason == "length" and c.message.content == ""
        assert THOUGHT.startswith(c.message.model_extra["reasoning_content"])
        assert c.message.model_extra["reasoning_content"]


async def test_enable_thinking_false_closes_think_in_the_prompt_so_all_is_content():
    # the template left <think> open: the answer starts inside reasoning
    opened = TEMPLATE.replace("<|im_start|>assistant\n{%", "<|im_start|>assistant\n<think>\n{%")
    async with serve(f"{THOUGHT}</think>{ANSWER}", tok=thinking_tokenizer(opened)) as (http, oa):
        out = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100)
        assert out.choices[0].message.model_extra["reasoning_content"] == f"{THOUGHT}"
        assert out.choices[0].message.content == ANSWER
    async with serve(ANSWER) as (http, oa):
        out = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert out.choices[0].message.content == ANSWER
        tok = await http.post("/tokenize", json={"messages": ASK,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
        assert "</think>" in thinking_tokenizer().decode((await tok.json())["tokens"], skip_special_tokens=False)
        bad = await http.post("/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": {
            "add_generation_prompt": False}})
        assert bad.status == 400
        assert (await bad.json())["error"]["param"] == "chat_template_kwargs.add_generation_prompt"


async def test_deepseek_r1_starts_inside_reasoning():
    async with serve(f"{THOUGHT}</think>{ANSWER}", parser="deepseek-r1") as (http, oa):
        out = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100)
        assert out.choices[0].message.model_extra["reasoning_content"] == THOUGHT
        assert out.choices[0].message.content == ANSWER


async def test_separate_reasoning_false_and_stream_reasoning_false():
    text = f"<think>{THOUGHT}</think>{ANSWER}"
    async with serve(text) as (http, oa):
        out = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100,
                                               extra_body={"separate_reasoning": False})
        assert out.choices[0].message.content == text
        assert "reasoning_content" not in out.choices[0].message.model_extra
        assert "completion_tokens_details" not in (out.usage.model_extra or {}) \
            and out.usage.completion_tokens_details is None

        stream = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100, stream=True,
                                                  extra_body={"stream_reasoning": False})
        pieces, content = [], ""
        async for chunk in stream:
            delta = chunk.choices[0].delta
            if (delta.model_extra or {}).get("reasoning_content"):
                pieces.append(delta.model_extra["reasoning_content"])
            content += delta.content or ""
        assert pieces == [THOUGHT] and content == ANSWER


async def test_without_a_parser_text_is_untouched_and_a_budget_is_refused():
    text = f"<think>{THOUGHT}</think>{ANSWER}"
    async with serve(text, parser=None) as (http, oa):
        out = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100)
        assert out.choices[0].message.content == text
        assert "reasoning_content" not in out.choices[0].message.model_extra
        for field in ("max_thinking_tokens", "thinking_token_budget", "thinking_budget"):
            r = await http.post("/v1/chat/completions", json={"messages": ASK, field: 4})
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == field, body
            assert "--reasoning-parser" in body["error"]["message"]
            assert_error(body)
    async with serve(text) as (http, oa):
        r = await http.post("/v1/chat/completions", json={"messages": ASK, "max_thinking_tokens": 4,
                                                          "thinking_budget": 5})
        assert r.status == 400 and (await r.json())["error"]["param"] == "thinking_budget"
        r = await http.post("/v1/chat/completions", json={"messages": ASK, "max_thinking_tokens": -1})
        assert r.status == 400 and "max_thinking_tokens" in (await r.json())["error"]["param"]
        r = await http.post("/v1/chat/completions", json={"messages": ASK, "separate_reasoning": "yes"})
        assert r.status == 400


async def test_budget_needs_single_token_tags():
    from transformers import AutoTokenizer

    from actorserve.engine.weights.models import resolve_model
    from actorserve.engine.text.tokenizer import TextTokenizer

    plain = TextTokenizer(AutoTokenizer.from_pretrained(str(resolve_model("tiny")), local_files_only=True),
                          chat_template=TEMPLATE)
    async with serve(f"<think>{THOUGHT}</think>{ANSWER}", tok=plain) as (http, oa):
        out = await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=100)
        assert out.choices[0].message.model_extra["reasoning_content"] == THOUGHT   # text split still works
        assert out.usage.completion_tokens_details.reasoning_tokens == \
            len(plain.encode(THOUGHT, add_special_tokens=False))
        r = await http.post("/v1/chat/completions", json={"messages": ASK, "thinking_token_budget": 4})
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "thinking_token_budget"
        assert "single tokens" in body["error"]["message"]


async def test_responses_reasoning_items_and_events():
    async with serve(f"<think>{THOUGHT}</think>{ANSWER}") as (http, oa):
        resp = await oa.responses.create(model=NAME, input="What is 2 + 2?", max_output_tokens=100)
        assert [i.type for i in resp.output] == ["reasoning", "message"]
        rs = resp.output[0]
        assert rs.id.startswith("rs_") and rs.summary == [] and rs.status == "completed"
        assert [(c.type, c.text) for c in rs.content] == [("reasoning_text", THOUGHT)]
        assert resp.output_text == ANSWER
        n_thought = len(thinking_tokenizer().encode(THOUGHT, add_special_tokens=False))
        assert resp.usage.output_tokens_details.reasoning_tokens == n_thought

        # the output goes back as input (a client managing its context): accepted, not shown
        follow = await oa.responses.create(model=NAME, max_output_tokens=100, input=[
            {"role": "user", "content": "What is 2 + 2?"}, rs.model_dump(exclude_none=True),
            {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And 3 + 3?"}])
        assert follow.status == "completed"
        cont = await oa.responses.create(model=NAME, input="Why?", previous_response_id=resp.id,
                                         max_output_tokens=100)
        assert cont.status == "completed" and cont.output_text == ANSWER

        events = []
        async with await oa.responses.create(model=NAME, input="What is 2 + 2?", max_output_tokens=100,
                                             stream=True) as stream:
            async for ev in stream:
                events.append(ev)
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == THOUGHT and len(deltas) > 1
        done = kinds.index("response.reasoning_text.done")
        assert events[done].text == THOUGHT and kinds[done + 1:done + 3] == [
            "response.content_part.done", "response.output_item.done"]
        assert kinds.index("response.output_text.delta") > done         # the answer after
        final = events[-1].response
        assert final.status == "completed" and [i.type for i in final.output] == ["reasoning", "message"]
        assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
        assert [e.sequence_number for e in events] == list(range(len(events)))


def test_cli_flag_and_aliases():
    import argparse

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli.config_from_args(p.parse_args([])).reasoning_parser is None
    c = serve_cli.config_from_args(p.parse_args(["--reasoning-parser", "deepseek_r1", "--enable-reasoning"]))
    assert c.reasoning_parser == "deepseek-r1"
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "nope"])
    assert json.dumps(c.reasoning_parser)


async def test_separate_reasoning_route():
    async with serve(ANSWER, parser=None) as (http, oa):
        cases = [("qwen3", f"<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
                 ("qwen3", ANSWER, "", ANSWER),
                 ("deepseek-r1", f"{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
                 ("deepseek_r1", "still thinking", "still thinking", "")]
        for parser, text, reasoning, rest in cases:
            r = await http.post("/separate_reasoning", json={"text": text, "reasoning_parser": parser})
            assert r.status == 200 and await r.json() == {"reasoning_text": reasoning, "text": rest}
        r = await http.post("/separate_reasoning", json={"text": "x", "reasoning_parser": "kimi"})
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "reasoning_parser"
        r = await http.post("/separate_reasoning", json={"text": "x"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "reasoning_parser"
