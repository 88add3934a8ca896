"""Watchdog and sessions through the real actors, over the fake engine and a manual clock."""

from __future__ import annotations

import asyncio
import functools
import threading

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import (
    CloseSession, ContinueGeneration, OpenSession, PauseGeneration, SessionBegin,
)
from actorserve.replay.check import check
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES

import waiting
from runtime_helpers import assert_nothing_held
from actor_access import actor_of


async def make(*, in_thread=False, watchdog=None, **engine_kw):
    clock = ManualClock()
    rec = FlightRecorder(clock=clock, capacity=1_000_000, lifecycles=LIFECYCLES.values())
    engine = FakeEngine(**engine_kw)
    cfg = SchedulerConfig(batch=BatchConfig(), step_in_thread=in_thread, watchdog_timeout_s=watchdog)
    rt = Runtime(engine, config=cfg, clock=clock, recorder=rec)
    await rt.start()
    return rt, engine, rec, clock


until = functools.partial(waiting.until, timeout=5.0)


# -- watchdog ----------------------------------------------------------------------------------


async def test_watchdog_marks_and_clears_unhealthy():
    gate, started, stall = threading.Event(), threading.Event(), {"on": False}

    def fault(batch):
        if stall["on"]:
            started.set()
            gate.wait(10)

    rt, engine, rec, clock = await make(in_thread=True, watchdog=5.0, fault=fault)
    wd = actor_of(rt, "watchdog")
    assert wd is not None and wd.interval == 1.25
    for _ in range(40):                       # idle for 50 virtual seconds: nothing is pending
        clock.advance(1.25)
        await rt.quiesce()
    assert rt.snapshot().health == "healthy"
    stall["on"] = True
    h = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    assert await asyncio.to_thread(started.wait, 10)
    for _ in range(3):                        # 3.75 s without a step: still within the timeout
        clock.advance(1.25)
        await until(lambda: not wd.asking and wd.mailbox.statistics().current_size == 0)
    assert rt.snapshot().health == "healthy"
    for _ in range(3):
        clock.advance(1.25)
        await until(lambda: not wd.asking and wd.mailbox.statistics().current_size == 0)
    await until(lambda: rt.snapshot().health == "unhealthy")
    snap = rt.snapshot()
    assert snap.state == "serving"             # the run phase is untouched: health is its own region
    assert "no scheduler step completed" in snap.health_reason and "1 request(s) pending" in snap.health_reason
    info = rt.server_info()
    assert info["watchdog"]["stalled"] and info["watchdog"]["stalls"] == 1
    stall["on"] = False
    gate.set()
    assert (await h.stream.final()).finish_reason == "length"
    await rt.quiesce()
    clock.advance(1.25)
    await rt.quiesce()
    assert rt.snapshot().health == "healthy" and not rt.server_info()["watchdog"]["stalled"]
    evs = [(e.event, e.dst) for e in rec.events(rid="health", kind="health")]
    assert evs == [("create", "healthy"), ("stall", "unhealthy"), ("recover", "healthy")]
    assert [e.event for e in rec.events(rid="server", kind="server")] == ["create", "ready"]
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_a_server_can_be_paused_and_unhealthy_at_once():
    """A pause that waited at a stalled step applies while the server is unhealthy: the run
    scheduler goes paused_in_place (the one machine that holds the pause) while the server's
    run phase stays serving, the health region stays unhealthy until a step completes, and
    recovering re-fires nothing (each is a state of its own machine)."""
    gate, started, stall = threading.Event(), threading.Event(), {"on": True}

    def fault(batch):
        if stall["on"]:
            started.set()
            gate.wait(10)

    rt, engine, rec, clock = await make(in_thread=True, watchdog=1.0, fault=fault)
    h = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    assert await asyncio.to_thread(started.wait, 10)
    pause = asyncio.ensure_future(rt.control(PauseGeneration("in_place")))   # waits for the step
    wd = actor_of(rt, "watchdog")
    for _ in range(8):
        clock.advance(0.25)                   # each tick asked and answered before the next
        await until(lambda: not wd.asking and wd.mailbox.statistics().current_size == 0)
    await until(lambda: rt.snapshot().health == "unhealthy")
    assert not pause.done() and actor_of(rt, "scheduler").state.name == "pausing"
    stall["on"] = False
    gate.set()
    assert (await pause).ok
    snap = rt.snapshot()
    assert (snap.state, snap.pause_mode, snap.health) == ("serving", "in_place", "unhealthy")   # at once
    clock.advance(0.25)
    await until(lambda: rt.snapshot().health == "healthy")
    assert rt.snapshot().pause_mode == "in_place"
    await rt.control(ContinueGeneration())
    assert rt.snapshot().pause_mode is None
    server = [e.event for e in rec.events(rid="server", kind="server")]
    assert server == ["create", "ready"]          # the pause is the scheduler's alone
    sched = [e.event for e in rec.events(rid="scheduler", kind="scheduler")]
    assert "pause_in_place" in sched and "resume" in sched
    assert (await h.stream.final()).finish_reason == "length"
    await rt.quiesce()
    assert check(rec.events()).ok
    await rt.shutdown()


