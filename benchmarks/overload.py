"""Overload: N concurrent chats against `--max-queued-requests`, and /health under that load.

Starts `actorserve serve` as a subprocess on 127.0.0.1 (a free port) with the chosen model and
admission control (the client must not share the server's event loop), fires ``--requests`` chat completions at once (``--max-tokens`` each, greedy,
``ignore_eos``) with aiohttp, and meanwhile polls ``/health`` and ``/health_generate`` every
50 ms. Each chat ends as accepted (200) or shed (503 with Retry-After); nothing else is
expected. Then it checks the server holds no request and no KV block, and serves one more
chat. Prints one JSON line:

    requests, accepted, shed, other (statuses other than 200/503), retry_after (values seen),
    accepted_latency_p50_ms / p99, shed_latency_p99_ms (how fast a refusal comes back),
    health_p50_ms / p99 / max, health_generate_p99_ms, wall_s

    .venv/bin/python benchmarks/overload.py --model tiny --requests 2000 --max-queued 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from collections import Counter
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
from serverproc import free_port, start_server, stop_server, wait_up  # noqa: E402



def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else float("nan")


async def server_info(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/server_info") as r:
        return await r.json()


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        statuses: Counter = Counter()
        retry: Counter = Counter()
        lat: dict[int, list[float]] = {200: [], 503: []}
        health: list[float] = []
        probes: list[float] = []
        done = asyncio.Event()

        async def chat(i: int) -> None:
            body = {"model": "default", "messages": [{"role": "user", "content": f"story {i}"}],
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            async with http.post(f"{url}/v1/chat/completions", json=body) as r:
                await r.read()
                statuses[r.status] += 1
                if r.status == 503:
                    retry[r.headers.get("Retry-After")] += 1
                lat.setdefault(r.status, []).append(time.perf_counter() - t0)

        async def poll() -> None:
            k = 0
            while not done.is_set():
                path = "/health_generate" if k % 5 == 4 else "/health"
                t0 = time.perf_counter()
                async with http.get(f"{url}{path}") as r:
                    await r.read()
                    (probes if path == "/health_generate" else health).append(time.perf_counter() - t0)
                    assert r.status == 200, (path, r.status)
                k += 1
                await asyncio.sleep(0.05)

        t0 = time.perf_counter()
        poller = asyncio.ensure_future(poll())
        await asyncio.gather(*(chat(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
        done.set()
        await poller
        for _ in range(200):                  # the server settles: nothing held
            st = (await server_info(http, url))["scheduler"]
            if st["live_requests"] == 0 and st["kv_used_blocks"] == 0:
                break
            await asyncio.sleep(0.05)
        async with http.post(f"{url}/v1/chat/completions", json={
                "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}) as r:
            after = r.status
    ms = 1e3
    return {
        "requests": args.requests, "max_queued": args.max_queued, "max_tokens": args.max_tokens,
        "accepted": statuses[200], "shed": statuses[503],
        "other": {k: v for k, v in statuses.items() if k not in (200, 503)},
        "retry_after": dict(retry),
        "accepted_latency_p50_ms": round(pct(lat[200], 0.5) * ms, 1),
        "accepted_latency_p99_ms": round(pct(lat[200], 0.99) * ms, 1),
        "shed_latency_p99_ms": round(pct(lat[503], 0.99) * ms, 1),
        "health_p50_ms": round(pct(health, 0.5) * ms, 2), "health_p99_ms": round(pct(health, 0.99) * ms, 2),
        "health_max_ms": round(max(health) * ms, 2) if health else None, "health_polls": len(health),
        "health_generate_p99_ms": round(pct(probes, 0.99) * ms, 1),
        "held_after": {"live": st["live_requests"], "kv_blocks": st["kv_used_blocks"]},
        "chat_after": after, "wall_s": round(wall, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-queued", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    blocks = (args.max_num_seqs + 8) * (args.max_tokens // 16 + 4)
    proc = start_server(port, "--model", args.model, "--embedding-model", "none",
                        "--kv-blocks", str(blocks), "--max-num-seqs", str(args.max_num_seqs),
                        "--max-queued-requests", str(args.max_queued),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_up(url, proc))
        result = asyncio.run(measure(url, args))
    finally:
        stop_server(proc)
    print(json.dumps({"model": args.model, **result, "server_rc": proc.returncode}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
