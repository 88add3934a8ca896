"""What the lifecycle machinery costs per request: actors + machines + recorder, nothing else.

Runs N generation requests (8-token prompt, 1 new token) through the real Runtime — request
actors, scheduler actor, batching policy, block manager, shared `transitions` machines, flight
recorder (ring buffer) — over the fake engine with steps run inline, and, in the same run, the
same transitions walked over a bare dict table (the floor). Prints one JSON line:

    us_per_request      wall time per request through the runtime
    floor_us_per_request  the bare dict-table loop
    bytes_per_request   memory held per in-flight request (actor, mailbox, sequence, machine
                        model), measured with tracemalloc after all N are submitted
    recorder_bytes_per_event  memory of one event in the ring buffer

Goal (issue 2): at most 50 us and 2 KB per request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
import tracemalloc

from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.batching import BatchConfig
from actorserve.engine.fake import FakeEngine
from actorserve.engine.params import SamplingParams
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
PATH = [("queued", "schedule"), ("prefill", "first_token"), ("decode", "finish"), ("detok", "deliver")]


def make_runtime(n: int) -> tuple[Runtime, FlightRecorder]:
    rec = FlightRecorder(capacity=max(100_000, 12 * n), lifecycles=LIFECYCLES.values())
    engine = FakeEngine(num_blocks=4 * n + 64, block_size=16, keep_history=False)
    cfg = SchedulerConfig(batch=BatchConfig(max_num_seqs=256, max_batch_tokens=8192), step_in_thread=False)
    return Runtime(engine, config=cfg, recorder=rec), rec


async def run_runtime(n: int) -> float:
    rt, rec = make_runtime(n)
    await rt.start()
    sp = SamplingParams(max_new_tokens=1)
    gc.collect()
    t0 = time.perf_counter()
    handles = [rt.generate(PROMPT, sp) for _ in range(n)]
    await rt.quiesce()
    dt = time.perf_counter() - t0
    assert all(h.stream.closed for h in handles) and rt.stats().live_requests == 0
    await rt.shutdown()
    return dt / n * 1e6


def run_floor(n: int) -> float:
    table = {(s, e): d for (s, e), d in zip(PATH, ["prefill", "decode", "detok", "done"])}
    t0 = time.perf_counter()
    for _ in range(n):
        req = {"state": "queued"}
        for _, event in PATH:
            req["state"] = table[(req["state"], event)]
    return (time.perf_counter() - t0) / n * 1e6


async def memory(n: int) -> tuple[float, float]:
    rt, rec = make_runtime(n)
    await rt.start()
    await rt.control_actor.ask(__import__("actorserve.messages", fromlist=["PauseGeneration"]).PauseGeneration("in_place"))
    sp = SamplingParams(max_new_tokens=1)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    handles = [rt.generate(PROMPT, sp) for _ in range(n)]
    await rt.quiesce()                      # submitted and queued, not yet scheduled
    held = tracemalloc.get_traced_memory()[0] - base
    ev_before = len(rec)
    base2 = tracemalloc.get_traced_memory()[0]
    for i in range(n):
        rec.note("bench", "probe", rid="r", data=None)
    ev_bytes = (tracemalloc.get_traced_memory()[0] - base2) / n
    tracemalloc.stop()
    del handles, ev_before
    await rt.shutdown()
    return held / n, ev_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = args.requests
    rt_us = [asyncio.run(run_runtime(n)) for _ in range(args.repeats)]
    floor_us = [run_floor(n) for _ in range(args.repeats)]
    bpr, bpe = asyncio.run(memory(n))
    out = {
        "requests": n,
        "us_per_request": round(statistics.median(rt_us), 2),
        "floor_us_per_request": round(statistics.median(floor_us), 3),
        "ratio_to_floor": round(statistics.median(rt_us) / statistics.median(floor_us), 1),
        "bytes_per_request": round(bpr),
        "recorder_bytes_per_event": round(bpe),
        "events_per_request": None,
        "goal": {"us_per_request": 50, "bytes_per_request": 2048},
    }
    rt, rec = make_runtime(100)

    async def count() -> float:
        await rt.start()
        before = len(rec)
        for _ in range(100):
            rt.generate(PROMPT, SamplingParams(max_new_tokens=1))
        await rt.quiesce()
        await rt.shutdown()
        return (len(rec) - before) / 100

    out["events_per_request"] = asyncio.run(count())
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
