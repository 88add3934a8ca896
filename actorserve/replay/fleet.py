"""One recording across replicas: load several, put them on one clock, check across them.

A fleet runs N replicas, each a process with its own runtime and flight recorder writing its
own file (``actorserve serve --record DIR --replica-id ID`` writes ``DIR/ID.jsonl``). Each
file's header names its replica and holds a clock anchor (`recorder.FlightRecorder.header`):
one reading of the event clock (``t_ns``, monotonic, private to the process) and one of the
wall clock (``wall_ns``), taken together.

*The merge rule.* An event's time on the common clock is
``wall_ns + (event.t_ns - anchor.t_ns)``: its own monotonic offset from the anchor, placed at
the anchor's wall time. A file with no anchor (made before anchors existed) is placed so that
its first event is at the fleet's start, and the report says so. `merged` interleaves the
replicas' events by common time with a k-way merge, which never reorders one file's events
(so each replica's causal order is kept even where two of its events share a time); ties
across replicas go to the replica listed first.

*Checks across replicas.* `cross_check` reports what no single file can show:

* ``rid-on-two-replicas``  one request id accepted (a ``generate`` or ``pool`` input) by two
                           replicas: a client or router reused an id, or a retry went to
                           another replica while the first still held it;
* ``session-moved``        one session id used on two replicas (opened, closed, joined by a
                           request, or its lifecycle): its KV and its turns live on one replica,
                           so a session that moved lost them.

Each replica's own invariants are `check.check`'s, run on that replica's events alone.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import socket
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from .check import Report, check
from .recorder import Event, read_all_parts

__all__ = ["CrossViolation", "Replica", "check_each", "cross_check", "load_replicas", "merged",
           "on_common_clock", "recording_files", "recording_path", "sessions_of"]


def recording_path(record: str | None, replica: str | None) -> tuple[str | None, str | None]:
    """(file, replica id) for ``--record`` and ``--replica-id``: a directory (one that exists,
    or a path ending in a separator) means ``DIR/<replica id>.jsonl``, the id defaulting to
    ``<host>-<pid>``; a file is used as it is, with the id given (or none)."""
    if record is None:
        return None, replica
    if os.path.isdir(record) or record.endswith(("/", os.sep)):
        replica = replica or f"{socket.gethostname()}-{os.getpid()}"
        if os.sep in replica or "/" in replica or replica in (".", ".."):
            raise ValueError(f"--replica-id {replica!r} cannot name a file in {record}")
        return os.path.join(record, f"{replica}.jsonl"), replica
    return record, replica


def recording_files(paths: Iterable[str]) -> list[str]:
    """The recordings named: files as given, and each directory's ``*.jsonl`` (not their
    rotated parts ``*.jsonl.N``, which `read_all_parts` joins), sorted by name."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(os.path.join(p, f) for f in os.listdir(p)
                          if f.endswith(".jsonl") and os.path.isfile(os.path.join(p, f)))
        else:
            out.append(p)
    return out


@dataclass
class Replica:
    """One replica's recording: its id, its file, its header and events, and the offset that
    puts its event times on the common clock (``common = t_ns + offset``)."""

    name: str
    path: str
    header: dict[str, Any]
    events: list[Event]
    offset: int = 0
    anchored: bool = True

    def common(self, t_ns: int) -> int:
        return t_ns + self.offset


