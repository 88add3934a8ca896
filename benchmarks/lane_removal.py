"""Abort-all over n queued requests: the scheduler's `Lane` against a deque's linear `remove`.

The scheduler drops an aborted request from its waiting lane by identity; with a deque each
removal scans the queue up to the one it removes, with a `Lane` it is O(1). This removes n
queued sequences in arrival order (how abort-all visits them: the deque finds each at its head,
its best case), then in a random order (requests aborted one by one: disconnects, deadlines;
O(n²) for the deque), and prints one JSON line: seconds for each and the ratios deque / lane
(higher = the lane is faster), all measured in this run.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import deque

from actorserve.engine.scheduling.lane import Lane
from actorserve.engine.scheduling.sequence import Sequence


def timed(make, order) -> float:  # type: ignore[no-untyped-def]
    q = make()
    t0 = time.perf_counter()
    for s in order:
        if hasattr(q, "discard"):
            q.discard(s)
        else:
            q.remove(s)
    dt = time.perf_counter() - t0
    assert not q
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10_000, help="queued requests")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seqs = [Sequence(f"r{i}", [i]) for i in range(args.n)]
    shuffled = random.Random(0).sample(seqs, len(seqs))
    out: dict[str, float | int] = {"n": args.n}
    for name, order in (("fifo", seqs), ("random", shuffled)):
        d = timed(lambda: deque(seqs), order)
        lane = timed(lambda: Lane(seqs), order)
        out[f"{name}_deque_s"] = round(d, 4)
        out[f"{name}_lane_s"] = round(lane, 4)
        out[f"{name}_ratio"] = round(d / lane, 2)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
