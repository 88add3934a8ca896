"""Structured outputs: what a grammar costs in decode speed, compile time and mask time.

In process, on the embedded SmolLM2-135M-Instruct (paged runner, the real sampler, the
runtime's actors; no HTTP), the same prompts are decoded greedily at 1 and at 16 concurrent
streams, once free and once under a JSON schema (a nested record with an enum, an array and
bounded strings), alternating the two in ``--rounds`` rounds so machine noise falls on both.
Each run's rate is generated tokens / wall time from the first submission to the last final
output. Then ``--schemas`` distinct schemas are compiled cold, and again from the cache, on
the runtime's worker thread (as the HTTP edge does), and the time spent filling and applying
the token bitmasks is read off `engine.sampling.grammar.mask_rows` during the constrained runs.

Prints ONE JSON line:

    ratio_1 / ratio_16: constrained tok/s over free tok/s (median of the rounds; goal >= 0.9),
    tok_s_free_1 / tok_s_json_1 / tok_s_free_16 / tok_s_json_16 (medians),
    compile_cold_p50_ms / p99, compile_cached_p50_ms / p99, mask_ms_per_step_p50 / p99 (a step
    of constrained rows: 1 or 16), mask_share (mask time / constrained wall time),
    valid_json (constrained outputs that parsed), tokens (per run), actorserve (the module).

    .venv/bin/python benchmarks/structured.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

from actorserve.omp import apply_defaults, release_idle_threads  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import actorserve  # noqa: E402
from actorserve.actors.runtime import Runtime  # noqa: E402
from actorserve.config import SchedulerConfig  # noqa: E402
from actorserve.engine.sampling import grammar as grammar_mod  # noqa: E402
from actorserve.engine.scheduling.batching import BatchConfig  # noqa: E402
from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "artist", "doctor", "farmer"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "street": {"type": "string", "maxLength": 30}},
                "required": ["city", "street"]}},
    "required": ["name", "age", "role", "skills", "address"]}
# For the speed runs: a schema no output can complete within the token budget (a long array of
# records), so constrained and free runs decode the same number of tokens at the same batch width
# and the rates compare the per-token cost alone (a record that ends early would shrink its batch).
LONG = {"type": "object", "properties": {"people": {
    "type": "array", "minItems": 60, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "role": {"enum": ["engineer", "artist", "doctor", "farmer"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "role", "age"]}}},
    "required": ["people"]}
TOPICS = ["a baker", "a pilot", "a painter", "a nurse", "a chess player", "a farmer", "a poet",
          "a sailor", "a coder", "a singer", "a teacher", "a judge", "a miner", "a chef", "a clown",
          "a monk"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else 0.0


def varied_schema(i: int) -> dict[str, Any]:
    """Distinct schemas of a realistic size (a dozen fields, nested, enums, arrays)."""
    props: dict[str, Any] = {}
    for j in range(12):
        kind = (i + j) % 4
        props[f"f{i}_{j}"] = ({"type": "string", "maxLength": 8 + j} if kind == 0 else
                              {"type": "integer", "minimum": 0, "maximum": 10 * (j + 1)} if kind == 1 else
                              {"enum": [f"v{i}_{j}_{k}" for k in range(3)]} if kind == 2 else
                              {"type": "array", "items": {"type": "object", "properties": {
                                  "x": {"type": "number"}, "y": {"type": "boolean"}}, "required": ["x"]},
                               "maxItems": 3})
    return {"type": "object", "properties": props, "required": sorted(props)[: 6]}


class MaskTimer:
    """Wraps `mask_rows` (the sampler imports it at call time) to time each call."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._orig = grammar_mod.mask_rows

    def __enter__(self) -> "MaskTimer":
        def timed(logits: Any, seqs: Any) -> None:
            t0 = time.perf_counter()
            self._orig(logits, seqs)
            self.times.append(time.perf_counter() - t0)
        grammar_mod.mask_rows = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        grammar_mod.mask_rows = self._orig


