"""The OpenAI Responses API (`/v1/responses`) with the official `openai` client over the tiny
model: create, stream, retrieve, delete, input items; chains with ``previous_response_id``
continue the parent's session (its KV: cached tokens grow, the prompt extends the parent's
tokens); branches; the store's bound and its recorded lifecycle; re-execution; bad input."""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest
from openai import AsyncOpenAI

from actorserve.replay.recorder import read_recording
from actorserve.replay.reexec import reexecute

from http_support import NAME, assert_error, load_tiny, serve, settle
from actor_access import actor_of

BLOCK = 16


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def client(http) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0, timeout=60)


@contextlib.asynccontextmanager
async def serving(tiny, **kw):
    """A server over the tiny model and an `openai` client of it (closed on the way out)."""
    async with serve(tiny, **kw) as (http, rt):
        async with client(http) as oa:
            yield http, rt, oa


def node(rt, session_id: str, rid: str):
    return actor_of(rt, "sessions").sessions[session_id].nodes[rid]


def cached_after(prompt: int, output: int) -> int:
    """Tokens of a finished request whose KV is cached: the last sampled token has none, and
    only whole blocks are shared."""
    return (prompt + output - 1) // BLOCK * BLOCK


async def test_create_retrieve_and_the_response_object(tiny):
    async with serving(tiny) as (http, rt, oa):
        r = await oa.responses.create(model=NAME, input="Hello there", instructions="Be brief.",
                                      max_output_tokens=8, temperature=0, metadata={"k": "v"})
        assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 8 and r.instructions == "Be brief." and r.metadata == {"k": "v"}
        prompt = tiny[2].apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hello there"}])
        assert r.usage.input_tokens == len(prompt)
        assert r.usage.total_tokens == len(prompt) + 8
        [msg] = r.output
        assert msg.type == "message" and msg.role == "assistant" and msg.status == "incomplete"
        assert msg.content[0].type == "output_text" and msg.content[0].text == r.output_text != ""
        # the same prompt through chat completions gives the same greedy text
        chat = await oa.chat.completions.create(model=NAME, max_tokens=8, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
        assert chat.choices[0].message.content == r.output_text
        got = await oa.responses.retrieve(r.id)
        assert got.model_dump() == r.model_dump()
        items = await oa.responses.input_items.list(r.id)
        assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello there")]
        await settle(rt)


async def test_a_chain_continues_the_parents_session_and_its_kv(tiny):
    async with serving(tiny, kv_blocks=128) as (http, rt, oa):
        r1 = await oa.responses.create(model=NAME, input="Tell me a story", max_output_tokens=8, temperature=0)
        r2 = await oa.responses.create(model=NAME, input="Go on", previous_response_id=r1.id,
                                       max_output_tokens=8, temperature=0)
        r3 = await oa.responses.create(model=NAME, input="And then?", previous_response_id=r2.id,
                                       max_output_tokens=8, temperature=0)
        assert r2.previous_response_id == r1.id
        sid = r1.id                                   # a root response's session is named after it
        n1, n2, n3 = node(rt, sid, r1.id), node(rt, sid, r2.id), node(rt, sid, r3.id)
        assert n2.parent is n1 and n3.parent is n2
        # the child's prompt is the parent's tokens (prompt + output) and then the new turn
        assert n2.prompt_ids[:len(n1.prompt_ids) + 8] == n1.prompt_ids + n1.output_ids
        assert n3.prompt_ids[:len(n2.prompt_ids) + 8] == n2.prompt_ids + n2.output_ids
        assert r2.usage.input_tokens == len(n2.prompt_ids) > r1.usage.input_tokens + 8
        # ... so its prefill starts after the parent's KV: cached tokens grow turn by turn
        c1 = r1.usage.input_tokens_details.cached_tokens
        c2 = r2.usage.input_tokens_details.cached_tokens
        c3 = r3.usage.input_tokens_details.cached_tokens
        assert c1 == 0
        assert c2 == cached_after(r1.usage.input_tokens, 8)
        assert c3 == cached_after(r2.usage.input_tokens, 8) > c2
        # the new turn's tokens are the whole conversation's rendering past the parent's text
        tok = tiny[2]
        first = [{"role": "user", "content": "Tell me a story"}]
        parent_text = tok.render_chat(first) + r1.output_text
        whole = tok.render_chat(first + [{"role": "assistant", "content": r1.output_text},
                                         {"role": "user", "content": "Go on"}])
        assert whole.startswith(parent_text)
        assert n2.prompt_ids == n1.prompt_ids + n1.output_ids + tok.encode(whole[len(parent_text):],
                                                                           add_special_tokens=False)
        await settle(rt)


async def test_two_children_of_one_response_are_branches_of_its_session(tiny):
    async with serving(tiny, kv_blocks=128) as (http, rt, oa):
        root = await oa.responses.create(model=NAME, input="Pick a colour", max_output_tokens=6, temperature=0)
        a, b = [await oa.responses.create(model=NAME, input=text, previous_response_id=root.id,
                                          max_output_tokens=6, temperature=0) for text in ("red", "blue")]
        parent = node(rt, root.id, root.id)
        assert {c.rid for c in parent.children} == {a.id, b.id}
        assert node(rt, root.id, a.id).parent is node(rt, root.id, b.id).parent is parent
        ca = a.usage.input_tokens_details.cached_tokens
        assert ca == cached_after(root.usage.input_tokens, 6)
        # the second branch shares the root's KV and whatever of the new turn's opening the
        # first branch committed; never its own text
        assert ca <= b.usage.input_tokens_details.cached_tokens < b.usage.input_tokens - 1
        await settle(rt)


async def test_streaming_sends_the_responses_events_in_order(tiny):
    async with serving(tiny) as (http, rt, oa):
        events = []
        async with await oa.responses.create(model=NAME, input="Stream this", max_output_tokens=6,
                                             temperature=0, stream=True) as stream:
            async for ev in stream:
                events.append(ev)
        kinds = [e.type for e in events]
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                         + ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done", "response.incomplete"])
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        text = "".join(d.delta for d in deltas)
        final = events[-1].response
        assert final.output_text == text == events[-4].text and final.usage.output_tokens == 6
        assert len({e.item_id for e in deltas}) == 1 and deltas[0].item_id == final.output[0].id
        assert (await oa.responses.retrieve(final.id)).model_dump() == final.model_dump()
        # unstreamed, the same request says the same
        same = await oa.responses.create(model=NAME, input="Stream this", max_output_tokens=6, temperature=0)
        assert same.output_text == text
        await settle(rt)


async def test_raw_stream_names_each_event_type(tiny):
    async with serve(tiny) as (http, rt):
        resp = await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "stream": True})
        raw = (await resp.text()).strip().split("\n\n")
        for block in raw:
            event, data = block.split("\n")
            assert event == "event: " + json.loads(data.removeprefix("data: "))["type"]
        assert "[DONE]" not in raw[-1]
        await settle(rt)


