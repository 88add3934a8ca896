"""A lifecycle as a self-contained SVG document, laid out by Graphviz or in pure Python.

`to_svg(lc, highlight, layout=...)` asks a layout for a `geometry.Drawing` and writes it down:

* ``layout="python"`` (the default): `statemachines.layout`, deterministic everywhere, no
  subprocess; what the replay page and the live ``/debug/diagram`` route draw;
* ``layout="graphviz"``: Graphviz's ``dot`` (`statemachines.graphviz_layout`); raises
  `GraphvizUnavailable` when ``dot`` is not installed;
* ``layout="auto"``: Graphviz when ``dot`` is on the PATH, else the pure-Python layout
  (what ``actorserve diagram --format svg`` uses, and so ``make diagrams``).

Both produce the same markup: a group per state (``data-state``) with a ``node-box`` rect
(terminal states have a second, inner border), a group per edge (``data-source``,
``data-dest``) whose path ends in an arrowhead marker, label text on a white ``label-bg``
backdrop, and the compound state (`statemachines.compound`) as a rounded ``group-box`` drawn
under everything with its name in the top-left corner. The root element says which layout
drew it (``data-layout``) and the definition it shows (``data-definition``, the lifecycle's
hash), so a stale picture can be told from one drawn by another layout.
"""

from __future__ import annotations

import html
from typing import Any

from .core import Lifecycle
from .geometry import (
    COLORS, FONT, GROUP_PX, LABEL_COLORS, LABEL_PX, LINE, MARGIN, NODE_PX, TITLE_PX, Drawing,
    lines_width,
)
from .graphviz_layout import GraphvizUnavailable, dot_version, graphviz_drawing
from .highlight import CURRENT_STROKE, VISITED_FILL, Highlight, normalize_highlight
from .layout import Layout

__all__ = ["GraphvizUnavailable", "LAYOUTS", "draw", "to_svg"]

LAYOUTS = ("python", "graphviz", "auto")
GROUP_FILL, GROUP_STROKE = "#f1f5f9", "#94a3b8"

_esc = html.escape    # quote=True: safe in text and in attribute values


def draw(lc: Lifecycle, hl: Highlight | None, layout: str = "python") -> Drawing:
    """Lay `lc` out with the named layout (see the module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout == "auto":
        layout = "graphviz" if dot_version() is not None else "python"
    if layout == "graphviz":
        return graphviz_drawing(lc, hl)
    return Layout(lc, hl).drawing()


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


def to_svg(lc: Lifecycle, highlight: Any = None, *, layout: str = "python") -> str:
    """A self-contained SVG of `lc` (optionally highlighted); ends with a newline."""
    hl = normalize_highlight(lc, highlight)
    D = draw(lc, hl, layout)
    pid = "".join(c if c.isalnum() else "-" for c in lc.name)
    W, H = D.width, D.height
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W:.0f}" height="{H:.0f}" '
        f'viewBox="0 0 {W:.0f} {H:.0f}" font-family="{_esc(FONT)}" role="img" '
        f'aria-label="{_esc(lc.name)} lifecycle" data-layout="{_esc(D.layout)}" '
        f'data-definition="{lc.definition_hash}">',
        f"<title>{_esc(lc.name)} lifecycle</title>",
        "<defs>",
    ]
    for style, color in COLORS.items():
        out.append(f'<marker id="{pid}-arrow{"-" + style if style else ""}" viewBox="0 0 10 10" '
                   'refX="10" refY="5" markerWidth="9" markerHeight="9" '
                   f'markerUnits="userSpaceOnUse" orient="auto">'
                   f'<path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker>')
    out += ["</defs>", f'<rect width="{W:.0f}" height="{H:.0f}" fill="#ffffff"/>',
            f'<text class="title" x="{MARGIN}" y="{MARGIN + 8}" font-size="{TITLE_PX}" '
            f'font-weight="bold" fill="#0f172a">{_esc(lc.name)}</text>']
    if D.group is not None:
        name, x, y, w, h = D.group
        members = " ".join(s.name for s in lc.states if s.name in D.group_members)
        out += [f'<g class="group" data-group="{_esc(name)}" data-members="{_esc(members)}">',
                f'<rect class="group-box" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
                f'height="{h:.1f}" rx="14" fill="{GROUP_FILL}" stroke="{GROUP_STROKE}" '
                f'stroke-width="1.4"/>',
                f'<text class="group-label" x="{D.group_label[0]:.1f}" '
                f'y="{D.group_label[1]:.1f}" '
                f'font-size="{GROUP_PX}" font-weight="bold" fill="#475569">{_esc(name)}</text>',
                "</g>"]

    def stroke(style: str) -> str:
        dash = ' stroke-dasharray="6 4"' if style == "fail" else ""
        width = 1.2 if not style else 2
        marker = f"{pid}-arrow" + (f"-{style}" if style else "")
        return (f'fill="none" stroke="{COLORS[style]}" stroke-width="{width}"{dash} '
                f'marker-end="url(#{marker})"')

    edges_svg, labels_svg = ['<g class="edges">'], ['<g class="labels">']
    for p in D.paths:
        cls = "edge" if p.kind == "edge" else f"edge {p.kind}"
        attrs = f'data-source="{_esc(p.src)}"'
        attrs += f' data-dest="{_esc(p.dst)}"' if p.dst is not None else ""
        attrs += f' data-event="{_esc(p.event)}"' if p.event is not None else ""
        edges_svg.append(f'<g class="{cls}" {attrs}><path d="{p.d}" {stroke(p.style)}/></g>')
        if p.label is not None:
            labels_svg += _label_svg(p.lines, p.label[0], p.label[1], LABEL_COLORS[p.style])
    out += edges_svg + ["</g>"] + labels_svg + ["</g>", '<g class="nodes">']

    for s in lc.states:
        x, y, w, h = D.boxes[s.name]
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
            cx, cy, d = D.start
            out.append(f'<circle class="initial" cx="{cx:.1f}" cy="{cy:.1f}" r="6" '
                       f'fill="#0f172a"/>')
            out.append(f'<path class="entry" d="{d}" fill="none" stroke="#0f172a" '
                       f'stroke-width="1.4" marker-end="url(#{pid}-arrow)"/>')
        out.append("</g>")
    out += ["</g>", "</svg>"]
    return "\n".join(out) + "\n"
