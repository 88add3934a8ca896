"""q4 decode at long contexts: the step pool and the fused step against the plain path.

At long contexts a step's attention runs on both cores (`decode_kernel.PARALLEL_MIN_ELEMENTS`):
in the fused step shared out over the step pool's threads (`paged_decode_part`), on the glued
path on OpenMP threads while the pool sleeps (`quant.StepPool.paused`). This measures what
the pool, the glue and the fused step give there: the real `PagedLlamaRunner` on the embedded SmolLM2 with q4 and
``--dtype`` (default bfloat16), B sequences prefilled to L tokens (``--cases L:B,...``), then
``--steps`` greedy decode steps with everything on, and with the fused step, the glue and the
pool off (the plain path), alternating on the same sequences, ``--repeats`` times; the best
ms a step of each and their ratio. (That both paths decode the same tokens is a test:
tests/test_glue.py.)

    .venv/bin/python benchmarks/quant_long_context.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from actorserve.omp import apply_defaults  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402
from actorserve.engine.runners.runner import build_engine  # noqa: E402
from actorserve.engine.scheduling.sequence import Sequence  # noqa: E402


def case(model: Any, L: int, B: int, steps: int, repeats: int) -> dict[str, Any]:
    need = L // 16 + steps * (2 * repeats + 1) // 16 + 2
    engine = build_engine(model, num_blocks=B * need, block_size=16, max_model_len=need * 16)
    seqs = []
    for i in range(B):
        s = Sequence(f"s{i}", [(7 * j + i) % 40000 + 100 for j in range(L)],
                     sampling=SamplingParams(temperature=0.0, max_new_tokens=10 ** 6))
        s.block_table = list(range(i * need, (i + 1) * need))
        while s.num_computed < L:                     # prefill in chunks of 512
            n = min(512, L - s.num_computed)
            out = engine.execute([(s, n)])
            s.num_computed += n
        s.output_ids.append(out[0].token_id)
        seqs.append(s)
    full = {a: getattr(engine, a) for a in ("fused", "glue", "step_pool")}
    best = {"full": float("inf"), "plain": float("inf")}
    for _ in range(repeats):
        for mode in ("full", "plain"):
            for a, v in full.items():
                setattr(engine, a, v if mode == "full" else None)
            t0 = time.perf_counter()
            for _ in range(steps):
                outs = engine.execute([(s, 1) for s in seqs])
                for s, o in zip(seqs, outs):
                    s.num_computed += 1
                    s.output_ids.append(o.token_id)
            best[mode] = min(best[mode], (time.perf_counter() - t0) / steps * 1e3)
    return {"L": L, "B": B, "full_ms": round(best["full"], 2), "plain_ms": round(best["plain"], 2),
            "speedup": round(best["plain"] / best["full"], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--cases", default="6000:1,3000:4")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from actorserve.engine.weights.models import load_model

    model, _, _ = load_model(args.model, dtype=getattr(torch, args.dtype), quantization="q4")
    result: dict[str, Any] = {"bench": "quant_long_context", "dtype": args.dtype,
                              "threads": torch.get_num_threads(), "cases": []}
    for item in args.cases.split(","):
        L, B = (int(v) for v in item.split(":"))
        fig = case(model, L, B, args.steps, args.repeats)
        print(fig, file=sys.stderr, flush=True)
        result["cases"].append(fig)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
