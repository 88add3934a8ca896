"""The `PauseControl` part alone: it acts on a scheduler only through its `PauseHooks`."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from actorserve.actors.pause_control import PauseControl, PauseHooks
from actorserve.messages import Paused, Resumed, Retracted
from actorserve.statemachines import PAUSED_MODE, SCHEDULER, STEP_IN_FLIGHT, Subject


class Fake:
    """A scheduler as the part sees it: a SCHEDULER subject, a running list, what it was told."""

    def __init__(self, running=(), state="pending"):
        self.model = Subject(SCHEDULER.state_named(state), "sched")
        self.running = list(running)
        self.told, self.freed, self.requeued, self.fired, self.replies = [], [], [], [], []
        self.seqs = set(s.rid for s in self.running)
        self.drain_steps = 0

    def hooks(self, loop):
        def fire(event):
            self.fired.append(event)
            SCHEDULER.fire(self.model, event)

        def drain_step():
            if not self.running:
                return False
            self.drain_steps += 1
            fire("drain_step")
            return True

        return PauseHooks(
            can=lambda e: SCHEDULER.can(self.model.state, e), fire=fire,
            paused_mode=lambda: PAUSED_MODE.get(self.model.state),
            in_flight=lambda: self.model.state in STEP_IN_FLIGHT,
            idle=lambda: not self.seqs and self.model.state not in STEP_IN_FLIGHT,
            running=self.running, requeue=self.requeued.extend, free_kv=self.freed.append,
            flush_kv=lambda: 7, abort_all=lambda: 0, tell=lambda rid, m: self.told.append(m),
            close_window=lambda: None, drain_step=drain_step, settle=lambda: None,
            future=loop.create_future, reply=lambda fut, v: (self.replies.append(v), fut.set_result(v)))


def seq(rid, pooling=None):
    return SimpleNamespace(rid=rid, pooling=pooling, prefill_complete=True)


async def test_retract_frees_and_requeues_the_running_and_counts_them():
    f = Fake([seq("a"), seq("b")])
    pc = PauseControl()
    h = f.hooks(asyncio.get_running_loop())
    res = pc.pause("retract", h)
    assert res.ok and res.detail == {"mode": "retract", "affected": 2}
    assert f.model.state.name == "paused_retract" and f.fired == ["pause_retract"]
    assert [s.rid for s in f.freed] == [s.rid for s in f.requeued] == ["a", "b"] and f.running == []
    assert [type(m) for m in f.told] == [Retracted, Retracted] and pc.retractions == 2
    assert not pc.pause("abort", h).ok                      # already paused
    assert pc.flush(h).ok                                   # paused retract: nothing holds KV
    assert pc.resume(h).detail == {"was": "retract"} and f.model.state.name == "pending"


async def test_a_pause_mid_step_waits_for_the_boundary_and_continue_cancels_it():
    f = Fake([seq("a"), seq("p", pooling=object())], state="stepping")
    pc = PauseControl()
    h = f.hooks(asyncio.get_running_loop())
    fut = pc.pause("in_place", h)
    assert isinstance(fut, asyncio.Future) and not fut.done() and f.model.state.name == "pausing"
    assert not pc.pause("abort", h).ok                      # one pending pause at a time
    assert not pc.flush(h).ok                               # busy: a step in flight, KV held
    SCHEDULER.fire(f.model, "step_done")
    pc.step_over(h)
    assert fut.result().ok and f.model.state.name == "paused_in_place"
    assert [type(m) for m in f.told] == [Paused]            # the pooling forward is just not stepped
    assert pc.resume(h).ok and [type(m) for m in f.told] == [Paused, Resumed]
    # a pause cancelled by continue before its step is over
    SCHEDULER.fire(f.model, "step")
    fut = pc.pause("abort", h)
    res = pc.resume(h)
    assert res.ok and "cancelled" in res.message and not fut.result().ok
    assert f.model.state.name == "stepping" and pc.pending is None


async def test_a_wait_pause_drains_the_running_then_pauses_and_idle_waiters_hear_it():
    f = Fake([seq("a")])
    pc = PauseControl()
    h = f.hooks(asyncio.get_running_loop())
    fut = pc.pause("wait", h)
    assert f.drain_steps == 1 and f.model.state.name == "pausing" and not fut.done()
    idle = pc.when_idle(h)
    assert isinstance(idle, asyncio.Future)
    f.running.clear()
    f.seqs.clear()                                        # the drain step finished the request
    SCHEDULER.fire(f.model, "step_done")
    pc.step_over(h)
    assert fut.result().detail == {"mode": "retract", "affected": 0, "asked": "wait"}
    pc.check_idle(h)
    assert idle.result() is True and pc.when_idle(h) is True
    assert pc.flush(h).detail == {"freed_blocks": 7}


async def test_teardown_answers_a_pending_pause_and_idle_waiters():
    f = Fake([seq("a")], state="stepping")
    pc = PauseControl()
    h = f.hooks(asyncio.get_running_loop())
    fut, idle = pc.pause("abort", h), pc.when_idle(h)
    pc.teardown("server shutting down", h)
    assert fut.result().message == "server shutting down" and idle.result() is False
    assert pc.pending is None and pc.idle_waiters == []