async def test_logprobs_on_request(tiny):
    async with serving(tiny) as (http, rt, oa):
        r = await oa.responses.create(model=NAME, input="Hi", max_output_tokens=4, temperature=0,
                                      include=["message.output_text.logprobs"], top_logprobs=2)
        lps = r.output[0].content[0].logprobs
        assert len(lps) == 4 and all(len(lp.top_logprobs) == 2 for lp in lps)
        for lp in lps:       # greedy: the chosen token is the most likely one
            assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob)
        plain = await oa.responses.create(model=NAME, input="Hi", max_output_tokens=4, temperature=0)
        assert plain.output[0].content[0].logprobs is None
        await settle(rt)


async def test_delete_and_store_false(tiny):
    async with serving(tiny) as (http, rt, oa):
        r = await oa.responses.create(model=NAME, input="keep me", max_output_tokens=3)
        await oa.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            await oa.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            await oa.responses.delete(r.id)
        with pytest.raises(openai.BadRequestError) as err:
            await oa.responses.create(model=NAME, input="more", previous_response_id=r.id)
        assert err.value.body["param"] == "previous_response_id"
        assert err.value.body["code"] == "previous_response_not_found"
        await settle(rt)
        assert r.id not in actor_of(rt, "sessions").sessions                  # its session went with it
        # store: false keeps nothing, opens no session, but may continue a stored parent
        parent = await oa.responses.create(model=NAME, input="stored", max_output_tokens=4, temperature=0)
        sessions = set(actor_of(rt, "sessions").sessions)
        loose = await oa.responses.create(model=NAME, input="not stored", store=False, max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            await oa.responses.retrieve(loose.id)
        child = await oa.responses.create(model=NAME, input="next", store=False, max_output_tokens=4,
                                          previous_response_id=parent.id, temperature=0)
        assert set(actor_of(rt, "sessions").sessions) == sessions
        assert child.usage.input_tokens_details.cached_tokens == cached_after(parent.usage.input_tokens, 4)
        await settle(rt)


async def test_the_store_is_bounded_and_its_lifecycle_recorded(tiny, tmp_path):
    path = tmp_path / "rec.jsonl"
    async with serving(tiny, responses_store=2, record_path=path) as (http, rt, oa):
        rs = [await oa.responses.create(model=NAME, input=f"n{i}", max_output_tokens=2) for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            await oa.responses.retrieve(rs[0].id)               # the oldest ended one was evicted
        for r in rs[1:]:
            assert (await oa.responses.retrieve(r.id)).id == r.id
        await oa.responses.delete(rs[1].id)
        await settle(rt)
        assert actor_of(rt, "responses").describe()["evicted"] == 1 and actor_of(rt, "responses").describe()["deleted"] == 1
        assert set(actor_of(rt, "sessions").sessions) == {rs[2].id}
    _, events = read_recording(path)
    hist = {}
    for e in events:
        if e.kind == "response":
            hist.setdefault(e.rid, []).append(e.event)
    assert hist == {f"response:{rs[0].id}": ["create", "start", "run_out", "evict"],
                    f"response:{rs[1].id}": ["create", "start", "run_out", "delete"],
                    f"response:{rs[2].id}": ["create", "start", "run_out"]}
    report = await reexecute(events)
    assert report.ok, report.format()
    assert report.drift == 0


async def test_a_chain_over_http_reexecutes_exactly(tiny, tmp_path):
    path = tmp_path / "chain.jsonl"
    async with serving(tiny, kv_blocks=128, record_path=path) as (http, rt, oa):
        r1 = await oa.responses.create(model=NAME, input="one", max_output_tokens=4, temperature=0.7,
                                       extra_body={"seed": 1})
        async with await oa.responses.create(model=NAME, input="two", previous_response_id=r1.id, stream=True,
                                             max_output_tokens=4) as stream:
            [e async for e in stream]
        await oa.responses.delete(r1.id)
        await settle(rt)
    report = await reexecute(read_recording(path)[1])
    assert report.ok, report.format()
    assert report.drift == 0
    assert report.instances >= 4


async def test_new_instructions_start_a_session_of_their_own(tiny):
    async with serving(tiny, kv_blocks=128) as (http, rt, oa):
        r1 = await oa.responses.create(model=NAME, input="Hi", instructions="A", max_output_tokens=4, temperature=0)
        r2 = await oa.responses.create(model=NAME, input="Again", instructions="B", previous_response_id=r1.id,
                                       max_output_tokens=4, temperature=0)
        # instructions are not carried over: the system message changed, so the conversation
        # no longer extends the parent's tokens
        assert r2.id in actor_of(rt, "sessions").sessions and r2.id not in actor_of(rt, "sessions").sessions[r1.id].nodes
        whole = tiny[2].apply_chat_template([
            {"role": "system", "content": "B"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "Again"}])
        assert node(rt, r2.id, r2.id).prompt_ids == whole
        await settle(rt)


async def test_a_client_that_leaves_cancels_its_stored_response(tiny):
    async with serve(tiny) as (http, rt):
        resp = await http.post("/v1/responses", json={"input": "long", "stream": True,
                                                      "max_output_tokens": 400})
        first = await resp.content.readuntil(b"\n\n")
        rid = json.loads(first.split(b"data: ", 1)[1])["response"]["id"]
        resp.close()
        await settle(rt)
        got = await http.get(f"/v1/responses/{rid}")
        assert (await got.json())["status"] == "cancelled"
        r = await http.post("/v1/responses", json={"input": "x", "previous_response_id": rid})
        assert r.status == 400 and "cancelled" in (await r.json())["error"]["message"]


async def test_function_tools_and_their_results(tiny):
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                           "required": ["city"], "additionalProperties": False}}
    async with serving(tiny, kv_blocks=128) as (http, rt, oa):
        r = await oa.responses.create(model=NAME, input="Weather in Paris?", tools=[tool],
                                      tool_choice="required", parallel_tool_calls=False,
                                      max_output_tokens=200, temperature=0)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and r.status == "completed", r.output
        assert all(c.name == "get_weather" and set(json.loads(c.arguments)) == {"city"} for c in calls)
        out = await oa.responses.create(model=NAME, previous_response_id=r.id, tools=[tool], max_output_tokens=4,
                                        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                "output": "sunny"}])
        assert out.status in ("completed", "incomplete")
        items = await oa.responses.input_items.list(out.id)
        assert [(i.type, i.call_id, i.output) for i in items.data] == [
            ("function_call_output", calls[0].call_id, "sunny")]
        # streamed, a forced call arrives as function_call items with argument deltas
        events = []
        async with await oa.responses.create(model=NAME, input="Weather in Rome?", tools=[tool], stream=True,
                                             tool_choice={"type": "function", "name": "get_weather"},
                                             max_output_tokens=200, temperature=0) as stream:
            events = [e async for e in stream]
        added = [e.item for e in events if e.type == "response.output_item.added"]
        assert added and all(i.type == "function_call" for i in added)
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        assert "".join(done) == args and json.loads(done[0])["city"]
        await settle(rt)


