"""vLLM's control routes over HTTP on the tiny model: `/pause?mode=abort|wait|keep`, `/resume`,
`/is_paused`, `/reset_prefix_cache`; pause is a barrier (no step starts after it answers)."""

from __future__ import annotations

import asyncio

import pytest

from http_support import assert_error, load_tiny, settle, until
from test_http_control import Stall, serve
from actor_access import actor_of, live_actors

GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def _step_notes(rec) -> int:
    return sum(1 for e in rec.events(kind="scheduler") if e.event in ("step", "drain_step"))


async def test_pause_wait_drains_the_running_request_admits_none_then_pauses(tiny):
    async with serve(tiny) as (http, rt, rec):
        stall = Stall(rt.engine)
        stall.armed = True
        a = asyncio.ensure_future(http.post("/generate", json=GEN))
        assert await asyncio.to_thread(stall.started.wait, 10)       # A's first step is held
        b = asyncio.ensure_future(http.post("/generate", json={**GEN, "rid": "b-queued"}))
        await until(lambda: any(x.rid == "b-queued" for x in live_actors(rt)), what="b-queued in the runtime")
        pause = asyncio.ensure_future(http.post("/pause", params={"mode": "wait"}))
        await until(lambda: actor_of(rt, "scheduler").state.name == "pausing", what="the wait pause pending")
        stall.release()
        r = await pause
        assert r.status == 200, await r.text()  # noqa
        assert await r.json() == {"status": "paused"}
        ra = await a                                  # A ran to its end, not aborted
        body = await ra.json()
        assert body["meta_info"]["finish_reason"]["type"] == "length"
        assert body["meta_info"]["completion_tokens"] == 4
        qb = [x for x in live_actors(rt) if x.rid == "b-queued"]
        assert qb and qb[0].state.name == "queued" and not b.done()      # B was never admitted
        assert actor_of(rt, "scheduler").state.name == "paused_retract" and actor_of(rt, "scheduler").running == []
        drains = [e for e in rec.events(kind="scheduler") if e.event == "drain_step"]
        assert drains, "the drain stepped the running request with drain_step"
        r = await http.get("/is_paused")
        assert (await r.json())["is_paused"] is True
        steps = _step_notes(rec)
        await rt.quiesce()                             # pause is a barrier: every actor is done, nothing stepped
        assert _step_notes(rec) == steps and not b.done()
        r = await http.post("/resume")
        assert r.status == 200 and await r.json() == {"status": "resumed"}
        rb = await b
        assert (await rb.json())["meta_info"]["finish_reason"]["type"] == "length"
        assert (await (await http.get("/is_paused")).json())["is_paused"] is False
        await settle(rt)


async def test_pause_wait_when_idle_pauses_at_once(tiny):
    async with serve(tiny) as (http, rt, rec):
        r = await http.post("/pause", params={"mode": "wait", "clear_cache": "true"})
        assert r.status == 200 and await r.json() == {"status": "paused"}
        again = await http.post("/pause", params={"mode": "abort"})       # already paused: same answer
        assert again.status == 200 and await again.json() == {"status": "paused"}
        assert (await http.post("/resume")).status == 200
        assert (await http.post("/generate", json=GEN)).status == 200
        await settle(rt)


async def test_pause_abort_ends_the_running_request_with_partial_output_and_is_a_barrier(tiny):
    async with serve(tiny) as (http, rt, rec):
        stall = Stall(rt.engine)
        stall.armed = True
        a = asyncio.ensure_future(http.post("/generate", json={**GEN, "sampling_params": {
            **GEN["sampling_params"], "max_new_tokens": 50}}))
        assert await asyncio.to_thread(stall.started.wait, 10)
        pause = asyncio.ensure_future(http.post("/pause"))                 # mode=abort by default
        await until(lambda: actor_of(rt, "scheduler").state.name == "pausing", what="the pause pending")
        stall.release()
        r = await pause
        assert r.status == 200 and await r.json() == {"status": "paused"}
        steps = _step_notes(rec)
        body = await (await a).json()
        assert body["meta_info"]["finish_reason"]["type"] == "abort"
        assert body["meta_info"]["completion_tokens"] < 50
        snap = await (await http.get("/is_paused")).json()
        assert snap["is_paused"] is True and snap["mode"] == "abort"
        late = asyncio.ensure_future(http.post("/generate", json=GEN))      # queues; nothing steps
        await until(lambda: len(live_actors(rt)) == 1, what="the late request in the runtime")
        await rt.quiesce()
        assert _step_notes(rec) == steps and not late.done()
        assert (await http.post("/resume")).status == 200
        assert (await late).status == 200
        await settle(rt)


async def test_pause_keep_parks_the_request_and_resume_finishes_it(tiny):
    async with serve(tiny) as (http, rt, rec):
        stall = Stall(rt.engine)
        stall.armed = True
        a = asyncio.ensure_future(http.post("/generate", json=GEN))
        assert await asyncio.to_thread(stall.started.wait, 10)
        pause = asyncio.ensure_future(http.post("/pause", params={"mode": "keep"}))
        await until(lambda: actor_of(rt, "scheduler").state.name == "pausing", what="the pause pending")
        stall.release()
        assert (await pause).status == 200
        snap = await (await http.get("/is_paused")).json()
        assert snap == {**snap, "is_paused": True, "mode": "in_place"}
        assert not a.done() and actor_of(rt, "scheduler").running, "the request is parked with its KV"
        r = await http.post("/reset_prefix_cache")                       # the KV is kept: refused
        assert r.status == 400
        assert_error(await r.json())
        assert (await (await http.post("/resume")).json()) == {"status": "resumed"}
        body = await (await a).json()
        assert body["meta_info"]["finish_reason"]["type"] == "length"
        assert body["meta_info"]["completion_tokens"] == 4
        await settle(rt)


async def test_reset_prefix_cache_and_bad_query_parameters(tiny):
    async with serve(tiny) as (http, rt, rec):
        assert (await http.post("/generate", json=GEN)).status == 200
        await settle(rt)
        r = await http.post("/reset_prefix_cache")
        assert r.status == 200 and await r.read() == b""
        assert (await http.post("/reset_prefix_cache")).status == 200           # idempotent
        flushes = [c for c in actor_of(rt, "control").history if c.op == "flush_cache"]
        assert len(flushes) == 2 and all(c.state.name == "applied" for c in flushes)
        stall = Stall(rt.engine)
        stall.armed = True
        a = asyncio.ensure_future(http.post("/generate", json=GEN))
        assert await asyncio.to_thread(stall.started.wait, 10)
        r = await http.post("/reset_prefix_cache")                  # a request holds KV: said so
        assert r.status == 400 and "busy" in (await r.json())["error"]["message"]
        stall.release()
        assert (await a).status == 200
        for params, param in (({"mode": "nap"}, "mode"), ({"clear_cache": "maybe"}, "clear_cache"),
                              ({"wait_for_inflight_requests": "2"}, "wait_for_inflight_requests")):
            r = await http.post("/pause", params=params)
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == param, body
        for name in ("reset_running_requests", "reset_external"):
            r = await http.post("/reset_prefix_cache", params={name: "true"})
            assert r.status == 400 and (await r.json())["error"]["param"] == name
        assert (await (await http.get("/is_paused")).json())["is_paused"] is False
        await settle(rt)
