"""The row buckets of the packed dense linears (`engine.runners.dense.BUCKETS`): their speed cost, A/B in
one process.

Loads the model as ``make serve`` does (``--dtype``/``--quantization`` auto unless given), then
for each prefill length and each decode batch runs the same work with the buckets off
(``dense.BUCKET = False``: every row count as it is, what ``ACTORSERVE_DENSE=exact`` does) and
on, alternating, ``--rounds`` times. The two see the same machine load, so their ratio is
what the buckets cost even where the absolute times are noisy (a shared box). Prints one JSON
line: per case, wall and CPU ms (min) of each and the bucketed / exact ratios of their mins
and medians (above 1, the buckets cost time), and the row count oneDNN computed. A case whose
width is a bucket already (``decode 40 rows``) does the same work both ways: its ratios show
the noise.

    python benchmarks/dense_buckets.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from actorserve.omp import apply_defaults  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from actorserve.engine.runners import dense  # noqa: E402
from engine import prompts_of, runner_prefill  # noqa: E402  (benchmarks/engine.py)
from quant_decode import decode  # noqa: E402
from serverproc import cpu_name  # noqa: E402


def ab(fn, rounds: int) -> dict[str, float]:
    """`fn()` with the buckets off and on, alternating: wall ms (what `fn` returns, seconds) and
    the process's CPU ms around it (all its threads: less disturbed by other processes on a
    shared box than wall time, as long as OpenMP waits passively), min and median, and the
    bucketed / exact ratios of each."""
    fn()                                   # compile both sets of shapes before timing
    dense.BUCKET = False
    fn()
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            dense.BUCKET = on
            c0 = time.process_time()
            wall[on].append(fn() * 1e3)
            cpu[on].append((time.process_time() - c0) * 1e3)
    dense.BUCKET = True
    out: dict[str, float] = {}
    for name, d in (("wall", wall), ("cpu", cpu)):
        ex, bu = d[False], d[True]
        out.update({f"{name}_exact_min_ms": round(min(ex), 2), f"{name}_bucketed_min_ms": round(min(bu), 2),
                    f"{name}_ratio_min": round(min(bu) / min(ex), 3),
                    f"{name}_ratio_median": round(statistics.median(bu) / statistics.median(ex), 3)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--prefill", default="90,260,300,700", help="prompt lengths")
    p.add_argument("--batches", default="12,20,40", help="decode batch widths (rows a step)")
    p.add_argument("--decode", type=int, default=6, help="decode steps a measurement")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from actorserve.engine.weights.dtype import resolve_dtype
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.runners.runner import build_engine

    dtype, _ = resolve_dtype(args.dtype)
    model, tok, _ = load_model(args.model, dtype=dtype, quantization=args.quantization)
    lengths = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    need = max(lengths + [64]) + max(batches + [1]) * (64 + args.decode + 2)
    engine = build_engine(model, num_blocks=-(-need // 16) + 8, block_size=16)
    cases = []
    for n in lengths:
        prompt = prompts_of(tok, 1, n)[0]
        res = ab(lambda: runner_prefill(engine, prompt), args.rounds)
        cases.append({"case": f"prefill {len(prompt)}", "rows_computed": _computed(len(prompt)), **res})
    short = prompts_of(tok, 1, 32)[0]
    for b in batches:
        res = ab(lambda: decode(engine, short, b, args.decode)[0] / 1e3, args.rounds)
        cases.append({"case": f"decode {b} rows", "rows_computed": _computed(b), **res})
    out = {"bench": "dense_buckets", "cpu": cpu_name(), "dtype": str(dtype).removeprefix("torch."),
           "packed": getattr(model, "actorserve_packed", None), "cases": cases,
           "args": {k: v for k, v in vars(args).items() if k != "json"}}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


def _computed(rows: int) -> int:
    whole, rest = divmod(rows, dense.CHUNK)
    return whole * dense.CHUNK + (dense.bucket_rows(rest) if rest else 0)


if __name__ == "__main__":
    main()
