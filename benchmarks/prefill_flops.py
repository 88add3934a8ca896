"""Prefill at the CPU's matrix throughput: achieved FLOP/s of a prompt chunk against the machine's
measured peak, in one run.

The real `PagedLlamaRunner` on the embedded SmolLM2-135M-Instruct as ``make serve`` loads it
(``--dtype``/``--quantization`` auto unless given) prefills one prompt of ``--tokens`` tokens
(best of ``--repeats``). Its FLOPs are counted from the shapes: 2 x (the linears' weights) per
token, plus causal attention, 2 x T^2 x heads x head_dim per layer (QK^T and PV over half the
square); the LM head runs for the last row only. The peak is the best of a few square matmuls
(``--peak-n``) in the same dtype on the same threads: what torch's kernels reach on this CPU
(AMX tiles, avx512_bf16 or float32 FMA). Prints one JSON line: ms, GFLOP/s, peak GFLOP/s and
their ratio, and the CPU's matrix features.

And the decode floor: the machine's read bandwidth (the best of a few sums over a 1 GiB
float32 tensor) and what a decode step must read at the least, over it: the quantized
weights (the q4/q8 copies, what a step of at most the runner's `kernel_rows` reads: 8 rows, or
256 with bf16 where the CPU has avx512_bf16) or the dense weights in the model's dtype (wider
steps), plus ``--floor-context`` tokens of KV per sequence.

    .venv/bin/python benchmarks/prefill_flops.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from actorserve.omp import apply_defaults  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import prompts_of, runner_prefill  # noqa: E402  (benchmarks/engine.py)


def peak(dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """GFLOP/s of the best of `repeats` n x n x n matmuls in `dtype`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_gb_per_s(repeats: int = 3) -> float:
    big = torch.ones(1 << 28)                     # 1 GiB of float32
    big.sum()
    return (big.numel() * 4) / min(_timed(big.sum) for _ in range(repeats)) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-n", type=int, default=2048)
    p.add_argument("--floor-context", type=int, default=200, help="KV tokens per sequence in the floor")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from actorserve.engine.weights.dtype import cpu_bf16_flags, resolve_dtype
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.runners.runner import build_engine

    dtype, why = resolve_dtype(args.dtype)
    model, tok, _ = load_model(args.model, dtype=dtype, quantization=args.quantization)
    engine = build_engine(model, num_blocks=-(-args.tokens // 16) + 4, block_size=16)
    prompt = prompts_of(tok, 1, args.tokens)[0]
    T = len(prompt)
    runner_prefill(engine, prompt[:64])
    seconds = min(runner_prefill(engine, prompt) for _ in range(args.repeats))
    cfg = model.config
    head = model.get_output_embeddings()
    linear = sum(m.weight.numel() for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and m is not head)
    attn = 2 * T * T * cfg.num_attention_heads * engine.head_dim * cfg.num_hidden_layers
    flops = 2 * linear * T + attn + 2 * head.weight.numel()
    top = peak(dtype, args.peak_n)
    out = {"bench": "prefill_flops", "tokens": T, "dtype": str(dtype).removeprefix("torch."), "dtype_why": why,
           "cpu_matrix_features": list(cpu_bf16_flags()), "threads": torch.get_num_threads(),
           "ms": round(seconds * 1e3, 1), "tokens_per_s": round(T / seconds, 1),
           "gflop": round(flops / 1e9, 1), "gflop_per_s": round(flops / seconds / 1e9, 1),
           "peak_matmul_gflop_per_s": round(top, 1), "fraction_of_peak": round(flops / seconds / 1e9 / top, 3),
           "attention_share_of_flops": round(attn / flops, 3)}
    bw = read_gb_per_s()
    rep = getattr(model, "actorserve_quant", None)
    dense_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                      if isinstance(m, torch.nn.Linear))
    kv_token = 2 * cfg.num_hidden_layers * engine.n_kv * engine.head_dim * dtype.itemsize
    out["read_gb_per_s"] = round(bw, 1)
    floor: dict[str, float] = {}
    for rows in (1, 8, 32):
        weights = rep.quant_bytes if rep is not None and rows <= engine.kernel_rows else dense_bytes
        floor[f"{rows}_rows_ms"] = round((weights + rows * args.floor_context * kv_token) / bw / 1e6, 2)
    out["decode_floor"] = {"weights_mb_quantized": round(rep.quant_bytes / 1e6, 1) if rep else None,
                           "weights_mb_dense": round(dense_bytes / 1e6, 1),
                           "kv_kb_per_token": round(kv_token / 1e3, 1), "context": args.floor_context,
                           "kernel_rows": engine.kernel_rows, **floor}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
