"""The trim at rest (`actors/rest.py`): the C heap's free pages go back to the OS once the
scheduler has been quiet for a whole interval, once per burst of work, on the step thread."""

from __future__ import annotations

import threading

import pytest

from actorserve.actors.rest import RestTrimmer

from http_support import load_tiny, serve, settle
from actor_access import actor_of


class FakeScheduler:
    def __init__(self) -> None:
        self.idle, self.steps_done = True, 0


class FakeSystem:
    async def call_on_step_thread(self, fn):
        return fn()


async def test_trims_once_per_quiet_burst_and_never_while_busy():
    sched, calls = FakeScheduler(), []
    t = RestTrimmer(sched, FakeSystem(), interval=1.0, trim=lambda: calls.append(1) or True)
    assert not await t.check() and not await t.check()      # nothing ever ran: nothing to give back
    sched.idle, sched.steps_done = False, 5                  # busy
    assert not await t.check()
    sched.idle = True                                        # idle, but steps ran since the last look
    assert not await t.check()
    assert await t.check() and calls == [1]                  # quiet for a whole interval: trim
    assert not await t.check() and not await t.check()       # once per burst
    sched.steps_done = 6                                     # a short burst, idle at both looks
    assert not await t.check()
    assert await t.check() and len(calls) == 2 and t.trims == 2
    with pytest.raises(ValueError):
        RestTrimmer(sched, FakeSystem(), interval=0)


async def test_trims_on_the_step_thread_of_a_real_runtime():
    threads = []
    async with serve(load_tiny()) as (http, rt):
        t = RestTrimmer(actor_of(rt, "scheduler"), rt.system, interval=1.0,
                        trim=lambda: threads.append(threading.current_thread().name) or True)
        assert not await t.check()
        r = await http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
        assert r.status == 200
        await settle(rt)
        assert not await t.check()            # the first look after work: steps moved
        assert await t.check()                # quiet since: trims
        assert threads == [threads[0]] and threads[0].startswith("actorserve-step")
        r = await http.post("/generate", json={"text": "again", "sampling_params": {"max_new_tokens": 4}})
        assert r.status == 200                # the server serves on after a trim
        from actorserve.engine.weights.memory_release import malloc_trim
        malloc_trim()                         # the real call is harmless (False without glibc)
