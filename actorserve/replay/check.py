"""Invariants over a recording, and re-driving recorded histories through today's machines.

`check(events)` walks the events once and reports `Violation`s, each with the seq where it
shows:

* ``no-terminal``     an accepted request (a ``create`` event) never reached a terminal state;
* ``two-terminals``   a request reached a terminal state twice;
* ``after-terminal``  a transition was attempted after the terminal state;
* ``illegal``         a refused transition (the runtime tried an event its state does not allow);
* ``divergence``      today's definition refuses a transition the recording says was allowed
                      (the first one per request), or lands in another state.

Kinds that are not request lifecycles (server, session) are checked for legality only.

*Open recordings.* A server writes its recording as it runs, and a clean shutdown leaves its
mark at the end: the runtime records a ``shutdown`` input, drains and stops the server
(``server ... -> stopped``) and aborts what is left. A recording made by a server (it holds
the runtime's inputs or the server's transitions) with neither of those marks is *open*: the
server is still running, or it died without shutting down. Its requests still live at the end
are then in flight, not broken: `check(..., allow_open=True)` lists them in
`Report.in_flight` instead of reporting ``no-terminal``, and checks everything else (the
requests that ended, every transition) as usual. A closed recording that leaves a request
live is a real ``no-terminal``. Events with no sign of a server (a hand-made list, an old
ring buffer) are judged as closed.

*The end marker.* A recorder that writes one (`recorder.ended_in_order`) settles the question
from the file instead: `check(..., ended=True)` is closed, ``ended=False`` is open, whatever
the events say (a server killed while shutting down is not closed). A *cut* recording
(``cut=True``: open, and its process is known to be gone, since a later incarnation of the
replica took its path) lists the requests live at its end in `Report.lost`, lost with the
process, never as violations; everything before the cut is checked as usual, as a kill can
only truncate the end.

*Renamed states (a note for old recordings).* Until issue 31 the server's machine had its own
copy of the pause: ``serving -> paused_<mode>`` (``pause_<mode>``), ``paused_<mode> -> serving``
(``resume``), and ``drain`` from a paused state. Pause now lives in the scheduler's machine only
and the server stays ``serving`` (or ``draining``) while its scheduler is paused. A recording
from before is read through `legacy`: those server pause/resume transitions are skipped (the
same recording holds the scheduler's, which carry the pause) and a server ``paused_<mode>`` is
read as ``serving``. Its failed steps' isolations were a self-loop (``isolate``, ``stepping ->
stepping``); they are the ``isolating`` state now (left by ``isolated``), and an old self-loop
is skipped. A generation request's ``retract`` went to ``retracted`` and, in the same turn,
``requeue`` took it to ``queued``; ``retract`` goes to ``queued`` now (the state was never
observable), so an old ``retract`` is read as leading to ``queued`` and its ``requeue`` is
skipped.

Until issue 31 a control record had one in-between state, ``waiting`` (``wait``); its progress
is states now (``asking``, ``waiting_idle``, ``working``, ``probing``: `statemachines.lifecycles`).
An old ``wait`` is skipped and a transition out of ``waiting`` is read as leaving ``received``,
so an old record checks as ``received -> applied | rejected``. An old record does not say which
of today's states it passed through, so re-execution compares an old recording's control
records by their outcome (`old_control`, `control_outcomes`) and says so in its report.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from ..statemachines import LIFECYCLES, LifecycleError, Subject
from .recorder import Event

REQUEST_KINDS = ("generation", "pooling", "control")


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    rid: str | None
    seq: int
    detail: str


@dataclass(frozen=True, slots=True)
class InFlight:
    """A request still live when the recording ends: its state and since when (ns)."""

    kind: str
    rid: str | None
    state: str
    since_ns: int


@dataclass(slots=True)
class Report:
    requests: Counter
    terminal: Counter
    violations: list[Violation]
    open: bool = False                  # no clean shutdown at the end (see the module doc)
    in_flight: list[InFlight] = field(default_factory=list)
    last_ns: int | None = None          # time of the last event
    cut: bool = False                   # open, and its process was killed (module doc)
    lost: list[InFlight] = field(default_factory=list)   # live at the cut: lost with the process

    @property
    def ok(self) -> bool:
        return not self.violations


def recording_is_open(events: Iterable[Event]) -> bool:
    """Whether a server made these events (its inputs or its transitions are in them) and
    they do not end with a clean shutdown (no ``shutdown`` input, the server never stopped)."""
    by_server = closed = False
    for ev in events:
        if ev.kind == "input" or ev.kind == "server":
            by_server = True
        if (ev.kind == "input" and ev.event == "shutdown") or (
                ev.kind == "server" and ev.ok and ev.dst == "stopped"):
            closed = True
    return by_server and not closed


_OLD_SERVER_PAUSED = ("paused_abort", "paused_retract", "paused_in_place")


#: the control machine's events before issue 31 (``wait``: received -> waiting)
_OLD_CONTROL_EVENTS = frozenset({"create", "apply", "reject", "wait"})
OLD_CONTROL_NOTE = ("control records recorded under the control machine before issue 31 (received -> "
                    "[waiting ->] applied | rejected) are compared by their outcome; today's records "
                    "also pass through asking, waiting_idle, working or probing")


def old_control(events: Iterable[Event]) -> bool:
    """Whether the recording's control records were made by the control machine before issue 31:
    it has control records, and none of them uses an event that machine did not have."""
    seen = False
    for ev in events:
        if ev.kind == "control":
            if ev.event not in _OLD_CONTROL_EVENTS:
                return False
            seen = True
    return seen


def control_outcomes(history: list[tuple[int, tuple]]) -> list[tuple[int, tuple]]:
    """A control record's history as its creation and its end (where it landed, and whether the
    transition was allowed): what an old recording and today's re-execution can both say."""
    return [(seq, (event if event == "create" else "end", None, dst, ok))
            for seq, (event, src, dst, ok) in history if event == "create" or dst in ("applied", "rejected")]


