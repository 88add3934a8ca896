"""`/health_generate`, the watchdog and sessions over HTTP, on the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from actorserve.actors.runtime import Runtime
from actorserve.config import ModelConfig, SchedulerConfig, ServerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.http.edge.app import build_app
from actorserve.messages import ServerEvent
from actorserve.replay.check import check
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES

from http_support import NAME, assert_error, load_tiny, settle, until
from actor_access import actor_of, live_actors


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@contextlib.asynccontextmanager
async def serve(tiny, *, batch=None, kv_blocks=128, watchdog=None):
    from actorserve.engine.runners.runner import build_engine

    model, hf_tok, tok = tiny
    engine = build_engine(model, num_blocks=kv_blocks, block_size=16, tokenizer=hf_tok, model_name=NAME)
    rec = FlightRecorder(capacity=200_000, lifecycles=LIFECYCLES.values())
    rt = Runtime(engine, config=SchedulerConfig(batch=batch or BatchConfig(), watchdog_timeout_s=watchdog),
                 recorder=rec)
    app = build_app(rt, tok, ServerConfig(model=ModelConfig(model="tiny", kv_blocks=kv_blocks)), NAME)
    async with TestServer(app, host="127.0.0.1", port=0, handler_cancellation=True) as server:
        async with TestClient(server) as client:
            yield client, rt, rec


class Stall:
    """Fault injection on the real runner: while armed, every model step blocks on a gate."""

    def __init__(self, engine):
        self.engine, self.orig = engine, engine.execute
        self.gate, self.started, self.armed = threading.Event(), threading.Event(), False
        engine.execute = self.execute

    def execute(self, batch):
        if self.armed:
            self.started.set()
            self.gate.wait(30)
        return self.orig(batch)

    def release(self):
        self.armed = False
        self.gate.set()


async def test_health_generate_answers_while_a_long_prefill_runs(tiny):
    async with serve(tiny, batch=BatchConfig(max_prefill_chunk=8)) as (http, rt, rec):
        r = await http.get("/health_generate")
        assert r.status == 200, await r.text()
        body = await r.json()
        assert body["status"] == "ok" and body["latency_s"] > 0
        long = asyncio.ensure_future(http.post("/generate", json={
            "input_ids": [5 + i % 200 for i in range(900)],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}))
        def in_prefill():
            actors = [a for a in live_actors(rt) if not a.is_probe]
            return actors[0] if actors and actors[0].state.name == "prefill" else None
        long_actor = await until(in_prefill, what="the long request in prefill")
        r = await http.get("/health_generate")
        assert r.status == 200, await r.text()
        assert long_actor.state.name == "prefill", "the probe waited for the long prefill"
        resp = await long
        assert resp.status == 200 and (await resp.json())["meta_info"]["completion_tokens"] == 2
        # the probe's token came before the long request's first token, and probes are not traffic
        probes = [e for e in rec.events(kind="generation") if e.rid.startswith("health-probe-")]
        first_token_long = next(e.seq for e in rec.events(rid=long_actor.rid, kind="generation")
                                if e.event == "first_token")
        assert max(e.seq for e in probes if e.event == "deliver") < first_token_long
        metrics = await (await http.get("/metrics")).text()
        assert ('actorserve_requests_total{finish_reason="length",kind="generate",model_name='
                f'"{NAME}"}} 1.0') in metrics
        assert "health" not in metrics
        assert rt.stats().prompt_tokens == 900
        await settle(rt)
        assert check(rec.events()).ok


async def test_health_generate_is_503_when_the_model_step_stalls(tiny):
    async with serve(tiny) as (http, rt, rec):
        stall = Stall(rt.engine)
        stall.armed = True
        h = asyncio.ensure_future(http.post("/generate", json={
            "text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}))
        assert await asyncio.to_thread(stall.started.wait, 10)
        r = await http.get("/health_generate", params={"timeout": "0.3"})
        assert r.status == 503
        body = await r.json()
        assert body["status"] == "unavailable" and "did not complete" in body["reason"]
        assert not any(a.is_probe for a in live_actors(rt)), "a timed-out probe is aborted"
        await until(lambda: not actor_of(rt, "control").open)    # HealthDone reaches the control actor in a turn
        last = actor_of(rt, "control").history[-1]
        assert last.op == "health_generate" and last.state.name == "rejected"
        assert "did not complete" in last.result.message
        assert (await http.get("/health")).status == 200           # /health stays shallow
        assert (await http.get("/health_generate", params={"timeout": "x"})).status == 400
        stall.release()
        assert (await h).status == 200
        assert (await http.get("/health_generate")).status == 200
        await settle(rt)


async def test_watchdog_makes_health_503_with_a_reason_and_recovers(tiny):
    async with serve(tiny, watchdog=0.2) as (http, rt, rec):
        stall = Stall(rt.engine)
        stall.armed = True
        h = asyncio.ensure_future(http.post("/generate", json={
            "text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}))
        await until(lambda: rt.snapshot().health == "unhealthy")
        assert rt.snapshot().health == "unhealthy"
        info = await (await http.get("/server_info")).json()
        assert info["server_state"] == "serving" and info["health"] == "unhealthy"
        assert "no scheduler step" in info["health_reason"]
        assert info["watchdog"]["stalled"] is True
        for path in ("/health", "/health_generate"):
            r = await http.get(path)
            assert r.status == 503, path
        stall.release()
        assert (await h).status == 200
        await until(lambda: rt.snapshot().health == "healthy")
        assert rt.snapshot().health == "healthy" and rt.server_state == "serving"
        assert (await http.get("/health_generate")).status == 200
        await settle(rt)


async def test_sessions_over_http(tiny):
    async with serve(tiny) as (http, rt, rec):
        sid = await (await http.post("/open_session", json={"session_id": "chat-1"})).json()
        assert sid == "chat-1"
        r = await http.post("/open_session", json={"session_id": "chat-1"})
        assert r.status == 400
        assert_error(await r.json())
        anon = await (await http.post("/open_session", json={})).json()
        assert isinstance(anon, str) and len(anon) >= 8
        sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        first = "The quick brown fox jumps over the lazy dog. " * 4
        cached, rids = [], []
        for i, text in enumerate([first, " And then?", " Tell me more."]):
            r = await http.post("/generate", json={"text": text, "sampling_params": sp, "rid": f"t{i}",
                                                   "session_params": {"id": "chat-1"}})
            assert r.status == 200, await r.text()
            meta = (await r.json())["meta_info"]
            cached.append(meta["cached_tokens"])
            rids.append(meta["id"])
        assert cached[0] < cached[1] < cached[2], cached
        # drop_previous_output and replace branch from t0
        r = await http.post("/generate", json={"text": " Other.", "sampling_params": sp, "rid": "b1",
                                               "session_params": {"id": "chat-1", "rid": "t0",
                                                                  "drop_previous_output": True}})
        assert r.status == 200
        r = await http.post("/generate", json={"text": " Again.", "sampling_params": sp, "rid": "b2",
                                               "session_params": {"id": "chat-1", "rid": "t0", "replace": True}})
        assert r.status == 200 and (await r.json())["meta_info"]["cached_tokens"] >= cached[1]
        r = await http.post("/generate", json={"text": "x", "sampling_params": sp,
                                               "session_params": {"id": "chat-1", "rid": "t2"}})
        assert r.status == 400, "t2 was pruned by the replace"
        # chat completions accept a session id
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "session_id": anon})
        assert r.status == 200, await r.text()
        r2 = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "more"}], "max_tokens": 4,
            "session_params": {"id": anon}})
        usage = (await r2.json())["usage"]
        assert usage["prompt_tokens"] > (await r.json())["usage"]["prompt_tokens"]
        assert (await http.post("/close_session", json={"session_id": "chat-1"})).status == 200
        for sess in ("chat-1", "nope"):
            r = await http.post("/generate", json={"text": "x", "sampling_params": sp,
                                                   "session_params": {"id": sess}})
            assert r.status == 400
            assert "session" in (await r.json())["error"]["message"]
        assert (await http.post("/close_session", json={"session_id": "nope"})).status == 400
        info = await (await http.get("/server_info")).json()
        assert [s["session_id"] for s in info["sessions"]["open"]] == [anon]
        await settle(rt)
        assert check(rec.events()).ok


async def test_a_session_turns_logprob_start_len_counts_the_whole_session_prompt(tiny):
    """SGLang checks (and applies) ``logprob_start_len`` against the turn's whole prompt: the
    session's tokens so far + the new input, not the new chunk alone."""
    async with serve(tiny) as (http, rt, rec):
        await http.post("/open_session", json={"session_id": "lp"})
        sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = await http.post("/generate", json={"text": "The quick brown fox jumps over the lazy dog.",
                                               "sampling_params": sp, "rid": "lp0", "session_params": {"id": "lp"}})
        assert r.status == 200, await r.text()
        first = (await r.json())["meta_info"]
        so_far = first["prompt_tokens"] + first["completion_tokens"]
        turn = {"text": " And?", "sampling_params": sp, "return_logprob": True,
                "session_params": {"id": "lp", "rid": "lp0"}}
        new_len = len(tiny[2].encode(" And?"))
        start = so_far + 1                        # past the new chunk's length, inside the whole prompt
        assert start >= new_len
        r = await http.post("/generate", json={**turn, "rid": "lp1", "logprob_start_len": start})
        assert r.status == 200, await r.text()
        meta = (await r.json())["meta_info"]
        whole = meta["prompt_tokens"]
        assert whole > start
        assert len(meta["input_token_logprobs"]) == whole - start       # applied to the whole prompt
        r = await http.post("/generate", json={**turn, "rid": "lp2", "logprob_start_len": whole})
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "logprob_start_len", body
        assert f"{whole} tokens" in body["error"]["message"]
        r = await http.post("/generate", json={**turn, "rid": "lp3", "logprob_start_len": whole - 1})
        assert r.status == 200, await r.text()        # the refused turn left nothing behind
        assert (await http.post("/close_session", json={"session_id": "lp"})).status == 200
        await settle(rt)
        assert check(rec.events()).ok


