"""N-gram speculative decoding against plain decoding: same model, same requests, same run.

For each dtype in ``--dtypes`` the model (the embedded SmolLM2-135M-Instruct by default) is
loaded once; for each workload a fresh runtime (actors and scheduler, the model step in a worker
thread, no HTTP) serves the same chat requests twice, without and with ``--speculative ngram``
(``--spec-tokens`` drafts, default 4), ``--concurrency`` at a time (default 1: the single-stream
case speculation is for). Greedy, ``--max-tokens`` (default 96), stopping at EOS like a client
would; the token streams are compared, so equal work is checked, not assumed.

Workloads (``--workloads``):

* ``story``: "write a short story about <topic>" (benchmarks/serving.py's prompts): little in
  the context to copy, the case where speculation can only cost;
* ``copy``: "Repeat this text exactly" over a paragraph: the output is in the prompt;
* ``code``: "Add type hints to this function" over a short Python function: most of the
  output is in the prompt, as in code editing.

Figures per dtype and workload: output tokens / s without and with speculation and their ratio
(wall time of the whole workload, first request sent to last finished; one untimed warm-up
request first), the share of drafts accepted, tokens per verify step, and ``identical``: the
share of requests whose token streams agree exactly. Every rate is the best of ``--repeats``.
Prints ONE JSON line: ``{dtype: {workload: {...}}, threads, max_tokens, spec_tokens}``.

    .venv/bin/python benchmarks/speculative.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

from actorserve.omp import apply_defaults, release_idle_threads  # noqa: E402  the server's OpenMP settings, GOMP_SPINCOUNT too
apply_defaults()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from actorserve.actors.runtime import Runtime  # noqa: E402
from actorserve.config import SchedulerConfig  # noqa: E402
from actorserve.engine.scheduling.batching import BatchConfig  # noqa: E402
from actorserve.engine.scheduling.params import SamplingParams  # noqa: E402

TOPICS = ["the sea", "a robot", "autumn", "a lighthouse", "bread", "mountains", "a cat", "the moon"]
PARAGRAPHS = [
    "The lighthouse keeper climbed the stairs every evening at dusk. He wound the clockwork, "
    "trimmed the wick and polished the great lens until it shone.",
    "Bread needs only flour, water, salt and time. The dough rises slowly overnight, and in the "
    "morning it is shaped, proofed again and baked in a very hot oven.",
    "A small robot lived in the corner of a busy workshop. Each day it sorted screws by size, "
    "swept the floor and waited for someone to say thank you.",
    "In autumn the hills turn red and gold. The air smells of wood smoke, the days grow short, "
    "and the first frost silvers the grass before sunrise.",
]
FUNCTIONS = [
    "def area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative')\n"
    "    return width * height\n",
    "def greet(name, times):\n    lines = []\n    for i in range(times):\n        lines.append('Hello, ' + name)\n"
    "    return lines\n",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n",
]


def messages(workload: str, i: int) -> list[dict[str, str]]:
    if workload == "story":
        text = f"Request {i}: write a short story about {TOPICS[i % len(TOPICS)]}."
    elif workload == "copy":
        text = f"Repeat the following text exactly, word for word:\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"
    elif workload == "code":
        text = f"Add type hints to this Python function. Reply with the code only.\n\n{FUNCTIONS[i % len(FUNCTIONS)]}"
    else:
        raise ValueError(f"unknown workload {workload!r}")
    return [{"role": "user", "content": text}]


async def serve_all(engine: Any, batch: BatchConfig, prompts: list[list[int]], args: argparse.Namespace
                    ) -> tuple[float, list[list[int]], Any]:
    """(seconds for all prompts, each one's tokens, the scheduler's stats)."""
    release_idle_threads()          # as `serve` does: the step thread's OpenMP team is the only one
    rt = Runtime(engine, config=SchedulerConfig(batch=batch, step_in_thread=True))
    await rt.start()
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.max_tokens)
    try:
        await rt.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=8)).stream.final()
        sem = asyncio.Semaphore(args.concurrency)
        tokens: list[list[int]] = [[] for _ in prompts]

        async def one(i: int) -> None:
            async with sem:
                async for item in rt.generate(prompts[i], sp).stream:
                    tokens[i].extend(item.token_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        elapsed = time.perf_counter() - t0
        stats = rt.stats()
    finally:
        await rt.shutdown()
    return elapsed, tokens, stats


def measure(engine: Any, tok: Any, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    prompts = [tok.apply_chat_template(messages(workload, i), tokenize=True, add_generation_prompt=True)
               for i in range(args.requests)]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    plain_cfg = BatchConfig()
    spec_cfg = BatchConfig(speculative="ngram", speculative_tokens=args.spec_tokens,
                           speculative_max_batch=max(8, args.concurrency))
    best: dict[str, float] = {}
    outs: dict[str, list[list[int]]] = {}
    spec_stats = None
    for _ in range(args.repeats):
        for name, cfg in (("plain", plain_cfg), ("spec", spec_cfg)):
            secs, toks, stats = asyncio.run(serve_all(engine, cfg, prompts, args))
            rate = sum(len(t) for t in toks) / secs
            best[name] = max(best.get(name, 0.0), rate)
            outs[name] = toks
            if name == "spec":
                spec_stats = stats
    same = sum(a == b for a, b in zip(outs["plain"], outs["spec"])) / len(prompts)
    st = spec_stats
    return {"plain_tok_s": round(best["plain"], 2), "spec_tok_s": round(best["spec"], 2),
            "ratio": round(best["spec"] / best["plain"], 3),
            "accept_rate": round(st.spec_accepted_tokens / st.spec_draft_tokens, 3) if st.spec_draft_tokens else 0.0,
            "tokens_per_verify": round(st.avg_spec_accept_length, 3),
            "verify_steps": st.spec_steps, "identical": round(same, 3),
            "tokens": sum(len(t) for t in outs["spec"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--workloads", default="story,copy,code")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--spec-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.runners.runner import build_engine

    result: dict[str, Any] = {}
    for dtype in args.dtypes.split(","):
        model, tok, _ = load_model(args.model, threads=args.threads, dtype=dtype)
        engine = build_engine(model, num_blocks=2048, block_size=16, tokenizer=tok)
        result[dtype] = {w: measure(engine, tok, w, args) for w in args.workloads.split(",")}
        del engine, model
    result.update(threads=torch.get_num_threads(), max_tokens=args.max_tokens, spec_tokens=args.spec_tokens,
                  concurrency=args.concurrency, requests=args.requests)
    if args.json:
        print(json.dumps(result))
        return
    for dtype, per in result.items():
        if isinstance(per, dict):
            for w, r in per.items():
                print(f"{dtype:9} {w:6} plain {r['plain_tok_s']:7.2f} tok/s  spec {r['spec_tok_s']:7.2f} tok/s  "
                      f"x{r['ratio']:.2f}  accept {r['accept_rate']:.2f}  {r['tokens_per_verify']:.2f} tok/verify  "
                      f"identical {r['identical']:.2f}")


if __name__ == "__main__":
    main()
