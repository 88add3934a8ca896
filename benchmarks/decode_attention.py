"""Decode attention grouped by context length vs one padded group (`engine.runners.paged_attention`).

One layer shaped like SmolLM2-135M's (3 KV heads, 9 query heads, head dim 64, fp32), paged
KV with block size 16. Mixes: ``mixed`` = 63 sequences of 128 tokens beside one of 4,096
(one long request used to make every short one gather and attend over 4,096 positions);
``uniform`` = 64 of 1,024 (grouping has nothing to split: the cost of the grouping itself).
For each: milliseconds per decode step of that layer, grouped and as one padded group, and
the ratio one-group / grouped (higher = grouping faster), measured alternately in this run.
Prints one JSON line with --json.

``--context B:L,...`` measures instead the in-place decode kernel (`engine.kernels.decode_kernel`)
on bfloat16 caches: B sequences of L tokens, their blocks scattered over the cache as a server's
are, over enough layers that the caches do not fit in the CPU's caches (as in a 30-layer model).
Figures: ms per layer, the cache bytes read per second, and that over the machine's read
bandwidth measured in the same run (a sum over a buffer as large, on the same threads):

    .venv/bin/python benchmarks/decode_attention.py --threads 2 --context 32:320,1:16384 --json
"""

from __future__ import annotations

import argparse
import json
import os
import time

from actorserve.omp import apply_defaults  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()

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


def read_gbs(nbytes: int, reps: int) -> float:
    """The machine's read bandwidth: a bfloat16 sum over a buffer of `nbytes`, best of `reps`."""
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_()
    best = min(_timed(buf.sum) for _ in range(reps))
    return nbytes / best / 1e9


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernel_context(b: int, length: int, reps: int) -> dict[str, float]:
    """The decode kernel over `b` sequences of `length` tokens in bfloat16, scattered blocks."""
    from actorserve.engine.kernels import decode_kernel
    kern, why = decode_kernel.load()
    if kern is None:
        raise SystemExit(f"no decode kernel: {why}")
    nb = -(-length // BS)
    layer_bytes = 2 * b * nb * BS * NKV * D * 2
    layers = max(2, -(-(256 << 20) // layer_bytes))      # 256 MB of caches in all: past any L3
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(b * nb * BS, NKV, D, generator=g).bfloat16() for _ in range(layers)]
    vs = [torch.randn(b * nb * BS, NKV, D, generator=g).bfloat16() for _ in range(layers)]
    table = torch.randperm(b * nb, generator=g).int().view(b, nb).contiguous()
    ctx = torch.full((b,), length, dtype=torch.int32)
    q = torch.randn(b, NKV, GROUP, D, generator=g)
    out = torch.empty_like(q)

    def step() -> None:
        for k, v in zip(ks, vs):
            kern.run(q, k, v, table, ctx, BS, D ** -0.5, None, out)
    step()
    ms = min(_timed(step) for _ in range(reps)) / layers * 1e3
    read = 2 * b * length * NKV * D * 2
    gbs = read / ms / 1e6
    machine = read_gbs(layers * layer_bytes, 3)
    return {"ms_per_layer": round(ms, 3), "cache_gb_s": round(gbs, 1), "machine_read_gb_s": round(machine, 1),
            "of_bandwidth": round(gbs / machine, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", default=None, metavar="B:L,...",
                    help="the in-place kernel on bf16 caches of B sequences of L tokens instead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out: dict[str, object] = {"threads": args.threads}
    if args.context:
        for item in args.context.split(","):
            b, length = (int(x) for x in item.split(":"))
            out[f"B{b}_L{length}"] = kernel_context(b, length, max(3, args.reps // 4))
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return
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
