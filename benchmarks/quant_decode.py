"""Quantized decode (`--quantization q4`) against the dense weights, in the engine alone.

The real `PagedLlamaRunner` on the embedded SmolLM2-135M-Instruct, one greedy sequence (or
B of them, B in ``--batches``, default 1, 4, 8: the steps the q4 kernels take) prefilled
from a 14-token prompt, then ``--decode`` decode steps. Configurations, all in this run:
fp32 dense, bf16 dense, q4 with fp32 activations, q4 with bf16 activations; each q4 engine
also with its decode-step pieces taken away one by one (``without_fused_step``: the layers
one Python call at a time; ``without_glue``: HF's norm and RoPE modules too;
``without_step_pool``: and the kernels' threads by the OpenMP rules alone, with, at B=1,
every product on all threads, ``PARALLEL_MIN = 0``, which is why small products run on one
without the pool), each variant's greedy tokens against the full engine's. Figures are ms
per decode step (best of ``--repeats``) and the ratio of each to fp32 dense;
``greedy_same_q4_fp32_vs_fp32`` says whether q4-fp32's tokens equal dense fp32's (the
default model's q4 weights are its own, so they should).

    .venv/bin/python benchmarks/quant_decode.py --json
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

from actorserve.engine.kernels import quant  # noqa: E402
from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402
from actorserve.engine.runners.runner import build_engine  # noqa: E402
from actorserve.engine.scheduling.sequence import Sequence  # noqa: E402
from engine import prompts_of, runner_prefill  # noqa: E402  (benchmarks/engine.py)


TEMPERATURE = 0.0       # ``--temperature``: the decode steps' sampling (0: greedy)


def decode(engine: Any, prompt: list[int], b: int, n: int) -> tuple[float, list[int]]:
    """ms per decode step of `b` copies of `prompt`, and the first copy's tokens."""
    bs = engine.kv.block_size
    need = -(-(len(prompt) + n + 1) // bs)
    seqs = []
    for i in range(b):
        s = Sequence(f"q{i}", prompt, sampling=SamplingParams(temperature=TEMPERATURE, max_new_tokens=n))
        s.block_table = list(range(i * need, (i + 1) * need))
        seqs.append(s)
    outs = engine.execute([(s, s.num_tokens) for s in seqs])
    for s, o in zip(seqs, outs):
        s.num_computed = s.num_tokens
        s.output_ids.append(o.token_id)
    t0 = time.perf_counter()
    for _ in range(n):
        outs = engine.execute([(s, 1) for s in seqs])
        for s, o in zip(seqs, outs):
            s.num_computed += 1
            s.output_ids.append(o.token_id)
    ms = (time.perf_counter() - t0) / n * 1e3
    for s in seqs:
        engine.release(s)
    return ms, list(seqs[0].output_ids)


# (name, the runner attributes set to None): each takes away one more piece of the q4 step
VARIANTS = [("without_fused_step", ("fused",)), ("without_glue", ("fused", "glue")),
            ("without_step_pool", ("fused", "glue", "step_pool"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--decode", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="fp32,bf16,q4_fp32,q4_bf16,q4a8_bf16",
                   help="which engines (fp32 is the reference of the ratios; leave it in for them)")
    p.add_argument("--prefill", type=int, default=512, help="also a prefill of this many tokens (0: none)")
    p.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                   help="also each q4 engine without its fused step, glue and step pool")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the decode steps at this temperature (default 0: greedy)")
    p.add_argument("--context", type=int, default=0,
                   help="the decode rows' prompt: this many tokens (default: a 14-token prompt); each "
                        "row's context is its own blocks, as a server's members are")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    global TEMPERATURE
    TEMPERATURE = args.temperature
    from actorserve.engine.weights.models import load_model

    batches = [int(x) for x in args.batches.split(",")]
    configs = [("fp32", torch.float32, "none"), ("bf16", torch.bfloat16, "none"),
               ("q4_fp32", torch.float32, "q4"), ("q4_bf16", torch.bfloat16, "q4"),
               ("q4a8_bf16", torch.bfloat16, "q4a8")]
    configs = [c for c in configs if c[0] in args.configs.split(",")]
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "decode_steps": args.decode}
    tokens: dict[str, list[int]] = {}
    for name, dtype, q in configs:
        model, tok, _ = load_model(args.model, dtype=dtype, quantization=q)
        prompt = (prompts_of(tok, 1, args.context)[0] if args.context
                  else tok.encode("Request 1: write a short story about a dragon and a knight"))
        need = -(-(len(prompt) + args.decode + 8) // 16)
        engine = build_engine(model, num_blocks=max(batches) * max(8, need) + 8, block_size=16)
        fig: dict[str, Any] = {}
        for b in batches:
            decode(engine, prompt, b, 4)
            fig[f"B{b}_ms"] = round(min(decode(engine, prompt, b, args.decode)[0] for _ in range(args.repeats)), 2)
        tokens[name] = decode(engine, prompt, 1, args.decode)[1]
        if args.prefill:             # one prompt of --prefill tokens, tokens / s (q4a8: its kernel too)
            long = prompts_of(tok, 1, args.prefill)[0]
            fig[f"prefill_{args.prefill}_tok_s"] = round(args.prefill / min(runner_prefill(engine, long)
                                                                            for _ in range(args.repeats)), 1)
        if q != "none" and args.variants:     # the same engine with its decode-step machinery taken away
            saved = {a: getattr(engine, a) for a in ("fused", "glue", "step_pool")}
            for vname, off in VARIANTS:
                for a in off:
                    setattr(engine, a, None)
                alone: dict[str, Any] = {f"B{b}_ms": round(min(decode(engine, prompt, b, args.decode)[0]
                                                               for _ in range(args.repeats)), 2) for b in batches}
                alone["greedy_same"] = decode(engine, prompt, 1, args.decode)[1] == tokens[name]
                if vname == VARIANTS[-1][0]:   # ... and every small product on all threads
                    keep, quant.PARALLEL_MIN = quant.PARALLEL_MIN, 0
                    alone["B1_all_threads_ms"] = round(min(decode(engine, prompt, 1, args.decode)[0]
                                                           for _ in range(args.repeats)), 2)
                    quant.PARALLEL_MIN = keep
                for a, v in saved.items():
                    setattr(engine, a, v)
                fig[vname] = alone
            fig["speedup_over_without_all"] = {f"B{b}": round(fig[VARIANTS[-1][0]][f"B{b}_ms"] / fig[f"B{b}_ms"], 2)
                                               for b in batches}
            fig["report"] = model.actorserve_quant.describe()
        result[name] = fig
        print(f"{name}: {fig}", file=sys.stderr, flush=True)
        del engine, model
    for name, *_ in configs:
        if "fp32" in result and name != "fp32":
            result[name]["speedup_vs_fp32"] = {f"B{b}": round(result["fp32"][f"B{b}_ms"] / result[name][f"B{b}_ms"], 2)
                                               for b in batches}
    if args.prefill and "fp32" in result:
        key = f"prefill_{args.prefill}_tok_s"
        result[f"prefill_{args.prefill}_vs_fp32"] = {n: round(result[n][key] / result["fp32"][key], 2)
                                                    for n, *_ in configs if n != "fp32"}
    if "q4_fp32" in tokens and "fp32" in tokens:
        result["greedy_same_q4_fp32_vs_fp32"] = tokens["q4_fp32"] == tokens["fp32"]
    if "q4a8_bf16" in tokens and "q4_bf16" in tokens:   # 8-bit activations: how far the tokens follow
        a, b = tokens["q4a8_bf16"], tokens["q4_bf16"]
        result["q4a8_greedy_prefix_vs_q4_bf16"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
