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

The SVG layout is computed in `statemachines.svg` (pure Python, no Graphviz needed);
`to_svg` writes it down as markup.
"""

from __future__ import annotations

import enum
import html
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .core import Lifecycle
from .svg import (
    COLORS, FONT, LABEL_COLORS, LABEL_PX, LINE, LOOP_H, MARGIN, NODE_PX, STUB_H, Layout,
    lines_width,
)

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
            out.append(f"    {_q(dest)} [shape=plaintext, label={_q('✗')}, "
                       f"fontcolor={_q(FAILED)}];")
        out.append(f"    {_q(src)} -> {_q(dest)} [label={_q(event + ' (rejected)')}, "
                   f"color={_q(FAILED)}, fontcolor={_q(FAILED)}, style=dashed];")
    out.append("}")
    return "\n".join(out) + "\n"


# -- SVG ---------------------------------------------------------------------------------

_esc = html.escape    # quote=True: safe in text and in attribute values


def _label_svg(lines: list[str], cx: float, base: float, color: str) -> list[str]:
    """Label lines stacked upwards so the last baseline is at `base`, on a white backdrop."""
    w = lines_width(lines) + 4
    top = base - LINE * len(lines) + 2
    out = [f'<rect class="label-bg" x="{cx - w / 2:.1f}" y="{top:.1f}" width="{w:.1f}" '
           f'height="{LINE * len(lines) + 1:.1f}" fill="#ffffff" fill-opacity="0.85"/>']
    for i, t in enumerate(lines):
        y = base - LINE * (len(lines) - 1 - i)
        out.append(f'<text x="{cx:.1f}" y="{y:.1f}" text-anchor="middle" '
                   f'font-size="{LABEL_PX}" fill="{color}">{_esc(t)}</text>')
    return out


def to_svg(lc: Lifecycle, highlight: Any = None) -> str:
    """A self-contained SVG of `lc`, laid out in pure Python (see `statemachines.svg`)."""
    hl = normalize_highlight(lc, highlight)
    L = Layout(lc, hl)
    pid = "".join(c if c.isalnum() else "-" for c in lc.name)
    W, H = L.width_px, L.height
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W:.0f}" height="{H:.0f}" '
        f'viewBox="0 0 {W:.0f} {H:.0f}" font-family="{_esc(FONT)}" role="img" '
        f'aria-label="{_esc(lc.name)} lifecycle">',
        f"<title>{_esc(lc.name)} lifecycle</title>",
        "<defs>",
    ]
    for style, color in COLORS.items():
        out.append(f'<marker id="{pid}-arrow{"-" + style if style else ""}" viewBox="0 0 10 10" '
                   'refX="10" refY="5" markerWidth="9" markerHeight="9" '
                   f'markerUnits="userSpaceOnUse" orient="auto">'
                   f'<path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker>')
    out += ["</defs>", f'<rect width="{W:.0f}" height="{H:.0f}" fill="#ffffff"/>',
            f'<text x="{MARGIN}" y="{MARGIN + 8}" font-size="15" font-weight="bold" '
            f'fill="#0f172a">{_esc(lc.name)}</text>']

    def stroke(style: str) -> str:
        dash = ' stroke-dasharray="6 4"' if style == "fail" else ""
        width = 1.2 if not style else 2
        marker = f"{pid}-arrow" + (f"-{style}" if style else "")
        return (f'fill="none" stroke="{COLORS[style]}" stroke-width="{width}"{dash} '
                f'marker-end="url(#{marker})"')

    edges_svg, labels_svg = ['<g class="edges">'], ['<g class="labels">']
    for e in L.edges:
        d, label = L.path(e)
        attrs = f'data-source="{_esc(e.src)}" data-dest="{_esc(e.dst)}"'
        edges_svg.append(f'<g class="edge" {attrs}><path d="{d}" {stroke(e.style)}/></g>')
        if label is not None:
            cx, y, _ = label
            labels_svg += _label_svg(e.lines, cx, y - 4, LABEL_COLORS[e.style])
    for name, e in L.loops.items():
        x, y, w, h = L.box(name)
        cx = x + w / 2
        d = (f"M{cx - 9:.1f},{y:.1f} C{cx - 26:.1f},{y - LOOP_H:.1f} "
             f"{cx + 26:.1f},{y - LOOP_H:.1f} {cx + 9:.1f},{y:.1f}")
        edges_svg.append(f'<g class="edge self-loop" data-source="{_esc(name)}" '
                         f'data-dest="{_esc(name)}"><path d="{d}" {stroke(e.style)}/></g>')
        labels_svg += _label_svg(e.lines, cx, y - LOOP_H + 2, LABEL_COLORS[e.style])
    if L.stub is not None:
        x, y, w, h = L.box(L.stub[0])
        cx, y0 = x + w / 2, y + h
        edges_svg.append(f'<g class="edge failed-edge" data-source="{_esc(L.stub[0])}" '
                         f'data-event="{_esc(L.stub[1])}"><path d="M{cx:.1f},{y0:.1f} '
                         f'L{cx:.1f},{y0 + STUB_H:.1f}" {stroke("fail")}/></g>')
        labels_svg += _label_svg([L.stub[1] + " ✗"], cx, y0 + STUB_H + LINE, COLORS["fail"])
    out += edges_svg + ["</g>"] + labels_svg + ["</g>", '<g class="nodes">']

    for s in lc.states:
        x, y, w, h = L.box(s.name)
        visited = hl is not None and (s.name in hl.visited or s.name == hl.current)
        current = hl is not None and s.name == hl.current
        fill = VISITED_FILL if visited else "#f8fafc"
        stroke_c, sw = (CURRENT_STROKE, 3) if current else ("#334155", 1.4)
        out.append(f'<g class="node{" current" if current else ""}" '
                   f'id="{pid}-state-{_esc(s.name)}" data-state="{_esc(s.name)}">')
        out.append(f'<rect class="node-box" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
                   f'height="{h:.1f}" rx="8" fill="{fill}" stroke="{stroke_c}" '
                   f'stroke-width="{sw}"/>')
        if s in lc.terminal:
            out.append(f'<rect class="node-inner" x="{x + 4:.1f}" y="{y + 4:.1f}" '
                       f'width="{w - 8:.1f}" height="{h - 8:.1f}" rx="5" fill="none" '
                       f'stroke="{stroke_c}" stroke-width="1"/>')
        count = hl.visited.get(s.name) if hl is not None else None
        ty = y + h / 2 + (0 if count else 4.5)
        bold = ' font-weight="bold"' if current else ""
        out.append(f'<text class="node-label" x="{x + w / 2:.1f}" y="{ty:.1f}" '
                   f'text-anchor="middle" font-size="{NODE_PX}" fill="#0f172a"{bold}>'
                   f'{_esc(s.name)}</text>')
        if count:
            out.append(f'<text class="node-count" x="{x + w / 2:.1f}" y="{ty + 13:.1f}" '
                       f'text-anchor="middle" font-size="{LABEL_PX}" fill="#1d4ed8">'
                       f'×{count}</text>')
        if s == lc.initial:
            cy = y + h / 2
            out.append(f'<circle class="initial" cx="{x - 24:.1f}" cy="{cy:.1f}" r="6" '
                       f'fill="#0f172a"/>')
            out.append(f'<path d="M{x - 18:.1f},{cy:.1f} L{x:.1f},{cy:.1f}" fill="none" '
                       f'stroke="#0f172a" stroke-width="1.4" marker-end="url(#{pid}-arrow)"/>')
        out.append("</g>")
    out += ["</g>", "</svg>"]
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