def load_replicas(paths: Iterable[str]) -> list[Replica]:
    """Read every recording (rotated parts joined) and place each on the common clock.
    A replica's id is its header's ``replica``, else its file name without ``.jsonl``; two
    files naming the same replica are told apart by their file names. Raises `ValueError`
    when a file cannot be read as a recording."""
    reps: list[Replica] = []
    for path in recording_files(paths):
        header, events = read_all_parts(path)
        base = os.path.basename(path)
        name = str(header.get("replica") or (base[:-6] if base.endswith(".jsonl") else base))
        anchor = header.get("clock") or {}
        if "t_ns" in anchor and "wall_ns" in anchor:
            reps.append(Replica(name, path, header, events, int(anchor["wall_ns"]) - int(anchor["t_ns"])))
        else:
            reps.append(Replica(name, path, header, events, 0, anchored=False))
    names = [r.name for r in reps]
    for r in reps:
        if names.count(r.name) > 1:
            r.name = f"{r.name} ({os.path.basename(r.path)})"
    anchored = [r.common(r.events[0].t_ns) for r in reps if r.anchored and r.events]
    start = min(anchored, default=0)
    for r in reps:                     # no anchor: its first event at the fleet's start
        if not r.anchored:
            r.offset = start - (r.events[0].t_ns if r.events else 0)
    return reps


def merged(reps: list[Replica]) -> Iterator[tuple[int, int, Event]]:
    """(common time, replica index, event) for every event of every replica, ordered by
    common time; one replica's events keep their file order (the module docstring)."""
    def stream(i: int, r: Replica) -> Iterator[tuple[int, int, Event]]:
        return ((r.offset + e.t_ns, i, e) for e in r.events)

    return heapq.merge(*(stream(i, r) for i, r in enumerate(reps)), key=lambda x: (x[0], x[1]))


def on_common_clock(reps: list[Replica]) -> list[list[Event]]:
    """Each replica's events with ``t_ns`` on the common clock, measured from the fleet's
    first event (so the numbers stay small)."""
    firsts = [r.common(r.events[0].t_ns) for r in reps if r.events]
    t0 = min(firsts, default=0)
    return [[dataclasses.replace(e, t_ns=r.common(e.t_ns) - t0) for e in r.events] for r in reps]


@dataclass(frozen=True, slots=True)
class CrossViolation:
    kind: str                           # rid-on-two-replicas | session-moved
    key: str                            # the request or session id
    where: tuple[tuple[str, int], ...]  # (replica, seq of its first use there), per replica
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.key, "detail": self.detail,
                "where": [{"replica": r, "seq": s} for r, s in self.where]}


def sessions_of(events: Iterable[Event]) -> dict[str, int]:
    """session id -> seq of the first event that used it: its lifecycle (``session:ID``), an
    open/close control request, a session input, a request that joined it."""
    out: dict[str, int] = {}
    for e in events:
        sid = None
        if e.kind == "session" and e.rid and e.rid.startswith("session:"):
            sid = e.rid[len("session:"):]
        elif e.kind == "input" and e.data:
            if e.event == "generate":
                sid = e.data.get("session")
            elif e.event in ("session", "control") and isinstance(e.data.get("args"), dict):
                sid = e.data["args"].get("session_id")
        if sid and sid not in out:
            out[str(sid)] = e.seq
    return out


def _accepted(events: Iterable[Event]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        if e.kind == "input" and e.event in ("generate", "pool") and e.rid and e.rid not in out:
            out[e.rid] = e.seq
    return out


def _shared(reps: list[Replica], per: list[dict[str, int]], kind: str, what: str) -> list[CrossViolation]:
    holders: dict[str, list[tuple[str, int]]] = {}
    for r, ids in zip(reps, per):
        for key, seq in ids.items():
            holders.setdefault(key, []).append((r.name, seq))
    return [CrossViolation(kind, key, tuple(w), f"{what} {key!r} on "
                           + ", ".join(f"{n} (seq {s})" for n, s in w))
            for key, w in holders.items() if len(w) > 1]


def cross_check(reps: list[Replica]) -> list[CrossViolation]:
    """The checks across replicas (the module docstring), in the order the ids first show."""
    return (_shared(reps, [_accepted(r.events) for r in reps], "rid-on-two-replicas", "request")
            + _shared(reps, [sessions_of(r.events) for r in reps], "session-moved", "session"))

def check_each(reps: list[Replica], *, require_terminal: bool = True) -> list[Report]:
    """`check.check` per replica, open recordings allowed (as for one file)."""
    return [check(r.events, require_terminal=require_terminal, allow_open=True) for r in reps]
