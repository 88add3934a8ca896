"""Helpers to build a runtime over the fake engine with a manual clock and a recorder."""

from __future__ import annotations

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES
from actor_access import actor_of, live_actors


async def make_runtime(*, in_thread: bool = False, batch: BatchConfig | None = None, **engine_kw):
    clock = ManualClock()
    rec = FlightRecorder(clock=clock, capacity=1_000_000, lifecycles=LIFECYCLES.values())
    engine = FakeEngine(**engine_kw)
    rt = Runtime(engine, config=SchedulerConfig(batch=batch or BatchConfig(), step_in_thread=in_thread),
                 clock=clock, recorder=rec)
    await rt.start()
    return rt, engine, rec, clock


def assert_nothing_held(rt: Runtime) -> None:
    """No request actor, queue entry, mailbox message or KV block is left behind."""
    st = rt.stats()
    assert (st.waiting, st.running, st.live_requests, st.step_in_flight) == (0, 0, 0, False), st
    assert st.kv_used_blocks == 0, st
    actor_of(rt, "scheduler").bm.check()
    assert live_actors(rt) == []
    for actor in rt.system.actors.values():
        assert actor.statistics().current_size == 0, actor
    assert not actor_of(rt, "scheduler").inflight and not actor_of(rt, "scheduler")._free_after_step
    assert actor_of(rt, "scheduler").state.name in ("idle", "paused_abort", "paused_retract", "paused_in_place"), \
        actor_of(rt, "scheduler").state
    assert actor_of(rt, "output").tracked == {}, actor_of(rt, "output").tracked       # the output stage let go of every request
    assert actor_of(rt, "control").open == {}, actor_of(rt, "control").open
    assert rt.system.busy == 0
