"""A small layered (Sugiyama-style) SVG renderer for lifecycles, in pure Python.

No Graphviz: the layout is computed here and written as a self-contained SVG string.

1. *Cycles.* A depth-first search from the initial state (edges in table order) marks
   back edges; they are reversed for layout and drawn right-to-left. Self-loops are left
   out of the layout and drawn as small loops on top of their node. Rows with the same
   (source, dest) are merged into one edge with a multi-line label.
2. *Layers.* Longest path from the sources of the acyclic graph; terminal states are
   pushed to the last layer so the sinks line up on the right.
3. *Ranks.* Layer ``k`` becomes rank ``2k``; the odd ranks between them hold the edge
   labels. Every edge becomes a chain of items, one per rank it crosses: a dummy point,
   or (in the middle gap) its label box. Labels and long edges thus take real room in the
   ordering and can overlap neither nodes nor each other.
4. *Order.* Barycenter sweeps down and up, then adjacent swaps (transposition) where
   that removes crossings; the order with the fewest crossings wins.
5. *Coordinates.* Ranks are columns (left to right). Within a column the items keep
   their order and minimum separations, and each pulls towards the mean of its
   neighbours: a least-squares fit solved exactly by pool-adjacent-violators, iterated.
6. *Drawing.* An edge is one path: horizontal runs through the columns it crosses and
   cubic Bézier S-curves between columns, ending in an arrowhead marker on the node's
   side. The label sits just above the run in its label column.

Text widths are estimated for a monospace font (0.6 em per character), which the SVG
asks for, so boxes fit their text without font metrics.
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .core import Lifecycle

if TYPE_CHECKING:
    from .diagram import Highlight

FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"
NODE_PX, LABEL_PX, LINE = 13, 11, 13      # font sizes and label line height
NODE_H, NODE_H_COUNT = 34, 42             # node height (taller when counts are shown)
LOOP_H, STUB_H = 24, 22                   # self-loop height, failed stub length
GAP, NODE_GAP = 10, 22                    # vertical separation: any items / two nodes
MARGIN, TOP = 20, 44                      # outer margin, room for the title
COLORS = {"": "#64748b", "hot": "#2563eb", "fail": "#dc2626"}
LABEL_COLORS = {"": "#334155", "hot": "#1d4ed8", "fail": "#dc2626"}


def text_width(text: str, px: float) -> float:
    return len(text) * px * 0.6


@dataclass
class _Edge:
    src: str
    dst: str
    lines: list[str] = field(default_factory=list)
    style: str = ""
    rev: bool = False
    chain: list = field(default_factory=list)   # items, from the low rank to the high one


def _merge(lc: Lifecycle, hl: Highlight | None) -> tuple[list[_Edge], dict[str, _Edge]]:
    """Merged edges (src != dst) and self-loops, with labels and highlight styles."""
    rows = [(s.name, e.event, e.dest.name, e.condition) for e in lc.edges for s in e.sources]
    failed = hl.failed_edge if hl is not None else None
    if failed is not None and failed[2] is not None and not any(r[:3] == failed for r in rows):
        rows.append((*failed, None))    # an illegal edge that was tried: draw it too
    edges: dict[tuple[str, str], _Edge] = {}
    loops: dict[str, _Edge] = {}
    for src, event, dst, cond in rows:
        e = (loops if src == dst else edges).setdefault(
            src if src == dst else (src, dst), _Edge(src, dst))
        label = f"{event} [{cond}]" if cond else event
        if hl is not None:
            if n := hl.edge_count(src, event, dst):
                label += f" ×{n}"
                e.style = e.style or "hot"
            if failed == (src, event, dst):
                label += " ✗"
                e.style = "fail"
        e.lines.append(label)
    return list(edges.values()), loops


def _layers(lc: Lifecycle, edges: list[_Edge]) -> tuple[dict[str, int], list[str]]:
    """Mark back edges (DFS from the initial state); longest-path layers; DFS preorder."""
    names = [s.name for s in lc.states]
    out: dict[str, list[_Edge]] = defaultdict(list)
    for e in edges:
        out[e.src].append(e)
    mark: dict[str, int] = {}
    pre: list[str] = []

    def dfs(u: str) -> None:
        mark[u] = 1
        pre.append(u)
        for e in out[u]:
            if mark.get(e.dst) == 1:
                e.rev = True
            elif e.dst not in mark:
                dfs(e.dst)
        mark[u] = 2

    for root in [lc.initial.name] + names:
        if root not in mark:
            dfs(root)
    layer = dict.fromkeys(names, 0)
    changed = True
    while changed:
        changed = False
        for e in edges:
            lo, hi = (e.dst, e.src) if e.rev else (e.src, e.dst)
            if layer[hi] < layer[lo] + 1:
                layer[hi] = layer[lo] + 1
                changed = True
    last = max(layer.values())
    for s in lc.terminal:           # sinks line up on the right (if they really are sinks)
        if any(e.dst == s.name for e in edges) and not any(e.src == s.name for e in edges):
            layer[s.name] = last
    return layer, pre


def _crossings(order: list[list], links: list[list[tuple]], r: int) -> int:
    """Crossings between ranks r and r+1."""
    pa = {it: i for i, it in enumerate(order[r])}
    pb = {it: i for i, it in enumerate(order[r + 1])}
    ps = [(pa[a], pb[b]) for a, b in links[r]]
    return sum(1 for i, (a1, b1) in enumerate(ps) for a2, b2 in ps[i + 1:]
               if (a1 - a2) * (b1 - b2) < 0)


def _order(order: list[list], up: dict, down: dict, links: list[list[tuple]]) -> list[list]:
    total = lambda o: sum(_crossings(o, links, r) for r in range(len(o) - 1))  # noqa: E731
    best, best_c = [list(rk) for rk in order], total(order)

    def sweep(r: int, nbrs: dict, ref: int) -> None:
        pos = {it: i for i, it in enumerate(order[ref])}
        bary = {it: (sum(pos[n] for n in nbrs[it]) / len(nbrs[it]) if nbrs[it] else i)
                for i, it in enumerate(order[r])}
        order[r].sort(key=lambda it: bary[it])   # stable: ties keep their order

    for _ in range(6):
        for r in range(1, len(order)):
            sweep(r, up, r - 1)
        for r in range(len(order) - 2, -1, -1):
            sweep(r, down, r + 1)
        improved = True
        while improved:                           # transposition
            improved = False
            for r, rank in enumerate(order):
                for i in range(len(rank) - 1):
                    local = lambda: sum(_crossings(order, links, q)  # noqa: E731
                                        for q in (r - 1, r) if 0 <= q < len(order) - 1)
                    before = local()
                    rank[i], rank[i + 1] = rank[i + 1], rank[i]
                    if local() < before:
                        improved = True
                    else:
                        rank[i], rank[i + 1] = rank[i + 1], rank[i]
        if (c := total(order)) < best_c:
            best, best_c = [list(rk) for rk in order], c
    return best


def _pav(want: list[float], seps: list[float]) -> list[float]:
    """Closest positions (least squares) to `want` keeping order and gaps `seps`."""
    off = [0.0]
    for s in seps:
        off.append(off[-1] + s)
    blocks: list[list[float]] = []       # [mean, count]
    for v in (w - o for w, o in zip(want, off)):
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    flat = [m for m, c in blocks for _ in range(int(c))]
    return [v + o for v, o in zip(flat, off)]


class _Layout:
    """Positions of everything; `render_svg` turns it into markup."""

    def __init__(self, lc: Lifecycle, hl: Highlight | None):
        self.lc, self.hl = lc, hl
        self.edges, self.loops = _merge(lc, hl)
        self.layer, pre = _layers(lc, self.edges)
        counts = hl is not None and any(hl.visited.values())
        self.h = NODE_H_COUNT if counts else NODE_H
        self.stub = None
        if hl is not None and hl.failed_edge is not None and hl.failed_edge[2] is None:
            self.stub = hl.failed_edge
        self._items(pre)
        self._place_y()
        self._place_x()

    # -- structure ---------------------------------------------------------------------
    def _items(self, pre: list[str]) -> None:
        nranks = 2 * max(self.layer.values()) + 1
        order: list[list] = [[] for _ in range(nranks)]
        self.rank: dict = {}
        self.top: dict = {}
        self.bot: dict = {}
        self.width: dict = {}
        for name in pre:
            it = ("n", name)
            r = 2 * self.layer[name]
            order[r].append(it)
            self.rank[it] = r
            self.width[it] = max(72.0, text_width(name, NODE_PX) + 28)
            loop = self.loops.get(name)
            self.top[it] = self.h / 2 + (LOOP_H + LINE * len(loop.lines) + 4 if loop else 0)
            stub = self.stub is not None and self.stub[0] == name
            self.bot[it] = self.h / 2 + (STUB_H + LINE + 6 if stub else 0)
        for ei, e in enumerate(self.edges):
            lo, hi = (e.dst, e.src) if e.rev else (e.src, e.dst)
            a, b = self.layer[lo], self.layer[hi]
            label_rank = 2 * (a + (b - a - 1) // 2) + 1
            e.chain = [("n", lo)]
            for r in range(2 * a + 1, 2 * b):
                it = ("l", ei) if r == label_rank else ("d", ei, r)
                order[r].append(it)
                self.rank[it] = r
                if it[0] == "l":
                    self.width[it] = max(text_width(t, LABEL_PX) for t in e.lines) + 10
                    self.top[it], self.bot[it] = LINE * len(e.lines) + 2, 4
                else:
                    self.width[it], self.top[it], self.bot[it] = 0, 1, 1
                e.chain.append(it)
            e.chain.append(("n", hi))
        self.up: dict = defaultdict(list)
        self.down: dict = defaultdict(list)
        links: list[list[tuple]] = [[] for _ in range(max(nranks - 1, 0))]
        for e in self.edges:
            for u, v in zip(e.chain, e.chain[1:]):
                self.down[u].append(v)
                self.up[v].append(u)
                links[self.rank[u]].append((u, v))
        self.order = _order(order, self.up, self.down, links)

    def _sep(self, a, b) -> float:
        gap = NODE_GAP if a[0] == b[0] == "n" else GAP
        return self.bot[a] + gap + self.top[b]

    def _place_y(self) -> None:
        y: dict = {}
        for rank in self.order:
            pos = 0.0
            for i, it in enumerate(rank):
                pos = pos + self._sep(rank[i - 1], it) if i else 0.0
                y[it] = pos
        n = len(self.order)
        for sweep in range(24):
            seq = range(n) if sweep % 2 == 0 else range(n - 1, -1, -1)
            for r in seq:
                rank = self.order[r]
                if not rank:
                    continue
                want = []
                for it in rank:
                    nb = self.up[it] + self.down[it]
                    want.append(sum(y[v] for v in nb) / len(nb) if nb else y[it])
                seps = [self._sep(a, b) for a, b in zip(rank, rank[1:])]
                for it, v in zip(rank, _pav(want, seps)):
                    y[it] = v
        lo = min(y[it] - self.top[it] for it in y)
        self.y = {it: round(v - lo + TOP, 1) for it, v in y.items()}
        self.height = max(self.y[it] + self.bot[it] for it in y) + MARGIN

    def _place_x(self) -> None:
        self.col: list[tuple[float, float]] = []      # (left, right) per rank
        x = MARGIN + 30.0                              # room for the initial marker
        for r, rank in enumerate(self.order):
            w = max((self.width[it] for it in rank), default=0.0)
            for it in rank:
                if it[0] == "n" and (loop := self.loops.get(it[1])):
                    w = max(w, max(text_width(t, LABEL_PX) for t in loop.lines) + 8)
                if it[0] == "n" and self.stub and self.stub[0] == it[1]:
                    w = max(w, text_width(self.stub[1] + " ✗", LABEL_PX) + 8)
            if r:
                dy = max((abs(self.y[u] - self.y[v]) for u in self.order[r - 1]
                          for v in self.down[u]), default=0.0)
                x += 26 + min(70.0, 0.2 * dy)
            self.col.append((x, x + w))
            x += w
        self.width_px = max(x + MARGIN, text_width(self.lc.name, 15) + 2 * MARGIN + 80)

    # -- geometry ----------------------------------------------------------------------
    def box(self, name: str) -> tuple[float, float, float, float]:
        """(x, y, width, height) of a state's rectangle."""
        it = ("n", name)
        left, right = self.col[self.rank[it]]
        w = self.width[it]
        return ((left + right - w) / 2, self.y[it] - self.h / 2, w, self.h)

    def port(self, name: str, other, side: int) -> float:
        """y where the link to item `other` meets side `side` (+1 right, -1 left)."""
        it = ("n", name)
        nbrs = sorted(self.down[it] if side > 0 else self.up[it], key=lambda v: self.y[v])
        k = len(nbrs)
        step = min(8.0, (self.h - 14) / (k - 1)) if k > 1 else 0.0
        return self.y[it] + (nbrs.index(other) - (k - 1) / 2) * step

    def path(self, e: _Edge) -> tuple[str, tuple[float, float, int] | None]:
        """SVG path data from e.src to e.dst, and where its label goes (x, y, lines)."""
        lo, hi = e.chain[0][1], e.chain[-1][1]
        x, _, w, _ = self.box(lo)
        pts = [(x + w, self.port(lo, e.chain[1], +1), 0)]
        label = None
        for k, it in enumerate(e.chain[1:-1], 1):
            left, right = self.col[self.rank[it]]
            pts += [(left, self.y[it], k), (right, self.y[it], k)]
            if it[0] == "l":
                label = ((left + right) / 2, self.y[it], len(e.lines))
        x, _, _, _ = self.box(hi)
        pts.append((x, self.port(hi, e.chain[-2], -1), len(e.chain)))
        if e.rev:
            pts.reverse()
        d = [f"M{pts[0][0]:.1f},{pts[0][1]:.1f}"]
        for (x1, y1, k1), (x2, y2, k2) in zip(pts, pts[1:]):
            if k1 == k2:
                if (x1, y1) != (x2, y2):
                    d.append(f"L{x2:.1f},{y2:.1f}")
            else:
                mx = (x1 + x2) / 2
                d.append(f"C{mx:.1f},{y1:.1f} {mx:.1f},{y2:.1f} {x2:.1f},{y2:.1f}")
        return " ".join(d), label


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _label_svg(lines: list[str], cx: float, base: float, color: str) -> list[str]:
    """Label lines stacked upwards so the last baseline is at `base`, on a white backdrop."""
    w = max(text_width(t, LABEL_PX) for t in lines) + 4
    top = base - LINE * len(lines) + 2
    out = [f'<rect x="{cx - w / 2:.1f}" y="{top:.1f}" width="{w:.1f}" '
           f'height="{LINE * len(lines) + 1:.1f}" fill="#ffffff" fill-opacity="0.85"/>']
    for i, t in enumerate(lines):
        y = base - LINE * (len(lines) - 1 - i)
        out.append(f'<text x="{cx:.1f}" y="{y:.1f}" text-anchor="middle" '
                   f'font-size="{LABEL_PX}" fill="{color}">{_esc(t)}</text>')
    return out


def render_svg(lc: Lifecycle, hl: Highlight | None = None) -> str:
    """The SVG document for `lc` (with an optional normalised highlight)."""
    L = _Layout(lc, hl)
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

    hl = L.hl
    for s in lc.states:
        x, y, w, h = L.box(s.name)
        visited = hl is not None and (s.name in hl.visited or s.name == hl.current)
        current = hl is not None and s.name == hl.current
        fill = "#dbeafe" if visited else "#f8fafc"
        stroke_c, sw = ("#1d4ed8", 3) if current else ("#334155", 1.4)
        out.append(f'<g class="node{" current" if current else ""}" id="{pid}-state-{_esc(s.name)}" '
                   f'data-state="{_esc(s.name)}">')
        out.append(f'<rect class="node-box" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
                   f'height="{h:.1f}" rx="8" fill="{fill}" stroke="{stroke_c}" stroke-width="{sw}"/>')
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
