"""Wire compatibility with SGLang and vLLM clients (docs/compat.md), over the tiny model: each
test pins the exact shape one of their own server tests reads."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai import AsyncOpenAI

from http_support import NAME, assert_error, load_tiny, serve, settle, until

PROMPT = "hello world"


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def client_for(http) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0, timeout=30)


async def _generate(http, **sampling):
    r = await http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, **sampling}})
    assert r.status == 200, await r.text()
    return await r.json()


async def _sse(resp) -> list[dict]:
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


# -- 1. what stopped a request ------------------------------------------------------------------


async def test_generate_finish_reason_says_what_matched(tiny):
    tok = tiny[2]
    async with serve(tiny) as (http, rt):
        base = await _generate(http)
        ids = base["output_ids"]
        assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        # a stop token: SGLang's {type: stop, matched: id}; its text is trimmed, its id kept
        by_id = await _generate(http, stop_token_ids=[ids[1]])
        assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[1]}
        assert by_id["output_ids"] == ids[:2] and by_id["text"] == tok.decode(ids[:1])
        kept = await _generate(http, stop_token_ids=[ids[1]], no_stop_trim=True)
        assert kept["text"] == tok.decode(ids[:2])
        # a stop string: matched is the string
        head = tok.decode(ids[:1])
        stop = base["text"][len(head):len(head) + 2]
        assert stop and stop not in base["text"][:len(head) + 1]
        by_str = await _generate(http, stop=[stop, "never-seen"])
        assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert by_str["text"] == head
        assert (await _generate(http, stop=stop, no_stop_trim=True))["text"] == head + stop
        # streamed: the last event only has a finish_reason
        r = await http.post("/generate", json={"text": PROMPT, "stream": True, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "stop_token_ids": [ids[1]]}})
        events = await _sse(r)
        assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
        assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[1]}
        await settle(rt)


async def test_openai_choices_carry_matched_stop_and_stop_reason(tiny):
    async with serve(tiny) as (http, rt), client_for(http) as oa:
        ids = (await _generate(http))["output_ids"]
        eos = rt.engine_info.eos_token_ids[0]
        c = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                        extra_body={"stop_token_ids": [ids[1]]})
        assert c.choices[0].finish_reason == "stop"
        assert c.choices[0].model_extra == {"matched_stop": ids[1], "stop_reason": ids[1]}
        c = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
        assert c.choices[0].finish_reason == "length"
        assert c.choices[0].model_extra == {"matched_stop": None, "stop_reason": None}
        # EOS: SGLang says which token; vLLM's stop_reason is null for EOS
        chat = await oa.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, logit_bias={str(eos): 100})
        assert chat.choices[0].finish_reason == "stop"
        assert chat.choices[0].model_extra == {"matched_stop": eos, "stop_reason": None}
        # vLLM's include_stop_str_in_output keeps the stop token's text
        trimmed = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                              extra_body={"stop_token_ids": [ids[1]]})
        kept = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                           extra_body={"stop_token_ids": [ids[1]],
                                                       "include_stop_str_in_output": True})
        assert kept.choices[0].text == trimmed.choices[0].text + tiny[2].decode([ids[1]])
        # streamed: on each choice's last chunk
        for create, kw in ((oa.completions.create, {"prompt": PROMPT}),
                           (oa.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]})):
            stream = await create(model=NAME, max_tokens=4, temperature=0, stream=True,
                                  logit_bias={str(eos): 100}, **kw)
            chunks = [ch async for ch in stream]
            last = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason][-1]
            assert last.choices[0].model_extra["matched_stop"] == eos
            assert last.choices[0].model_extra["stop_reason"] is None
        await settle(rt)


# -- 2. vLLM's extras on the OpenAI routes -------------------------------------------------------


async def test_continuous_usage_stats_put_usage_on_every_chunk(tiny):
    async with serve(tiny) as (http, rt), client_for(http) as oa:
        opts = {"include_usage": True, "continuous_usage_stats": True}
        stream = await oa.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
            stream=True, stream_options=opts, extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        assert all(ch.usage is not None for ch in chunks)
        with_choices = [ch for ch in chunks if ch.choices]
        done = [ch.usage.completion_tokens for ch in with_choices]
        assert done[0] == 0 and done == sorted(done) and done[-1] == 5        # role chunk first
        assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
                   for ch in chunks)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        # completions, two prompts of different lengths: each chunk's usage is its own choice's
        stream = await oa.completions.create(model=NAME, prompt=["a", "a b c d"], max_tokens=3,
                                             temperature=0, stream=True, stream_options=opts,
                                             extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        prompt_len = {0: len(tiny[2].encode("a")), 1: len(tiny[2].encode("a b c d"))}
        for ch in chunks[:-1]:
            assert ch.usage.prompt_tokens == prompt_len[ch.choices[0].index]
            assert 1 <= ch.usage.completion_tokens <= 3
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
        # without it (or without include_usage): one usage chunk at the end, or none
        stream = await oa.completions.create(model=NAME, prompt="a", max_tokens=3, stream=True,
                                             stream_options={"include_usage": True,
                                                             "continuous_usage_stats": False})
        assert [ch.choices for ch in [c async for c in stream] if ch.usage is not None] == [[]]
        stream = await oa.completions.create(model=NAME, prompt="a", max_tokens=3, stream=True,
                                             stream_options={"include_usage": False,
                                                             "continuous_usage_stats": True})
        assert all(ch.usage is None for ch in [c async for c in stream])
        # stream_options without stream is a 400 (as vLLM)
        r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2,
                                                     "stream_options": {"include_usage": True}})
        assert r.status == 400 and (await r.json())["error"]["param"] == "stream_options"
        await settle(rt)


async def test_echo_of_a_token_prompt_shows_its_special_tokens(tiny):
    """vLLM decodes a token-id prompt for echo with its special tokens kept (``[0, 0, 0]`` is
    three ``<unk>``); a text prompt is echoed exactly as sent."""
    tok = tiny[2]
    shown = tok.decode([0, 0, 0], skip_special_tokens=False)
    assert shown and tok.decode([0, 0, 0]) == ""          # the test means something
    async with serve(tiny) as (http, rt), client_for(http) as oa:
        c = await oa.completions.create(model=NAME, prompt=[0, 0, 0], max_tokens=2, echo=True, temperature=0)
        plain = await oa.completions.create(model=NAME, prompt=[0, 0, 0], max_tokens=2, temperature=0)
        assert c.choices[0].text == shown + plain.choices[0].text
        lp = await oa.completions.create(model=NAME, prompt=[0, 0, 0], max_tokens=1, echo=True,
                                         temperature=0, logprobs=0)
        assert lp.choices[0].logprobs.text_offset[:4] == [0, 5, 10, 15] == [len(shown) * i // 3 for i in range(4)]
        stream = await oa.completions.create(model=NAME, prompt=[0, 0, 0], max_tokens=2, echo=True,
                                             temperature=0, stream=True)
        assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == c.choices[0].text
        text = await oa.completions.create(model=NAME, prompt="  one  two", max_tokens=1, echo=True, temperature=0)
        assert text.choices[0].text.startswith("  one  two")
        await settle(rt)


async def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny):
    tok = tiny[2]
    async with serve(tiny) as (http, rt), client_for(http) as oa:
        ids = tok.encode("one two three four five six seven eight")
        c = await oa.completions.create(model=NAME, prompt=ids, max_tokens=2, echo=True, temperature=0,
                                        extra_body={"truncate_prompt_tokens": 4})
        assert c.usage.prompt_tokens == 4
        assert c.choices[0].text.startswith(tok.decode(ids[-4:]))
        same = await oa.completions.create(model=NAME, prompt=ids[-4:], max_tokens=2, temperature=0)
        plain = await oa.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0,
                                            extra_body={"truncate_prompt_tokens": -1})
        assert c.choices[0].text == tok.decode(ids[-4:]) + same.choices[0].text
        assert plain.usage.prompt_tokens == len(ids)
        chat = await oa.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi there"}],
                                                max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
        assert chat.usage.prompt_tokens == 5
        r = await http.post("/v1/completions", json={"prompt": "a", "truncate_prompt_tokens": 10**6})
        assert r.status == 400
        assert_error(await r.json())
        assert (await r.json())["error"]["param"] == "truncate_prompt_tokens"
        await settle(rt)


async def test_custom_chat_roles_reach_the_template(tiny):
    async with serve(tiny) as (http, rt), client_for(http) as oa:
        # vLLM's test_custom_role: string and text-part content render the same
        one = await oa.chat.completions.create(model=NAME, messages=[
            {"role": "my-custom-role", "content": "what is 1+1?"}], max_tokens=4, temperature=0, seed=0)
        two = await oa.chat.completions.create(model=NAME, messages=[
            {"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}],
            max_tokens=4, temperature=0, seed=0)
        assert one.choices[0].message.content == two.choices[0].message.content
        r = await http.post("/tokenize", json={"messages": [{"role": "my-custom-role", "content": "x"}]})
        text = tiny[2].decode((await r.json())["tokens"], skip_special_tokens=False)
        assert "my-custom-role\nx" in text
        for bad in ("", 7, "r" * 257):
            r = await http.post("/v1/chat/completions", json={"messages": [{"role": bad, "content": "x"}]})
            assert r.status == 400 and (await r.json())["error"]["param"] == "messages.0.role"
        await settle(rt)


async def test_streamed_choices_of_n_are_sampled_apart(tiny):
    async with serve(tiny) as (http, rt), client_for(http) as oa:
        for extra in ({"seed": 7}, {}):
            stream = await oa.completions.create(model=NAME, prompt=PROMPT, n=4, max_tokens=8,
                                                 temperature=1.0, stream=True,
                                                 extra_body={"ignore_eos": True}, **extra)
            texts = ["", "", "", ""]
            async for ch in stream:
                texts[ch.choices[0].index] += ch.choices[0].text
            assert len(set(texts)) == 4, texts
        # seeded: choice i uses seed + i, so a seeded stream is reproducible choice by choice
        again = await oa.completions.create(model=NAME, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0,
                                            seed=7, extra_body={"ignore_eos": True})
        one = await oa.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                          seed=8, extra_body={"ignore_eos": True})
        assert again.choices[1].text == one.choices[0].text
        await settle(rt)


# -- 3. vLLM's score, rerank and classify shapes ------------------------------------------------


async def test_vllm_score_pairs_one_to_n_and_n_to_n(tiny):
    async with serve(tiny) as (http, rt):
        r = await http.post("/v1/rerank", json={"query": "q", "documents": ["a b", "c", "d e f"], "top_n": 0})
        rerank = await r.json()
        assert set(rerank) == {"id", "model", "results", "usage"}
        assert [set(x) for x in rerank["results"]] == [{"index", "relevance_score", "document"}] * 3
        assert set(rerank["usage"]) == {"prompt_tokens", "total_tokens"}
        by_doc = {x["index"]: x["relevance_score"] for x in rerank["results"]}
        for path in ("/v1/score", "/score"):
            r = await http.post(path, json={"model": NAME, "text_1": "q", "text_2": ["a b", "c", "d e f"]})
            body = await r.json()
            assert r.status == 200, body
            assert set(body) == {"id", "object", "created", "model", "data", "usage"}
            assert body["object"] == "list" and body["model"] == NAME
            assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score"), (2, "score")]
            assert [d["score"] for d in body["data"]] == pytest.approx([by_doc[i] for i in range(3)])
            assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] == rerank["usage"]["total_tokens"]
        # N:N pairs element by element; the other spellings of the two sides
        r = await http.post("/v1/score", json={"text_1": ["q", "q", "q"], "text_2": ["a b", "c", "d e f"]})
        assert [d["score"] for d in (await r.json())["data"]] == pytest.approx([by_doc[i] for i in range(3)])
        r = await http.post("/score", json={"queries": "q", "documents": "c"})
        assert [d["score"] for d in (await r.json())["data"]] == pytest.approx([by_doc[1]])
        r = await http.post("/score", json={"data_1": ["q"], "data_2": ["c"]})
        assert [d["score"] for d in (await r.json())["data"]] == pytest.approx([by_doc[1]])
        for bad, param in (({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                           ({"text_1": [], "text_2": ["c"]}, "text_1"),
                           ({"text_1": "a"}, "text_2"),
                           ({"text_1": "a", "text_2": "b", "queries": "c", "documents": "d"}, "queries")):
            r = await http.post("/v1/score", json=bad)
            assert r.status == 400 and (await r.json())["error"]["param"] == param, bad
        r = await http.post("/v1/score", json={"text_1": "a", "text_2": "b", "model": "nope"})
        assert r.status == 404
        # SGLang's body on the same path still works
        r = await http.post("/score", json={"query": "q", "items": ["a"], "label_token_ids": [1, 2]})
        assert r.status == 200 and len((await r.json())["scores"][0]) == 2
        # vLLM's classify shape
        r = await http.post("/classify", json={"input": ["good", "bad"]})
        body = await r.json()
        assert {"id", "object", "created", "model", "data", "usage"} <= set(body) and body["object"] == "list"
        assert [set(d) for d in body["data"]] == [{"index", "label", "probs", "num_classes"}] * 2
        await settle(rt)


# -- 4. /get_server_info ------------------------------------------------------------------------


async def test_server_info_has_the_fields_sglang_clients_read(tiny):
    async with serve(tiny, kv_blocks=64) as (http, rt):
        for path in ("/get_server_info", "/server_info"):
            info = await (await http.get(path)).json()
            assert info["max_total_num_tokens"] == 64 * 16
            assert info["max_running_requests"] == 64
            assert info["chunked_prefill_size"] == 1024 and info["max_prefill_tokens"] == 1024
            assert info["page_size"] == 16 and info["context_length"] == 1024
            assert info["max_req_input_len"] == 1023
            assert isinstance(info["version"], str) and isinstance(info["attention_backend"], str)
            assert info["is_embedding"] is False
            # bench_serving: internal_states[0].get("avg_spec_accept_length")
            assert isinstance(info["internal_states"], list) and info["internal_states"][0].get(
                "avg_spec_accept_length") is None
            assert info["internal_states"][0]["kv_free_blocks"] >= 0


# -- 5. tokenize / detokenize -------------------------------------------------------------------


async def test_tokenize_and_detokenize_variants(tiny):
    tok = tiny[2]
    async with serve(tiny) as (http, rt):
        one = await (await http.post("/tokenize", json={"prompt": "a b"})).json()
        assert one == {"tokens": tok.encode("a b"), "count": len(tok.encode("a b")), "max_model_len": 1024,
                       "token_strs": None}
        batch = await (await http.post("/tokenize", json={"prompt": ["a b", "c"], "add_special_tokens": False,
                                                          "return_token_strs": True})).json()
        assert batch["tokens"] == [tok.encode("a b", add_special_tokens=False), tok.encode("c", add_special_tokens=False)]
        assert batch["count"] == [len(x) for x in batch["tokens"]]
        assert batch["token_strs"] == [tok.hf.convert_ids_to_tokens(x) for x in batch["tokens"]]
        msgs = [{"role": "user", "content": "hi"}]
        gen = await (await http.post("/v1/tokenize", json={"messages": msgs})).json()
        bare = await (await http.post("/v1/tokenize", json={"messages": msgs, "add_generation_prompt": False})).json()
        assert gen["tokens"] == tok.apply_chat_template(msgs)
        assert bare["tokens"] == tok.apply_chat_template(msgs, add_generation_prompt=False)
        assert len(gen["tokens"]) > len(bare["tokens"])
        r = await http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": True,
                                               "continue_final_message": True})
        assert r.status == 400 and (await r.json())["error"]["param"] == "continue_final_message"
        r = await http.post("/tokenize", json={"text": "a", "prompt": "b"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        ids = tok.encode("hello there")
        for path in ("/detokenize", "/v1/detokenize"):
            d = await (await http.post(path, json={"tokens": ids})).json()
            assert d == {"text": tok.decode(ids, skip_special_tokens=False)} | {"prompt": d["text"]}
            d = await (await http.post(path, json={"tokens": [ids, ids[:1]], "skip_special_tokens": True})).json()
            assert d["text"] == [tok.decode(ids), tok.decode(ids[:1])] == d["prompt"]
        vocab = tok.vocab_size
        for path, body, param in (("/detokenize", {"tokens": [1, vocab]}, "tokens.1"),
                                  ("/v1/detokenize", {"tokens": [[1], [2, vocab]]}, "tokens.1.1"),
                                  ("/detokenize", {"input_ids": [-1]}, "input_ids.0"),
                                  ("/generate", {"input_ids": [1, vocab]}, "input_ids.1"),
                                  ("/v1/completions", {"prompt": [1, vocab], "max_tokens": 1}, "prompt.1")):
            r = await http.post(path, json=body)
            assert r.status == 400 and (await r.json())["error"]["param"] == param, (path, body)
        await settle(rt)


# -- 6. SGLang's texts: a duplicate rid, where an abort caught a request -------------------------


async def test_duplicate_rid_and_abort_messages_in_sglang_words(tiny):
    async with serve(tiny, kv_blocks=256) as (http, rt):
        long = {"max_new_tokens": 900, "ignore_eos": True}
        running = asyncio.ensure_future(http.post("/generate", json={
            "text": PROMPT, "rid": "run", "sampling_params": long}))
        await until(lambda: (rt.request_info("run") or {}).get("state") == "decode")
        # paused in place: "run" keeps its KV and stays live; new requests wait in the queue
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status == 200
        r = await http.post("/generate", json={"text": PROMPT, "rid": "run", "sampling_params": {"max_new_tokens": 2}})
        assert r.status == 400
        assert (await r.json())["error"]["message"].startswith("Duplicate request ID detected: run")
        waiting = asyncio.ensure_future(http.post("/generate", json={
            "text": PROMPT, "rid": "wait", "sampling_params": {"max_new_tokens": 2}}))
        await until(lambda: (rt.request_info("wait") or {}).get("state") == "queued")
        for rid in ("run", "wait"):
            assert (await (await http.post("/abort_request", json={"rid": rid})).json())["success"]
        out = await (await running).json()
        assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted"}
        assert out["output_ids"]                       # caught mid-decode, its partial output kept
        out = await (await waiting).json()
        assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert (await http.post("/continue_generation", json={})).status == 200
        await settle(rt)


# -- 7. sessions as SGLang's test_session_control drives them -----------------------------------


async def _turn(http, sid, ids, rid=None, offset=-1, replace=True, max_new=4):
    r = await http.post("/generate", json={
        "input_ids": ids, "session_params": {"id": sid, "rid": rid, "offset": offset, "replace": replace},
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "no_stop_trim": True,
                            "skip_special_tokens": False, "ignore_eos": True}})
    return r.status, await r.json()


async def test_session_turns_with_offset_minus_one_and_backtracking(tiny):
    tok = tiny[2]
    chunks = [tok.encode(x) for x in ("Let me tell you something about France and Paris. " * 3, "The capital is",
                                      "The population is", "A brief history is")]
    chunks = [chunks[0]] + [c[1:] if c[0] == tok.hf.bos_token_id else c for c in chunks[1:]]
    async with serve(tiny) as (http, rt):
        sid = await (await http.post("/open_session", json={"capacity_of_str_len": 1000})).json()
        assert isinstance(sid, str)
        again = await http.post("/open_session", json={"capacity_of_str_len": 1000, "session_id": sid})
        assert again.status == 400
        rid, turns, first = None, [], None
        for i, ids in enumerate(chunks):
            status, out = await _turn(http, sid, ids, rid, max_new=1 if i == 0 else 4)
            assert status == 200, out
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 1 if i == 0 else 4}
            if i > 1:
                assert out["meta_info"]["cached_tokens"] > 0      # the chain's KV is reused
            rid = out["meta_info"]["id"]
            first = first or rid
            turns.append(out)
        # the same prompts without a session: offset -1 dropped each turn's last output token
        composed = list(chunks[0])
        for i, ids in enumerate(chunks):
            if i:
                composed = composed[:-1] + ids        # (parent prompt + output)[:-1] + new input
                r = await http.post("/generate", json={"input_ids": composed, "sampling_params": {
                    "temperature": 0, "max_new_tokens": 4, "skip_special_tokens": False, "ignore_eos": True}})
                plain = await r.json()
                assert plain["output_ids"] == turns[i]["output_ids"], i
            composed = composed + turns[i]["output_ids"]
        # backtrack to the first turn with replace: the later turns are gone
        status, back = await _turn(http, sid, chunks[-1], first)
        assert status == 200
        status, gone = await _turn(http, sid, chunks[-1], rid)
        assert status == 400, gone
        # branching from one turn without replace keeps both branches
        status, b1 = await _turn(http, sid, chunks[1], back["meta_info"]["id"], offset=0, replace=False)
        status2, b2 = await _turn(http, sid, chunks[2], back["meta_info"]["id"], offset=0, replace=False)
        assert status == status2 == 200 and b1["meta_info"]["id"] != b2["meta_info"]["id"]
        assert (await http.post("/close_session", json={"session_id": sid})).status == 200
        status, closed = await _turn(http, sid, chunks[-1], first)
        assert status == 400
        await settle(rt)


# -- 8. GET /v1/models/{id} ---------------------------------------------------------------------


async def test_model_card_shape_and_404(tiny):
    async with serve(tiny) as (http, rt), client_for(http) as oa:
        listed = {m.id: m for m in (await oa.models.list()).data}
        for name in (NAME, "default"):
            card = await (await http.get(f"/v1/models/{name}")).json()
            assert card == {"id": name, "object": "model", "created": card["created"], "owned_by": "actorserve",
                            "root": NAME, "parent": None, "max_model_len": 1024}
            assert listed[name].model_dump(exclude_unset=True) == card
            m = await oa.models.retrieve(name)
            assert m.id == name and m.object == "model"
        with pytest.raises(openai.NotFoundError) as nf:
            await oa.models.retrieve("nope")
        assert nf.value.body["code"] == "model_not_found"
        r = await http.get("/v1/models/nope")
        assert r.status == 404
        assert_error(await r.json(), "invalid_request_error")
