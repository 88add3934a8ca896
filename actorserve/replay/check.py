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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
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


@dataclass(slots=True)
class Report:
    requests: Counter
    terminal: Counter
    violations: list[Violation]

    @property
    def ok(self) -> bool:
        return not self.violations


class _Track:
    __slots__ = ("subject", "terminal_seq", "diverged", "accepted", "kind")

    def __init__(self, subject: Subject, kind: str, accepted: bool) -> None:
        self.subject = subject
        self.kind = kind
        self.accepted = accepted
        self.terminal_seq: int | None = None
        self.diverged = False


def check(events: Iterable[Event], *, require_terminal: bool = True) -> Report:
    tracks: dict[tuple[str, str | None], _Track] = {}
    viol: list[Violation] = []
    requests: Counter = Counter()
    terminal: Counter = Counter()
    for ev in events:
        lc = LIFECYCLES.get(ev.kind)
        if lc is None:
            continue
        key = (ev.kind, ev.rid)
        if ev.event == "create":
            init = lc.state_named(ev.dst) if ev.dst else lc.initial
            tracks[key] = _Track(Subject(init, ev.rid), ev.kind, True)
            requests[ev.kind] += 1
            continue
        tr = tracks.get(key)
        if tr is None:  # the recording starts mid-life (ring buffer) or a singleton (server)
            tr = tracks[key] = _Track(Subject(lc.state_named(ev.src) if ev.src else lc.initial, ev.rid),
                                      ev.kind, False)
        if not ev.ok:
            viol.append(Violation("illegal", ev.rid, ev.seq, str(ev.error)))
            continue
        if tr.terminal_seq is not None:
            again = ev.dst is not None and lc.is_terminal(lc.state_named(ev.dst))
            viol.append(Violation("two-terminals" if again else "after-terminal", ev.rid, ev.seq,
                                  f"{ev.kind}: {ev.event} after terminal state (seq {tr.terminal_seq})"))
            continue
        subj = tr.subject
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
    if require_terminal:
        for (kind, rid), tr in tracks.items():
            if tr.accepted and kind in REQUEST_KINDS and tr.terminal_seq is None:
                viol.append(Violation("no-terminal", rid, -1, f"{kind}: ended in {tr.subject.state.name}"))
    viol.sort(key=lambda v: (v.seq if v.seq >= 0 else 1 << 62))
    return Report(requests, terminal, viol)
