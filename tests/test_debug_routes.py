"""Live inspection over HTTP (`http.edge.debug_routes`): request history, the SSE event stream,
diagrams with a request's path highlighted, the flag and the API key; plus the recorder's
subscriber hook they stand on."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines.diagram import VISITED_FILL
from http_support import assert_error, load_tiny, serve, settle, until

SP = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def test_recorder_subscribe_and_unsubscribe():
    class Clock:
        def now_ns(self) -> int:
            return 7

    rec = FlightRecorder(clock=Clock())
    rec.note("step", "step")                           # before subscribing: not delivered
    got = []
    unsubscribe = rec.subscribe(got.append)
    rec.subscribe(lambda ev: 1 / 0)                    # a broken listener is dropped, not fatal
    rec.note("step", "step", rid="r1", data={"n": 1})
    assert [(e.seq, e.rid, e.kind, e.data) for e in got] == [(2, "r1", "step", {"n": 1})]
    assert len(rec._subscribers) == 1
    unsubscribe()
    rec.note("step", "step")
    assert len(got) == 1 and not rec._subscribers and len(rec) == 3


async def test_request_history_and_unknown_rid(tiny):
    async with serve(tiny, debug_routes=True) as (http, rt):
        r = await http.post("/generate", json={"text": "hi", "sampling_params": SP, "rid": "dbg1"})
        assert r.status == 200, await r.text()
        await settle(rt)
        r = await http.get("/debug/requests/dbg1")
        assert r.status == 200, await r.text()
        body = await r.json()
        assert body["rid"] == "dbg1" and body["kind"] == "generation"
        assert body["state"] == "done" and body["live"] is False
        seqs = [e["seq"] for e in body["history"]]
        assert seqs == sorted(seqs)
        path = [e["dst"] for e in body["history"] if e["kind"] == "generation" and e["ok"]]
        assert path[0] == "queued" and path[-1] == "done" and "decode" in path
        r = await http.get("/debug/requests/nope")
        assert r.status == 404
        assert_error(await r.json(), "not_found_error")


async def test_live_request_state(tiny):
    async with serve(tiny, debug_routes=True) as (http, rt):
        await http.post("/pause_generation", json={"mode": "in_place"})
        waiting = asyncio.ensure_future(http.post("/generate", json={
            "text": "wait", "sampling_params": SP, "rid": "held"}))
        async def held():
            async with http.get("/debug/requests/held") as r:
                return await r.json() if r.status == 200 else None
        body = await until(held, poll=0.02, what="/debug/requests/held answering 200")
        assert body["live"] is True and body["state"] == "queued"
        await http.post("/continue_generation")
        await waiting
        await settle(rt)
        assert (await (await http.get("/debug/requests/held")).json())["state"] == "done"


async def test_disabled_by_default(tiny):
    async with serve(tiny) as (http, rt):
        await http.post("/generate", json={"text": "hi", "sampling_params": SP, "rid": "x"})
        for path in ("/debug/requests/x", "/debug/events", "/debug/diagram/generation",
                     "/debug/diagram/generation?rid=x&format=svg"):
            r = await http.get(path)
            assert r.status == 404, path
            assert_error(await r.json())


async def test_api_key_guards_debug_routes(tiny):
    async with serve(tiny, api_key="sekret", debug_routes=True) as (http, rt):
        auth = {"Authorization": "Bearer sekret"}
        await http.post("/generate", json={"text": "hi", "sampling_params": SP, "rid": "k1"}, headers=auth)
        for path in ("/debug/requests/k1", "/debug/events", "/debug/diagram/generation"):
            r = await http.get(path)
            assert r.status == 401, path
            assert_error(await r.json(), "authentication_error")
        assert (await http.get("/debug/requests/k1", headers=auth)).status == 200
        assert (await http.get("/debug/diagram/generation", headers=auth)).status == 200
        assert not rt.recorder._subscribers


async def _read_events(resp, until) -> list:
    """Read SSE ``data:`` events until `until(event)` holds for one; comments are skipped."""
    out = []
    buf = b""
    while True:
        chunk = await resp.content.readany()
        assert chunk, f"stream ended early after {out}"
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            if not block.startswith(b"data: "):
                continue
            ev = json.loads(block[len(b"data: "):])
            out.append(ev)
            if until(ev):
                return out


async def test_event_stream_filters_by_rid(tiny):
    async with serve(tiny, debug_routes=True) as (http, rt):
        await http.post("/generate", json={"text": "old", "sampling_params": SP, "rid": "s1"})
        await settle(rt)
        before = rt.recorder.seq
        resp = await http.get("/debug/events", params={"rid": "s1"})
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert len(rt.recorder._subscribers) == 1
        # the old request's events are not replayed; a new request with that rid streams live
        other = asyncio.ensure_future(http.post("/generate", json={"text": "o", "sampling_params": SP,
                                                                   "rid": "other"}))
        gen = asyncio.ensure_future(http.post("/generate", json={"text": "new", "sampling_params": SP,
                                                                 "rid": "s1"}))
        evs = await asyncio.wait_for(_read_events(
            resp, lambda e: e.get("kind") == "generation" and e.get("dst") == "done"), 10)
        await gen, await other
        assert {e["rid"] for e in evs} == {"s1"}
        seqs = [e["seq"] for e in evs]
        assert seqs == sorted(seqs) and seqs[0] > before
        path = [e["dst"] for e in evs if e["kind"] == "generation"]
        assert path[0] == "queued" and path[-1] == "done"
        # only the new request's events: exactly one "create"
        assert sum(1 for e in evs if e["event"] == "create") == 1
        resp.close()                                    # the client leaves: the stream ends
        await until(lambda: not rt.recorder._subscribers)
        assert not rt.recorder._subscribers


async def test_event_stream_kind_filter_and_shutdown(tiny):
    async with serve(tiny, debug_routes=True) as (http, rt):
        resp = await http.get("/debug/events", params={"kind": "step"})
        await http.post("/generate", json={"text": "k", "sampling_params": SP})
        evs = await asyncio.wait_for(_read_events(resp, lambda e: True), 10)
        assert evs[0]["kind"] == "step" and evs[0]["data"]["batch"]
        # the server stopping ends the stream with [DONE]
        await http.server.app.shutdown()
        rest = await asyncio.wait_for(resp.content.read(), 5)
        assert rest.endswith(b"data: [DONE]\n\n")


async def test_diagram_with_rid_highlights_path(tiny):
    async with serve(tiny, debug_routes=True) as (http, rt):
        await http.post("/generate", json={"text": "d", "sampling_params": SP, "rid": "d1"})
        await settle(rt)
        r = await http.get("/debug/diagram/generation", params={"format": "svg", "rid": "d1"})
        assert r.status == 200, await r.text()
        svg = await r.text()
        assert VISITED_FILL in svg and 'class="node-count"' in svg and "×1" in svg
        assert 'class="node current"' in svg and 'data-state="done"' in svg
        plain = await (await http.get("/debug/diagram/generation", params={"format": "svg"})).text()
        assert VISITED_FILL not in plain and "node-count" not in plain
        mer = await (await http.get("/debug/diagram/generation", params={"rid": "d1"})).text()
        assert mer.startswith("stateDiagram") and mer != await (await http.get("/debug/diagram/generation")).text()
        assert (await http.get("/debug/diagram/generation", params={"rid": "nope"})).status == 404
        r = await http.get("/debug/diagram/pooling", params={"rid": "d1"})
        assert r.status == 400 and "generation" in (await r.json())["error"]["message"]


def test_cli_flag():
    from actorserve.http.edge import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli.config_from_args(p.parse_args([])).debug_routes is False
    assert serve_cli.config_from_args(p.parse_args(["--debug-routes"])).debug_routes is True
