"""Chaos with hostile traffic: poison requests, overload, deadlines, aborts and pauses at once.

Over the fake engine (its `fault` raises when a poison token is in a step, as an overflow in
sampling would) with a manual clock and admission control. It must end with every accepted
request in exactly one terminal state, the poison ones failed alone, no KV block held, the
recording clean, and re-execution matching step for step.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Overloaded, Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import PoolingParams, SamplingParams
from actorserve.messages import AbortRequest, ContinueGeneration, PauseGeneration
from actorserve.replay.check import check
from actorserve.replay.reexec import reexecute
from actorserve.replay.recorder import FlightRecorder
from actorserve.replay.stats import abort_latencies_ms
from actorserve.statemachines import LIFECYCLES

from runtime_helpers import assert_nothing_held

POISON = 666


def poison_fault(batch):
    if any(POISON in seq.prompt_ids for seq, _ in batch):
        raise ValueError("Overflow when unpacking long long")


@pytest.mark.parametrize("seed", [3, 21])
async def test_poison_overload_deadlines_and_control_end_clean_and_reexecute(seed):
    rng = random.Random(seed)
    clock = ManualClock()
    rec = FlightRecorder(clock=clock, capacity=2_000_000, lifecycles=LIFECYCLES.values())
    cfg = SchedulerConfig(batch=BatchConfig(max_num_seqs=16, max_batch_tokens=128, max_prefill_chunk=16),
                          step_in_thread=False, max_queued_requests=24, pool_batch_wait_s=0.005)
    rt = Runtime(FakeEngine(num_blocks=256, block_size=4, keep_history=False, fault=poison_fault),
                 config=cfg, clock=clock, recorder=rec,
                 pooling_engines={"embed": FakeEngine(num_blocks=128, block_size=4, keep_history=False)})
    await rt.start()
    handles, pending, poison, shed = [], [], set(), 0
    for i in range(700):
        prompt = [rng.randrange(1, 999) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.04:
            prompt[rng.randrange(len(prompt))] = POISON
        deadline = rng.choice([None] * 6 + [0.003, 0.02])
        try:
            if rng.random() < 0.15:
                h = rt.pool([t for t in prompt if t != POISON] or [1], PoolingParams(), target="embed")
            else:
                h = rt.generate(prompt, SamplingParams(max_new_tokens=rng.randrange(1, 10), ignore_eos=True),
                                deadline_s=deadline)
                if POISON in prompt:
                    poison.add(h.rid)
            handles.append(h)
        except Overloaded:
            shed += 1
        r = rng.random()
        if r < 0.05 and handles:
            pending.append(rt.abort(rng.choice(handles).rid, "client went away"))
        elif r < 0.06:
            pending.append(rt.control(AbortRequest(rid=rng.choice(handles).rid[:3], prefix=True)))
        elif r < 0.08:
            pending.append(rt.control(PauseGeneration(rng.choice(["abort", "retract", "in_place"]))))
        elif r < 0.11:
            pending.append(rt.control(ContinueGeneration()))
        if i % 8 == 0:                  # let the runtime move now and then: the queue drains
            clock.advance(0.001)
            await rt.quiesce()
    for _ in range(3):
        await rt.control(ContinueGeneration())
        await rt.quiesce()
    for _ in range(2000):
        if all(h.stream.closed for h in handles) and all(p.done() for p in pending):
            break
        clock.advance(0.002)
        await rt.quiesce()
    else:
        raise AssertionError("requests or controls still open after 4 virtual seconds")
    await asyncio.gather(*pending)
    seen = Counter()
    for h in handles:
        out = await h.stream.final()
        seen[out.finish_reason] += 1
        if out.finish_reason == "error":
            assert h.rid in poison, (h.rid, out.error)          # only poison requests fail
            assert "model step failed" in out.error     # alone in its step, or found by isolation
    await rt.quiesce()
    assert shed > 0 and rt.shed == shed                          # overload was real
    assert seen["error"] > 0 and seen["timeout"] > 0 and seen["abort"] > 0 and seen["length"] > 0
    assert rt.stats().isolations > 0 and rt.stats().isolated_failures == seen["error"]
    report = check(rec.events())
    assert report.ok, report.violations[:5]
    assert sum(report.terminal.values()) == report.requests["generation"] + report.requests["pooling"] \
        + report.requests["control"]                             # exactly one terminal each
    assert_nothing_held(rt)
    # the clock moves 1 ms between the loop's quiesces: every abort is applied in the first one
    # after it arrived (latency 0 or 1 ms on this clock), none waits for a later step
    lat = abort_latencies_ms(rec.events())
    assert lat and set(lat) <= {0.0, 1.0}
    await rt.shutdown()
    rx = await reexecute(rec.events())
    assert rx.ok, rx.format()
    assert rx.drift == 0 and rx.fillers == 0
