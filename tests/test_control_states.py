"""A control record's progress is states of the CONTROL lifecycle (asking, waiting_idle,
working, probing), and old recordings (one ``waiting`` state) are read with a note."""

from __future__ import annotations

from actorserve.actors.runtime import Runtime
from actorserve.actors.clock import ManualClock
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import AbortRequest, Drain, PauseGeneration
from actorserve.replay.check import OLD_CONTROL_NOTE, check
from actorserve.replay.recorder import Event, FlightRecorder

from actor_access import actor_of
from actorserve.replay.reexec import ReexecReport, compare
from actorserve.statemachines import CONTROL, LIFECYCLES

from runtime_helpers import assert_nothing_held


async def _runtime_with_a_pool_scheduler():
    clock = ManualClock()
    rec = FlightRecorder(clock=clock, capacity=100_000, lifecycles=LIFECYCLES.values())
    rt = Runtime(FakeEngine(), config=SchedulerConfig(batch=BatchConfig(), step_in_thread=False),
                 clock=clock, recorder=rec,
                 pooling_engines={"embed": FakeEngine(num_blocks=64, block_size=4)})
    await rt.start()
    return rt, rec


def _path(rec, op):
    rid = [e.rid for e in rec.events(kind="control") if e.event == "create" and e.data["op"] == op][-1]
    return [(e.event, e.dst) for e in rec.events(rid=rid, kind="control")]


async def test_an_abort_asks_every_scheduler_and_ends_with_the_last_answer():
    rt, rec = await _runtime_with_a_pool_scheduler()
    h = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True))
    res = await rt.control(AbortRequest(rid=h.rid, reason="gone"))
    assert res.ok and res.detail["aborted"] == 1
    assert (await h.stream.final()).finish_reason == "abort"
    # two schedulers asked: the first answer is ``answered`` (one more expected), the second ends it
    assert _path(rec, "abort_request") == [("create", "received"), ("ask", "asking"),
                                           ("answered", "asking"), ("apply", "applied")]
    # a bad abort is refused where it arrives, nothing asked
    assert not (await rt.control(AbortRequest(reason="x"))).ok
    assert _path(rec, "abort_request") == [("create", "received"), ("reject", "rejected")]
    await rt.quiesce()
    assert_nothing_held(rt)
    assert check(rec.events()).ok
    await rt.shutdown()


async def test_a_drain_waits_for_each_scheduler_to_be_idle():
    rt, rec = await _runtime_with_a_pool_scheduler()
    assert (await rt.control(PauseGeneration("in_place"))).ok
    assert _path(rec, "pause_generation") == [("create", "received"), ("ask", "asking"), ("apply", "applied")]
    res = await rt.control(Drain("test"))
    assert res.ok
    assert _path(rec, "drain") == [("create", "received"), ("wait_idle", "waiting_idle"),
                                   ("answered", "waiting_idle"), ("apply", "applied")]
    assert actor_of(rt, "control").open == {}
    await rt.shutdown()


def _ev(seq, event, src, dst, kind="control", rid="ctl-1", data=None):
    return Event(seq, seq, rid, kind, event, src, dst, True, None, None, None, data)


def test_an_old_control_recording_checks_and_compares_by_outcome_with_a_note():
    old = [_ev(1, "create", None, "received", data={"op": "flush_cache"}),
           _ev(2, "wait", "received", "waiting"), _ev(3, "apply", "waiting", "applied"),
           _ev(4, "create", None, "received", rid="ctl-2", data={"op": "pause_generation"}),
           _ev(5, "apply", "received", "applied", rid="ctl-2")]
    report = check(old)
    assert report.ok, report.violations
    assert report.terminal[("control", "applied")] == 2
    new = [_ev(1, "create", None, "received"), _ev(2, "ask", "received", "asking"),
           _ev(3, "busy", "asking", "waiting_idle"), _ev(4, "retry", "waiting_idle", "asking"),
           _ev(5, "apply", "asking", "applied"),
           _ev(6, "create", None, "received", rid="ctl-2"), _ev(7, "ask", "received", "asking", rid="ctl-2"),
           _ev(8, "apply", "asking", "applied", rid="ctl-2")]
    same = compare(old, new, ReexecReport())
    assert same.transition_diffs == [] and same.notes == [OLD_CONTROL_NOTE]
    assert "note: control records recorded under" in same.format()
    # a different outcome still differs
    changed = new[:4] + [_ev(5, "time_out", "waiting_idle", "rejected")] + new[5:]
    diffs = compare(old, changed, ReexecReport()).transition_diffs
    assert [(d.rid, d.replayed[2]) for d in diffs] == [("ctl-1", "rejected")]
    # a recording of today's machine is compared transition by transition, with no note
    exact = compare(new, new[:1] + new[2:], ReexecReport())
    assert exact.notes == [] and [d.rid for d in exact.transition_diffs] == ["ctl-1"]


def test_every_live_control_state_can_end_and_is_reachable():
    live = [s for s in CONTROL.states if not CONTROL.is_terminal(s)]
    for s in live:
        assert CONTROL.can(s, "apply") and CONTROL.can(s, "reject"), s
    reached = {CONTROL.initial} | {e.dest for e in CONTROL.edges}
    assert reached == set(CONTROL.states)
