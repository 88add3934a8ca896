"""Diagram exporters for `Lifecycle` tables: Mermaid, Graphviz DOT, SVG and a Markdown page.

Every exporter is a pure function of the lifecycle's data (states, initial, terminal,
edges) plus an optional *highlight*, so the pictures are generated from the same tables
the runtime fires and cannot drift from them. No I/O happens here; `diagram_cli` writes.

Conventions shared by the three graph formats:

* one drawn transition per (source, event, dest), in table order, so the output is
  deterministic; a conditional row is labelled ``event [condition]``;
* an event that leaves (nearly) every live state is drawn once, from a compound ``live``
  state enclosing those states (`statemachines.compound` finds it in the table): a Mermaid
  composite ``state live { ... }``, a DOT cluster with ``ltail`` edges, an SVG rounded box;
* the initial state gets an entry arrow, terminal states an exit (Mermaid ``--> [*]``)
  or a double border (DOT ``peripheries=2``, SVG double rectangle), and line up on the right.

A *highlight* (`statemachines.highlight`) is one request's path: visited states, edge counts,
the current state and a refused event, drawn in blue and red.

The SVG is written by `statemachines.svg` from a layout: Graphviz's ``dot`` when asked for
and installed, else the pure-Python layered layout (`statemachines.layout`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .compound import Group, Row, drawn_rows, live_group
from .core import Lifecycle
from .highlight import (
    CURRENT_STROKE, FAILED, VISITED_FILL, VISITED_STROKE, EdgeKey, Highlight, normalize_highlight,
)
from .svg import to_svg

__all__ = ["Highlight", "normalize_highlight", "to_mermaid", "to_dot", "to_svg", "to_markdown",
           "VISITED_FILL"]


def _group_rows(lc: Lifecycle) -> tuple[Group | None, list[Row]]:
    group = live_group(lc)
    return group, drawn_rows(lc, group)


def _count(hl: Highlight, group: Group | None, r: Row) -> int:
    sources = group.members if r.grouped and group is not None else (r.src,)
    return sum(hl.edge_count(s, r.event, r.dest) for s in sources)


def _failed(hl: Highlight, group: Group | None, r: Row) -> bool:
    if hl.failed_edge is None or hl.failed_edge[1:] != (r.event, r.dest):
        return False
    src = hl.failed_edge[0]
    return src in group.members if r.grouped and group is not None else src == r.src


def _extra_failed(hl: Highlight | None, group: Group | None, rows: list[Row]) -> EdgeKey | None:
    """The failed edge when it must be drawn in addition to the table's edges."""
    if hl is None or hl.failed_edge is None:
        return None
    if hl.failed_edge[2] is not None and any(_failed(hl, group, r) for r in rows):
        return None
    return hl.failed_edge


# -- Mermaid -----------------------------------------------------------------------------

_MERMAID_RESERVED = frozenset({"state", "note", "direction", "class", "classDef", "style",
                               "end", "as", "left", "right", "of", "click", "linkStyle"})


def _mid(name: str) -> str:
    """A Mermaid-safe id for a state name (aliased only when it would not parse)."""
    return f"s_{name}" if name in _MERMAID_RESERVED or not name.isidentifier() else name