async def run(rt: Runtime, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, int, list[str]]:
    t0 = time.perf_counter()
    handles = [rt.generate(p, sp) for p in prompts]
    outs = [await h.stream.final() for h in handles]
    wall = time.perf_counter() - t0
    tokens = sum(o.completion_tokens for o in outs)
    return tokens / wall, tokens, [o.text for o in outs]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.runners.runner import build_engine
    from actorserve.engine.text.tokenizer import TextTokenizer

    model, hf, _ = load_model(args.model, threads=args.threads)
    tok = TextTokenizer(hf, generation_config=model.generation_config)
    engine = build_engine(model, num_blocks=2048, block_size=16, tokenizer=hf)
    release_idle_threads()          # as `serve` does: the step thread's OpenMP team is the only one
    rt = Runtime(engine, config=SchedulerConfig(batch=BatchConfig(max_num_seqs=32)),
                 detokenizer=tok.detokenizer_for)
    await rt.start()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe {t} as a JSON record."}])
               for t in TOPICS]
    free = SamplingParams(temperature=0.0, max_new_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_new_tokens=args.max_tokens,
                                 grammar=("json_schema", json.dumps(LONG)))
    record = SamplingParams(temperature=0.0, max_new_tokens=200, grammar=("json_schema", json.dumps(SCHEMA)))
    await rt.compile_grammar(constrained.grammar)
    await rt.compile_grammar(record.grammar)
    await run(rt, prompts[:2], free)                     # warm up both paths
    await run(rt, prompts[:2], constrained)
    rates: dict[str, list[float]] = {k: [] for k in ("free_1", "json_1", "free_16", "json_16")}
    tokens: dict[str, int] = {}
    masks: dict[int, list[float]] = {1: [], 16: []}
    mask_total = json_wall = 0.0
    valid = total = 0
    for _ in range(args.rounds):
        for width in (1, 16):
            batch = prompts[:width]
            rate, n, _ = await run(rt, batch, free)
            rates[f"free_{width}"].append(rate)
            tokens[f"free_{width}"] = n
            with MaskTimer() as mt:
                t0 = time.perf_counter()
                rate, n, _ = await run(rt, batch, constrained)
                json_wall += time.perf_counter() - t0
            rates[f"json_{width}"].append(rate)
            tokens[f"json_{width}"] = n
            masks[width].extend(mt.times)
            mask_total += sum(mt.times)
    _, _, texts = await run(rt, prompts, record)
    for t in texts:
        total += 1
        try:
            json.loads(t)
            valid += 1
        except ValueError:
            pass
    cold, cached = [], []
    for i in range(args.schemas):
        spec = ("json_schema", json.dumps(varied_schema(i)))
        t0 = time.perf_counter()
        await rt.compile_grammar(spec)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await rt.compile_grammar(spec)
        cached.append(time.perf_counter() - t0)
    await rt.shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "ratio_1": round(med["json_1"] / med["free_1"], 3),
        "ratio_16": round(med["json_16"] / med["free_16"], 3),
        **{f"tok_s_{k}": round(v, 1) for k, v in med.items()},
        "compile_cold_p50_ms": pct([c * 1e3 for c in cold], 0.5),
        "compile_cold_p99_ms": pct([c * 1e3 for c in cold], 0.99),
        "compile_cached_p50_ms": pct([c * 1e3 for c in cached], 0.5),
        "compile_cached_p99_ms": pct([c * 1e3 for c in cached], 0.99),
        "mask_ms_per_step_1_p50": pct([m * 1e3 for m in masks[1]], 0.5),
        "mask_ms_per_step_16_p50": pct([m * 1e3 for m in masks[16]], 0.5),
        "mask_ms_per_step_16_p99": pct([m * 1e3 for m in masks[16]], 0.99),
        "mask_share": round(mask_total / json_wall, 4) if json_wall else 0.0,
        "valid_json": f"{valid}/{total}", "tokens": tokens, "rounds": args.rounds,
        "schemas": args.schemas, "actorserve": os.path.dirname(actorserve.__file__),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--schemas", type=int, default=50)
    p.add_argument("--json", action="store_true", help="print the one JSON line only")
    args = p.parse_args()
    out = asyncio.run(main_async(args))
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
