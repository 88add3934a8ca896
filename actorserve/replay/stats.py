"""Latency figures from a recording: abort latency and time spent in each state.

Abort latency of a request is the time from the abort that reached it — the nearest earlier
`AbortRequest`/`Abort` message naming it (or naming no rid: abort_all, prefix) or a
`PauseGeneration` — to its `aborted` transition, i.e. the moment its stream was closed.
Time in state is measured between consecutive transitions of the same request.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from .recorder import Event

ABORTERS = ("AbortRequest", "Abort", "PauseGeneration")


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def _summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": round(_pct(values, 0.5), 3), "p99_ms": round(_pct(values, 0.99), 3),
            "max_ms": round(max(values), 3), "mean_ms": round(sum(values) / len(values), 3)}


def abort_latencies_ms(events: Iterable[Event]) -> list[float]:
    last_any: Event | None = None           # latest abort that names no single rid
    last_by_rid: dict[str, Event] = {}
    out = []
    for e in events:
        if e.kind == "message" and e.event in ABORTERS:
            if e.rid:
                last_by_rid[e.rid] = e
            else:
                last_any = e
        elif e.kind in ("generation", "pooling") and e.ok and e.dst == "aborted":
            cands = [c for c in (last_by_rid.get(e.rid or ""), last_any) if c is not None]
            if cands:
                start = max(cands, key=lambda c: c.seq)
                out.append((e.t_ns - start.t_ns) / 1e6)
    return out


def time_in_state_ms(events: Iterable[Event]) -> dict[str, dict[str, float]]:
    entered: dict[tuple[str, str], tuple[str, int]] = {}
    spans: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.kind not in ("generation", "pooling") or not e.ok or e.dst is None or e.rid is None:
            continue
        key = (e.kind, e.rid)
        prev = entered.get(key)
        if prev is not None and prev[0] == e.dst:
            continue  # a self-loop (a prefill chunk) stays in the same state
        if prev is not None:
            spans[f"{e.kind}.{prev[0]}"].append((e.t_ns - prev[1]) / 1e6)
        entered[key] = (e.dst, e.t_ns)
    return {k: _summary(v) for k, v in sorted(spans.items())}


def latency_report(events: list[Event]) -> dict[str, object]:
    aborts = abort_latencies_ms(events)
    return {"abort_latency": _summary(aborts) if aborts else None,
            "time_in_state": time_in_state_ms(events)}
