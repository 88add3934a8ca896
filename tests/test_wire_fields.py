"""Issue 29's standard fields, over the tiny model: each is honoured as the peer that defines it
honours it (min_tokens / min_new_tokens, stop_regex, continue_final_message and
add_generation_prompt, tools on /tokenize, max_new_tokens 0, best_of, structured_outputs, the
completions default of 16 tokens, weight_version), and a field sent at its no-op value is
accepted on every route while any other value of it is still a 400."""

from __future__ import annotations

import json
import re

import pytest
from openai import AsyncOpenAI

from http_support import NAME, assert_error, load_tiny, serve, settle

PROMPT = "hello world"


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def client_for(http) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0, timeout=30)


async def _gen(http, **sampling) -> dict:
    r = await http.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0, **sampling}})
    assert r.status == 200, await r.text()
    return await r.json()


async def _bad(http, path: str, body: dict, param: str) -> str:
    r = await http.post(path, json=body)
    got = await r.json()
    assert r.status == 400, (path, body, got)
    assert_error(got)
    assert got["error"]["param"] == param, got
    return got["error"]["message"]


async def _sse(resp) -> list[dict]:
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


async def test_min_tokens_masks_the_end_until_reached(tiny):
    async with serve(tiny) as (http, rt):
        base = (await _gen(http, max_new_tokens=6))["output_ids"]
        # the first greedy token as a stop token ends the request at once ...
        cut = await _gen(http, max_new_tokens=6, stop_token_ids=[base[0]])
        assert cut["output_ids"] == base[:1] and cut["meta_info"]["finish_reason"]["type"] == "stop"
        # ... but not before min_new_tokens: it is never drawn while short of the minimum
        held = await _gen(http, max_new_tokens=6, min_new_tokens=3, stop_token_ids=[base[0]])
        assert len(held["output_ids"]) >= 3 and base[0] not in held["output_ids"][:3]
        # vLLM's name on the OpenAI routes, the same effect
        oa = client_for(http)
        out = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                          extra_body={"stop_token_ids": [base[0]], "min_tokens": 3})
        assert out.usage.completion_tokens >= 3
        # a stop string is not looked for before the minimum either
        first = tiny[2].decode(base[:1])
        assert first.strip(), first          # a visible first token, to stop on
        s1 = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, stop=[first])
        s3 = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, stop=[first],
                                         extra_body={"min_tokens": 3})
        assert s1.choices[0].text == "" and s1.choices[0].finish_reason == "stop"
        assert s3.usage.completion_tokens >= 3
        msg = await _bad(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3}, "min_tokens")
        assert msg == "min_tokens must be less than or equal to max_tokens=2, got 3."
        await _bad(http, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 5}},
                   "sampling_params.min_new_tokens")
        await _bad(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                  "min_tokens": -1}, "min_tokens")
        await oa.close()
        await settle(rt)


