"""Flight recorder on vs off: throughput at 16 concurrent streams, and recording size.

Drives the Runtime directly (actors, scheduler, paged runner; no HTTP) on the tiny fixture
by default, so the runtime's own costs weigh as much as they can against the model step:
`--streams` concurrent greedy streams of `--max-tokens` tokens, `--requests` in total,
alternating rounds with the recorder writing JSONL to a temp file and with no recorder at
all. Prints one JSON line: tokens/s with and without, their ratio (goal >= 0.97), and the
size of the recording per 1,000 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

from actorserve.omp import apply_defaults, release_idle_threads  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from actorserve.actors.runtime import Runtime  # noqa: E402
from actorserve.config import SchedulerConfig  # noqa: E402
from actorserve.engine.scheduling.batching import BatchConfig  # noqa: E402
from actorserve.engine.weights.models import load_model  # noqa: E402
from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402
from actorserve.engine.runners.runner import build_engine  # noqa: E402
from actorserve.replay.recorder import FlightRecorder  # noqa: E402
from actorserve.statemachines import LIFECYCLES  # noqa: E402


async def one_round(model, tok, args, path: str | None) -> tuple[float, int]:
    engine = build_engine(model, num_blocks=512, block_size=16, tokenizer=tok, model_name="bench")
    rec = FlightRecorder(path=path, lifecycles=LIFECYCLES.values()) if path else None
    release_idle_threads()          # as `serve` does: the step thread's OpenMP team is the only one
    rt = Runtime(engine, config=SchedulerConfig(batch=BatchConfig(max_num_seqs=args.streams)), recorder=rec)
    await rt.start()
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.max_tokens, ignore_eos=True)
    prompts = [tok.encode(f"request {i} asks about the weather in a city by the sea") for i in range(args.requests)]
    sem = asyncio.Semaphore(args.streams)
    tokens = 0

    async def one(p):
        nonlocal tokens
        async with sem:
            async for item in rt.generate(p, sp).stream:
                tokens += len(item.token_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    dt = time.perf_counter() - t0
    await rt.shutdown()
    size = os.path.getsize(path) if path else 0
    return tokens / dt, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds of each first")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model, tok, _ = load_model(args.model, threads=args.threads)
    on, off, sizes = [], [], []
    with tempfile.TemporaryDirectory() as d:
        for w in range(args.warmup):        # first-round costs (allocator, file cache) off the books
            asyncio.run(one_round(model, tok, args, None))
            asyncio.run(one_round(model, tok, args, os.path.join(d, f"warm{w}.jsonl")))
        for r in range(args.rounds):
            tps, _ = asyncio.run(one_round(model, tok, args, None))
            off.append(tps)
            tps, size = asyncio.run(one_round(model, tok, args, os.path.join(d, f"r{r}.jsonl")))
            on.append(tps)
            sizes.append(size)
    out = {"model": args.model, "streams": args.streams, "requests": args.requests,
           "max_tokens": args.max_tokens,
           "tokens_per_s_recorder_off": round(statistics.median(off), 1),
           "tokens_per_s_recorder_on": round(statistics.median(on), 1),
           "ratio_on_to_off": round(statistics.median(on) / statistics.median(off), 3),
           "ratios": [round(a / b, 3) for a, b in zip(on, off)],
           "recording_bytes_per_1000_requests": int(statistics.median(sizes) / args.requests * 1000)}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
