"""Decode attention grouped by context length vs one padded group (`engine.runners.paged_attention`).

One layer shaped like SmolLM2-135M's (3 KV heads, 9 query heads, head dim 64, fp32), paged
KV with block size 16. Mixes: ``mixed`` = 63 sequences of 128 tokens beside one of 4,096
(one long request used to make every short one gather and attend over 4,096 positions);
``uniform`` = 64 of 1,024 (grouping has nothing to split: the cost of the grouping itself).
For each: milliseconds per decode step of that layer, grouped and as one padded group, and
the ratio one-group / grouped (higher = grouping faster), measured alternately in this run.
Prints one JSON line with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from actorserve.engine.runners import paged_attention as pa  # noqa: E402
from actorserve.engine.runners.block_tables import BlockTables  # noqa: E402
from actorserve.engine.scheduling.sequence import Sequence  # noqa: E402

BS, NKV, GROUP, D = 16, 3, 3, 64


def setup(ctxs: list[int]):  # type: ignore[no-untyped-def]
    blocks = sum(-(-c // BS) for c in ctxs)
    kv = pa.PagedKV(1, blocks, BS, NKV, D)
    for t in (kv.k[0], kv.v[0]):
        t.normal_()
    free = list(range(blocks))
    seqs = []
    for i, c in enumerate(ctxs):
        s = Sequence(f"r{i}", [1] * c)
        s.block_table = [free.pop() for _ in range(-(-c // BS))]
        s.num_computed = c - 1
        seqs.append(s)
    q = torch.randn(len(ctxs), NKV * GROUP, D)
    return kv, [(s, 1) for s in seqs], q


def step_ms(kv, batch, q, grouped: bool, reps: int) -> float:  # type: ignore[no-untyped-def]
    real = pa.group_by_length
    if not grouped:
        pa.group_by_length = lambda needs, **_: [list(range(len(needs)))]
    try:
        out = torch.empty(q.shape[0], NKV * GROUP * D)
        tables = BlockTables(BS)
        t0 = time.perf_counter()
        for _ in range(reps):
            plan = pa.plan_step(batch, tables, GROUP)
            pa.paged_attention(q, kv, 0, plan, out, scale=D ** -0.5)
        return (time.perf_counter() - t0) / reps * 1e3
    finally:
        pa.group_by_length = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out: dict[str, object] = {"threads": args.threads}
    for name, ctxs in (("mixed", [128] * 63 + [4096]), ("uniform", [1024] * 64)):
        kv, batch, q = setup(ctxs)
        step_ms(kv, batch, q, True, 2)
        g, one = [], []
        for _ in range(args.rounds):
            g.append(step_ms(kv, batch, q, True, args.reps))
            one.append(step_ms(kv, batch, q, False, args.reps))
        gm, om = sorted(g)[len(g) // 2], sorted(one)[len(one) // 2]
        out[name] = {"grouped_ms": round(gm, 2), "one_group_ms": round(om, 2),
                     "ratio": round(om / gm, 2), "groups": len(pa.plan_step(batch, BlockTables(BS), GROUP).decode)}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