async def test_text_format_json_schema(tiny):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    async with serving(tiny) as (http, rt, oa):
        r = await oa.responses.create(model=NAME, input="Answer in JSON", max_output_tokens=20, temperature=0,
                                      text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                       "strict": True}})
        assert isinstance(json.loads(r.output_text)["ok"], bool) and r.status == "completed"
        assert r.text.format.type == "json_schema"
        await settle(rt)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0.type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": []}, "input"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include.0"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "model": "nope"}, "model"),
])
async def test_bad_requests_are_400s_naming_the_field(tiny, body, param):
    async with serve(tiny) as (http, rt):
        r = await http.post("/v1/responses", json=body)
        assert r.status in (400, 404), await r.text()
        err = await r.json()
        assert_error(err)
        assert err["error"]["param"] == param
        assert actor_of(rt, "responses").describe()["stored"] == 0
        ok = await http.post("/v1/responses", json={"input": "still serving", "max_output_tokens": 1})
        assert ok.status == 200


async def test_input_items_pages(tiny):
    async with serving(tiny) as (http, rt, oa):
        r = await oa.responses.create(model=NAME, max_output_tokens=1, input=[
            {"role": "user", "content": f"m{i}"} for i in range(5)])
        page = await oa.responses.input_items.list(r.id, limit=2, order="asc")
        assert [i.content[0].text for i in page.data] == ["m0", "m1"] and page.has_more
        rest = await oa.responses.input_items.list(r.id, limit=10, order="asc", after=page.data[-1].id)
        assert [i.content[0].text for i in rest.data] == ["m2", "m3", "m4"] and not rest.has_more
        desc = await oa.responses.input_items.list(r.id)
        assert [i.content[0].text for i in desc.data] == ["m4", "m3", "m2", "m1", "m0"]
        await settle(rt)


