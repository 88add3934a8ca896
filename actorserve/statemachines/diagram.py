"""Diagram exporters for `Lifecycle` tables: Mermaid, Graphviz DOT, SVG and a Markdown page.

Every exporter is a pure function of the lifecycle's data (states, initial, terminal,
edges) plus an optional *highlight*, so the pictures are generated from the same tables
the runtime fires and cannot drift from them. No I/O happens here; `diagram_cli` writes.

Conventions shared by the three graph formats:

* one drawn transition per (source, event, dest), in table order, so the output is
  deterministic; a conditional row is labelled ``event [condition]``;
* the initial state gets an entry arrow, terminal states an exit (Mermaid ``--> [*]``)
  or a double border (DOT ``doublecircle``, SVG double rectangle).

A highlight describes one request's path through the lifecycle::

    {"current": "decode", "visited": {"queued": 1, "prefill": 3},
     "edges": {("queued", "schedule", "prefill"): 1},
     "failed_edge": ("paused", "finish", None)}

States may be given by name or as enum members. Visited states are filled light blue and
show their visit count, the current state gets a bold border, traversed edges are blue
with their count, and the failed edge is red; a failed edge with ``dest=None`` (an event
that was refused) is drawn as a red dashed stub labelled with the event.

The SVG layout itself lives in `statemachines.svg` (pure Python, no Graphviz needed).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .core import Lifecycle

__all__ = ["Highlight", "normalize_highlight", "to_mermaid", "to_dot", "to_svg", "to_markdown"]

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


def _rows(lc: Lifecycle) -> list[tuple[str, str, str, str | None]]:
    """(source, event, dest, condition) per drawn transition, in table order."""
    return [
        (src.name, e.event, e.dest.name, e.condition) for e in lc.edges for src in e.sources
    ]


def _label(event: str, condition: str | None) -> str:
    return f"{event} [{condition}]" if condition else event


def _extra_failed(lc: Lifecycle, hl: Highlight | None) -> EdgeKey | None:
    """The failed edge when it must be drawn in addition to the table's edges."""
    if hl is None or hl.failed_edge is None:
        return None
    src, event, dest = hl.failed_edge
    if dest is not None and any(r[:3] == (src, event, dest) for r in _rows(lc)):
        return None
    return hl.failed_edge


# -- Mermaid -----------------------------------------------------------------------------

_MERMAID_RESERVED = frozenset({"state", "note", "direction", "class", "classDef", "style",
                               "end", "as", "left", "right", "of", "click", "linkStyle"})


def _mid(name: str) -> str:
    """A Mermaid-safe id for a state name (aliased only when it would not parse)."""
    return f"s_{name}" if name in _MERMAID_RESERVED or not name.isidentifier() else name


def to_mermaid(lc: Lifecycle, highlight: Any = None) -> str:
    """A Mermaid ``stateDiagram-v2`` of `lc` (optionally highlighted); ends with a newline."""
    hl = normalize_highlight(lc, highlight)
    out = ["stateDiagram-v2", "    direction LR"]
    for s in lc.states:
        if _mid(s.name) != s.name:
            out.append(f'    state "{s.name}" as {_mid(s.name)}')
    out.append(f"    [*] --> {_mid(lc.initial.name)}")
    for src, event, dest, cond in _rows(lc):
        label = _label(event, cond)
        if hl is not None:
            if n := hl.edge_count(src, event, dest):
                label += f" ×{n}"
            if hl.is_failed(src, event, dest):
                label += " (rejected)"
        out.append(f"    {_mid(src)} --> {_mid(dest)}: {label}")
    for s in lc.states:
        if s in lc.terminal:
            out.append(f"    {_mid(s.name)} --> [*]")
    if hl is None:
        return "\n".join(out) + "\n"
    extra = _extra_failed(lc, hl)
    stub = None
    if extra is not None:
        src, event, dest = extra
        if dest is None:
            stub = "rejected_" + "".join(c if c.isalnum() else "_" for c in event)
            while stub in lc.states.__members__:
                stub += "_"
            out.append(f'    state "✗ {event}" as {stub}')
            dest = stub
        out.append(f"    {_mid(src)} --> {_mid(dest)}: {event} (rejected)")
    for s, n in hl.visited.items():
        if n:
            out.append(f"    {_mid(s)} : visited ×{n}")
    out.append(f"    classDef visited fill:{VISITED_FILL},stroke:{VISITED_STROKE}")
    out.append(f"    classDef current fill:{VISITED_FILL},stroke:{CURRENT_STROKE},stroke-width:3px")
    out.append(f"    classDef failed fill:#fee2e2,stroke:{FAILED},color:{FAILED}")
    for s in lc.states:
        if s.name == hl.current:
            out.append(f"    class {_mid(s.name)} current")
        elif s.name in hl.visited:
            out.append(f"    class {_mid(s.name)} visited")
    if stub is not None:
        out.append(f"    class {stub} failed")
    return "\n".join(out) + "\n"