def legacy(ev: Event) -> Event | None:
    """An event of a recording made before a rename, as today's machines name it (None: it has
    no counterpart today and is skipped). See the module docstring."""
    if ev.kind == "control" and (ev.event == "wait" or ev.src == "waiting"):
        return None if ev.event == "wait" else dataclasses.replace(ev, src="received")
    if ev.kind == "scheduler" and ev.event == "isolate" and ev.src == ev.dst:
        return None
    if ev.kind == "generation" and (ev.src == "retracted" or ev.dst == "retracted"):
        return None if ev.event == "requeue" else dataclasses.replace(ev, dst="queued")
    if ev.kind != "server" or not (ev.src in _OLD_SERVER_PAUSED or ev.dst in _OLD_SERVER_PAUSED):
        return ev
    if ev.event.startswith("pause_") or ev.event == "resume":
        return None
    return dataclasses.replace(ev, src="serving" if ev.src in _OLD_SERVER_PAUSED else ev.src,
                               dst="serving" if ev.dst in _OLD_SERVER_PAUSED else ev.dst)


class _Track:
    __slots__ = ("subject", "terminal_seq", "diverged", "accepted", "kind", "since")

    def __init__(self, subject: Subject, kind: str, accepted: bool, since: int) -> None:
        self.subject = subject
        self.kind = kind
        self.accepted = accepted
        self.terminal_seq: int | None = None
        self.diverged = False
        self.since = since