async def test_a_store_of_none_refuses_store_true_and_serves_store_false(tiny):
    async with serving(tiny, responses_store=0) as (http, rt, oa):
        with pytest.raises(openai.BadRequestError) as err:
            await oa.responses.create(model=NAME, input="x", max_output_tokens=1)
        assert err.value.body["code"] == "store_disabled" and err.value.body["param"] == "store"
        r = await oa.responses.create(model=NAME, input="x", max_output_tokens=1, store=False)
        assert r.status == "incomplete" and not actor_of(rt, "sessions").sessions
        await settle(rt)


@pytest.fixture(scope="module")
def smol():
    from http_support import load_smol
    return load_smol()


@pytest.mark.model
async def test_a_chain_over_a_real_chat_template_ended_by_eos(smol):
    """SmolLM2's own template: the parent ends with its EOS (<|im_end|>), a token of the KV but
    not of the text, and the child still extends the parent's tokens exactly."""
    async with serving(smol, kv_blocks=128) as (http, rt, oa):
        r1 = await oa.responses.create(model=NAME, input="What is 2+2? Reply with the number only.", max_output_tokens=64,
                                       temperature=0)
        assert r1.status == "completed", r1.output_text
        r2 = await oa.responses.create(model=NAME, input="And 3+3?", previous_response_id=r1.id,
                                       max_output_tokens=24, temperature=0)
        n1, n2 = node(rt, r1.id, r1.id), node(rt, r1.id, r2.id)
        eos = smol[1].convert_tokens_to_ids("<|im_end|>")
        assert n1.output_ids[-1] == eos and n2.parent is n1
        assert n2.prompt_ids[:len(n1.prompt_ids) + len(n1.output_ids)] == n1.prompt_ids + n1.output_ids
        assert tuple(n2.prompt_ids).count(eos) == tuple(n1.prompt_ids).count(eos) + 2   # no doubled EOS
        assert r2.usage.input_tokens_details.cached_tokens == cached_after(r1.usage.input_tokens,
                                                                           r1.usage.output_tokens)
        await settle(rt)


