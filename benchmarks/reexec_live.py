"""Re-execution of a live server's recording: does it reproduce, and how fast is it?

Starts `actorserve serve --record` (the embedded SmolLM2 and MiniLM by default) as a
subprocess on 127.0.0.1, drives a mixed workload through the official `openai` client and
plain HTTP — streaming chats (some with stop strings), embeddings, a score, clients that walk
away mid-stream, abort_request, pauses in all three modes with continue, a flush, a
health_generate and a session — then stops the server with SIGTERM (graceful drain) and
re-executes the recording. Prints one JSON line: the run's size, whether every step's batch
and every transition matched, and the live run's duration against re-execution's (the ratio
is how much faster a bug reproduces offline than it took to happen).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp
from openai import AsyncOpenAI

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def wait_up(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with s.get(base + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError("server did not come up")


async def workload(base: str, n_chats: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    oa = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    counts: dict[str, int] = {}

    def seen(k: str) -> None:
        counts[k] = counts.get(k, 0) + 1

    async with aiohttp.ClientSession() as http:
        async def chat(i: int) -> None:
            await asyncio.sleep(rng.random() * 2)
            stream = await oa.chat.completions.create(
                model="default", messages=[{"role": "user", "content": f"Tell me about city {i}."}],
                max_tokens=rng.randrange(8, 40), temperature=0.7, seed=i, stream=True,
                stop=["."] if i % 4 == 0 else None)
            async for _ in stream:
                pass
            seen("chat")

        async def walk_away(i: int) -> None:
            await asyncio.sleep(rng.random() * 2)
            async with http.post(base + "/generate", json={
                    "text": f"A long story {i}", "stream": True,
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}) as r:
                await r.content.readuntil(b"\n\n")
                await r.content.readuntil(b"\n\n")
            seen("disconnect")

        async def embed(i: int) -> None:
            await asyncio.sleep(rng.random() * 3)
            await oa.embeddings.create(model="default-embedding", input=[f"sentence {i} {j}" for j in range(4)])
            seen("embeddings")

        async def control() -> None:
            for mode, after in (("in_place", 1.5), ("retract", 1.5), ("abort", 3.0)):
                await asyncio.sleep(after)
                async with http.post(base + "/pause_generation", json={"mode": mode}) as r:
                    seen(f"pause:{r.status}")
                await asyncio.sleep(0.2)
                async with http.post(base + "/continue_generation", json={}) as r:
                    seen(f"continue:{r.status}")
            async with http.post(base + "/abort_request", json={"rid": "no-such-request"}) as r:
                seen(f"abort_request:{r.status}")
            async with http.get(base + "/health_generate") as r:
                seen(f"health:{r.status}")

        async def session() -> None:
            async with http.post(base + "/open_session", json={"session_id": "bench"}) as r:
                seen(f"open:{r.status}")
            for t in range(3):
                async with http.post(base + "/generate", json={
                        "text": f" turn {t}", "session_params": {"id": "bench"},
                        "sampling_params": {"max_new_tokens": 6}}) as r:
                    seen(f"turn:{r.status}")
            async with http.post(base + "/close_session", json={"session_id": "bench"}) as r:
                seen(f"close:{r.status}")

        async def score() -> None:
            async with http.post(base + "/v1/score", json={"query": "Is Paris in France?",
                                                          "items": ["yes", "no"],
                                                          "label_token_ids": [9, 10]}) as r:
                seen(f"score:{r.status}")

        await asyncio.gather(*(chat(i) for i in range(n_chats)), *(walk_away(i) for i in range(3)),
                             *(embed(i) for i in range(12)), control(), session(), score())
        async with http.post(base + "/flush_cache", json={}) as r:
            seen(f"flush:{r.status}")
    await oa.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--chats", type=int, default=24)
    ap.add_argument("--port", type=int, default=30157)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", help="keep the recording at this path")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra argument for `actorserve serve` (repeat), e.g. --serve-arg=--watchdog-timeout=1")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from actorserve.replay.check import check
    from actorserve.replay.recorder import read_all_parts
    from actorserve.replay.reexec import reexecute

    with tempfile.TemporaryDirectory() as d:
        path = args.keep or os.path.join(d, "live.jsonl")
        base = f"http://127.0.0.1:{args.port}"
        proc = subprocess.Popen([sys.executable, "-m", "actorserve.cli", "serve", "--model", args.model,
                                 "--port", str(args.port), "--record", path, "--log-level", "warning",
                                 *args.serve_arg])
        try:
            asyncio.run(wait_up(base, proc))
            t0 = time.perf_counter()
            counts = asyncio.run(workload(base, args.chats, args.seed))
            live_s = time.perf_counter() - t0
        finally:
            proc.send_signal(signal.SIGINT if os.name == "nt" else signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _, events = read_all_parts(path)
        violations = len(check(events).violations)
        t1 = time.perf_counter()
        report = asyncio.run(reexecute(events))
        reexec_s = time.perf_counter() - t1
        out = {"model": args.model, "workload": counts, "events": len(events),
               "requests": sum(1 for e in events if e.kind == "input" and e.event in ("generate", "pool")),
               "steps": {k: a for k, (a, _) in report.steps.items()},
               "check_violations": violations, "reexec_ok": report.ok, "drift": report.drift,
               "step_diffs": len(report.step_diffs), "transition_diffs": len(report.transition_diffs),
               "live_s": round(live_s, 2), "reexec_s": round(reexec_s, 3),
               "speedup": round(live_s / reexec_s, 1)}
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        if not report.ok:
            print(report.format(), file=sys.stderr)


if __name__ == "__main__":
    main()