async def test_stop_regex_cuts_at_the_earliest_match_streamed_or_not(tiny):
    async with serve(tiny) as (http, rt):
        base = await _gen(http, max_new_tokens=12)
        text = base["text"]
        assert len(text) > 6, text
        piece = text[3:6]
        pattern = re.escape(piece[0]) + "." + re.escape(piece[2])     # matches at 3 (or before)
        at = re.search(pattern, text).start()
        cut = await _gen(http, max_new_tokens=12, stop_regex=pattern)
        assert cut["text"] == text[:at]
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
        kept = await _gen(http, max_new_tokens=12, stop_regex=[pattern], no_stop_trim=True)
        assert kept["text"] == text[:re.search(pattern, text).end()]
        # streamed: nothing of the match goes out before the match is known
        r = await http.post("/generate", json={"text": PROMPT, "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "stop_regex": pattern}})
        events = await _sse(r)
        assert events[-1]["text"] == text[:at]
        assert all(text[:at].startswith(e["text"]) for e in events)
        # the OpenAI routes take it too (SGLang's extension there)
        oa = client_for(http)
        out = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                          extra_body={"stop_regex": pattern})
        assert out.choices[0].text == text[:at] and out.choices[0].finish_reason == "stop"
        await _bad(http, "/generate", {"text": PROMPT, "sampling_params": {"stop_regex": "(unclosed"}},
                   "sampling_params.stop_regex")
        await _bad(http, "/generate", {"text": PROMPT, "sampling_params": {"stop_regex": ["ok", "a*"]}},
                   "sampling_params.stop_regex.1")
        await oa.close()
        await settle(rt)


async def test_chat_template_controls_and_tokenize_with_tools(tiny):
    msgs = [{"role": "user", "content": "Say a number."}, {"role": "assistant", "content": "The number is"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}}}}]
    async with serve(tiny) as (http, rt):
        async def count(**body) -> int:
            r = await http.post("/v1/tokenize", json=body)
            assert r.status == 200, await r.text()
            return (await r.json())["count"]

        oa = client_for(http)
        cont = await oa.chat.completions.create(model=NAME, messages=msgs, max_tokens=1, temperature=0, extra_body={
            "continue_final_message": True, "add_generation_prompt": False})
        assert cont.usage.prompt_tokens == await count(messages=msgs, continue_final_message=True,
                                                       add_generation_prompt=False)
        bare = await oa.chat.completions.create(model=NAME, messages=msgs[:1], max_tokens=1, temperature=0,
                                                extra_body={"add_generation_prompt": False})
        gen = await oa.chat.completions.create(model=NAME, messages=msgs[:1], max_tokens=1, temperature=0)
        assert bare.usage.prompt_tokens == await count(messages=msgs[:1], add_generation_prompt=False)
        assert gen.usage.prompt_tokens == await count(messages=msgs[:1]) > bare.usage.prompt_tokens
        msg = await _bad(http, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True,
                                                        "add_generation_prompt": True}, "continue_final_message")
        assert "Cannot set both" in msg
        await _bad(http, "/v1/chat/completions", {"messages": msgs[:1], "continue_final_message": True},
                   "continue_final_message")
        # tools on /tokenize: the prompt a chat request with those tools has
        with_tools = await count(messages=msgs[:1], tools=tools)
        chat = await oa.chat.completions.create(model=NAME, messages=msgs[:1], tools=tools, max_tokens=1,
                                                temperature=0)
        assert with_tools == chat.usage.prompt_tokens > gen.usage.prompt_tokens
        await _bad(http, "/v1/tokenize", {"messages": msgs[:1], "tools": [{"type": "function"}]}, "tools.0.function")
        await oa.close()
        await settle(rt)


