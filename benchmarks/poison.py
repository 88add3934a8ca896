"""Poison in the engine: 16 streams + 1 request whose seed overflows in sampling, on a real model.

The HTTP edge refuses a 2**80 seed with a 400; this measures the defence behind it, the
scheduler's step isolation (`actors/isolation.py`), by handing the poison straight to the
`Runtime`. Two runs on the same engine in one process: the 16 greedy streams alone (baseline),
then the same 16 with the poison request submitted among them. Prints one JSON line:

    streams, max_tokens, poison_outcome (finish_reason, error), others_lost_tokens (tokens of
    the 16 that differ from or are missing against the baseline: the goal is 0),
    baseline_s, with_poison_s, added_latency_ms (wall time difference), added_per_stream_p50_ms,
    isolations, isolated_failures

    .venv/bin/python benchmarks/poison.py --model default --streams 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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
from actorserve.engine.text.tokenizer import TextTokenizer  # noqa: E402

PROMPTS = ["Tell me about the sea.", "What is a robot?", "Describe autumn.", "Why is bread good?"]


async def run_once(rt: Runtime, tok: TextTokenizer, n: int, max_tokens: int,
                   poison: bool) -> tuple[list[list[int]], list[float], float, object]:
    sp = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [tok.encode(PROMPTS[i % len(PROMPTS)] + f" ({i})") for i in range(n)]
    t0 = time.perf_counter()
    handles = [rt.generate(p, sp) for p in ids[: n // 2]]
    bad = None
    if poison:
        bad = rt.generate(tok.encode("poison"), SamplingParams(max_new_tokens=max_tokens, temperature=1.0,
                                                                seed=2 ** 80))
    handles += [rt.generate(p, sp) for p in ids[n // 2:]]
    ends: list[float] = []

    async def read(h):  # type: ignore[no-untyped-def]
        out = await h.stream.final()
        ends.append(time.perf_counter() - t0)
        return out

    outs = await asyncio.gather(*(read(h) for h in handles))
    wall = time.perf_counter() - t0
    bad_out = await bad.stream.final() if bad is not None else None
    await rt.quiesce()
    return [o.token_ids for o in outs], sorted(ends), wall, bad_out


async def main_async(args: argparse.Namespace) -> dict:
    model, hf_tok, _ = load_model(args.model, threads=args.threads)
    tok = TextTokenizer(hf_tok)
    blocks = (args.streams + 4) * (args.max_tokens // 16 + 8)
    engine = build_engine(model, num_blocks=blocks, block_size=16, tokenizer=hf_tok)
    release_idle_threads()          # as `serve` does: the step thread's OpenMP team is the only one
    rt = Runtime(engine, config=SchedulerConfig(batch=BatchConfig(max_num_seqs=args.streams + 1)),
                 detokenizer=tok.detokenizer_for)
    await rt.start()
    base_tokens, base_ends, base_wall, _ = await run_once(rt, tok, args.streams, args.max_tokens, False)
    tokens, ends, wall, bad = await run_once(rt, tok, args.streams, args.max_tokens, True)
    lost = sum(sum(1 for a, b in zip(x, y) if a != b) + abs(len(x) - len(y))
               for x, y in zip(base_tokens, tokens))
    st = rt.stats()
    await rt.shutdown()
    return {"streams": args.streams, "max_tokens": args.max_tokens, "model": engine.info.model_name,
            "poison_outcome": {"finish_reason": bad.finish_reason, "error": bad.error},
            "others_lost_tokens": lost,
            "baseline_s": round(base_wall, 3), "with_poison_s": round(wall, 3),
            "added_latency_ms": round((wall - base_wall) * 1e3, 1),
            "added_per_stream_p50_ms": round(statistics.median(
                [(b - a) * 1e3 for a, b in zip(base_ends, ends)]), 1),
            "isolations": st.isolations, "isolated_failures": st.isolated_failures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(main_async(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
