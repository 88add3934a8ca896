"""A request's path through a lifecycle, as the diagram exporters take it.

A highlight describes one request's path::

    {"current": "decode", "visited": {"queued": 1, "prefill": 3},
     "edges": {("queued", "schedule", "prefill"): 1},
     "failed_edge": ("paused", "finish", None)}

States may be given by name or as enum members; `normalize_highlight` turns any of these
forms into a `Highlight` of state names (and checks that every name is a state). Visited
states are filled light blue and show their visit count, the current state gets a bold
border, traversed edges are blue with their count, and the failed edge is red; a failed edge
with ``dest=None`` (an event that was refused) is drawn as a red dashed stub.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .core import Lifecycle

__all__ = ["EdgeKey", "Highlight", "normalize_highlight",
           "VISITED_FILL", "VISITED_STROKE", "CURRENT_STROKE", "FAILED"]

EdgeKey = tuple[str, str, "str | None"]

VISITED_FILL = "#dbeafe"
VISITED_STROKE = "#2563eb"
CURRENT_STROKE = "#1d4ed8"
FAILED = "#dc2626"


@dataclass(frozen=True)
class Highlight:
    """A request's path, normalised to state names (see the module docstring)."""

    current: str | None = None
    visited: Mapping[str, int] = field(default_factory=dict)
    edges: Mapping[EdgeKey, int] = field(default_factory=dict)
    failed_edge: EdgeKey | None = None

    def edge_count(self, src: str, event: str, dest: str) -> int:
        return int(self.edges.get((src, event, dest), 0))

    def is_failed(self, src: str, event: str, dest: str | None) -> bool:
        return self.failed_edge == (src, event, dest)


def _name(lc: Lifecycle, state: Any, *, optional: bool = False) -> str | None:
    if state is None and optional:
        return None
    name = state.name if isinstance(state, enum.Enum) else str(state)
    if name not in lc.states.__members__:
        raise ValueError(f"{lc.name}: highlight names unknown state {name!r}")
    return name


def normalize_highlight(lc: Lifecycle, highlight: Any) -> Highlight | None:
    """Accept None, a `Highlight` or the dict form; return a `Highlight` of names."""
    if highlight is None or isinstance(highlight, Highlight):
        return highlight
    if not isinstance(highlight, Mapping):
        raise TypeError(f"highlight must be a mapping, not {type(highlight).__name__}")
    unknown = set(highlight) - {"current", "visited", "edges", "failed_edge"}
    if unknown:
        raise ValueError(f"unknown highlight keys: {', '.join(sorted(unknown))}")
    raw_visited = highlight.get("visited") or {}
    if not isinstance(raw_visited, Mapping):
        raw_visited = {s: 1 for s in raw_visited}
    visited = {_name(lc, s): int(n) for s, n in raw_visited.items()}
    edges: dict[EdgeKey, int] = {}
    for (src, event, dest), n in (highlight.get("edges") or {}).items():
        edges[(_name(lc, src), str(event), _name(lc, dest, optional=True))] = int(n)
    failed = highlight.get("failed_edge")
    if failed is not None:
        src, event, dest = failed
        failed = (_name(lc, src), str(event), _name(lc, dest, optional=True))
    current = highlight.get("current")
    return Highlight(
        current=_name(lc, current) if current is not None else None,
        visited=visited, edges=edges, failed_edge=failed,
    )
