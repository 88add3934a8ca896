"""A recording as a Chrome Trace Event Format file, for chrome://tracing and Perfetto.

``actorserve replay REC --format chrome-trace --out trace.json`` writes one JSON object::

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

* process 1, ``actorserve``: a track (tid) for the server, its health and each scheduler,
  a slice per state; and for each scheduler a ``… steps`` track with a slice per model step
  (from its ``step`` note to its ``step_end`` input), its batch in ``args``;
* process 2, ``requests``: one track per request (generation, pooling, control), in arrival
  order, a slice (``"ph": "X"``) per state visit, named by the state, with the request id,
  lifecycle, the events that entered and left it and whether it was still open at the end in
  ``args``; a terminal state is an instant (``"ph": "i"``) on the request's track;
* metadata events (``"ph": "M"``) name both processes and every track, and sort the tracks.

Timestamps are microseconds from the recording's first event (``ts``, ``dur``, floats with
nanosecond precision). A state visit still open when the recording ends (an open recording,
or the health region, which never ends) runs to its last event. Slices on one track never
overlap: a track is one lifecycle instance, which is in one state at a time.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..statemachines import LIFECYCLES
from .recorder import Event
from .timeline import steps_of

__all__ = ["to_chrome_trace"]

ACTORS = ("server", "health", "scheduler")
REQUESTS = ("generation", "pooling", "control")
RUNTIME_PID, REQUESTS_PID = 1, 2


def _us(ns: int) -> float:
    return round(ns / 1000, 3)


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


def to_chrome_trace(events: Iterable[Event], *, t0: int | None = None) -> dict[str, Any]:
    """The trace object (see the module docstring); `json.dump` it. `t0` (ns) is the time
    ``ts`` counts from, the first event's by default (a fleet's traces share one)."""
    evs = list(events)
    out: list[dict[str, Any]] = [
        _meta("process_name", RUNTIME_PID, 0, {"name": "actorserve"}),
        _meta("process_sort_index", RUNTIME_PID, 0, {"sort_index": 0}),
        _meta("process_name", REQUESTS_PID, 0, {"name": "requests"}),
        _meta("process_sort_index", REQUESTS_PID, 0, {"sort_index": 1}),
    ]
    if not evs:
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"events": 0}}
    t0, last = (evs[0].t_ns if t0 is None else t0), evs[-1].t_ns
    tracks: dict[tuple[str, str | None], dict[str, Any]] = {}
    next_tid = {RUNTIME_PID: 1, REQUESTS_PID: 1}

    def track(kind: str, rid: str | None, name: str) -> dict[str, Any]:
        key = (kind, rid)
        if key not in tracks:
            pid = RUNTIME_PID if kind in ACTORS or kind == "steps" else REQUESTS_PID
            tid = next_tid[pid]
            next_tid[pid] += 1
            tracks[key] = {"pid": pid, "tid": tid, "open": None}
            out.append(_meta("thread_name", pid, tid, {"name": name}))
            out.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
        return tracks[key]

    def close(tr: dict[str, Any], end: int, left_by: str | None) -> None:
        start, state, kind, rid, entered = tr["open"]
        args = {"rid": rid, "lifecycle": kind, "entered_by": entered}
        if left_by is None:
            args["open_at_end"] = True
        else:
            args["left_by"] = left_by
        out.append({"ph": "X", "name": state, "cat": kind, "pid": tr["pid"], "tid": tr["tid"],
                    "ts": _us(start - t0), "dur": _us(end - start), "args": args})
        tr["open"] = None

    for e in evs:
        if e.kind not in LIFECYCLES or not e.ok or e.dst is None:
            continue
        if e.kind not in ACTORS and e.kind not in REQUESTS:
            continue
        name = e.rid if e.kind in REQUESTS and e.rid else (
            f"scheduler {e.rid}" if e.kind == "scheduler" and e.rid not in (None, "scheduler")
            else e.kind)
        tr = track(e.kind, e.rid, f"{name} ({e.kind})" if e.kind in REQUESTS else str(name))
        if tr["open"] is not None:
            if tr["open"][1] == e.dst:
                continue                       # a self-loop: still the same visit
            close(tr, e.t_ns, e.event)
        lc = LIFECYCLES[e.kind]
        if lc.states[e.dst] in lc.terminal:
            out.append({"ph": "i", "s": "t", "name": e.dst, "cat": e.kind, "pid": tr["pid"],
                        "tid": tr["tid"], "ts": _us(e.t_ns - t0),
                        "args": {"rid": e.rid, "lifecycle": e.kind, "entered_by": e.event}})
        else:
            tr["open"] = (e.t_ns, e.dst, e.kind, e.rid, e.event)
    for tr in tracks.values():
        if tr["open"] is not None:
            close(tr, last, None)
    for s in steps_of(evs):
        tr = track("steps", s.sched, f"{s.sched} steps")
        end = s.end if s.end is not None else last
        args: dict[str, Any] = {"step": s.step, "batch_size": len(s.batch),
                                "tokens": sum(int(m[1]) for m in s.batch if len(m) > 1),
                                "batch": [list(m) for m in s.batch[:64]]}
        if s.end is None:
            args["open_at_end"] = True
        out.append({"ph": "X", "name": f"step {s.step}", "cat": "step", "pid": tr["pid"],
                    "tid": tr["tid"], "ts": _us(s.start - t0), "dur": _us(end - s.start),
                    "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"events": len(evs), "first_seq": evs[0].seq, "last_seq": evs[-1].seq}}
