"""Lifecycle diagrams laid out by Graphviz's ``dot``, drawn by our own SVG writer.

Graphviz is optional (Debian's ``graphviz``; ``make setup`` installs it when it can). When
``dot`` is on the PATH, `graphviz_drawing` writes a layout-only DOT graph of exactly what
the SVG will show — the merged edges of `geometry.merge_edges` with their multi-line labels,
nodes of the sizes we draw (``fixedsize``), the compound state as a cluster whose edges
leave its border (``compound=true`` + ``ltail``), terminal sinks on one rank — runs
``dot -Tjson`` and reads back node centres, the cluster's box, each edge's spline and each
label's centre. Labels are set in Courier, whose widths Graphviz estimates at 0.6 em like
`geometry.text_width`, so the room dot keeps for a label is the room we draw it in.

Graphviz works in points with y pointing up; a point becomes one SVG pixel, y flipped, with
the margin and title room of the pure-Python layout around it. The output is deterministic
for one Graphviz version; the version is written into the SVG (``data-layout``).
"""

from __future__ import annotations

import json
import shutil
import subprocess

from .compound import Group, live_group
from .core import Lifecycle
from .geometry import (
    GROUP_PX, LABEL_PX, LINE, MARGIN, NODE_H, NODE_H_COUNT, TITLE_PX, TOP, Drawing, Path,
    lines_width, merge_edges, node_width, text_width,
)
from .highlight import Highlight
from .layout import layers

__all__ = ["GraphvizUnavailable", "dot_version", "exit_member", "graphviz_drawing",
           "layout_source"]

_versions: dict[str, str | None] = {}


class GraphvizUnavailable(RuntimeError):
    """``dot`` is not installed (or does not run)."""


def dot_version() -> str | None:
    """Graphviz's version (``"2.43.0"``) when ``dot`` is on the PATH and runs, else None."""
    path = shutil.which("dot")
    if path is None:
        return None
    if path not in _versions:
        try:
            r = subprocess.run([path, "-V"], capture_output=True, text=True, timeout=20)
            words = (r.stderr or r.stdout).split()
            _versions[path] = words[words.index("version") + 1] if "version" in words else None
        except (OSError, subprocess.SubprocessError):
            _versions[path] = None
    return _versions[path]


def exit_member(lc: Lifecycle, group: Group) -> str:
    """The member an edge drawn from the group leaves in DOT (``ltail`` clips it at the
    cluster's border): the one laid out furthest right, so the edge does not cross the box."""
    edges, _ = merge_edges(lc, None, group)
    layer, _ = layers(lc, [e for e in edges if not e.grouped], ())
    return max(group.members, key=lambda m: (layer[m], group.members.index(m)))


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def layout_source(lc: Lifecycle, hl: Highlight | None) -> tuple[str, dict]:
    """The layout-only DOT graph, and what its ids stand for (``ids``: node id -> state)."""
    group = live_group(lc)
    members = group.members if group is not None else ()
    edges, loops = merge_edges(lc, hl, group)
    h = NODE_H_COUNT if hl is not None and any(hl.visited.values()) else NODE_H
    nid = {s.name: f"n{i}" for i, s in enumerate(lc.states)}
    failed = hl.failed_edge if hl is not None else None
    stub = failed if failed is not None and failed[2] is None else None

    def node(name: str) -> str:
        return f"{nid[name]} [width={node_width(name) / 72:.4f}, height={h / 72:.4f}];"

    out = [f"digraph {_q(lc.name)} {{",
           "graph [rankdir=LR, compound=true, newrank=true, nodesep=0.3, ranksep=0.4, "
           "fontname=Courier];",
           'node [shape=box, fixedsize=true, label=""];',
           f"edge [fontname=Courier, fontsize={LABEL_PX}, arrowsize=0.7];",
           '__start [shape=point, width=0.17, height=0.17];']
    if group is not None:
        title_w = text_width(group.name, GROUP_PX) + 16
        out.append(f"subgraph cluster_group {{ label={_q(group.name)}; labeljust=l; "
                   f"fontname=Courier; fontsize={GROUP_PX}; margin=14; "
                   f"lwidth={title_w / 72:.3f};")
        out += [node(m) for m in members]
        if lc.initial.name in members:
            out.append("__start;")
        out.append("}")
    out += [node(s.name) for s in lc.states if s.name not in members]
    sinks = [nid[s.name] for s in lc.states if s in lc.terminal
             and any(e.dst == s.name for e in edges) and not any(e.src == s.name for e in edges)]
    if len(sinks) > 1:
        out.append("{rank=same; " + " ".join(sinks) + ";}")
    out.append(f"__start -> {nid[lc.initial.name]} [id=entry];")
    ids: dict = {"edges": {}, "nid": {v: k for k, v in nid.items()}}
    exit_from = exit_member(lc, group) if group is not None else None
    for i, e in enumerate(edges):
        label = _q("\n".join(e.lines))
        if e.grouped:
            out.append(f"{nid[exit_from]} -> {nid[e.dst]} [id=e{i}, label={label}, "
                       "ltail=cluster_group];")
        else:
            out.append(f"{nid[e.src]} -> {nid[e.dst]} [id=e{i}, label={label}];")
        ids["edges"][f"e{i}"] = ("group-edge" if e.grouped else "edge", e)
    for i, (name, e) in enumerate(loops.items()):
        out.append(f"{nid[name]} -> {nid[name]} [id=l{i}, label={_q(chr(10).join(e.lines))}];")
        ids["edges"][f"l{i}"] = ("self-loop", e)
    if stub is not None:
        w = lines_width([stub[1] + " ✗"]) + 8
        out.append(f'__stub [shape=plaintext, width={w / 72:.4f}, height={LINE / 72:.4f}];')
        out.append(f"{nid[stub[0]]} -> __stub [id=stub, style=dashed];")
    out.append("}")
    ids.update(group=group, stub=stub, h=h)
    return "\n".join(out) + "\n", ids