async def test_watchdog_ignores_a_pause_in_place():
    rt, engine, rec, clock = await make(watchdog=2.0)
    await rt.control(PauseGeneration("in_place"))
    h = rt.generate([4, 5], SamplingParams(max_new_tokens=3))
    for _ in range(20):
        clock.advance(0.5)
        await rt.quiesce()
    assert rt.snapshot().pause_mode == "in_place" and rt.snapshot().health == "healthy"
    await rt.control(ContinueGeneration())
    assert (await h.stream.final()).finish_reason == "length"
    await rt.shutdown()


# -- sessions ----------------------------------------------------------------------------------


async def turn(rt, sid, rid, new, n=6, **kw):
    res = await rt.session(SessionBegin(sid, rid, tuple(new), **kw))
    assert res.ok, res.message
    ids = res.detail["prompt_ids"]
    out = await rt.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True), rid=rid,
                            session=sid).stream.final()
    await rt.quiesce()
    return ids, out


async def test_three_turn_session_reuses_kv_and_records_its_lifecycle():
    rt, engine, rec, clock = await make()
    res = await rt.control(OpenSession("s1"))
    assert res.ok and res.detail["session_id"] == "s1"
    assert not (await rt.control(OpenSession("s1"))).ok          # duplicate
    p1, o1 = await turn(rt, "s1", "r1", list(range(10, 30)))
    p2, o2 = await turn(rt, "s1", "r2", [7, 8, 9])
    assert p2 == p1 + o1.token_ids + [7, 8, 9]
    p3, o3 = await turn(rt, "s1", "r3", [11, 12])
    assert p3 == p2 + o2.token_ids + [11, 12]
    assert 0 <= o1.cached_tokens < o2.cached_tokens < o3.cached_tokens
    assert o3.cached_tokens >= len(p2)  - rt.engine.info.block_size
    # a session id on a plain request must have been begun: an unknown session is refused
    assert not (await rt.session(SessionBegin("nope", "x", (1,)))).ok
    assert not (await rt.session(SessionBegin("s1", "r3", (1,)))).ok   # rid reused
    assert not (await rt.session(SessionBegin("s1", "r9", (1,), parent="zz"))).ok
    assert (await rt.control(CloseSession("s1"))).detail["state"] == "closed"
    assert not (await rt.session(SessionBegin("s1", "r4", (1,)))).ok
    await rt.quiesce()
    evs = [(e.event, e.dst) for e in rec.events(rid="session:s1", kind="session")]
    assert evs == [("create", "open"), ("close", "closed")]
    ops = [r.op for r in actor_of(rt, "control").history]
    assert ops.count("open_session") == 2 and ops[-1] == "close_session"
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_replace_drop_previous_output_and_offset():
    rt, engine, rec, clock = await make()
    await rt.control(OpenSession("s"))
    p1, o1 = await turn(rt, "s", "a", [5, 6, 7, 8])
    p2, o2 = await turn(rt, "s", "b", [9], parent="a")
    # drop_previous_output: the parent's prompt without its output
    p3, _ = await turn(rt, "s", "c", [1, 2], parent="a", drop_previous_output=True)
    assert p3 == p1 + [1, 2]
    # offset: the parent's context cut at offset
    p4, _ = await turn(rt, "s", "d", [3], parent="b", offset=5)
    assert p4 == (p2 + o2.token_ids)[:5] + [3]
    # a BOS at the start of the new input is dropped when it extends a parent
    p5, _ = await turn(rt, "s", "e", [1, 4], parent="a", bos_id=1)
    assert p5 == p1 + o1.token_ids + [4]
    # replace with a rid: extends it and prunes its other continuations (b, c, d, e)
    p6, _ = await turn(rt, "s", "f", [42], parent="a", replace=True)
    assert p6 == p1 + o1.token_ids + [42]
    for gone in ("b", "c", "d", "e"):
        res = await rt.session(SessionBegin("s", f"x-{gone}", (1,), parent=gone))
        assert not res.ok and "is not a request" in res.message
    # the chain's tip is now f: a request without a rid continues it
    p7, o7 = await turn(rt, "s", "g", [43])
    assert p7[:len(p6)] == p6
    # replace without a rid: the session starts over from the new input alone
    p8, _ = await turn(rt, "s", "h", [77, 78], replace=True)
    assert p8 == [77, 78]
    assert not (await rt.session(SessionBegin("s", "y", (1,), parent="a"))).ok
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_close_is_deferred_while_a_request_of_the_session_runs():
    rt, engine, rec, clock = await make()
    await rt.control(OpenSession("s"))
    await rt.control(PauseGeneration("in_place"))     # holds the request in the queue
    res = await rt.session(SessionBegin("s", "r1", (1, 2, 3)))
    h = rt.generate(res.detail["prompt_ids"], SamplingParams(max_new_tokens=3), rid="r1", session="s")
    closing = await rt.control(CloseSession("s"))
    assert closing.ok and closing.detail == {"state": "closing", "running": ["r1"]}
    again = await rt.session(SessionBegin("s", "r2", (4,)))
    assert not again.ok and "closing" in again.message
    assert actor_of(rt, "sessions").sessions["s"].state.name == "closing"
    await rt.control(ContinueGeneration())
    assert (await h.stream.final()).finish_reason == "length"
    await rt.quiesce()
    assert "s" not in actor_of(rt, "sessions").sessions
    evs = [(e.event, e.dst) for e in rec.events(rid="session:s", kind="session")]
    assert evs == [("create", "open"), ("defer_close", "closing"), ("close", "closed")]
    assert not (await rt.control(CloseSession("s"))).ok                 # unknown now
    await rt.shutdown()


async def test_idle_sessions_are_reaped_after_their_timeout():
    rt, engine, rec, clock = await make()
    await rt.control(OpenSession("idle", timeout=10))
    await rt.control(OpenSession("busy", timeout=10))
    await rt.control(OpenSession("forever"))
    clock.advance(5)
    await rt.quiesce()
    await turn(rt, "busy", "r1", [1, 2, 3])       # activity at t=5 moves its deadline to t=15
    clock.advance(5.5)
    await rt.quiesce()
    assert set(actor_of(rt, "sessions").sessions) == {"busy", "forever"}
    clock.advance(4)
    await rt.quiesce()
    assert set(actor_of(rt, "sessions").sessions) == {"busy", "forever"}
    clock.advance(1)
    await rt.quiesce()
    assert set(actor_of(rt, "sessions").sessions) == {"forever"}
    evs = [(e.event, e.dst) for e in rec.events(rid="session:idle", kind="session")]
    assert evs == [("create", "open"), ("expire", "closed")]
    res = await rt.session(SessionBegin("idle", "r2", (1,)))
    assert not res.ok and "unknown session" in res.message
    assert check(rec.events()).ok
    await rt.shutdown()