def test_watchdog_timeout_flag():
    import argparse

    from actorserve.http.edge import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli.config_from_args(p.parse_args([])).scheduler.watchdog_timeout_s is None
    assert serve_cli.config_from_args(p.parse_args([])).profile_dir is None
    assert serve_cli.config_from_args(p.parse_args(["--profile-dir", "/p"])).profile_dir == "/p"
    c = serve_cli.config_from_args(p.parse_args(["--watchdog-timeout", "2.5"]))
    assert c.scheduler.watchdog_timeout_s == 2.5


async def test_health_checks_are_control_records_and_embedding_engines_probe_by_pooling():
    import dataclasses

    from actorserve.engine.runners.fake import FakeEngine

    engine = FakeEngine()
    engine.info = dataclasses.replace(engine.info, kind="embed")
    rec = FlightRecorder(capacity=10_000, lifecycles=LIFECYCLES.values())
    rt = Runtime(engine, config=SchedulerConfig(), recorder=rec)
    app = build_app(rt, None, ServerConfig(), "fake-embed")
    async with TestServer(app, host="127.0.0.1", port=0) as server:
        async with TestClient(server) as http:
            r = await http.get("/health_generate")
            assert r.status == 200, await r.text()
            assert (await http.post("/pause_generation", json={"mode": "in_place"})).status == 200
            r = await http.get("/health_generate")
            assert r.status == 200 and (await r.json())["status"] == "paused"
            assert (await http.post("/continue_generation", json={})).status == 200
            probes = {e.rid for e in rec.events(kind="pooling") if e.rid.startswith("health-probe-")}
            assert len(probes) == 1
            assert not any(e.rid.startswith("health-probe-") for e in rec.events(kind="generation"))
            recs = [r for r in actor_of(rt, "control").history if r.op == "health_generate"]
            assert [r.state.name for r in recs] == ["applied", "applied"]
            paths = [[e.event for e in rec.events(rid=r.rid, kind="control")] for r in recs]
            assert paths == [["create", "probe", "apply"], ["create", "apply"]]
            await rt.control(ServerEvent("drain", "test"))
            r = await http.get("/health_generate")
            assert r.status == 503 and "draining" in (await r.json())["reason"]
            assert actor_of(rt, "control").history[-1].state.name == "rejected"
            report = check(rec.events())
            assert report.ok, report
