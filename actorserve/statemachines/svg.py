"""A small layered (Sugiyama-style) layout for lifecycle diagrams, in pure Python.

No Graphviz: `Layout` computes where every state, edge and label goes, and
`diagram.to_svg` writes that down as a self-contained SVG document.

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
4. *Order.* Barycenter sweeps down and up, then sifting (each item moves to the spot
   in its rank with the fewest crossings); run with ties kept and with ties
   reversed every other round; the order with the fewest crossings wins.
5. *Coordinates.* Ranks are columns (left to right). Within a column the items keep
   their order and minimum separations, and each pulls towards the mean of its
   neighbours: a least-squares fit solved exactly by pool-adjacent-violators, iterated.
6. *Paths.* An edge is one path: horizontal runs through the columns it crosses and
   cubic Bézier S-curves between columns, ending in an arrowhead marker on the node's
   side. The label sits just above the run in its label column.

Text widths are estimated for a monospace font (0.6 em per character), which the SVG
asks for, so boxes fit their text without font metrics.
"""

from __future__ import annotations

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


def lines_width(lines: list[str]) -> float:
    return max(text_width(t, LABEL_PX) for t in lines)


@dataclass
class LayoutEdge:
    src: str
    dst: str
    lines: list[str] = field(default_factory=list)
    style: str = ""
    rev: bool = False
    chain: list = field(default_factory=list)   # items, from the low rank to the high one


def _merge(lc: Lifecycle, hl: Highlight | None,
           ) -> tuple[list[LayoutEdge], dict[str, LayoutEdge]]:
    """Merged edges (src != dst) and self-loops, with labels and highlight styles."""
    rows = [(s.name, e.event, e.dest.name, e.condition) for e in lc.edges for s in e.sources]
    failed = hl.failed_edge if hl is not None else None
    if failed is not None and failed[2] is not None and not any(r[:3] == failed for r in rows):
        rows.append((*failed, None))    # an illegal edge that was tried: draw it too
    edges: dict[tuple[str, str], LayoutEdge] = {}
    loops: dict[str, LayoutEdge] = {}
    for src, event, dst, cond in rows:
        e = (loops if src == dst else edges).setdefault(
            src if src == dst else (src, dst), LayoutEdge(src, dst))
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


def _layers(lc: Lifecycle, edges: list[LayoutEdge]) -> tuple[dict[str, int], list[str]]:
    """Mark back edges (DFS from the initial state); longest-path layers; DFS preorder."""
    names = [s.name for s in lc.states]
    out: dict[str, list[LayoutEdge]] = defaultdict(list)
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


def _sift(order: list[list], up: dict, down: dict) -> None:
    """Move each item to the position in its rank with the fewest crossings (in place)."""
    for _ in range(10):
        improved = False
        for r, rank in enumerate(order):
            pu = {it: i for i, it in enumerate(order[r - 1])} if r else {}
            pd = {it: i for i, it in enumerate(order[r + 1])} if r + 1 < len(order) else {}
            nb = {it: ([pu[n] for n in up[it]], [pd[n] for n in down[it]]) for it in rank}

            def cost(a, b) -> int:                 # crossings of a's and b's links, a left
                return sum(x > y for s in (0, 1) for x in nb[a][s] for y in nb[b][s])

            for v in list(rank):
                i = rank.index(v)
                rest = rank[:i] + rank[i + 1:]
                c = sum(cost(v, u) for u in rest)  # v first
                costs = [c]
                for u in rest:                     # v after u
                    c += cost(u, v) - cost(v, u)
                    costs.append(c)
                k = min(range(len(costs)), key=lambda k: (costs[k], k != i))
                if costs[k] < costs[i]:
                    rank[:] = rest[:k] + [v] + rest[k:]
                    improved = True
        if not improved:
            return


def _order(order: list[list], up: dict, down: dict, links: list[list[tuple]]) -> list[list]:
    """Barycenter sweeps + sifting, twice (ties kept; ties reversed every other round)."""
    total = lambda o: sum(_crossings(o, links, r) for r in range(len(o) - 1))  # noqa: E731
    best, best_c = [list(rk) for rk in order], total(order)
    for alternate in (False, True):
        cur = [list(rk) for rk in order]
        for rnd in range(8):
            flip = -1 if alternate and rnd % 2 else 1
            for r, nbrs, ref in [(r, up, r - 1) for r in range(1, len(cur))] + \
                    [(r, down, r + 1) for r in range(len(cur) - 2, -1, -1)]:
                pos = {it: i for i, it in enumerate(cur[ref])}
                key = {it: (sum(pos[n] for n in nbrs[it]) / len(nbrs[it]) if nbrs[it] else i,
                            flip * i) for i, it in enumerate(cur[r])}
                cur[r].sort(key=key.__getitem__)
            _sift(cur, up, down)
            if (c := total(cur)) < best_c:
                best, best_c = [list(rk) for rk in cur], c
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


class Layout:
    """Positions of everything; `diagram.to_svg` turns it into markup."""

    def __init__(self, lc: Lifecycle, hl: Highlight | None):
        self.lc, self.hl = lc, hl
        self.edges, self.loops = _merge(lc, hl)
        self.layer, pre = _layers(lc, self.edges)
        counts = hl is not None and any(hl.visited.values())
        self.h = NODE_H_COUNT if counts else NODE_H
        failed = hl.failed_edge if hl is not None else None
        self.stub = failed if failed is not None and failed[2] is None else None
        self._items(pre)
        self._place_y()
        self._place_x()

    # -- structure ---------------------------------------------------------------------
    def _items(self, pre: list[str]) -> None:
        nranks = 2 * max(self.layer.values()) + 1
        order: list[list] = [[] for _ in range(nranks)]
        self.rank, self.top, self.bot, self.width, self.span = {}, {}, {}, {}, {}
        for name in pre:            # span: the column width it needs (loop/stub labels too)
            it = ("n", name)
            self.rank[it] = r = 2 * self.layer[name]
            order[r].append(it)
            self.width[it] = self.span[it] = max(72.0, text_width(name, NODE_PX) + 28)
            self.top[it] = self.bot[it] = self.h / 2
            if loop := self.loops.get(name):
                self.top[it] += LOOP_H + LINE * len(loop.lines) + 4
                self.span[it] = max(self.span[it], lines_width(loop.lines) + 8)
            if self.stub is not None and self.stub[0] == name:
                self.bot[it] += STUB_H + LINE + 6
                self.span[it] = max(self.span[it], lines_width([self.stub[1] + " ✗"]) + 8)
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
                    self.span[it] = lines_width(e.lines) + 10
                    self.top[it], self.bot[it] = LINE * len(e.lines) + 2, 4
                else:
                    self.span[it], self.top[it], self.bot[it] = 0, 1, 1
                e.chain.append(it)
            e.chain.append(("n", hi))
        self.up, self.down = defaultdict(list), defaultdict(list)
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
            w = max((self.span[it] for it in rank), default=0.0)
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

    def path(self, e: LayoutEdge) -> tuple[str, tuple[float, float, int] | None]:
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
