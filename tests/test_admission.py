"""Admission control and deadlines at the runtime: exact, over the fake engine and a manual clock."""

from __future__ import annotations

import pytest

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Overloaded, Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.batching import BatchConfig
from actorserve.engine.fake import FakeEngine
from actorserve.engine.params import PoolingParams, SamplingParams
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
    assert [e.event for e in rec.events(kind="admission")] == ["shed", "shed"]
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
    own = rt.generate([4, 5], SamplingParams(max_new_tokens=4), deadline_s=5.0)
    clock.advance(1.9)
    await rt.quiesce()
    assert rt.request_info(slow.rid)["state"] == "queued"
    clock.advance(0.1)                          # the default deadline: 2 s after arrival
    await rt.quiesce()
    out = await slow.stream.final()
    assert out.finish_reason == "timeout" and out.error == "deadline exceeded"
    assert rt.request_info(own.rid)["state"] == "queued"     # its own deadline is later
    clock.advance(3.0)
    await rt.quiesce()
    assert (await own.stream.final()).finish_reason == "timeout"
    ops = [e.data["op"] for e in rec.events(kind="control") if e.event == "create"]
    assert ops.count("abort_request") == 2                      # each one a control record
    timers = [e.data["label"] for e in rec.events(kind="input") if e.event == "timer"]
    assert timers == [f"req:{slow.rid}:deadline", f"req:{own.rid}:deadline"]
    await rt.control(ContinueGeneration())
    fine = await rt.generate([7], SamplingParams(max_new_tokens=2, ignore_eos=True)).stream.final()
    assert fine.finish_reason == "length"
    await rt.quiesce()
    clock.advance(10.0)                         # its timer was cancelled when it ended
    await rt.quiesce()
    assert ops == [e.data["op"] for e in rec.events(kind="control") if e.event == "create"][:len(ops)]
    assert [e.data["op"] for e in rec.events(kind="control") if e.event == "create"].count("abort_request") == 2
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()
    report = await reexecute(rec.events())
    assert report.ok, report.format()
