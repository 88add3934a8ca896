"""Soak check of deterministic re-execution: many chaos runs, each recorded and re-executed.

Runs the chaos workload of `tests/test_reexec.py` (1,000 requests: generation, pooling with a
batching window, disconnects, abort_request, pauses in all three modes, flushes with timeouts,
health probes, session turns, a watchdog) for `--seeds` seeds, with model steps inline and in a
worker thread, and re-executes each recording. Prints one JSON line: runs, how many
reproduced every step's batch and every transition with zero drift, and the seeds that did not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_reexec import chaos  # noqa: E402

from actorserve.replay.recorder import read_recording  # noqa: E402
from actorserve.replay.reexec import reexecute  # noqa: E402


async def one(seed: int, in_thread: bool, n: int) -> tuple[bool, int, int]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "run.jsonl")
        await chaos(path, seed=seed, in_thread=in_thread, n=n)
        _, events = read_recording(path)
    report = await reexecute(events)
    return report.ok, report.drift, len(events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--first-seed", type=int, default=100)
    ap.add_argument("--requests", type=int, default=1000)
    args = ap.parse_args()
    logging.disable(logging.ERROR)
    runs, exact, events, failed = 0, 0, 0, []
    t0 = time.perf_counter()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for in_thread in (False, True):
            ok, drift, n = asyncio.run(one(seed, in_thread, args.requests))
            runs += 1
            events += n
            if ok and drift == 0:
                exact += 1
            else:
                failed.append([seed, in_thread])
    print(json.dumps({"runs": runs, "requests_per_run": args.requests, "reproduced_exactly": exact,
                      "events": events, "failed": failed, "wall_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
