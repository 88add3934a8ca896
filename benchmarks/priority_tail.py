"""What a high-priority request's TTFT is made of, from a `priority.py --record PATH` recording.

For each high-class request of the loaded phases (rids ``r1000`` ..., ``r3000`` ... with
``--rounds``), from the flight recording
(``create`` -> ``schedule`` -> ``first_token`` of the request, the scheduler's ``step`` notes and
``step_end`` inputs, both stamped on the event loop):

* ``inflight``: from its ``create`` to the end of the step that was running when it arrived
  (0 if the scheduler was idle);
* ``between``: from there to the start of the step it ran in (the loop's turnaround: the step's
  outputs to the stage and back, planning; more when it missed the next step);
* ``step``: that step's duration and width (its members, prompt tokens);
* ``out``: from that step's end to the request's ``first_token``.

    .venv/bin/python benchmarks/priority_tail.py /tmp/rec.jsonl [--prefix r1]

Prints the p50/p95 of each part, the scheduler's asks to give a step up and the steps given
up (``preempt_step``, ``step_end`` ``preempted``), and the slowest requests' rows; ``--json``
one JSON line.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))   # run from anywhere
from actorserve.replay.recorder import read_all_parts  # noqa: E402


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else float("nan")


def steps_of(events: list[Any]) -> list[dict[str, Any]]:
    """Every step: start, end (loop times, ns), members ``[[rid, tokens], ...]``."""
    steps: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.kind == "step" and e.event == "step" and e.data:
            steps[e.data["step"]] = {"start": e.t_ns, "end": None, "batch": e.data["batch"]}
        elif e.event == "step_end" and e.data and e.data.get("step") in steps:
            steps[e.data["step"]]["end"] = e.t_ns
    return sorted((s for s in steps.values() if s["end"] is not None), key=lambda s: s["start"])


def breakdown(events: list[Any], prefix: str) -> list[dict[str, Any]]:
    steps = steps_of(events)
    starts = [s["start"] for s in steps]
    marks: dict[str, dict[str, int]] = {}
    for e in events:
        if e.kind == "generation" and e.rid and e.rid.startswith(prefix) and e.event in (
                "create", "schedule", "first_token"):
            marks.setdefault(e.rid, {}).setdefault(e.event, e.t_ns)
    rows = []
    for rid, m in sorted(marks.items()):
        if len(m) < 3:
            continue
        c, f = m["create"], m["first_token"]
        # the step it ran in: the first whose batch holds it, started after its create
        k0 = bisect.bisect_left(starts, c)
        mine = next((s for s in steps[k0:] if any(r == rid for r, _ in s["batch"])), None)
        if mine is None:
            continue
        before = steps[k0 - 1] if k0 > 0 else None
        inflight = max(0, before["end"] - c) if before is not None and before["end"] > c else 0
        ms = 1e-6
        rows.append({"rid": rid, "ttft": (f - c) * ms, "inflight": inflight * ms,
                     "between": (mine["start"] - c - inflight) * ms,
                     "step": (mine["end"] - mine["start"]) * ms, "out": (f - mine["end"]) * ms,
                     "width": len(mine["batch"]), "tokens": sum(n for _, n in mine["batch"]),
                     "missed": sum(1 for s in steps[k0:] if s["start"] < mine["start"])})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recording")
    p.add_argument("--prefix", default="r", help="the rids to break down (default: every high-class rid)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    _, events = read_all_parts(args.recording)
    # the loaded phases' high class: r1000..., and with --rounds r3000..., r5000... (priority.py)
    rows = [r for r in breakdown(events, args.prefix)
            if r["rid"][1:].isdigit() and int(r["rid"][1:]) < 100_000 and (int(r["rid"][1:]) // 1000) % 2 == 1]
    steps = steps_of(events)
    dur = [(s["end"] - s["start"]) * 1e-6 for s in steps]
    gaps = [(b["start"] - a["end"]) * 1e-6 for a, b in zip(steps, steps[1:]) if b["start"] - a["end"] < 50e6]
    parts = ("ttft", "inflight", "between", "step", "out", "width", "missed")
    out = {f"{k}_p50": round(pct([r[k] for r in rows], 0.5), 2) for k in parts}
    out.update({f"{k}_p95": round(pct([r[k] for r in rows], 0.95), 2) for k in parts})
    out.update({"requests": len(rows), "steps": len(steps), "step_ms_p50": round(pct(dur, 0.5), 2),
                "step_ms_p95": round(pct(dur, 0.95), 2), "gap_ms_p50": round(pct(gaps, 0.5), 2),
                "gap_ms_p95": round(pct(gaps, 0.95), 2),
                # the scheduler's asks to give the step in flight up, and the steps given up
                "preempt_asks": sum(1 for e in events if e.kind == "scheduler" and e.event == "preempt_step"),
                "steps_given_up": sum(1 for e in events if e.event == "step_end" and (e.data or {}).get("preempted"))})
    if args.json:
        print(json.dumps(out))
        return 0
    print(json.dumps(out, indent=1))
    for r in sorted(rows, key=lambda r: -r["ttft"])[:8]:
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
