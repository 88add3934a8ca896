"""Prefill time of a request whose 400-token prefix is in the prefix cache vs a cold one.

Drives the paged runner directly (the scheduler's part played inline, as in the engine
tests), on the embedded default model unless `--model` says otherwise. Each repeat: a cold
request with a fresh 400-token prefix + 16-token tail (nothing cached), then a second
request with the same prefix and another tail (its 400 prefix tokens, 25 whole
16-token blocks, come from the cache). Prints one JSON line with the medians and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from actorserve.omp import apply_defaults  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from actorserve.engine.scheduling.block_manager import BlockManager  # noqa: E402
from actorserve.engine.weights.models import load_model  # noqa: E402
from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402
from actorserve.engine.runners.runner import build_engine  # noqa: E402
from actorserve.engine.scheduling.sequence import Sequence  # noqa: E402


def prefill_ms(engine, bm: BlockManager, seq: Sequence) -> float:
    bm.match_prefix(seq)
    n = seq.num_uncomputed
    assert bm.allocate(seq, n)
    t0 = time.perf_counter()
    engine.execute([(seq, n)])
    dt = (time.perf_counter() - t0) * 1e3
    seq.num_computed += n
    bm.commit(seq)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prefix", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model, tok, _ = load_model(args.model, threads=args.threads)
    engine = build_engine(model, num_blocks=512, block_size=16, threads=args.threads)
    bm = BlockManager(512, 16)
    vocab = engine.info.vocab_size
    rng = random.Random(0)
    sp = SamplingParams(temperature=0.0, max_new_tokens=1)
    cold, warm, cached = [], [], []
    for r in range(args.repeats + 1):
        prefix = [rng.randrange(10, vocab - 1) for _ in range(args.prefix)]
        a = Sequence(f"a{r}", prefix + [rng.randrange(10, vocab - 1) for _ in range(16)], sampling=sp)
        b = Sequence(f"b{r}", prefix + [rng.randrange(10, vocab - 1) for _ in range(16)], sampling=sp)
        ca = prefill_ms(engine, bm, a)
        wb = prefill_ms(engine, bm, b)
        if r:  # the first round warms up
            cold.append(ca)
            warm.append(wb)
            cached.append(b.num_cached)
        for s in (a, b):
            engine.release(s)
            bm.free(s)
        bm.flush()
    out = {"model": engine.info.model_name, "prompt_tokens": args.prefix + 16,
           "cached_tokens": cached[0], "cold_prefill_ms": round(statistics.median(cold), 1),
           "cached_prefill_ms": round(statistics.median(warm), 1),
           "speedup": round(statistics.median(cold) / statistics.median(warm), 1)}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
