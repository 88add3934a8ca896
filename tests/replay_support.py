"""Recordings for the replay picture tests, made by a real runtime over the fake engine.

The runtime runs on a manual clock (exact, nothing slept); the recorder gets its own
`TickClock`, which moves 50 µs per event, so every state visit has a real, known duration,
and `idle(seconds)` puts a long quiet gap in the recording the way a server that waits for
clients does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import ContinueGeneration, PauseGeneration
from actorserve.replay.recorder import FlightRecorder, read_recording
from actorserve.statemachines import GENERATION, LIFECYCLES, IllegalTransition

TICK_NS = 50_000


class TickClock:
    """A recorder clock: each reading is `TICK_NS` after the one before."""

    def __init__(self) -> None:
        self.t = 0

    def now_ns(self) -> int:
        self.t += TICK_NS
        return self.t

    def now(self) -> float:
        return self.t / 1e9

    def idle(self, seconds: float) -> None:
        self.t += int(seconds * 1e9)

    def call_later(self, delay, fn):  # pragma: no cover - the recorder sets no timers
        raise AssertionError("the recorder sets no timers")


async def _runtime(path: Path):
    clock, tick = ManualClock(), TickClock()
    rec = FlightRecorder(path=path, lifecycles=LIFECYCLES.values(), clock=tick)
    rt = Runtime(FakeEngine(), config=SchedulerConfig(batch=BatchConfig()), clock=clock,
                 recorder=rec)
    await rt.start()
    return rt, rec, tick


async def recorded_run(path: Path, *, gaps: bool = False):
    """Two bursts of requests (a pause in place in the first), one refused event, a clean
    shutdown. With `gaps`: 10 minutes idle between the bursts and 37 before the shutdown."""
    rt, rec, tick = await _runtime(path)
    rids = []
    for burst in range(2):
        if burst and gaps:
            await rt.quiesce()                 # the first burst fully delivered
            tick.idle(600)
        hs = [rt.generate([i + 1, i + 2, i + 3], SamplingParams(max_new_tokens=3 + i))
              for i in range(2 * burst, 2 * burst + 2)]
        if burst == 0:
            await rt.control(PauseGeneration("in_place"))
            await rt.control(ContinueGeneration())
        for h in hs:
            await h.stream.final()
        rids += [h.rid for h in hs]
    actor_like = type("A", (), {})()           # one refused event, on the record
    actor_like.state, actor_like.rid = GENERATION.initial, rids[0]
    with pytest.raises(IllegalTransition):
        GENERATION.fire(actor_like, "deliver", observer=rec)
    await rt.quiesce()
    if gaps:
        tick.idle(37 * 60)
    await rt.shutdown()
    return read_recording(path)[1], rids


async def open_run(path: Path):
    """A server still running: one request done, then a pause, and one request waiting
    behind it when the file is read (flushed, never shut down)."""
    rt, rec, tick = await _runtime(path)
    done = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
    await done.stream.final()
    await rt.control(PauseGeneration("in_place"))
    waiting = rt.generate([4, 5, 6], SamplingParams(max_new_tokens=3))
    await rt.quiesce()
    rec.flush()
    return rt, read_recording(path)[1], done.rid, waiting.rid