def check(events: Iterable[Event], *, require_terminal: bool = True,
          allow_open: bool = False, ended: bool | None = None, cut: bool = False) -> Report:
    """Check the invariants (module docstring). With `allow_open`, an open recording's live
    requests are reported in flight rather than as ``no-terminal`` violations. `ended`: the
    file's end marker says it closed in order (True) or not (False); None: judge by the
    events. With `cut`, an open recording's live requests are lost with the process."""
    events = list(events)
    is_open = recording_is_open(events) if ended is None else not ended
    cut = cut and is_open
    tracks: dict[tuple[str, str | None], _Track] = {}
    viol: list[Violation] = []
    requests: Counter = Counter()
    terminal: Counter = Counter()
    for ev in events:
        lc = LIFECYCLES.get(ev.kind)
        if lc is None or (ev := legacy(ev)) is None:   # type: ignore[assignment]
            continue
        key = (ev.kind, ev.rid)
        if ev.event == "create":
            init = lc.state_named(ev.dst) if ev.dst else lc.initial
            tracks[key] = _Track(Subject(init, ev.rid), ev.kind, True, ev.t_ns)
            requests[ev.kind] += 1
            continue
        tr = tracks.get(key)
        if tr is None:  # the recording starts mid-life (ring buffer) or a singleton (server)
            tr = tracks[key] = _Track(Subject(lc.state_named(ev.src) if ev.src else lc.initial, ev.rid),
                                      ev.kind, False, ev.t_ns)
        if not ev.ok:
            viol.append(Violation("illegal", ev.rid, ev.seq, str(ev.error)))
            continue
        if tr.terminal_seq is not None:
            again = ev.dst is not None and lc.is_terminal(lc.state_named(ev.dst))
            viol.append(Violation("two-terminals" if again else "after-terminal", ev.rid, ev.seq,
                                  f"{ev.kind}: {ev.event} after terminal state (seq {tr.terminal_seq})"))
            continue
        subj = tr.subject
        if ev.dst is not None and ev.dst != ev.src:
            tr.since = ev.t_ns
        if not tr.diverged:
            if subj.state.name != ev.src:
                tr.diverged = True
                viol.append(Violation("divergence", ev.rid, ev.seq,
                                      f"{ev.kind}: recorded source {ev.src} but replay is in {subj.state.name}"))
            else:
                # Conditions (resume's, step_done's) are re-derived from the recorded destination:
                # a row's condition held iff that row leads where the recording went.
                for edge in lc.edges:
                    if edge.condition and edge.event == ev.event and subj.state in edge.sources:
                        setattr(subj, edge.condition, edge.dest.name == ev.dst)
                try:
                    lc.fire(subj, ev.event)
                except LifecycleError as exc:
                    tr.diverged = True
                    viol.append(Violation("divergence", ev.rid, ev.seq, f"{ev.kind}: {exc}"))
                else:
                    if subj.state.name != ev.dst:
                        tr.diverged = True
                        viol.append(Violation("divergence", ev.rid, ev.seq,
                                              f"{ev.kind}: {ev.event} now leads to {subj.state.name}, "
                                              f"recorded {ev.dst}"))
        dst = lc.state_named(ev.dst) if ev.dst else None
        if dst is not None and lc.is_terminal(dst):
            tr.terminal_seq = ev.seq
            if tr.accepted:
                terminal[(ev.kind, ev.dst)] += 1
            if tr.diverged:
                subj.state = dst
    in_flight = [InFlight(kind, rid, tr.subject.state.name, tr.since)
                 for (kind, rid), tr in tracks.items()
                 if tr.accepted and kind in REQUEST_KINDS and tr.terminal_seq is None]
    lost = in_flight if cut else []
    if cut:
        in_flight = []
    elif require_terminal and not (is_open and allow_open):
        for f in in_flight:
            viol.append(Violation("no-terminal", f.rid, -1, f"{f.kind}: ended in {f.state}"))
    viol.sort(key=lambda v: (v.seq if v.seq >= 0 else 1 << 62))
    return Report(requests, terminal, viol, is_open, in_flight,
                  events[-1].t_ns if events else None, cut, lost)


def stale_definitions(header: dict) -> list[str]:
    """The lifecycles a recording's header names whose definition is not today's (gone, or
    another definition hash): one line each, empty when all match."""
    out = []
    for name, d in (header.get("lifecycles") or {}).items():
        lc = LIFECYCLES.get(name)
        if lc is None:
            out.append(f"{name}: no longer defined")
        elif d.get("hash") != lc.definition_hash:
            out.append(f"{name}: recorded under definition {d.get('hash')}, today's is {lc.definition_hash}")
    return out
