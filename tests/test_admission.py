"""Admission control and deadlines at the runtime: exact, over the fake engine and a manual clock."""

from __future__ import annotations

import asyncio

import pytest

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Overloaded, Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import PoolingParams, SamplingParams
from actorserve.messages import ContinueGeneration, PauseGeneration
from actorserve.replay.check import check
from actorserve.replay.reexec import reexecute
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES

from runtime_helpers import assert_nothing_held


async def make(**cfg):
    clock = ManualClock()
    rec = FlightRecorder(clock=clock, capacity=200_000, lifecycles=LIFECYCLES.values())
    rt = Runtime(FakeEngine(), config=SchedulerConfig(batch=BatchConfig(max_num_seqs=4),
                                                      step_in_thread=False, **cfg),
                 clock=clock, recorder=rec)
    await rt.start()
    return rt, rec, clock


async def test_beyond_the_queue_limit_requests_are_refused_and_probes_pass():
    rt, rec, _ = await make(max_queued_requests=3)
    assert (await rt.control(PauseGeneration("in_place"))).ok     # nothing gets scheduled
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
    kept = [rt.generate([1, 2], sp) for _ in range(3)]
    with pytest.raises(Overloaded) as err:
        rt.generate([3, 4], sp)
    assert (err.value.queued, err.value.limit) == (3, 3) and err.value.retry_after_s >= 1
    with pytest.raises(Overloaded):
        rt.pool([5, 6], PoolingParams(task="score"))              # the same scheduler's queue
    probe = rt.generate([1], SamplingParams(max_new_tokens=1), is_probe=True)   # health passes
    assert rt.shed == 2
    assert [e.data["queued"] for e in rec.events(kind="input") if e.event == "shed"] == [3, 3]
    await rt.control(ContinueGeneration())
    outs = [await h.stream.final() for h in kept + [probe]]
    assert [o.finish_reason for o in outs] == ["length"] * 4
    later = await rt.generate([3, 4], sp).stream.final()     # room again: accepted
    assert later.finish_reason == "length"
    await rt.quiesce()
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_a_deadline_aborts_through_the_control_actor_with_finish_reason_timeout():
    rt, rec, clock = await make(request_timeout_s=2.0)
    assert (await rt.control(PauseGeneration("in_place"))).ok
    slow = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    own = rt.generate([4, 5], SamplingParams(max_new_tokens=4), deadline_s=1.0)
    long = rt.generate([6], SamplingParams(max_new_tokens=4), deadline_s=5.0)
    clock.advance(1.0)                          # a request's own deadline may be shorter
    await rt.quiesce()
    assert (await own.stream.final()).finish_reason == "timeout"
    assert rt.request_info(slow.rid)["state"] == "queued"
    clock.advance(0.9)
    await rt.quiesce()
    assert rt.request_info(slow.rid)["state"] == rt.request_info(long.rid)["state"] == "queued"
    clock.advance(0.1)                          # the server's deadline: 2 s after arrival
    await rt.quiesce()
    out = await slow.stream.final()
    assert out.finish_reason == "timeout" and out.error == "deadline exceeded"
    # ... which a request's own deadline cannot lengthen
    assert (await long.stream.final()).finish_reason == "timeout"
    ops = [e.data["op"] for e in rec.events(kind="control") if e.event == "create"]
    assert ops.count("abort_request") == 3                      # each one a control record
    timers = [e.data["label"] for e in rec.events(kind="input") if e.event == "timer"]
    assert timers == [f"req:{own.rid}:deadline", f"req:{slow.rid}:deadline", f"req:{long.rid}:deadline"]
    await rt.control(ContinueGeneration())
    fine = await rt.generate([7], SamplingParams(max_new_tokens=2, ignore_eos=True)).stream.final()
    assert fine.finish_reason == "length"
    await rt.quiesce()
    clock.advance(10.0)                         # its timer was cancelled when it ended
    await rt.quiesce()
    assert ops == [e.data["op"] for e in rec.events(kind="control") if e.event == "create"][:len(ops)]
    assert [e.data["op"] for e in rec.events(kind="control") if e.event == "create"].count("abort_request") == 3
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()
    report = await reexecute(rec.events())
    assert report.ok, report.format()


async def test_over_http_a_shed_request_is_503_with_retry_after_and_health_still_answers():
    from aiohttp.test_utils import TestClient, TestServer

    from actorserve.config import ModelConfig, ServerConfig
    from actorserve.engine.runners.runner import build_engine
    from actorserve.http.edge.app import build_app
    from http_support import NAME, assert_error, load_tiny, settle, until

    model, hf_tok, tok = load_tiny()
    engine = build_engine(model, num_blocks=64, block_size=16, tokenizer=hf_tok, model_name=NAME)
    rt = Runtime(engine, config=SchedulerConfig(max_queued_requests=2),
                 recorder=FlightRecorder(capacity=100_000, lifecycles=LIFECYCLES.values()))
    app = build_app(rt, tok, ServerConfig(model=ModelConfig(model="tiny", kv_blocks=64)), NAME)
    async with TestServer(app, host="127.0.0.1", port=0) as server, TestClient(server) as http:
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status == 200
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        waiting = [asyncio.ensure_future(http.post("/generate", json=body)) for _ in range(2)]
        await until(lambda: rt.stats().waiting == 2)
        shed = await http.post("/generate", json=body)
        assert shed.status == 503 and shed.headers["Retry-After"] == "1"
        answer = await shed.json()
        assert_error(answer)
        err = answer["error"]
        assert err["code"] == "server_overloaded" and "2 requests are waiting" in err["message"]
        chat = await http.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert chat.status == 503
        assert (await http.get("/health")).status == 200
        assert (await http.get("/health_generate")).status == 200      # paused: healthy, no probe
        metrics = await (await http.get("/metrics")).text()
        assert f'actorserve_requests_shed_total{{model_name="{NAME}"}} 2.0' in metrics
        assert (await http.post("/continue_generation", json={})).status == 200
        assert [r.status for r in await asyncio.gather(*waiting)] == [200, 200]
        assert (await http.post("/generate", json=body)).status == 200   # room again
        await settle(rt)



async def test_over_http_a_request_timeout_field_ends_the_request_with_finish_reason_timeout():
    from http_support import NAME, load_tiny, serve, settle

    async with serve(load_tiny()) as (http, rt):
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status == 200
        r = http.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
            "request_timeout": 0.2})
        g = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 5},
                                         "request_timeout": 0.2})
        chat, gen = await asyncio.gather(r, g)
        assert chat.status == 200 and (await chat.json())["choices"][0]["finish_reason"] == "timeout"
        assert (await gen.json())["meta_info"]["finish_reason"]["type"] == "timeout"
        bad = await http.post("/generate", json={"text": "x", "request_timeout": -1})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "request_timeout"
        assert (await http.post("/continue_generation", json={})).status == 200
        await settle(rt)
