"""A small layered (Sugiyama-style) layout for lifecycle diagrams, in pure Python.

The fallback when Graphviz is absent, and the layout used where a subprocess would not do
(request overlays in the replay page, the live ``/debug/diagram`` route). `Layout` computes
where every state, edge and label goes and hands back a `geometry.Drawing`.

1. *Cycles.* A depth-first search from the initial state (edges in table order) marks
   back edges; they are reversed for layout and drawn right-to-left. Self-loops are left
   out of the layout and drawn as small loops on top of their node.
2. *Layers.* Longest path from the sources of the acyclic graph; an edge drawn from the
   compound state (`statemachines.compound`) puts its destination after every member;
   terminal states are pushed to the last layer so the sinks line up on the right.
3. *Ranks.* Layer ``k`` becomes rank ``2k``; the odd ranks between them hold the edge
   labels. Every edge becomes a chain of items, one per rank it crosses: a dummy point,
   or (in the middle gap) its label box. Labels and long edges thus take real room in the
   ordering and can overlap neither nodes nor each other. An edge from the compound state
   starts at an anchor item on the right border of the box, in the group's last rank.
4. *Order.* Barycenter sweeps down and up, then sifting (`statemachines.layered`). In the
   ranks the compound state covers, its members (and the parts of edges inside it) come
   first and everything else after them, so the box can enclose exactly its members.
5. *Coordinates.* Ranks are columns (left to right). Within a column the items keep their
   order and minimum separations, and each pulls towards the mean of its neighbours: a
   least-squares fit, iterated; what lies outside the box is pushed below it.
6. *Paths.* An edge is one path: horizontal runs through the columns it crosses and
   cubic Bézier S-curves between columns, ending in an arrowhead marker on the node's
   side. The label sits just above the run in its label column.
"""

from __future__ import annotations

from collections import defaultdict

from .compound import live_group
from .core import Lifecycle
from .geometry import (
    LINE, LOOP_H, MARGIN, NODE_H, NODE_H_COUNT, STUB_H, TITLE_PX, TOP, Drawing,
    LayoutEdge, Path, lines_width, merge_edges, node_width, text_width,
)
from .highlight import Highlight
from .layered import order_ranks, pav

GAP, NODE_GAP = 10, 22                    # vertical separation: any items / two nodes
PAD_X, PAD_Y, GROUP_TITLE = 10, 12, 24    # compound box padding, room for its name


def layers(lc: Lifecycle, edges: list[LayoutEdge], members: tuple[str, ...],
            ) -> tuple[dict[str, int], list[str]]:
    """Mark back edges (DFS from the initial state); longest-path layers; DFS preorder."""
    names = [s.name for s in lc.states]
    out: dict[str, list[LayoutEdge]] = defaultdict(list)
    for e in edges:
        for src in (members if e.grouped else (e.src,)):
            out[src].append(e)
    mark: dict[str, int] = {}
    pre: list[str] = []

    def dfs(u: str) -> None:
        mark[u] = 1
        pre.append(u)
        for e in out[u]:
            if mark.get(e.dst) == 1:
                e.rev = True          # never a group edge: nothing leads back into the group
            elif e.dst not in mark:
                dfs(e.dst)
        mark[u] = 2

    for root in [lc.initial.name] + names:
        if root not in mark:
            dfs(root)
    pairs = [((e.dst, e.src) if e.rev else (e.src, e.dst)) for e in edges if not e.grouped]
    pairs += [(m, e.dst) for e in edges if e.grouped for m in members]
    layer = dict.fromkeys(names, 0)
    changed = True
    while changed:
        changed = False
        for lo, hi in pairs:
            if layer[hi] < layer[lo] + 1:
                layer[hi] = layer[lo] + 1
                changed = True
    last = max(layer.values())
    for s in lc.terminal:           # sinks line up on the right (if they really are sinks)
        if any(e.dst == s.name for e in edges) and not any(e.src == s.name for e in edges):
            layer[s.name] = last
    return layer, pre


