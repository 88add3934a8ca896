"""A prompt chunk's causal attention, one layer: the C kernel against torch's paths.

One layer shaped like SmolLM2-135M's (9 query heads, 3 KV heads, head size 64), bf16, random
q/k/v, with the server's OpenMP settings (`actorserve.omp`). For each chunk ``start:n`` (n
queries after `start` tokens of context): milliseconds (best of `--reps`) for the prefill kernel
(`engine.kernels.prefill_kernel`, where the CPU has avx512_bf16), torch's query blocks
(`prefill_attention.causal_blocked`, where they take the chunk: 256 tokens from position 0, 32
after context) and SDPA (causal from position 0, with a mask after context), alternated in one
process; the kernel's GFLOP/s (the causal half of the two products); and torch's best over the
kernel. One JSON line with --json:

    .venv/bin/python benchmarks/prefill_attention.py --chunks 0:32,0:256,0:1024,0:2048,300:16 --json
"""

from __future__ import annotations

import argparse
import json
import time

from actorserve.omp import apply_defaults

apply_defaults()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from actorserve.engine.kernels import prefill_kernel  # noqa: E402
from actorserve.engine.runners import prefill_attention as pa  # noqa: E402

NH, NKV, D = 9, 3, 64


def _best(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def one(start: int, n: int, reps: int, kernel: prefill_kernel.PrefillKernel | None) -> dict[str, float]:
    L = start + n
    q = torch.randn(n, NH, D).bfloat16()
    k, v = torch.randn(L, NKV, D).bfloat16(), torch.randn(L, NKV, D).bfloat16()
    out = torch.empty(n, NH, D, dtype=torch.bfloat16)
    kh, vh = k.view(1, L, NKV, D).transpose(1, 2), v.view(1, L, NKV, D).transpose(1, 2)
    qh = q.transpose(0, 1).unsqueeze(0)
    mask = None if start == 0 else torch.arange(L)[None] <= torch.arange(start, L)[:, None]
    ways = {"sdpa": lambda: out.copy_(F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=D ** -0.5, enable_gqa=True)[0].transpose(0, 1))}
    if n >= (pa.MIN_ROWS if start == 0 else pa.MIN_ROWS_AFTER):
        ways["blocks"] = lambda: pa.causal_blocked(q, k, v, D ** -0.5, out, start)
    if kernel is not None:
        ways["kernel"] = lambda: kernel.run(q, k, v, D ** -0.5, out, start)
    best: dict[str, float] = {}
    for _ in range(2):                      # alternated: each way's best of both rounds
        for name, fn in ways.items():
            best[name] = min(best.get(name, float("inf")), _best(fn, reps))
    res = {f"{name}_ms": round(ms, 4) for name, ms in best.items()}
    if kernel is not None:
        flops = 4 * NH * D * (n * start + n * (n + 1) / 2)         # q.k and p.v over the keys each query sees
        res["kernel_gflops"] = round(flops / best["kernel"] / 1e6, 1)
        res["torch_over_kernel"] = round(min(ms for name, ms in best.items() if name != "kernel") / best["kernel"], 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="0:32,0:256,0:1024,0:2048,300:16", help="start:n,...")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    kernel, why = prefill_kernel.load()
    out: dict[str, object] = {"threads": torch.get_num_threads(), "kernel": why}
    for chunk in args.chunks.split(","):
        start, n = (int(x) for x in chunk.split(":"))
        out[f"start{start}_n{n}"] = one(start, n, args.reps, kernel)
        if not args.json:
            print(chunk, out[f"start{start}_n{n}"], flush=True)
    print(json.dumps(out) if args.json else out)


if __name__ == "__main__":
    main()
