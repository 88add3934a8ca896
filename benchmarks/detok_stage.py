"""Stop-string finishes on a live server: time in `detok` and wasted forwards, from its recording.

Starts `actorserve serve --record` (the embedded SmolLM2 by default) as a subprocess on
127.0.0.1 at a free port and sends a bounded workload of chat completions through the official
`openai` client, `--concurrency` at a time: greedy requests in four rounds over the same
prompts, stopping on "." (round 0 and 3, round 3 sampled at temperature 0.7), on " the"
(round 1) or on nothing (round 2: each ends on EOS or on `max_tokens`). SmolLM2 writes both
stop strings within its first sentence or so. Then it stops the server with SIGTERM (graceful
drain; killed after 60 s), reads the recording and prints ONE JSON line:

    requests, finish (the client's finish_reason counts), stop_string_finishes (from the
    recording), wasted_forwards, wasted_on_stop_strings, requests_with_waste, wasted_by_cause,
    detok_p50_ms / p99, decode_p50_ms / p99, steps, violations, wall_s, actorserve (the module
    that served: check it is the tree you meant to measure).

A wasted forward is a model step that computed a request whose last token was already known
(actorserve/replay/stats.py, `wasted_forwards`). With `--keep PATH` the recording stays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections import Counter
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from openai import AsyncOpenAI  # noqa: E402
from serverproc import free_port, start_server, stop_server, wait_up  # noqa: E402

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "What is 2+2?",
    "Say hi.",
    "Tell me about the sea.",
    "Name three colours.",
    "Write a haiku about the moon.",
    "Explain photosynthesis briefly.",
    "Describe a cat.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What is a river?",
    "Describe the city of Paris.",
)
ROUNDS: tuple[tuple[list[str] | None, float], ...] = (
    (["."], 0.0), ([" the"], 0.0), (None, 0.0), (["."], 0.7))


async def workload(client: AsyncOpenAI, n: int, concurrency: int, max_tokens: int) -> Counter:
    gate = asyncio.Semaphore(concurrency)
    finish: Counter = Counter()

    async def one(i: int) -> None:
        stop, temperature = ROUNDS[(i // len(PROMPTS)) % len(ROUNDS)]
        async with gate:
            r = await client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                max_tokens=max_tokens, temperature=temperature, seed=i, stop=stop)
        finish[r.choices[0].finish_reason] += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return finish


def figures(path: str) -> dict[str, Any]:
    from actorserve.replay.check import check
    from actorserve.replay.recorder import read_all_parts
    from actorserve.replay.stats import latency_report

    _, events = read_all_parts(path)
    lat = latency_report(events)
    states: dict[str, Any] = lat["time_in_state"]  # type: ignore[assignment]
    w: dict[str, Any] = lat["wasted_forwards"]  # type: ignore[assignment]
    stop = w["by_cause"].get("stop_string", {"requests": 0, "wasted": 0})

    def ms(state: str, key: str) -> float | None:
        return states.get(state, {}).get(key)

    return {"stop_string_finishes": stop["requests"], "wasted_forwards": w["total"],
            "wasted_on_stop_strings": stop["wasted"], "requests_with_waste": w["requests_with_waste"],
            "wasted_by_cause": {k: c["wasted"] for k, c in w["by_cause"].items()},
            "finishes_by_cause": {k: c["requests"] for k, c in w["by_cause"].items()},
            "detok_p50_ms": ms("generation.detok", "p50_ms"), "detok_p99_ms": ms("generation.detok", "p99_ms"),
            "decode_p50_ms": ms("generation.decode", "p50_ms"), "decode_p99_ms": ms("generation.decode", "p99_ms"),
            "steps": sum(1 for e in events if e.kind == "step" and (e.data or {}).get("sched") == "scheduler"),
            "violations": len(check(events).violations)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--keep", help="keep the recording at this path")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra argument for `actorserve serve` (repeat)")
    args = ap.parse_args()
    import actorserve

    port = args.port or free_port()
    with tempfile.TemporaryDirectory() as d:
        path = args.keep or os.path.join(d, "live.jsonl")
        # the same interpreter and environment (PYTHONPATH included) as this process
        proc = start_server(port, "--model", args.model, "--record", path,
                            "--log-level", "warning", *args.serve_arg)
        try:
            async def drive() -> tuple[Counter, float]:
                async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                       max_retries=0, timeout=300) as client:
                    await wait_up(f"http://127.0.0.1:{port}", proc)
                    t0 = time.perf_counter()
                    finish = await workload(client, args.requests, args.concurrency, args.max_tokens)
                    return finish, time.perf_counter() - t0

            finish, wall = asyncio.run(drive())
        finally:
            stop_server(proc)
        out = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
               "finish": dict(sorted(finish.items())), **figures(path), "wall_s": round(wall, 2),
               "server_rc": proc.returncode, "actorserve": os.path.dirname(actorserve.__file__)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