class Layout:
    """Positions of everything; `drawing()` hands them to the SVG writer."""

    def __init__(self, lc: Lifecycle, hl: Highlight | None):
        self.lc, self.hl = lc, hl
        self.group = live_group(lc)
        self.members = self.group.members if self.group is not None else ()
        self.edges, self.loops = merge_edges(lc, hl, self.group)
        self.layer, pre = layers(lc, self.edges, self.members)
        counts = hl is not None and any(hl.visited.values())
        self.h = NODE_H_COUNT if counts else NODE_H
        failed = hl.failed_edge if hl is not None else None
        self.stub = failed if failed is not None and failed[2] is None else None
        if self.members:
            lay = [self.layer[m] for m in self.members]
            self.span = range(2 * min(lay), 2 * max(lay) + 1)
        else:
            self.span = range(0)
        self._items(pre)
        self._place_y()
        self._place_x()

    # -- structure ---------------------------------------------------------------------
    def _inside(self, it, e: LayoutEdge | None = None) -> bool:
        if it[0] == "n":
            return it[1] in self.members
        if it[0] == "g":
            return True
        return self.rank[it] in self.span and (e.src in self.members or e.dst in self.members)

    def _items(self, pre: list[str]) -> None:
        nranks = 2 * max(self.layer.values()) + 1
        order: list[list] = [[] for _ in range(nranks)]
        self.rank, self.top, self.bot, self.width, self.cspan = {}, {}, {}, {}, {}
        self.block: dict = {}
        for name in pre:            # cspan: the column width it needs (loop/stub labels too)
            it = ("n", name)
            self.rank[it] = r = 2 * self.layer[name]
            order[r].append(it)
            self.width[it] = self.cspan[it] = node_width(name)
            self.top[it] = self.bot[it] = self.h / 2
            if loop := self.loops.get(name):
                self.top[it] += LOOP_H + LINE * len(loop.lines) + 4
                self.cspan[it] = max(self.cspan[it], lines_width(loop.lines) + 8)
            if self.stub is not None and self.stub[0] == name:
                self.bot[it] += STUB_H + LINE + 6
                self.cspan[it] = max(self.cspan[it], lines_width([self.stub[1] + " ✗"]) + 8)
            self.block[it] = int(r in self.span and not self._inside(it))
        for ei, e in enumerate(self.edges):
            if e.grouped:
                lo, hi = ("g", ei), e.dst
                a, b = self.span[-1] // 2, self.layer[hi]
                order[2 * a].append(lo)
                self.rank[lo], self.cspan[lo], self.top[lo], self.bot[lo] = 2 * a, 0, 2, 2
                self.block[lo] = 0
                e.chain = [lo]
            else:
                lo, hi = (e.dst, e.src) if e.rev else (e.src, e.dst)
                a, b = self.layer[lo], self.layer[hi]
                e.chain = [("n", lo)]
            label_rank = 2 * (a + (b - a - 1) // 2) + 1
            for r in range(2 * a + 1, 2 * b):
                it = ("l", ei) if r == label_rank else ("d", ei, r)
                order[r].append(it)
                self.rank[it] = r
                if it[0] == "l":
                    self.cspan[it] = lines_width(e.lines) + 10
                    self.top[it], self.bot[it] = LINE * len(e.lines) + 2, 4
                else:
                    self.cspan[it], self.top[it], self.bot[it] = 0, 1, 1
                self.block[it] = int(r in self.span and not self._inside(it, e))
                e.chain.append(it)
            e.chain.append(("n", hi))
        self.up, self.down = defaultdict(list), defaultdict(list)
        links: list[list[tuple]] = [[] for _ in range(max(nranks - 1, 0))]
        for e in self.edges:
            for u, v in zip(e.chain, e.chain[1:]):
                self.down[u].append(v)
                self.up[v].append(u)
                links[self.rank[u]].append((u, v))
        self.order = order_ranks(order, self.up, self.down, links, self.block)

    def _sep(self, a, b) -> float:
        gap = NODE_GAP if a[0] == b[0] == "n" else GAP
        if self.block[a] != self.block[b]:
            gap += PAD_Y
        return self.bot[a] + gap + self.top[b]

    def _box_y(self, y: dict) -> tuple[float, float]:
        inside = [it for it in y if self.rank[it] in self.span and not self.block[it]]
        return (min(y[it] - self.top[it] for it in inside) - GROUP_TITLE,
                max(y[it] + self.bot[it] for it in inside) + PAD_Y)

    def _push_below_box(self, y: dict) -> None:
        """Items of the box's ranks that are not in it go below it (their order kept)."""
        _, bottom = self._box_y(y)
        for r in self.span:
            outside = [it for it in self.order[r] if self.block[it]]
            if outside and (d := bottom + GAP - (y[outside[0]] - self.top[outside[0]])) > 0:
                for it in outside:
                    y[it] += d

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
                for it, v in zip(rank, pav(want, seps)):
                    y[it] = v
            if self.members:
                self._push_below_box(y)
        lo = min(y[it] - self.top[it] for it in y)
        hi = max(y[it] + self.bot[it] for it in y)
        if self.members:
            top, bottom = self._box_y(y)
            lo, hi = min(lo, top), max(hi, bottom)
        self.y = {it: round(v - lo + TOP, 1) for it, v in y.items()}
        self.gy = (top - lo + TOP, bottom - lo + TOP) if self.members else (0.0, 0.0)
        self.height = hi - lo + TOP + MARGIN

    def _place_x(self) -> None:
        self.col: list[tuple[float, float]] = []      # (left, right) per rank
        x = MARGIN + 30.0 + (PAD_X + 10 if 0 in self.span else 0)   # room for the entry dot
        for r, rank in enumerate(self.order):
            w = max((self.cspan[it] for it in rank), default=0.0)
            if r:
                dy = max((abs(self.y[u] - self.y[v]) for u in self.order[r - 1]
                          for v in self.down[u]), default=0.0)
                x += 20 + min(50.0, 0.15 * dy) + (4 if (r in self.span) != (r - 1 in self.span)
                                                  else 0)
            self.col.append((x, x + w))
            x += w
        right = x + MARGIN
        if self.members:
            left = self.col[self.span[0]][0] - PAD_X
            if self.lc.initial.name in self.members:
                left = min(left, self.box(self.lc.initial.name)[0] - 38)
            self.gx = (left, self.col[self.span[-1]][1] + PAD_X)
            right = max(right, self.gx[1] + MARGIN)
        self.width_px = max(right, text_width(self.lc.name, TITLE_PX) + 2 * MARGIN + 80)

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

    def path(self, e: LayoutEdge) -> tuple[str, tuple[float, float] | None]:
        """SVG path data from e.src to e.dst, and where its label goes (x, last baseline)."""
        first, hi = e.chain[0], e.chain[-1][1]
        if first[0] == "g":
            pts = [(self.gx[1], self.y[first], 0)]
        else:
            x, _, w, _ = self.box(first[1])
            pts = [(x + w, self.port(first[1], e.chain[1], +1), 0)]
        label = None
        for k, it in enumerate(e.chain[1:-1], 1):
            left, right = self.col[self.rank[it]]
            pts += [(left, self.y[it], k), (right, self.y[it], k)]
            if it[0] == "l":
                label = ((left + right) / 2, self.y[it] - 4)
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

    def drawing(self) -> Drawing:
        paths = []
        for e in self.edges:
            d, label = self.path(e)
            paths.append(Path("group-edge" if e.grouped else "edge", e.src, e.dst, d, e.style,
                              e.lines, label))
        for name, e in self.loops.items():
            x, y, w, _ = self.box(name)
            cx = x + w / 2
            d = (f"M{cx - 9:.1f},{y:.1f} C{cx - 26:.1f},{y - LOOP_H:.1f} "
                 f"{cx + 26:.1f},{y - LOOP_H:.1f} {cx + 9:.1f},{y:.1f}")
            paths.append(Path("self-loop", name, name, d, e.style, e.lines, (cx, y - LOOP_H + 2)))
        if self.stub is not None:
            x, y, w, h = self.box(self.stub[0])
            cx, y0 = x + w / 2, y + h
            paths.append(Path("failed-edge", self.stub[0], None,
                              f"M{cx:.1f},{y0:.1f} L{cx:.1f},{y0 + STUB_H:.1f}", "fail",
                              [self.stub[1] + " ✗"], (cx, y0 + STUB_H + LINE), self.stub[1]))
        x, y, _, h = self.box(self.lc.initial.name)
        cy = y + h / 2
        group = None
        if self.group is not None:
            group = (self.group.name, self.gx[0], self.gy[0],
                     self.gx[1] - self.gx[0], self.gy[1] - self.gy[0])
        return Drawing("python", self.width_px, self.height, self.h,
                       {s.name: self.box(s.name) for s in self.lc.states}, paths,
                       (x - 24, cy, f"M{x - 18:.1f},{cy:.1f} L{x:.1f},{cy:.1f}"), group,
                       self.members, (self.gx[0] + 12, self.gy[0] + 17) if group else (0, 0))

