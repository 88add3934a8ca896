"""OpenAI-compatible routes over the tiny model, driven by the official `openai` client."""

from __future__ import annotations

import json

import openai
import pytest
from openai import AsyncOpenAI

from http_support import NAME, assert_error, load_tiny, serve, settle

KEY = "sk-test"
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def client_for(http) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key=KEY, max_retries=0, timeout=30)


async def test_models_and_chat_non_stream(tiny):
    async with serve(tiny, api_key=KEY) as (http, rt), client_for(http) as oa:
        models = await oa.models.list()
        assert {m.id for m in models.data} == {NAME, "default"}
        r = await oa.chat.completions.create(model=NAME, messages=MSGS, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert r.object == "chat.completion" and r.model == NAME
        assert len(r.choices) == 1 and r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 8
        assert r.usage.total_tokens == r.usage.prompt_tokens + 8 and r.usage.prompt_tokens > 0
        again = await oa.chat.completions.create(model="default", messages=MSGS, max_tokens=8,
                                                 temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].message.content == r.choices[0].message.content
        await settle(rt)


async def test_chat_stream_usage_and_n(tiny):
    async with serve(tiny, api_key=KEY) as (http, rt), client_for(http) as oa:
        stream = await oa.chat.completions.create(
            model=NAME, messages=MSGS, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ref = await oa.chat.completions.create(model=NAME, messages=MSGS, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert text == ref.choices[0].message.content
        two = await oa.chat.completions.create(model=NAME, messages=MSGS, max_tokens=4, n=2, seed=7,
                                               extra_body={"ignore_eos": True})
        assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 8
        s2 = await oa.chat.completions.create(model=NAME, messages=MSGS, max_tokens=3, n=2, stream=True,
                                              extra_body={"ignore_eos": True})
        ends = [ch.choices[0].index async for ch in s2 if ch.choices and ch.choices[0].finish_reason]
        assert sorted(ends) == [0, 1]
        await settle(rt)


async def test_completions_and_logprobs(tiny):
    async with serve(tiny, api_key=KEY) as (http, rt), client_for(http) as oa:
        r = await oa.completions.create(model=NAME, prompt=["one two", "three"], max_tokens=5,
                                        temperature=0, logprobs=2, extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1]
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
        assert [len(top) for top in lp.top_logprobs] == [2] * 5          # logprobs=2: two per token
        ids = await oa.completions.create(model=NAME, prompt=[5, 6, 7, 8], max_tokens=3,
                                          extra_body={"ignore_eos": True})
        assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3
        chunks = [c async for c in await oa.completions.create(
            model=NAME, prompt="stream me", max_tokens=4, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})]
        assert chunks[-1].usage.completion_tokens == 4
        assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
        chat = await oa.chat.completions.create(model=NAME, messages=MSGS, max_tokens=3, logprobs=True,
                                                top_logprobs=2, extra_body={"ignore_eos": True})
        content = chat.choices[0].logprobs.content
        assert len(content) == 3 and len(content[0].top_logprobs) == 2
        await settle(rt)


@pytest.mark.parametrize("echo", [False, True])
async def test_streamed_completion_logprobs_equal_the_whole_answer(tiny, echo):
    # text_offset is where each token begins in the choice's whole text, in a stream as in one
    # answer; two top logprobs per token. With echo the prompt's tokens come first (vLLM's
    # echo with logprobs), the first of them unscored.
    kw = dict(model=NAME, prompt="one two", max_tokens=12, temperature=0, logprobs=2, echo=echo,
              extra_body={"ignore_eos": True})
    async with serve(tiny, api_key=KEY) as (http, rt), client_for(http) as oa:
        answer = await oa.completions.create(**kw)
        chunks = [c.choices[0] async for c in await oa.completions.create(stream=True, **kw) if c.choices]
        await settle(rt)
    whole, k = answer.choices[0], answer.usage.prompt_tokens if echo else 0
    lp = whole.logprobs
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for x in streamed for t in x.tokens] == lp.tokens and len(lp.tokens) == k + 12
    assert [o for x in streamed for o in x.text_offset] == lp.text_offset
    assert [t for x in streamed for t in x.top_logprobs] == lp.top_logprobs
    assert [len(top) for top in lp.top_logprobs[k:]] == [2] * 12
    assert (lp.token_logprobs[0] is None and lp.top_logprobs[0] is None) == echo
    assert "".join(c.text for c in chunks) == whole.text
    start = len("one two") if echo else 0
    assert whole.text.startswith("one two") == echo and lp.text_offset[k] == start
    # Each token's stretch of the text is that token: the offsets index the text itself
    # (a token decoded alone loses its SentencePiece leading space, so lengths of
    # `tokens` would drift off it). An echoed BOS has no text.
    ends = lp.text_offset[1:] + [len(whole.text)]
    spans = list(zip(lp.text_offset, ends, lp.tokens))[1 if echo else 0:]
    assert [whole.text[a:b].strip() for a, b, _ in spans] == [t.strip() for _, _, t in spans]
    assert any(whole.text[a] == " " for a in lp.text_offset)      # the case the lengths get wrong


async def test_client_errors_are_openai_shaped(tiny):
    async with serve(tiny, api_key=KEY) as (http, rt), client_for(http) as oa:
        with pytest.raises(openai.NotFoundError) as nf:
            await oa.chat.completions.create(model="gpt-5", messages=MSGS, max_tokens=2)
        assert nf.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            await oa.chat.completions.create(model=NAME, messages=MSGS, max_tokens=-1)
        with pytest.raises(openai.BadRequestError):
            await oa.chat.completions.create(model=NAME, messages=[{"role": "", "content": "x"}])
        with pytest.raises(openai.BadRequestError) as too_long:
            await oa.completions.create(model=NAME, prompt=[5] * 1100, max_tokens=2)
        assert "context length" in too_long.value.message
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        cases = [
            ("/v1/chat/completions", b"{not json"),
            ("/v1/chat/completions", json.dumps({"model": NAME, "messages": "hi"}).encode()),
            ("/v1/chat/completions", json.dumps({"model": NAME, "messages": MSGS, "max_tokens": "x"}).encode()),
            ("/v1/chat/completions", json.dumps({"model": NAME, "messages": MSGS, "temperature": -1}).encode()),
            ("/v1/completions", json.dumps({"model": NAME, "prompt": {"a": 1}}).encode()),
            ("/v1/completions", b""),
        ]
        for path, data in cases:
            resp = await http.post(path, data=data, headers=h)
            assert resp.status == 400, (path, data, await resp.text())
            assert_error(await resp.json(), "invalid_request_error")
        # still serving after all that
        ok = await oa.completions.create(model="default", prompt="fine", max_tokens=2,
                                         extra_body={"ignore_eos": True})
        assert ok.choices[0].finish_reason == "length"
        await settle(rt)


async def test_auth_and_body_limit(tiny):
    async with serve(tiny, api_key=KEY, max_body_bytes=4096) as (http, rt):
        assert (await http.get("/health")).status == 200
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
            resp = await http.get("/v1/models", headers=headers)
            assert resp.status == 401
            assert_error(await resp.json(), "authentication_error")
        async with AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        big = json.dumps({"model": NAME, "prompt": "x" * 10_000}).encode()
        resp = await http.post("/v1/completions", data=big, headers={"Authorization": f"Bearer {KEY}",
                                                                     "Content-Type": "application/json"})
        assert resp.status == 413
        assert_error(await resp.json())
        assert (await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status == 200


async def test_a_streamed_chats_role_chunk_goes_out_with_its_first_token(tiny):
    """The role chunk is not sent at acceptance but with the choice's first output, as vLLM's
    and SGLang's servers send it: clients that time the first chunk (`vllm bench serve`) took
    the early one for the first token. While generation is paused the accepted request has
    nothing on the wire; once it continues, the role chunk comes first, then the tokens."""
    import asyncio

    from waiting import until

    async with serve(tiny, api_key=KEY) as (http, rt):
        hdr = {"Authorization": f"Bearer {KEY}"}
        assert (await http.post("/pause_generation", json={"mode": "in_place"}, headers=hdr)).status == 200
        body = {"model": NAME, "messages": MSGS, "max_tokens": 3, "stream": True, "ignore_eos": True}
        task = asyncio.ensure_future(http.post("/v1/chat/completions", json=body, headers=hdr))
        await until(lambda: rt.stats().live_requests == 1, what="the request was not accepted")
        for _ in range(200):        # loop turns, not time: any write would have reached the client
            await asyncio.sleep(0)  # sleep-ok: one loop turn each; a negative check has no event to await
        assert not task.done() or task.result().content.total_bytes == 0
        assert (await http.post("/continue_generation", json={}, headers=hdr)).status == 200
        resp = await task
        assert resp.status == 200
        events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                  if line.startswith("data: {")]
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in e["choices"][0]["delta"] for e in events[1:] if e["choices"])
        assert sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content")) >= 1
        await settle(rt)