# -- Graphviz DOT ------------------------------------------------------------------------

def _q(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**kw: Any) -> str:
    return "[" + ", ".join(f"{k}={v}" for k, v in kw.items()) + "]"


def to_dot(lc: Lifecycle, highlight: Any = None) -> str:
    """A Graphviz ``digraph`` of `lc` (optionally highlighted); ends with a newline."""
    hl = normalize_highlight(lc, highlight)
    font = _q("Helvetica")
    out = [
        f"digraph {_q(lc.name)} {{",
        "    rankdir=LR;",
        f"    graph [fontname={font}, label={_q(lc.name)}, labelloc=t];",
        f"    node [shape=box, style={_q('rounded')}, fontname={font}];",
        f"    edge [fontname={font}, fontsize=10];",
        f"    {_q('__start')} [shape=point, width=0.15, label={_q('')}];",
        f"    {_q('__start')} -> {_q(lc.initial.name)};",
    ]
    for s in lc.states:
        attrs: dict[str, Any] = {}
        if s in lc.terminal:
            attrs["shape"] = "doublecircle"
        if hl is not None:
            n = hl.visited.get(s.name)
            if n is not None or s.name == hl.current:
                attrs["style"] = _q("rounded,filled")
                attrs["fillcolor"] = _q(VISITED_FILL)
            if n:
                attrs["label"] = _q(f"{s.name}\n×{n}")
            if s.name == hl.current:
                attrs["penwidth"] = 3
                attrs["color"] = _q(CURRENT_STROKE)
        out.append(f"    {_q(s.name)}" + (f" {_attrs(**attrs)}" if attrs else "") + ";")
    for src, event, dest, cond in _rows(lc):
        attrs = {"label": _label(event, cond)}
        style: dict[str, Any] = {}
        if hl is not None:
            if n := hl.edge_count(src, event, dest):
                attrs["label"] += f" ×{n}"
                style = {"color": _q(VISITED_STROKE), "penwidth": 2}
            if hl.is_failed(src, event, dest):
                attrs["label"] += " (rejected)"
                style = {"color": _q(FAILED), "fontcolor": _q(FAILED), "penwidth": 2}
        out.append(f"    {_q(src)} -> {_q(dest)} "
                   f"{_attrs(label=_q(attrs['label']), **style)};")
    extra = _extra_failed(lc, hl)
    if extra is not None:
        src, event, dest = extra
        if dest is None:
            dest = "__rejected"
            out.append(f"    {_q(dest)} [shape=plaintext, label={_q('✗')}, fontcolor={_q(FAILED)}];")
        out.append(f"    {_q(src)} -> {_q(dest)} [label={_q(event + ' (rejected)')}, "
                   f"color={_q(FAILED)}, fontcolor={_q(FAILED)}, style=dashed];")
    out.append("}")
    return "\n".join(out) + "\n"


# -- SVG ---------------------------------------------------------------------------------

def to_svg(lc: Lifecycle, highlight: Any = None) -> str:
    """A self-contained SVG of `lc`, laid out in pure Python (see `statemachines.svg`)."""
    from .svg import render_svg

    return render_svg(lc, normalize_highlight(lc, highlight))


# -- Markdown ----------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(lcs: Iterable[Lifecycle] | Mapping[str, Lifecycle]) -> str:
    """The ``docs/lifecycles.md`` page: every lifecycle's doc, hash, diagram and table."""
    items = list(lcs.values()) if isinstance(lcs, Mapping) else list(lcs)
    out = [
        "# Lifecycles",
        "",
        "This page is generated by `actorserve diagram all --format markdown` (`make diagrams`) "
        "from the transition tables in `actorserve/statemachines/lifecycles.py`, the same "
        "tables the runtime fires; do not edit it by hand. Static SVG renderings are written "
        "by `actorserve diagram all --format svg --out docs/diagrams`. A conditional "
        "transition is labelled `event [condition]`: when several rows share an event and a "
        "source, the first whose condition holds wins.",
    ]
    for lc in items:
        out += ["", f"## {lc.name}", ""]
        if lc.doc:
            out += [lc.doc, ""]
        terminal = ", ".join(f"`{s.name}`" for s in lc.states if s in lc.terminal)
        out += [
            f"Definition hash: `{lc.definition_hash}`. Initial state: `{lc.initial.name}`; "
            f"terminal: {terminal}.",
            "",
            "```mermaid",
            to_mermaid(lc).rstrip("\n"),
            "```",
            "",
            "| event | from | to | condition |",
            "|---|---|---|---|",
        ]
        for e in lc.edges:
            sources = ", ".join(f"`{s.name}`" for s in e.sources)
            cond = f"`{_cell(e.condition)}`" if e.condition else ""
            out.append(f"| `{_cell(e.event)}` | {sources} | `{e.dest.name}` | {cond} |")
    return "\n".join(out) + "\n"