async def test_max_new_tokens_zero_scores_the_prompt_only(tiny):
    async with serve(tiny) as (http, rt):
        r = await http.post("/generate", json={"text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                               "sampling_params": {"max_new_tokens": 0}})
        assert r.status == 200, await r.text()
        out = await r.json()
        n = len(tiny[2].encode(PROMPT))
        assert out["text"] == "" and out["output_ids"] == []
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == n
        assert len(meta["input_token_logprobs"]) == n and meta["output_token_logprobs"] == []
        r = await http.post("/generate", json={"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 0}})
        [event] = await _sse(r)
        assert event["text"] == "" and event["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        # the OpenAI routes still take at least one token
        await _bad(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens")
        await settle(rt)


async def test_best_of_answers_the_most_likely_candidates(tiny):
    async with serve(tiny) as (http, rt):
        oa = client_for(http)
        kw = dict(model=NAME, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7)
        every = await oa.completions.create(n=3, logprobs=0, **kw)      # the same three candidates
        mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices]
        best = await oa.completions.create(n=1, best_of=3, **kw)
        [choice] = best.choices
        assert choice.text == every.choices[mean.index(max(mean))].text
        assert choice.logprobs is None and choice.index == 0
        assert best.usage.completion_tokens == every.usage.completion_tokens    # all three were generated
        two = await oa.completions.create(n=2, best_of=3, logprobs=0, **kw)
        ranked = sorted(range(3), key=lambda i: mean[i], reverse=True)[:2]
        assert [c.text for c in two.choices] == [every.choices[i].text for i in ranked]
        assert [c.index for c in two.choices] == [0, 1] and two.choices[0].logprobs is not None
        await _bad(http, "/v1/completions", {"prompt": PROMPT, "n": 3, "best_of": 2}, "best_of")
        await _bad(http, "/v1/completions", {"prompt": PROMPT, "best_of": 2, "stream": True}, "best_of")
        same = await oa.completions.create(n=1, best_of=1, **kw)        # best_of == n: plain n
        assert len(same.choices) == 1
        await oa.close()
        await settle(rt)


async def test_structured_outputs_and_the_completions_default(tiny):
    async with serve(tiny) as (http, rt):
        oa = client_for(http)
        out = await oa.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "yes or no?"}],
                                               max_tokens=5, temperature=0,
                                               extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert out.choices[0].message.content in ("yes", "no")
        digits = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                             extra_body={"structured_outputs": {"regex": "[0-9]{3}",
                                                                                "disable_any_whitespace": False}})
        assert re.fullmatch("[0-9]{3}", digits.choices[0].text)
        obj = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={
            "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"], "additionalProperties": False}}})
        assert obj.choices[0].finish_reason == "stop", obj        # the grammar closed the object
        assert set(json.loads(obj.choices[0].text)) == {"a"}
        msg = await _bad(http, "/v1/completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a", "choice": ["b"]}},
                         "structured_outputs")
        assert "only use one kind" in msg
        await _bad(http, "/v1/completions", {"prompt": PROMPT, "structured_outputs": {}}, "structured_outputs")
        await _bad(http, "/v1/completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a", "bogus": 1}},
                   "structured_outputs.bogus")
        await _bad(http, "/v1/completions", {"prompt": PROMPT, "structured_outputs": {
            "regex": "a", "disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace")
        await _bad(http, "/v1/completions", {"prompt": PROMPT, "structured_outputs": {"choice": ["a"]},
                                             "guided_regex": "b"}, "structured_outputs")
        # /v1/completions without max_tokens: 16 tokens at most (OpenAI's, vLLM's and SGLang's default)
        plain = await oa.completions.create(model=NAME, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
        assert plain.usage.completion_tokens == 16 and plain.choices[0].finish_reason == "length"
        await oa.close()
        await settle(rt)


async def test_noop_values_are_accepted_and_others_refused(tiny):
    async with serve(tiny) as (http, rt):
        # what sglang.bench_serving and sglang.Engine-shaped payloads send unasked
        r = await http.post("/generate", json={
            "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                                        "spaces_between_special_tokens": True},
            "lora_path": None, "return_routed_experts": False, "custom_logit_processor": None,
            "return_hidden_states": False, "bootstrap_room": None, "data_parallel_rank": None, "stream": False})
        assert r.status == 200, await r.text()
        meta = (await r.json())["meta_info"]
        assert meta["weight_version"] == "default"
        await _bad(http, "/generate", {"input_ids": [1, 2], "lora_path": "my-adapter"}, "lora_path")
        await _bad(http, "/generate", {"input_ids": [1, 2], "return_routed_experts": True}, "return_routed_experts")
        # vLLM's and OpenAI's extras at their defaults, on the OpenAI routes
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "use_beam_search": False,
                "length_penalty": 1, "cache_salt": None, "modalities": ["text"], "bad_words": [],
                "include_reasoning": True, "truncation_side": "left"}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status == 200, await r.text()
        await _bad(http, "/v1/chat/completions", {**body, "use_beam_search": True}, "use_beam_search")
        await _bad(http, "/v1/chat/completions", {**body, "length_penalty": 0.5}, "length_penalty")
        await _bad(http, "/v1/chat/completions", {**body, "modalities": ["text", "audio"]}, "modalities")
        await settle(rt)
