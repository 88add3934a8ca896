"""Ordering and coordinate helpers of the layered layout (`statemachines.layout`).

The items of a rank are ordered to reduce edge crossings (barycenter sweeps, then sifting),
then placed along the rank by a least-squares fit that keeps their order and separations
(pool-adjacent-violators). Every item has a *block*: the items of a rank stay sorted by
block whatever the crossings say, which is how a compound state keeps its members together
(block 0, inside its box) and everything else of that rank after them (block 1, below it).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping


def crossings(order: list[list], links: list[list[tuple]], r: int) -> int:
    """Crossings between ranks r and r+1."""
    pa = {it: i for i, it in enumerate(order[r])}
    pb = {it: i for i, it in enumerate(order[r + 1])}
    ps = [(pa[a], pb[b]) for a, b in links[r]]
    return sum(1 for i, (a1, b1) in enumerate(ps) for a2, b2 in ps[i + 1:]
               if (a1 - a2) * (b1 - b2) < 0)


def _sift(order: list[list], up: dict, down: dict, block: Mapping[Hashable, int]) -> None:
    """Move each item to the place in its rank (and block) with the fewest crossings."""
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
                b = block[v]
                lo = sum(block[u] < b for u in rest)
                hi = sum(block[u] <= b for u in rest)
                c = sum(cost(v, u) for u in rest)  # v first
                costs = [c]
                for u in rest:                     # v after u
                    c += cost(u, v) - cost(v, u)
                    costs.append(c)
                k = min(range(lo, hi + 1), key=lambda k: (costs[k], k != i))
                if costs[k] < costs[i]:
                    rank[:] = rest[:k] + [v] + rest[k:]
                    improved = True
        if not improved:
            return


def order_ranks(order: list[list], up: dict, down: dict, links: list[list[tuple]],
                block: Mapping[Hashable, int]) -> list[list]:
    """Barycenter sweeps + sifting, twice (ties kept; ties reversed every other round);
    the order with the fewest crossings wins."""
    total = lambda o: sum(crossings(o, links, r) for r in range(len(o) - 1))  # noqa: E731
    start = [sorted(rk, key=block.__getitem__) for rk in order]
    best, best_c = [list(rk) for rk in start], total(start)
    for alternate in (False, True):
        cur = [list(rk) for rk in start]
        for rnd in range(8):
            flip = -1 if alternate and rnd % 2 else 1
            for r, nbrs, ref in [(r, up, r - 1) for r in range(1, len(cur))] + \
                    [(r, down, r + 1) for r in range(len(cur) - 2, -1, -1)]:
                pos = {it: i for i, it in enumerate(cur[ref])}
                key = {it: (block[it],
                            sum(pos[n] for n in nbrs[it]) / len(nbrs[it]) if nbrs[it] else i,
                            flip * i) for i, it in enumerate(cur[r])}
                cur[r].sort(key=key.__getitem__)
            _sift(cur, up, down, block)
            if (c := total(cur)) < best_c:
                best, best_c = [list(rk) for rk in cur], c
    return best


def pav(want: list[float], seps: list[float]) -> list[float]:
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
