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

*Incarnations.* A replica restarted at the same path leaves its earlier recordings beside the
newest (``r0.prev-1.jsonl``, ``r0.prev-2.jsonl`` ... ``r0.jsonl``, `recorder.keep_earlier`).
Each is a `Replica` of its own (its own events, seq and clock anchor), listed oldest first and
named ``r0#1``, ``r0#2`` ... when the replica has several. An earlier one without an end
marker is *cut* (its process was killed): its requests live at the end are lost with the
process (`check.Report.lost`). A rid that a cut recording lost and that is accepted again
after the cut (its last event, common clock), by the restarted replica or another one, is
the router's retry, not ``rid-on-two-replicas``; one accepted elsewhere before the cut was
held twice and still is. A session used by an earlier incarnation and then by a later one of
the same replica is not ``session-moved``: it died with the process, it did not move.

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
from .recorder import Event, ended_in_order, incarnation_of, read_all_parts

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


def _order(path: str) -> tuple[str, float]:
    base, k = incarnation_of(path)
    return base, float("inf") if k is None else k


def recording_files(paths: Iterable[str]) -> list[str]:
    """The recordings named: files as given, and each directory's ``*.jsonl`` (not their
    rotated parts ``*.jsonl.N``, which `read_all_parts` joins), sorted by name, a replica's
    incarnations together, oldest first (``r0.prev-1.jsonl`` ... ``r0.jsonl``)."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted((os.path.join(p, f) for f in os.listdir(p)
                           if f.endswith(".jsonl") and os.path.isfile(os.path.join(p, f))), key=_order)
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
    replica: str = ""                   # the replica id (`name` tells its incarnations apart)
    ended: bool | None = None           # `recorder.ended_in_order` of its header
    earlier: bool = False               # an earlier incarnation: a later one took its path

    def common(self, t_ns: int) -> int:
        return t_ns + self.offset


def load_replicas(paths: Iterable[str]) -> list[Replica]:
    """Read every recording (rotated parts joined) and place each on the common clock.
    A replica's id is its header's ``replica``, else its file name without ``.jsonl``; two
    files naming the same replica are told apart by their file names, a replica's incarnations
    by ``#K`` (the module docstring). Raises `ValueError` when a file cannot be read as a
    recording."""
    reps: list[Replica] = []
    files = recording_files(paths)
    first: dict[str, int] = {}
    for i, p in enumerate(files):      # a replica's incarnations together, oldest first
        first.setdefault(incarnation_of(p)[0], i)
    files.sort(key=lambda p: (first[incarnation_of(p)[0]], _order(p)[1]))
    incs = [incarnation_of(p) for p in files]
    for path, (newest, k) in zip(files, incs):
        header, events = read_all_parts(path)
        base = os.path.basename(newest)
        rid = name = str(header.get("replica") or (base[:-6] if base.endswith(".jsonl") else base))
        mine = [j for b, j in incs if b == newest]
        if len(mine) > 1:
            name += f"#{k if k is not None else max(j or 0 for j in mine) + 1}"
        rep = Replica(name, path, header, events, replica=rid, ended=ended_in_order(header),
                      earlier=k is not None)
        anchor = header.get("clock") or {}
        if "t_ns" in anchor and "wall_ns" in anchor:
            rep.offset = int(anchor["wall_ns"]) - int(anchor["t_ns"])
        else:
            rep.anchored = False
        reps.append(rep)
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


def _accepted(events: Iterable[Event]) -> dict[str, Event]:
    out: dict[str, Event] = {}
    for e in events:
        if e.kind == "input" and e.event in ("generate", "pool") and e.rid and e.rid not in out:
            out[e.rid] = e
    return out


def _flag(kind: str, what: str, key: str, w: list[tuple[str, int]]) -> CrossViolation:
    return CrossViolation(kind, key, tuple(w), f"{what} {key!r} on "
                          + ", ".join(f"{n} (seq {s})" for n, s in w))


def _rids(reps: list[Replica], reports: list[Report]) -> list[CrossViolation]:
    """``rid-on-two-replicas``, a holder that lost the rid with its process before another
    accepted it excused (the router's retry)."""
    holders: dict[str, list[tuple[int, Event]]] = {}
    for i, r in enumerate(reps):
        for key, e in _accepted(r.events).items():
            holders.setdefault(key, []).append((i, e))
    lost = [{f.rid for f in rep.lost} for rep in reports]

    def retried(key: str, i: int, hs: list[tuple[int, Event]]) -> bool:
        r = reps[i]
        if not r.events or key not in lost[i]:
            return False
        cut_at = r.common(r.events[-1].t_ns)
        return any(j != i and reps[j].common(e.t_ns) >= cut_at for j, e in hs)

    out = []
    for key, hs in holders.items():
        if len(hs) > 1 and sum(not retried(key, i, hs) for i, _ in hs) > 1:
            out.append(_flag("rid-on-two-replicas", "request", key, [(reps[i].name, e.seq) for i, e in hs]))
    return out


def _sessions(reps: list[Replica]) -> list[CrossViolation]:
    """``session-moved``, an earlier incarnation's use excused when a later incarnation of the
    same replica uses it too (the session died with the process)."""
    holders: dict[str, list[tuple[int, int]]] = {}
    for i, r in enumerate(reps):
        for key, seq in sessions_of(r.events).items():
            holders.setdefault(key, []).append((i, seq))
    out = []
    for key, hs in holders.items():
        left = [i for i, _ in hs if not (reps[i].earlier and any(
            j > i and reps[j].replica == reps[i].replica for j, _ in hs))]
        if len(hs) > 1 and len(left) > 1:
            out.append(_flag("session-moved", "session", key, [(reps[i].name, s) for i, s in hs]))
    return out


def cross_check(reps: list[Replica], reports: list[Report] | None = None) -> list[CrossViolation]:
    """The checks across replicas (the module docstring), in the order the ids first show.
    `reports`: `check_each`'s, when already made (what each replica lost)."""
    if reports is None:
        reports = check_each(reps, require_terminal=False)
    return _rids(reps, reports) + _sessions(reps)


def check_each(reps: list[Replica], *, require_terminal: bool = True) -> list[Report]:
    """`check.check` per replica, open recordings allowed (as for one file), a cut one's
    live requests lost with its process."""
    return [check(r.events, require_terminal=require_terminal, allow_open=True, ended=r.ended,
                  cut=r.earlier) for r in reps]
