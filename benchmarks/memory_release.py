"""How much memory `/release_memory_occupation` really gives back, and whether the resume
restores the same server.

Starts `actorserve serve` as a subprocess (`serverproc`: 127.0.0.1, a free port) with `make
serve`'s defaults unless told otherwise (SmolLM2, ``--kv-memory-gb 1``, ``--dtype auto``,
``--quantization auto``), runs ``--prompts`` greedy ``/generate`` requests, then reads the
server's resident set (``VmRSS`` of ``/proc/<pid>/status``) before the release, after
``/release_memory_occupation`` (all tags) and after ``/resume_memory_occupation``, and runs the
same requests again.

Prints one JSON line: ``rss_before_mb``, ``rss_released_mb``, ``rss_resumed_mb``,
``kv_bytes`` and ``weights_bytes`` (what the release answer says each tag freed: the KV tensors
and every weight tensor with its derived copies), ``fraction_given_back`` (the RSS drop over KV
+ weight bytes; the goal is >= 0.90), ``release_s``, ``resume_s``, ``outputs_identical`` and
the ``cpu``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402

from serverproc import cpu_name, free_port, rss_bytes, start_server, stop_server, wait_up  # noqa: E402


async def outputs(http: aiohttp.ClientSession, url: str, n: int, max_tokens: int) -> list[list[int]]:
    got = []
    for i in range(n):
        body = {"text": f"Prompt {i}: write about the sea and the moon.",
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
        async with http.post(f"{url}/generate", json=body) as r:
            assert r.status == 200, await r.text()
            got.append((await r.json())["output_ids"])
    return got


async def control(http: aiohttp.ClientSession, url: str, path: str) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    async with http.post(f"{url}/{path}", json={}) as r:
        body = await r.json()
        assert r.status == 200, body
    return body, time.perf_counter() - t0


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    mb = 1 / (1 << 20)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        before = await outputs(http, url, args.prompts, args.max_tokens)
        rss0 = rss_bytes(pid)
        released, release_s = await control(http, url, "release_memory_occupation")
        await asyncio.sleep(args.settle_s)            # let the kernel account the unmapped pages
        rss1 = rss_bytes(pid)
        _, resume_s = await control(http, url, "resume_memory_occupation")
        rss2 = rss_bytes(pid)
        after = await outputs(http, url, args.prompts, args.max_tokens)
    kv = int(released["tags"]["kv_cache"]["bytes"])
    weights = int(released["tags"]["weights"]["bytes"])
    return {
        "model": args.model, "rss_before_mb": round(rss0 * mb, 1), "rss_released_mb": round(rss1 * mb, 1),
        "rss_resumed_mb": round(rss2 * mb, 1), "kv_bytes": kv, "weights_bytes": weights,
        "fraction_given_back": round((rss0 - rss1) / (kv + weights), 4),
        "release_s": round(release_s, 3), "resume_s": round(resume_s, 3),
        "outputs_identical": before == after, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "cpu": cpu_name(),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    extra = ["--model", args.model] + (["--kv-memory-gb", str(args.kv_memory_gb)] if args.kv_memory_gb else [])
    proc = start_server(port, *extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_up(url, proc)
        return await measure(url, proc.pid, args)
    finally:
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--kv-memory-gb", type=float, default=None, help="default: the server's (1 GB)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--settle-s", type=float, default=0.5)
    p.add_argument("--json", action="store_true", help="one JSON line (the only output there is)")
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
