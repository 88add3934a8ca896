"""What both diagram layouts share: text metrics, the edges to draw, and the finished drawing.

A layout (`statemachines.layout`, pure Python, or `statemachines.graphviz_layout`, Graphviz's
``dot``) turns a lifecycle into a `Drawing`: a box per state, the compound state's box, one
`Path` per drawn edge with its label's place, and the entry arrow. `statemachines.svg` writes
a `Drawing` down as markup, so both layouts produce the same kind of document.

`merge_edges` decides what is drawn: the rows of `compound.drawn_rows` (an edge leaving every
state of the compound state is drawn once, from the group), rows with the same (source, dest)
merged into one edge with one label line each, self-loops apart, and the highlight's counts
and styles applied (``hot`` for a traversed edge, ``fail`` for the refused one).

Text widths are estimated for a monospace font (0.6 em per character), which the SVG asks
for, so boxes fit their text without font metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .compound import Group, drawn_rows
from .core import Lifecycle
from .highlight import Highlight

FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"
NODE_PX, LABEL_PX, LINE = 13, 11, 13      # font sizes and label line height
TITLE_PX, GROUP_PX = 15, 12               # the diagram's title, the compound state's name
NODE_H, NODE_H_COUNT = 34, 42             # node height (taller when counts are shown)
LOOP_H, STUB_H = 24, 22                   # self-loop height, failed stub length
MARGIN, TOP = 20, 44                      # outer margin, room for the title
COLORS = {"": "#64748b", "hot": "#2563eb", "fail": "#dc2626"}
LABEL_COLORS = {"": "#334155", "hot": "#1d4ed8", "fail": "#dc2626"}


def text_width(text: str, px: float) -> float:
    return len(text) * px * 0.6


def lines_width(lines: list[str]) -> float:
    return max(text_width(t, LABEL_PX) for t in lines)


def node_width(name: str) -> float:
    return max(72.0, text_width(name, NODE_PX) + 28)


@dataclass
class LayoutEdge:
    """One drawn edge: merged rows between two states (or from the group to a state)."""

    src: str
    dst: str
    lines: list[str] = field(default_factory=list)
    style: str = ""
    grouped: bool = False
    rev: bool = False
    chain: list = field(default_factory=list)   # pure layout: items, low rank to high


def merge_edges(lc: Lifecycle, hl: Highlight | None, group: Group | None,
                ) -> tuple[list[LayoutEdge], dict[str, LayoutEdge]]:
    """Merged edges (src != dst) and self-loops, with labels and highlight styles."""
    rows = drawn_rows(lc, group)
    members = group.members if group is not None else ()
    failed = hl.failed_edge if hl is not None else None

    def failed_here(src: str, event: str, dst: str, grouped: bool) -> bool:
        if failed is None or failed[1:] != (event, dst):
            return False
        return failed[0] in members if grouped else failed[0] == src

    extra = None
    if failed is not None and failed[2] is not None and not any(
            failed_here(r.src, r.event, r.dest, r.grouped) for r in rows):
        extra = failed                      # an illegal edge that was tried: draw it too
    edges: dict[tuple[str, str], LayoutEdge] = {}
    loops: dict[str, LayoutEdge] = {}
    items = [(r.src, r.event, r.dest, r.label, r.grouped) for r in rows]
    if extra is not None:
        items.append((extra[0], extra[1], extra[2], extra[1], False))
    for src, event, dst, label, grouped in items:
        if src == dst:
            e = loops.setdefault(src, LayoutEdge(src, dst))
        else:
            e = edges.setdefault((src, dst), LayoutEdge(src, dst, grouped=grouped))
        if hl is not None:
            sources = members if grouped else (src,)
            if n := sum(hl.edge_count(s, event, dst) for s in sources):
                label += f" ×{n}"
                e.style = e.style or "hot"
            if failed_here(src, event, dst, grouped) or (src, event, dst) == extra:
                label += " ✗"
                e.style = "fail"
        e.lines.append(label)
    return list(edges.values()), loops


@dataclass
class Path:
    """A drawn edge: `d` is SVG path data; `label` is (centre x, last baseline) or None."""

    kind: str                      # "edge", "self-loop", "group-edge" or "failed-edge"
    src: str
    dst: str | None
    d: str
    style: str = ""
    lines: list[str] = field(default_factory=list)
    label: tuple[float, float] | None = None
    event: str | None = None


@dataclass
class Drawing:
    """A laid-out lifecycle: everything `svg.to_svg` needs, in SVG user units (px)."""

    layout: str                                   # "python" or "graphviz <version>"
    width: float
    height: float
    node_h: float
    boxes: dict[str, tuple[float, float, float, float]]     # state -> (x, y, w, h)
    paths: list[Path]
    start: tuple[float, float, str]               # entry dot (cx, cy) and its arrow's path
    group: tuple[str, float, float, float, float] | None = None    # (name, x, y, w, h)
    group_members: tuple[str, ...] = ()
    group_label: tuple[float, float] = (0.0, 0.0)    # where its name starts (x, baseline)