def _spline(pos: str, X, Y) -> str:
    """SVG path data for a Graphviz ``pos`` (B-spline points, ``e,x,y`` = the arrow tip)."""
    pts, tip = [], None
    for tok in pos.split(";")[0].split():
        if tok.startswith("e,"):
            tip = tuple(float(v) for v in tok[2:].split(","))
        elif not tok.startswith("s,"):
            pts.append(tuple(float(v) for v in tok.split(",")))
    p = [(X(x), Y(y)) for x, y in pts]
    d = [f"M{p[0][0]:.1f},{p[0][1]:.1f}"]
    for i in range(1, len(p) - 2, 3):
        d.append("C" + " ".join(f"{x:.1f},{y:.1f}" for x, y in p[i:i + 3]))
    if tip is not None:
        d.append(f"L{X(tip[0]):.1f},{Y(tip[1]):.1f}")
    return " ".join(d)


def graphviz_drawing(lc: Lifecycle, hl: Highlight | None) -> Drawing:
    """Lay `lc` out with ``dot``; raises `GraphvizUnavailable` when it is not installed."""
    version = dot_version()
    dot = shutil.which("dot")
    if version is None or dot is None:
        raise GraphvizUnavailable("Graphviz's `dot` is not installed (Debian: apt-get install "
                                  "graphviz); use layout='python'")
    source, ids = layout_source(lc, hl)
    r = subprocess.run([dot, "-Tjson"], input=source, capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        raise GraphvizUnavailable(f"dot failed ({r.returncode}): {r.stderr.strip()[:400]}")
    g = json.loads(r.stdout)
    llx, lly, urx, ury = (float(v) for v in g["bb"].split(","))

    def X(x: float) -> float:
        return x - llx + MARGIN

    def Y(y: float) -> float:
        return ury - y + TOP

    h = ids["h"]
    boxes, centre, group = {}, {}, None
    label_at = (0.0, 0.0)
    for obj in g.get("objects", []):
        name = obj.get("name", "")
        if name == "cluster_group":
            x1, y1, x2, y2 = (float(v) for v in obj["bb"].split(","))
            group = (ids["group"].name, X(x1), Y(y2), x2 - x1, y2 - y1)
            cx, cy = (float(v) for v in obj["lp"].split(","))
            label_at = (X(cx) - float(obj.get("lwidth", 0)) * 36 + 8, Y(cy) + GROUP_PX * 0.35)
        elif "pos" in obj:
            x, y = (float(v) for v in obj["pos"].split(","))
            centre[name] = (X(x), Y(y))
            if name in ids["nid"]:
                state = ids["nid"][name]
                w = node_width(state)
                boxes[state] = (X(x) - w / 2, Y(y) - h / 2, w, h)
    paths, start = [], None
    for e in g.get("edges", []):
        eid, d = e.get("id"), _spline(e["pos"], X, Y)
        if eid == "entry":
            start = (*centre["__start"], d)
        elif eid == "stub":
            cx, cy = centre["__stub"]
            stub = ids["stub"]
            paths.append(Path("failed-edge", stub[0], None, d, "fail", [stub[1] + " ✗"],
                              (cx, cy + LINE / 2 - 2.5), stub[1]))
        else:
            kind, le = ids["edges"][eid]
            lx, ly = (float(v) for v in e["lp"].split(","))
            base = Y(ly) + LINE * len(le.lines) / 2 - 2.5
            paths.append(Path(kind, le.src, le.dst, d, le.style, le.lines, (X(lx), base)))
    assert start is not None
    width = max((urx - llx) + 2 * MARGIN, text_width(lc.name, TITLE_PX) + 2 * MARGIN + 80)
    members = ids["group"].members if ids["group"] is not None else ()
    return Drawing(f"graphviz {version}", width, (ury - lly) + TOP + MARGIN, h, boxes, paths,
                   start, group, members, label_at)