def to_mermaid(lc: Lifecycle, highlight: Any = None) -> str:
    """A Mermaid ``stateDiagram-v2`` of `lc` (optionally highlighted); ends with a newline.

    With a compound state (`statemachines.compound`) the members and the transitions among
    them go in a ``state live { ... }`` block (its own ``[*]`` entry when it holds the initial
    state); everything that crosses its border is written after the block, so no outer state
    is ever named inside it (Mermaid would move it in)."""
    hl = normalize_highlight(lc, highlight)
    group, rows = _group_rows(lc)
    members = set(group.members) if group is not None else set()
    out = ["stateDiagram-v2", "    direction LR"]
    inner: list[str] = []

    def lines_for(s: str) -> list[str]:
        return inner if s in members else out

    for s in lc.states:
        if _mid(s.name) != s.name:
            lines_for(s.name).append(f'    state "{s.name}" as {_mid(s.name)}')
    if group is not None:
        inner[:0] = [f"    {_mid(m)}" for m in group.members if _mid(m) == m]
    entry = _mid(group.name) if lc.initial.name in members else _mid(lc.initial.name)
    out.append(f"    [*] --> {entry}")
    if lc.initial.name in members:
        inner.append(f"    [*] --> {_mid(lc.initial.name)}")
    after: list[str] = []
    for r in rows:
        label = r.label
        if hl is not None:
            if n := _count(hl, group, r):
                label += f" ×{n}"
            if _failed(hl, group, r):
                label += " (rejected)"
        line = f"    {_mid(r.src)} --> {_mid(r.dest)}: {label}"
        (inner if r.src in members and r.dest in members else after).append(line)
    for s in lc.states:
        if s in lc.terminal:
            after.append(f"    {_mid(s.name)} --> [*]")
    extra = _extra_failed(hl, group, rows)
    stub = None
    if extra is not None:
        src, event, dest = extra
        if dest is None:
            stub = "rejected_" + "".join(c if c.isalnum() else "_" for c in event)
            while stub in lc.states.__members__ or (group is not None and stub == group.name):
                stub += "_"
            after.append(f'    state "✗ {event}" as {stub}')
            dest = stub
        line = f"    {_mid(src)} --> {_mid(dest)}: {event} (rejected)"
        (inner if src in members and dest in members else after).append(line)
    if hl is not None:
        for s, n in hl.visited.items():
            if n:
                (inner if s in members else after).append(f"    {_mid(s)} : visited ×{n}")
    if group is not None:
        out.append(f"    state {_mid(group.name)} {{")
        out += ["    " + line for line in inner]
        out.append("    }")
    out += after
    if hl is None:
        return "\n".join(out) + "\n"
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
    """A Graphviz ``digraph`` of `lc` (optionally highlighted); ends with a newline.

    The compound state is a cluster; an edge drawn from it leaves one member (the one laid
    out furthest right) with ``ltail``, so Graphviz clips it at the cluster's border."""
    from .graphviz_layout import exit_member

    hl = normalize_highlight(lc, highlight)
    group, rows = _group_rows(lc)
    members = set(group.members) if group is not None else set()
    font = _q("Helvetica")
    out = [
        f"digraph {_q(lc.name)} {{",
        "    rankdir=LR;",
        *(["    compound=true;", "    newrank=true;"] if group is not None else []),
        f"    graph [fontname={font}, label={_q(lc.name)}, labelloc=t];",
        f"    node [shape=box, style={_q('rounded')}, fontname={font}];",
        f"    edge [fontname={font}, fontsize=10];",
    ]
    start = f"    {_q('__start')} [shape=point, width=0.15, label={_q('')}];"
    node_lines: dict[str, str] = {}
    for s in lc.states:
        attrs: dict[str, Any] = {}
        if s in lc.terminal:
            attrs["peripheries"] = 2
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
        node_lines[s.name] = f"{_q(s.name)}" + (f" {_attrs(**attrs)}" if attrs else "") + ";"
    if group is not None:
        out.append(f"    subgraph {_q('cluster_' + group.name)} {{")
        out.append(f"        label={_q(group.name)}; labeljust=l; style={_q('rounded')}; "
                   f"color={_q('#94a3b8')};")
        if lc.initial.name in members:
            out.append("    " + start)
        out += [f"        {node_lines[m]}" for m in group.members]
        out.append("    }")
    if lc.initial.name not in members:
        out.append(start)
    out.append(f"    {_q('__start')} -> {_q(lc.initial.name)};")
    out += [f"    {node_lines[s.name]}" for s in lc.states if s.name not in members]
    sinks = [s.name for s in lc.states if s in lc.terminal]
    if group is not None and len(sinks) > 1:
        out.append("    { rank=same; " + " ".join(f"{_q(s)};" for s in sinks) + " }")
    tail = exit_member(lc, group) if group is not None else None
    for r in rows:
        label = r.label
        style: dict[str, Any] = {}
        if hl is not None:
            if n := _count(hl, group, r):
                label += f" ×{n}"
                style = {"color": _q(VISITED_STROKE), "penwidth": 2}
            if _failed(hl, group, r):
                label += " (rejected)"
                style = {"color": _q(FAILED), "fontcolor": _q(FAILED), "penwidth": 2}
        if r.grouped and group is not None:
            style["ltail"] = _q("cluster_" + group.name)
            src = tail
        else:
            src = r.src
        out.append(f"    {_q(src)} -> {_q(r.dest)} {_attrs(label=_q(label), **style)};")
    extra = _extra_failed(hl, group, rows)
    if extra is not None:
        src, event, dest = extra
        if dest is None:
            dest = "__rejected"
            out.append(f"    {_q(dest)} [shape=plaintext, label={_q('✗')}, "
                       f"fontcolor={_q(FAILED)}];")
        out.append(f"    {_q(src)} -> {_q(dest)} [label={_q(event + ' (rejected)')}, "
                   f"color={_q(FAILED)}, fontcolor={_q(FAILED)}, style=dashed];")
    out.append("}")
    return "\n".join(out) + "\n"


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
