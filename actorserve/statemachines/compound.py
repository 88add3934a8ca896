"""The compound "live" state of a lifecycle, found in its transition table.

Most lifecycles let every live state end the same way: generation's ``abort`` and ``fail``
leave each of its six live states, the scheduler's ``stop`` each of its eight, the server's
``drain`` all its states but ``draining``. Drawn one arrow per source, that is a fan of
parallel edges that crosses everything else. UML and XState draw such an event once, from a
composite state enclosing the states it leaves. This module finds that composite in the data,
so every exporter (Mermaid, DOT, both SVG layouts) draws the same one, and a lifecycle added
later gets one without being named here.

The rule, applied to the table alone:

* a *candidate* is the source set of an edge that leaves at least 3 states and covers the
  live (non-terminal) states but at most a quarter of them (at most one for fewer than 8);
* an edge is *drawn from the group* when its sources include the whole set, its destination is
  outside it, and nothing leads back from that destination into the set (a group edge is then
  never part of a cycle, which keeps both layouts simple);
* the candidate that saves the most drawn edges wins (ties: the larger set, then table order).

The group is named ``live`` (``live_`` ... if a state has that name). Sources of a group edge
that lie outside the set are still drawn one by one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .core import Lifecycle

__all__ = ["Group", "Row", "drawn_rows", "live_group"]


@dataclass(frozen=True, slots=True)
class Group:
    """A compound state: its name and its member states, in the states Enum's order."""

    name: str
    members: tuple[str, ...]

    def __contains__(self, state: object) -> bool:
        return state in self.members


@dataclass(frozen=True, slots=True)
class Row:
    """One drawn transition: ``src`` is a state name, or the group's name when `grouped`."""

    src: str
    event: str
    dest: str
    condition: str | None = None
    grouped: bool = False

    @property
    def label(self) -> str:
        return f"{self.event} [{self.condition}]" if self.condition else self.event


def _reaches(lc: Lifecycle, start: enum.Enum, targets: frozenset) -> bool:
    """Whether any state of `targets` can be reached from `start` along the table's edges."""
    seen, todo = {start}, [start]
    while todo:
        s = todo.pop()
        if s in targets:
            return True
        for e in lc.edges:
            if s in e.sources and e.dest not in seen:
                seen.add(e.dest)
                todo.append(e.dest)
    return False


def _grouped(lc: Lifecycle, members: frozenset) -> list[int]:
    """Indexes of the edges drawn from a group of `members`."""
    return [i for i, e in enumerate(lc.edges)
            if members <= set(e.sources) and e.dest not in members
            and not _reaches(lc, e.dest, members)]


def live_group(lc: Lifecycle) -> Group | None:
    """The compound state to draw for `lc`, or None when no event fans out of most states
    (a group holds the initial state: it is where an instance lives, not where it ended)."""
    live = [s for s in lc.states if s not in lc.terminal]
    need = max(3, len(live) - max(1, len(live) // 4))
    best: tuple | None = None
    seen: set[frozenset] = set()
    for order, edge in enumerate(lc.edges):
        members = frozenset(edge.sources)
        if members in seen or len(members) < need or not members <= set(live) or lc.initial not in members:
            continue
        seen.add(members)
        rows = _grouped(lc, members)
        if not rows:
            continue
        key = (len(rows) * (len(members) - 1), len(members), -order)
        if best is None or key > best[0]:
            best = (key, members)
    if best is None:
        return None
    name = "live"
    while name in lc.states.__members__:
        name += "_"
    return Group(name, tuple(s.name for s in lc.states if s in best[1]))


def drawn_rows(lc: Lifecycle, group: Group | None = None) -> list[Row]:
    """The transitions to draw, in table order: one per (source, event, dest), except that an
    edge drawn from the group is one row from the group (plus one per source outside it)."""
    if group is None:
        return [Row(s.name, e.event, e.dest.name, e.condition)
                for e in lc.edges for s in e.sources]
    members = frozenset(lc.states[m] for m in group.members)
    from_group = set(_grouped(lc, members))
    out: list[Row] = []
    for i, e in enumerate(lc.edges):
        if i in from_group:
            out.append(Row(group.name, e.event, e.dest.name, e.condition, grouped=True))
            out += [Row(s.name, e.event, e.dest.name, e.condition)
                    for s in e.sources if s not in members]
        else:
            out += [Row(s.name, e.event, e.dest.name, e.condition) for s in e.sources]
    return out
