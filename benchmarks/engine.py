"""The engine against an external floor: the paged runner vs HF ``generate`` with a static cache.

Same model (the embedded SmolLM2-135M-Instruct by default), same machine, same run, for each
dtype in ``--dtypes``:

* **decode**: B sequences (B in ``--batches``, default 1, 16, 64) of a ``--prompt-len`` token
  prompt each, prefilled, then ``--decode`` greedy tokens a step for all B. actorserve's side
  is `PagedLlamaRunner.execute` driven in a loop (the engine alone, no actors); HF's is
  ``model.generate(..., cache_implementation="static", do_sample=False)`` on the same batch,
  timed minus its own prefill (a ``max_new_tokens=1`` run). Rates are generated tokens / s.
* **prefill**: one 512-token prompt, tokens / s, both sides.
* **quality** (bf16 only): greedy tokens of the runner in bf16 vs fp32 on the decode prompts:
  the share of tokens before the first difference.

Every figure is the best of ``--repeats`` (noise on a shared box only ever slows a run down).
Prints ONE JSON line: ``{dtype: {decode_B: {actorserve, hf, ratio}, prefill_512: {...}},
bf16_vs_fp32_decode_B: ratio, greedy_agreement, threads, cpu_bf16}``.

    .venv/bin/python benchmarks/engine.py --json
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

from actorserve.engine.weights.dtype import cpu_bf16_flags  # noqa: E402
from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402
from actorserve.engine.runners.runner import build_engine  # noqa: E402
from actorserve.engine.scheduling.sequence import Sequence  # noqa: E402


def prompts_of(tok: Any, n: int, length: int) -> list[list[int]]:
    base = tok.encode("The history of the city is long and full of stories about its people, "
                      "its rivers, its markets and its many old bridges. " * 40)
    return [base[i:i + length] for i in range(n)]


def runner_decode(engine: Any, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    """Seconds for `n` decode steps of all prompts (prefill excluded), and the tokens."""
    bs = engine.kv.block_size
    seqs, offset = [], 0
    for i, p in enumerate(prompts):
        s = Sequence(f"b{i}", p, sampling=SamplingParams(temperature=0.0, max_new_tokens=n))
        need = -(-(len(p) + n + 1) // bs)
        s.block_table = list(range(offset, offset + need))
        offset += need
        seqs.append(s)
    with torch.inference_mode():
        outs = engine.execute([(s, s.num_tokens) for s in seqs])
        for s, o in zip(seqs, outs):
            s.num_computed = s.num_tokens
            s.output_ids.append(o.token_id)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            outs = engine.execute([(s, 1) for s in seqs])
            for s, o in zip(seqs, outs):
                s.num_computed += 1
                s.output_ids.append(o.token_id)
        took = time.perf_counter() - t0
    return took, [s.output_ids for s in seqs]


def runner_prefill(engine: Any, prompt: list[int]) -> float:
    bs = engine.kv.block_size
    s = Sequence("p", prompt, sampling=SamplingParams(temperature=0.0, max_new_tokens=1))
    s.block_table = list(range(-(-(len(prompt) + 1) // bs)))
    t0 = time.perf_counter()
    engine.execute([(s, len(prompt))])
    return time.perf_counter() - t0


def hf_generate(model: Any, prompts: list[list[int]], n: int) -> float:
    ids = torch.tensor(prompts, dtype=torch.long)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        full = time.perf_counter() - t0
    return max(full - first, 1e-9)


def hf_prefill(model: Any, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from actorserve.engine.weights.models import load_model

    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, Any] = {"threads": args.threads or torch.get_num_threads(),
                              "cpu_bf16": list(cpu_bf16_flags())}
    tokens: dict[str, list[list[int]]] = {}
    for name in args.dtypes.split(","):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
        model, tok, _ = load_model(args.model, threads=args.threads, dtype=dtype)
        blocks = sum(-(-(args.prompt_len + args.decode + 1) // 16) for _ in range(max(batches))) + 64
        engine = build_engine(model, num_blocks=blocks, block_size=16)
        fig: dict[str, Any] = {}
        for b in batches:
            prompts = prompts_of(tok, b, args.prompt_len)
            ours = min(runner_decode(engine, prompts, args.decode)[0] for _ in range(args.repeats))
            hf = min(hf_generate(model, prompts, args.decode) for _ in range(args.repeats))
            steps = args.decode - 1
            fig[f"decode_{b}"] = {"actorserve": round(b * steps / ours, 1),
                                  "hf": round(b * (args.decode - 1) / hf, 1), "ratio": round(hf / ours, 3)}
            print(f"{name} decode B={b}: {fig[f'decode_{b}']}", file=sys.stderr, flush=True)
        _, tokens[name] = runner_decode(engine, prompts_of(tok, 8, args.prompt_len), args.decode)
        long = prompts_of(tok, 1, 512)[0]
        ours = min(runner_prefill(engine, long) for _ in range(args.repeats))
        hf = min(hf_prefill(model, long) for _ in range(args.repeats))
        fig["prefill_512"] = {"actorserve": round(512 / ours, 1), "hf": round(512 / hf, 1),
                              "ratio": round(hf / ours, 3)}
        result[name] = fig
        del engine, model
    if "float32" in result and "bfloat16" in result:
        for b in batches:
            key = f"decode_{b}"
            result[f"bf16_vs_fp32_{key}"] = round(result["bfloat16"][key]["actorserve"]
                                                  / result["float32"][key]["actorserve"], 3)
        result["bf16_vs_fp32_prefill_512"] = round(result["bfloat16"]["prefill_512"]["actorserve"]
                                                   / result["float32"]["prefill_512"]["actorserve"], 3)
        same = total = 0
        for r, g in zip(tokens["float32"], tokens["bfloat16"]):
            total += len(r)
            same += next((i for i, (a, c) in enumerate(zip(r, g)) if a != c), len(r))
        result["greedy_agreement"] = round(same / total, 3)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
