"""The scheduler's machines: pause lives in one machine (the scheduler's), so `/is_paused` is
right while the server drains; a probe retracted by a pause goes back to the probe lane;
isolation is a state; old recordings (the server's own paused states, isolation as a
self-loop) still check."""

from __future__ import annotations

import asyncio

import pytest

from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import ContinueGeneration, PauseGeneration
from actorserve.replay.check import check
from actorserve.replay.recorder import Event

from http_support import load_tiny, serve
from runtime_helpers import assert_nothing_held, make_runtime
from waiting import until
from actor_access import actor_of


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


async def test_a_draining_server_whose_scheduler_is_paused_in_place_says_it_is_paused(tiny):
    """Before, the server's own copy of the pause left ``paused_in_place`` for ``draining`` while
    the scheduler stayed paused: `/is_paused` said false, and nothing stepped."""
    async with serve(tiny) as (http, rt):
        gen = asyncio.ensure_future(http.post("/generate", json={
            "text": "hi", "rid": "held", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}))
        await until(lambda: rt.request_info("held") is not None, what="the request is in")
        assert (await rt.control(PauseGeneration("in_place"))).ok
        drained = rt.drain("test")
        await rt.quiesce()
        st = await (await http.get("/is_paused")).json()
        assert st == {"is_paused": True, "mode": "in_place", "server_state": "draining"}
        assert actor_of(rt, "scheduler").state.name == "paused_in_place" and not drained.done()
        info = await (await http.get("/server_info")).json()
        assert info["pause_mode"] == "in_place" and info["server_state"] == "draining"
        assert (await http.get("/health")).status == 503       # paused, but draining: not healthy
        assert (await rt.control(ContinueGeneration())).ok          # a draining server may continue
        out = await (await gen).json()
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert (await drained).ok
        st = await (await http.get("/is_paused")).json()
        assert st == {"is_paused": False, "mode": None, "server_state": "draining"}
        assert not (await rt.control(PauseGeneration("retract"))).ok   # not while draining


async def test_a_probe_retracted_by_a_pause_goes_back_to_the_probe_lane():
    rt, engine, rec, _ = await make_runtime(batch=BatchConfig(max_num_seqs=2))
    probe = rt.generate([9, 8], SamplingParams(max_new_tokens=30, ignore_eos=True), is_probe=True)
    first = rt.generate([1, 2], SamplingParams(max_new_tokens=30, ignore_eos=True))
    sched = actor_of(rt, "scheduler")
    # both admitted (a step runs per few loop turns): checked every turn
    await until(lambda: len(sched.running) >= 2, poll=0, what="both running")
    assert {s.rid for s in sched.running} == {probe.rid, first.rid}
    assert (await rt.control(PauseGeneration("retract"))).ok     # at the next step boundary
    await rt.quiesce()
    assert [s.rid for s in sched.probe_lane] == [probe.rid]      # not behind the business traffic
    assert [s.rid for s in sched.lane] == [first.rid]
    late = rt.generate([3, 4], SamplingParams(max_new_tokens=2, ignore_eos=True))
    await rt.quiesce()
    assert [s.rid for s in sched.lane] == [first.rid, late.rid]
    assert (await rt.control(ContinueGeneration())).ok
    for h in (probe, first, late):
        assert (await h.stream.final()).finish_reason == "length"
    await rt.quiesce()
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


def _ev(seq: int, event: str, src: str | None, dst: str | None, kind: str = "server") -> Event:
    return Event(seq, seq, kind, kind, event, src, dst, True, None, None, None, None)


def test_a_recording_with_the_servers_old_paused_states_still_checks():
    old = [_ev(1, "create", None, "starting"), _ev(2, "ready", "starting", "serving"),
           _ev(3, "pause_in_place", "serving", "paused_in_place"),
           _ev(4, "resume", "paused_in_place", "serving"),
           _ev(5, "pause_retract", "serving", "paused_retract"),
           _ev(6, "drain", "paused_retract", "draining"), _ev(7, "stop", "draining", "stopped")]
    assert check(old).ok
    broken = old[:5] + [_ev(6, "ready", "paused_retract", "serving")]   # still a divergence
    assert [v.kind for v in check(broken).violations] == ["divergence"]


