"""Decode at scale: many sequences and long contexts through the paged runner (issue 13 part 2).

The real `PagedLlamaRunner` on the embedded SmolLM2-135M-Instruct, one decode step for every
member at a time, for shapes that hold the same number of KV tokens (``--kv-tokens``, default
131,072) split differently: 256 x 512, 64 x 2,048, 16 x 8,192, plus 1 x 8,192 alone and
256 x 64 (short contexts, the linear-layer floor of a 256-wide batch). The KV is filled with
random values instead of prefilled (the attention reads the same bytes either way; the
prefill of 131k tokens would take minutes here), the contexts' blocks are scattered (shuffled
block ids) as a long-running server's are.

Each shape runs twice, with the in-place decode kernel (`engine.kernels.decode_kernel`) and with the
torch gather + SDPA path, same engine, same KV (``inplace_vs_gather``: the tok/s ratio).
Per shape and path: ms per step, output tok/s, and where the step goes: ``plan_ms`` (`plan_step`, the
Python side: its cost is per member, never per block), ``attn_ms`` (`paged_attention` summed
over the layers: gather + SDPA) and the rest (linears, norms, sampling). ``attn_gbps`` is the
KV bytes the step's attention must read at least once divided by ``attn_ms``. Also the
ratio of each shape's tok/s to 256 x 64's (``vs_short``): how much the long contexts cost
against the same batch width without them. Best of ``--repeats`` runs of ``--steps`` steps.

    .venv/bin/python benchmarks/scale.py --json            # bf16 where the CPU has it
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from actorserve.omp import apply_defaults  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from actorserve.engine.runners import runner as runner_mod  # noqa: E402
from actorserve.engine.weights.dtype import dtype_name, resolve_dtype  # noqa: E402
from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402
from actorserve.engine.scheduling.sequence import Sequence  # noqa: E402

BS = 16


class Timed:
    """Wraps a function and sums the seconds spent in it."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.s = fn, 0.0

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.s += time.perf_counter() - t0


def shape_run(engine: Any, b: int, ctx: int, steps: int, rng: random.Random) -> dict[str, float]:
    need = -(-(ctx + steps + 1) // BS)
    free = list(range(engine.kv.num_blocks))
    rng.shuffle(free)
    seqs = []
    for i in range(b):
        s = Sequence(f"s{i}", [rng.randrange(1000, 20000) for _ in range(ctx)],
                     sampling=SamplingParams(temperature=0.0, max_new_tokens=steps + 1))
        s.block_table = [free.pop() for _ in range(need)]
        s.num_computed = ctx - 1                      # all but the last prompt token are "in the KV"
        seqs.append(s)
    attn, plan = Timed(runner_mod.paged_attention), Timed(runner_mod.plan_step)
    runner_mod.paged_attention, runner_mod.plan_step = attn, plan
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            outs = engine.execute([(s, 1) for s in seqs])
            for s, o in zip(seqs, outs):
                s.num_computed += 1
                s.output_ids.append(o.token_id)
        wall = time.perf_counter() - t0
    finally:
        runner_mod.paged_attention, runner_mod.plan_step = attn.fn, plan.fn
        for s in seqs:
            engine.release(s)
    kv_bytes = 2 * len(engine.layers) * b * (ctx + steps / 2) * engine.n_kv * engine.head_dim \
        * engine.kv.k[0].element_size()
    return {"step_ms": wall / steps * 1e3, "tok_s": b * steps / wall, "plan_ms": plan.s / steps * 1e3,
            "attn_ms": attn.s / steps * 1e3, "attn_gbps": kv_bytes / (attn.s / steps) / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-tokens", type=int, default=131072)
    p.add_argument("--shapes", default=None, help="BxCTX,... (default: the ones in the docstring)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only-default", action="store_true",
                   help="only the runner's own decode attention (default: in place and gather, alternately)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from actorserve.engine.weights.models import load_model

    kt = args.kv_tokens
    shapes = [(256, 64), (256, kt // 256), (64, kt // 64), (16, kt // 16), (1, kt // 16)]
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dtype, why = resolve_dtype(args.dtype)
    model, _, _ = load_model(args.model, threads=args.threads, dtype=dtype)
    blocks = max(b * -(-(c + args.steps + 1) // BS) for b, c in shapes) + 16
    engine = runner_mod.build_engine(model, num_blocks=blocks, block_size=BS, max_model_len=1 << 20)
    gen = torch.Generator().manual_seed(0)
    for t in engine.kv.k + engine.kv.v:
        t.normal_(generator=gen)
    rng = random.Random(0)
    result: dict[str, Any] = {"dtype": dtype_name(dtype), "why": why, "threads": torch.get_num_threads(),
                              "kv_gib": round(engine.kv.nbytes / 2 ** 30, 2), "steps": args.steps}
    kernel = engine.decode_kernel
    result["decode_attention"] = engine.info.attention
    modes = [("inplace", kernel), ("gather", None)] if kernel is not None and not args.only_default \
        else [("default", kernel)]
    for b, c in shapes:
        fig: dict[str, Any] = {}
        for name, kern in modes:
            engine.decode_kernel = kern
            shape_run(engine, b, c, 1, rng)                         # warm the scratch buffers
            runs = [shape_run(engine, b, c, args.steps, rng) for _ in range(args.repeats)]
            best = max(runs, key=lambda r: r["tok_s"])
            fig[name] = {k: round(v, 2) for k, v in best.items()}
        if len(modes) == 2:
            fig["inplace_vs_gather"] = round(fig["inplace"]["tok_s"] / fig["gather"]["tok_s"], 3)
        engine.decode_kernel = kernel
        result[f"{b}x{c}"] = fig
        print(f"{b}x{c}: {fig}", file=sys.stderr, flush=True)
    if "256x64" in result:
        for b, c in shapes:
            for name, _ in modes:
                result[f"{b}x{c}"][name]["vs_short"] = round(
                    result[f"{b}x{c}"][name]["tok_s"] / result["256x64"][name]["tok_s"], 3)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
