"""Control-plane latencies under load, through the HTTP server on 127.0.0.1.

Starts the server in-process (an ephemeral port) with the chosen model and keeps
``--concurrency`` streaming ``/generate`` requests running (greedy, ``ignore_eos``, long
outputs). Then, as a client sees it:

* abort: ``--aborts`` times, abort the oldest stream that has produced a token
  (``/abort_request {rid}``) and time from sending the abort to the client seeing its stream
  closed (finish_reason ``abort``); a fresh stream replaces it, so the load stays constant;
* pause / continue: ``--pauses`` times per mode (``in_place``, ``retract``), the round trip of
  ``/pause_generation`` (it returns once the pause is applied at the step boundary) and of
  ``/continue_generation``;
* health_generate: ``--probes`` round trips of ``/health_generate`` under the same load, and
  the same number on an idle server.

Prints one JSON line: ``abort_p50_ms, abort_p99_ms, pause_{mode}_p50_ms, continue_p50_ms,
health_generate_load_p50_ms / p99, health_generate_idle_p50_ms, step_ms`` (the mean model
step under load, the unit most of these latencies are made of).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402

from actorserve.config import ModelConfig, SchedulerConfig, ServerConfig  # noqa: E402
from actorserve.engine.scheduling.batching import BatchConfig  # noqa: E402
from actorserve.http.edge.server import build_runtime, serve_async  # noqa: E402


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Stream:
    """One streaming /generate request, read until the server closes it."""

    def __init__(self, http: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> None:
        self.rid = f"bench-{i}-{uuid.uuid4().hex[:8]}"
        self.first = asyncio.Event()
        self.closed_at: float | None = None
        self.finish: str | None = None
        body = {"text": f"Request {i}: tell a long story about the sea and the moon.",
                "rid": self.rid, "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
        self.task = asyncio.ensure_future(self._read(http, url, body))

    async def _read(self, http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
        async with http.post(url + "/generate", json=body) as resp:
            resp.raise_for_status()
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event["output_ids"]:
                    self.first.set()
                reason = event["meta_info"]["finish_reason"]
                if reason is not None:
                    self.finish = reason["type"]
        self.closed_at = time.perf_counter()
        self.first.set()


async def measure(url: str, rt: Any, args: argparse.Namespace) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=args.concurrency + 8)
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as http:
        async def probe_times(n: int) -> list[float]:
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                async with http.get(url + "/health_generate") as r:
                    assert r.status == 200, await r.text()
                ts.append(time.perf_counter() - t0)
            return ts

        await probe_times(2)                                           # warm-up
        idle = await probe_times(args.probes)
        counter = iter(range(1_000_000))
        streams = [Stream(http, url, next(counter), args.max_tokens) for _ in range(args.concurrency)]
        await asyncio.gather(*(s.first.wait() for s in streams))
        steps0, t_steps0 = rt.stats().steps, time.perf_counter()

        aborts = []
        for _ in range(args.aborts):
            victim = next(s for s in streams if s.first.is_set() and s.closed_at is None)
            t0 = time.perf_counter()
            async with http.post(url + "/abort_request", json={"rid": victim.rid}) as r:
                assert r.status == 200, await r.text()
            await victim.task
            assert victim.finish == "abort", victim.finish
            aborts.append(victim.closed_at - t0)
            streams.remove(victim)
            fresh = Stream(http, url, next(counter), args.max_tokens)
            streams.append(fresh)
            await fresh.first.wait()

        load = await probe_times(args.probes)
        pauses: dict[str, list[float]] = {"in_place": [], "retract": []}
        continues: list[float] = []
        for mode in pauses:
            for _ in range(args.pauses):
                t0 = time.perf_counter()
                async with http.post(url + "/pause_generation", json={"mode": mode}) as r:
                    assert r.status == 200, await r.text()
                pauses[mode].append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
                t0 = time.perf_counter()
                async with http.post(url + "/continue_generation", json={}) as r:
                    assert r.status == 200, await r.text()
                continues.append(time.perf_counter() - t0)
                await asyncio.sleep(0.1)
        steps = rt.stats().steps - steps0
        step_ms = (time.perf_counter() - t_steps0) / max(1, steps) * 1e3
        async with http.post(url + "/abort_request", json={"abort_all": True}) as r:
            assert r.status == 200
        await asyncio.gather(*(s.task for s in streams), return_exceptions=True)

    ms = 1e3
    out.update({
        "abort_p50_ms": pct(aborts, 0.5) * ms, "abort_p99_ms": pct(aborts, 0.99) * ms,
        "abort_max_ms": max(aborts) * ms, "aborts": len(aborts),
        "pause_in_place_p50_ms": pct(pauses["in_place"], 0.5) * ms,
        "pause_retract_p50_ms": pct(pauses["retract"], 0.5) * ms,
        "pause_p99_ms": pct(pauses["in_place"] + pauses["retract"], 0.99) * ms,
        "continue_p50_ms": pct(continues, 0.5) * ms, "continue_p99_ms": pct(continues, 0.99) * ms,
        "health_generate_load_p50_ms": pct(load, 0.5) * ms, "health_generate_load_p99_ms": pct(load, 0.99) * ms,
        "health_generate_idle_p50_ms": pct(idle, 0.5) * ms, "step_ms": step_ms,
    })
    return out


async def run(config: ServerConfig, built: Any, args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve_async(config, built=built, stop=stop,
                                             on_ready=lambda u: ready.set_result(u)))
    try:
        url = await asyncio.wait_for(asyncio.shield(ready), 120)
        return await measure(url, built.runtime, args)
    finally:
        stop.set()
        await task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--aborts", type=int, default=48)
    p.add_argument("--pauses", type=int, default=5)
    p.add_argument("--probes", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    blocks = (args.concurrency + 4) * (args.max_tokens // 16 + 8)
    config = ServerConfig(host="127.0.0.1", port=0,
                          model=ModelConfig(model=args.model, threads=args.threads, kv_blocks=blocks,
                                            embedding_model=None),
                          scheduler=SchedulerConfig(batch=BatchConfig(max_num_seqs=max(64, args.concurrency))))
    built = build_runtime(config)
    res = asyncio.run(run(config, built, args))
    result = {"model": built.served_name, "concurrency": args.concurrency, **res}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