async def test_cancel_answers_the_spec_errors_for_a_synchronous_response(tiny):
    """OpenAI cancels only ``background: true`` responses: any other stored response is a 400, in
    progress or ended, and stays as it was; an unknown id is a 404 (background: test_responses_background)."""
    async with serving(tiny) as (http, rt, oa):
        r = await oa.responses.create(model=NAME, input="Hello", max_output_tokens=4, temperature=0)
        with pytest.raises(openai.BadRequestError) as sync:
            await oa.responses.cancel(r.id)
        assert sync.value.status_code == 400 and "Cannot cancel a synchronous response." in sync.value.message
        assert sync.value.body["type"] == "invalid_request_error"
        assert (await oa.responses.retrieve(r.id)).status == r.status == "incomplete"
        with pytest.raises(openai.NotFoundError):
            await oa.responses.cancel("resp_nope")
        with pytest.raises(openai.BadRequestError) as bg:
            await oa.responses.create(model=NAME, input="Hello", background=True, store=False)
        assert bg.value.body["param"] == "background" and "`store` is true" in bg.value.message
        # a streamed response in progress: the cancel is refused and the stream runs to its end
        stream = await oa.responses.create(model=NAME, input="Hi", max_output_tokens=6, temperature=0,
                                           stream=True)
        events = stream.__aiter__()
        created = await events.__anext__()
        assert created.type == "response.created"
        with pytest.raises(openai.BadRequestError):
            await oa.responses.cancel(created.response.id)
        rest = [e async for e in events]
        assert rest[-1].type == "response.incomplete" and rest[-1].response.usage.output_tokens == 6
        await settle(rt)