def test_a_recording_with_isolation_as_a_self_loop_still_checks():
    old = [_ev(1, "create", None, "idle", "scheduler"), _ev(2, "admit", "idle", "pending", "scheduler"),
           _ev(3, "step", "pending", "stepping", "scheduler"),
           _ev(4, "isolate", "stepping", "stepping", "scheduler"),
           _ev(5, "defer_pause", "stepping", "pausing", "scheduler"),
           _ev(6, "isolate", "pausing", "pausing", "scheduler"),
           _ev(7, "step_done", "pausing", "pending", "scheduler")]
    assert check(old).ok


def test_a_recording_with_the_old_retracted_state_still_checks():
    def g(seq, event, src, dst):
        return Event(seq, seq, "r1", "generation", event, src, dst, True, None, None, None, None)
    old = [g(1, "create", None, "queued"), g(2, "schedule", "queued", "prefill"),
           g(3, "retract", "prefill", "retracted"), g(4, "requeue", "retracted", "queued"),
           g(5, "schedule", "queued", "prefill"), g(6, "first_token", "prefill", "decode"),
           g(7, "finish", "decode", "detok"), g(8, "deliver", "detok", "done")]
    assert check(old).ok


def test_the_queues_part_keeps_lanes_and_frees_an_inflight_member_after_its_step():
    from actorserve.actors.queues import Queues
    from actorserve.engine.scheduling.block_manager import BlockManager
    from actorserve.engine.scheduling.lane import Lane
    from actorserve.engine.scheduling.sequence import Sequence
    from actorserve.messages import AbortRequest as Abort

    bm, released = BlockManager(8, 4), []
    q = Queues(bm, Lane(), released.append)
    seqs = {rid: Sequence(rid, [1, 2, 3, 4, 5], is_probe=rid.startswith("p")) for rid in ("a", "p1", "b", "p2")}
    for s in seqs.values():
        q.add(s, None)
        q.enqueue(s)
    assert [s.order for s in seqs.values()] == [1, 2, 3, 4]
    assert [s.rid for s in q.probe_lane] == ["p1", "p2"] and [s.rid for s in q.lane] == ["a", "b"]
    for s in seqs.values():              # all admitted and running
        q.lane.discard(s) or q.probe_lane.discard(s)
        assert bm.allocate(s, 5)
        q.running.append(s)
    q.start([(seqs["a"], 5), (seqs["p1"], 5)])
    q.requeue([seqs["p1"], seqs["b"], seqs["p2"]])     # retracted, in that order
    for rid in ("p1", "b", "p2"):
        q.running.remove(seqs[rid])
    assert [s.rid for s in q.probe_lane] == ["p1", "p2"] and [s.rid for s in q.lane] == ["b"]
    assert bm.num_available == 0
    assert q.remove("a")[0] is seqs["a"] and released == [] and bm.num_available == 0   # in flight
    assert q.matches(Abort("p", prefix=True)) == ["p1", "p2"] and q.matches(Abort("")) == []
    q.step_over([(seqs["a"], 5), (seqs["p1"], 5)])     # the step is back: a's blocks go now
    assert released == [seqs["a"]] and q.inflight == {} and q.remove("a") is None
    assert bm.num_available == 2
    assert q.remove("b")[0] is seqs["b"] and released[-1] is seqs["b"] and bm.num_available == 4   # at once


def test_re_execution_compares_an_old_recording_as_todays_machines_name_it():
    from actorserve.replay.reexec import ReexecReport, compare

    def g(seq, event, src, dst, kind="generation", rid="r1"):
        return Event(seq, seq, rid, kind, event, src, dst, True, None, None, None, None)
    old = [g(1, "ready", "starting", "serving", "server", "server"),
           g(2, "pause_retract", "serving", "paused_retract", "server", "server"),
           g(3, "retract", "decode", "retracted"), g(4, "requeue", "retracted", "queued"),
           g(5, "resume", "paused_retract", "serving", "server", "server"),
           g(6, "schedule", "queued", "prefill")]
    new = [g(1, "ready", "starting", "serving", "server", "server"),
           g(2, "retract", "decode", "queued"), g(3, "schedule", "queued", "prefill")]
    assert compare(old, new, ReexecReport()).transition_diffs == []
    changed = new[:2] + [g(3, "abort", "queued", "aborted")]
    assert [d.rid for d in compare(old, changed, ReexecReport()).transition_diffs] == ["r1"]
