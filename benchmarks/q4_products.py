"""The q4 products alone, by width: the row kernel, the 16-row superblocks and packed dense bf16.

SmolLM2-135M's four layer shapes (q/k/v 960x576, o 576x576, gate/up 3072x576, down 576x1536),
random weights quantized to Q4_1, bfloat16 activations of ``--rows`` rows; each product timed
best of 3 passes of ``max(2, 2000 // rows)`` calls, the four summed, as GFLOP/s (2 M N K over the
time). The kernels run with the step pool on (as in a decode step), dense without it (as the
runner calls it: `engine.runners.dense`, the weight packed for oneDNN). The row kernel takes at
most 16 rows here (it is the slower one past that). One JSON line:

    .venv/bin/python benchmarks/q4_products.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

from actorserve.omp import apply_defaults  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()

import torch  # noqa: E402

from actorserve.engine.kernels import quant  # noqa: E402
from actorserve.engine.runners import dense  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _best(fn: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,8,16,32,64,128,256")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    lib = quant._Lib()
    if not lib.b16:
        raise SystemExit("this CPU has no avx512_bf16: the superblock kernel is not built")
    torch.manual_seed(0)
    weights = []
    for n, k in SHAPES:
        lin = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            lin.weight.copy_(quant.dequantize_q4(*quant.quantize_q4(torch.randn(n, k) * 0.05)))
        row = quant.QuantLinear(lin, "q4", lib).w
        row.max_rows = 1 << 16
        b16 = quant._Weights(4, row.q, row.d, row.m, None)
        b16.use_b16(rows=1 << 16)
        lin = lin.bfloat16()
        dense.pack_model(lin)
        weights.append((n, k, row, b16, lin))
    pool = quant.StepPool(torch.get_num_threads() - 1)
    out: dict[str, Any] = {"bench": "q4_products", "threads": torch.get_num_threads(), "gflops": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        t = {"row": 0.0, "b16": 0.0, "dense": 0.0}
        flops = 0
        for n, k, row, b16, lin in weights:
            x = torch.randn(m, k).bfloat16()
            reps = max(2, 2000 // m)
            with pool:
                t["b16"] += _best(lambda: b16.run(lib, x), reps)
                if m <= 16:
                    t["row"] += _best(lambda: row.run(lib, x), reps)
            t["dense"] += _best(lambda: dense.linear(lin, x), reps)
            flops += 2 * m * n * k
        out["gflops"][m] = {name: round(flops / v / 1e9, 1) for name, v in t.items() if v}
        if not args.json:
            print(m, out["gflops"][m], flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
