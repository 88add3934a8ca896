"""Pictures of a fleet's recordings: one timeline page, one trace, every replica on one clock.

* `to_fleet_html(reps)` — the replay page of `render.to_html`, with a lane group per replica
  (a header row, then that replica's server, health and scheduler lanes with their own steps,
  then its requests in arrival order), all on the common clock of `replay.fleet`. A request
  lane (and its diagram in the picker) is keyed ``REPLICA/RID``, so a request id that two
  replicas accepted draws two lanes, one in each group.
* `to_fleet_chrome_trace(reps)` — the Trace Event Format of `chrome_trace`, one process per
  replica (``pid`` 1, 2 … in the order given, named ``replica NAME``) holding its actor
  tracks then its request tracks; ``ts`` in microseconds from the fleet's first event.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .chrome_trace import RUNTIME_PID, to_chrome_trace
from .fleet import Replica, on_common_clock
from .recorder import Event
from .render import to_html
from .timeline import REQUEST_KINDS, Lane, Step, lanes_of, steps_of

__all__ = ["to_fleet_chrome_trace", "to_fleet_html"]

KEYED = (*REQUEST_KINDS, "control")     # lifecycles whose instances are keyed per replica


def _keyed(name: str, events: list[Event]) -> list[Event]:
    return [dataclasses.replace(e, rid=f"{name}/{e.rid}") if e.kind in KEYED and e.rid else e
            for e in events]


def to_fleet_html(reps: list[Replica], *, rid: str | None = None, title: str = "actorserve fleet",
                  status: str | None = None) -> str:
    """The fleet's page (module docstring); `rid` keeps that request's lanes, in every
    replica that has one."""
    lanes: list[Lane] = []
    steps: list[Step] = []
    evs: list[Event] = []
    for r, events in zip(reps, on_common_clock(reps)):
        keyed = _keyed(r.name, events)
        for ln in lanes_of(keyed):
            ln.group = r.name
            if ln.kind in REQUEST_KINDS:
                ln.label = ln.label[len(r.name) + 1:]
                if rid is not None and ln.label != rid:
                    continue
            lanes.append(ln)
        steps += [dataclasses.replace(s, group=r.name) for s in steps_of(events)]
        evs += keyed
    evs.sort(key=lambda e: e.t_ns)
    return to_html(evs, title=title, status=status, lanes=lanes, steps=steps)


def to_fleet_chrome_trace(reps: list[Replica]) -> dict[str, Any]:
    """The fleet's trace (module docstring); `json.dump` it."""
    out: list[dict[str, Any]] = []
    info = []
    for i, (r, events) in enumerate(zip(reps, on_common_clock(reps))):
        pid = i + 1
        part = to_chrome_trace(events, t0=0)["traceEvents"]
        shift = max((e["tid"] for e in part if e["pid"] == RUNTIME_PID), default=0)
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": f"replica {r.name}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": i}})
        for e in part:
            if e["ph"] == "M" and e["name"].startswith("process_"):
                continue
            tid = e["tid"] if e["pid"] == RUNTIME_PID else e["tid"] + shift
            e = {**e, "pid": pid, "tid": tid}
            if e["ph"] == "M" and e["name"] == "thread_sort_index":
                e["args"] = {"sort_index": tid}
            elif e["ph"] != "M":
                e["args"] = {**e.get("args", {}), "replica": r.name}
            out.append(e)
        info.append({"pid": pid, "replica": r.name, "path": r.path, "events": len(events),
                     "clock_anchor": r.anchored})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"replicas": info}}
