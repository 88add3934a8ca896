"""A soak: cycles of mixed traffic against a live server, its RSS at rest after each cycle.

Starts `actorserve serve` as a subprocess (`serverproc.py`, 127.0.0.1, a free port; the tiny
generation model by default and the embedded embedding model) and runs ``--cycles`` cycles of
``--requests`` requests, ``--concurrency`` at once, drawn (fixed seed) from this mix:

* ``chat`` (35%): `/v1/chat/completions`, half of them behind a shared ~400-token context
  (the prefix cache's case), the rest with a context of their own;
* ``stream`` (20%): the same, streamed, read to the end;
* ``embed`` (15%): `/v1/embeddings` of 1-8 texts;
* ``abort`` (10%): a streamed chat the client drops after its second chunk (a disconnect);
* ``session`` (10%): `/open_session`, two `/generate` turns in it, `/close_session`;
* ``response`` (10%): `/v1/responses` with ``store: true``, read back, then deleted.

After each cycle the benchmark waits until the server is at rest (no request running or
waiting, from `/metrics`), then reads the server's RSS (``VmRSS`` of its process, MB) and the
flight recorder's and stores' sizes (`/server_info`). Prints one JSON line: ``rss_mb`` per cycle
(index 0 is the idle server before any traffic), ``growth_pct`` per cycle (of the previous
RSS), ``max_growth_pct_from_cycle3``, ``trend_pct_per_cycle_from_cycle3`` (the least-squares slope of
the RSS after cycles 2..N, % of its mean: what the cycles add, without one cycle's ups and downs
of the threads' heaps), ``rest_over_start`` (the last idle RSS over the first),
``errors`` (any answer that was not what its kind expects), ``requests`` done per kind, the
CPU model and the arguments; with ``--smaps``, the RSS by kind of mapping too (`rss_by_region`).
``--cycles 3 --requests 300`` is a quick look while iterating. Goals (issue 31): from cycle 3 on growth per cycle <= 0.2%, and
the idle server within 10% of its start.

    python benchmarks/soak.py --json                 # 10 cycles of 600, 32 at once
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aiohttp  # noqa: E402

from serverproc import cpu_name, free_port, rss_bytes, start_server, stop_server, wait_up  # noqa: E402

MIX = [("chat", 35), ("stream", 20), ("embed", 15), ("abort", 10), ("session", 10), ("response", 10)]
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def rss_by_region(pid: int) -> dict[str, float]:
    """The process's RSS (MB) by kind of mapping, from ``/proc/PID/smaps``: ``files`` (the
    libraries and model files mapped), ``heap`` (the main thread's brk heap), ``arenas``
    (anonymous mappings inside the 64 MB reservations glibc makes for other threads' heaps),
    ``anon_large`` (other anonymous mappings of 1 MB or more: big tensors, mmapped mallocs)
    and ``anon_small`` (the rest: stacks, Python's own arenas, small mmaps)."""
    out = {"files": 0.0, "heap": 0.0, "arenas": 0.0, "anon_large": 0.0, "anon_small": 0.0}
    kind, size = "anon_small", 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=6)
            if "-" in first[0] and len(first) >= 5 and not first[0].endswith(":"):
                lo, hi = (int(x, 16) for x in first[0].split("-"))
                size, name = hi - lo, (first[5].strip() if len(first) > 5 else "")
                if name == "[heap]":
                    kind = "heap"
                elif name.startswith("/"):
                    kind = "files"
                elif name == "" and lo % (64 << 20) == 0 and size <= (64 << 20):
                    kind = "arenas"              # glibc's per-thread heaps are 64 MB-aligned
                else:
                    kind = "anon_large" if size >= (1 << 20) else "anon_small"
            elif first[0] == "Rss:":
                out[kind] += int(first[1]) / 1024
    return {k: round(v, 1) for k, v in out.items()}


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Soak:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.shared = text(random.Random(1), 400)
        self.errors: list[str] = []
        self.done: dict[str, int] = {k: 0 for k, _ in MIX}

    def _err(self, kind: str, what: str) -> None:
        if len(self.errors) < 12:
            self.errors.append(f"{kind}: {what}")

    def _chat_body(self, rng: random.Random, stream: bool) -> dict[str, Any]:
        context = self.shared if rng.random() < 0.5 else text(rng, rng.randint(20, 120))
        return {"model": "default", "messages": [{"role": "system", "content": context},
                                           {"role": "user", "content": text(rng, rng.randint(3, 12))}],
                "max_tokens": rng.randint(4, 24), "temperature": 0.7, "seed": rng.randint(0, 1 << 30),
                "stream": stream}

    async def one(self, http: aiohttp.ClientSession, kind: str, rng: random.Random) -> None:
        u = self.url
        if kind == "chat":
            async with http.post(f"{u}/v1/chat/completions", json=self._chat_body(rng, False)) as r:
                body = await r.json()
                if r.status != 200 or not body.get("choices"):
                    return self._err(kind, f"{r.status} {str(body)[:200]}")
        elif kind in ("stream", "abort"):
            async with http.post(f"{u}/v1/chat/completions", json=self._chat_body(rng, True)) as r:
                if r.status != 200:
                    return self._err(kind, f"{r.status} {(await r.text())[:200]}")
                chunks = 0
                async for line in r.content:
                    if line.startswith(b"data:"):
                        chunks += 1
                        if kind == "abort" and chunks >= 2:
                            r.close()                       # the client goes away mid-stream
                            break
                if kind == "stream" and chunks < 2:
                    return self._err(kind, f"{chunks} chunks")
        elif kind == "embed":
            texts = [text(rng, rng.randint(5, 40)) for _ in range(rng.randint(1, 8))]
            async with http.post(f"{u}/v1/embeddings", json={"model": "default-embedding", "input": texts}) as r:
                body = await r.json()
                if r.status != 200 or len(body.get("data", [])) != len(texts):
                    return self._err(kind, f"{r.status} {str(body)[:200]}")
        elif kind == "session":
            async with http.post(f"{u}/open_session", json={"capacity_of_str_len": 4096}) as r:
                sid = await r.json()
                if r.status != 200 or not isinstance(sid, str):
                    return self._err(kind, f"open {r.status} {sid}")
            rid = None
            for _turn in range(2):
                sp = {"session_params": {"id": sid, "rid": rid}} if rid else {"session_params": {"id": sid}}
                async with http.post(f"{u}/generate", json={
                        "text": text(rng, 8), **sp,
                        "sampling_params": {"max_new_tokens": rng.randint(4, 16), "temperature": 0.7}}) as r:
                    body = await r.json()
                    if r.status != 200:
                        self._err(kind, f"generate {r.status} {str(body)[:200]}")
                        break
                    rid = body["meta_info"]["id"]
            async with http.post(f"{u}/close_session", json={"session_id": sid}) as r:
                if r.status != 200:
                    return self._err(kind, f"close {r.status} {(await r.text())[:200]}")
        elif kind == "response":
            async with http.post(f"{u}/v1/responses", json={"model": "default", "input": text(rng, 10),
                                                             "max_output_tokens": rng.randint(4, 16),
                                                             "store": True}) as r:
                body = await r.json()
                if r.status != 200 or "id" not in body:
                    return self._err(kind, f"{r.status} {str(body)[:200]}")
            async with http.get(f"{u}/v1/responses/{body['id']}") as r:
                if r.status != 200:
                    return self._err(kind, f"get {r.status}")
            async with http.delete(f"{u}/v1/responses/{body['id']}") as r:
                if r.status != 200:
                    return self._err(kind, f"delete {r.status}")
        self.done[kind] += 1

    async def cycle(self, http: aiohttp.ClientSession, c: int) -> None:
        rng = random.Random(self.args.seed * 1000 + c)
        kinds = rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX], k=self.args.requests)
        queue = list(enumerate(kinds))

        async def worker(w: int) -> None:
            wrng = random.Random(self.args.seed * 7919 + c * 131 + w)
            while queue:
                _, kind = queue.pop()
                try:
                    await self.one(http, kind, wrng)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                    self._err(kind, repr(exc)[:200])
        await asyncio.gather(*(worker(w) for w in range(self.args.concurrency)))

    async def at_rest(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        """Until no request runs or waits (bounded), then the server's own sizes."""
        for _ in range(600):
            async with http.get(f"{self.url}/metrics") as r:
                text_ = await r.text()
            busy = 0.0
            for line in text_.splitlines():
                if line.startswith(("sglang:num_running_reqs", "sglang:num_queue_reqs")):
                    busy += float(line.rsplit(" ", 1)[1])
            if busy == 0:
                break
            await asyncio.sleep(0.1)
        else:
            self._err("rest", "the server never came to rest")
        await asyncio.sleep(self.args.rest)
        async with http.get(f"{self.url}/server_info") as r:
            info = await r.json()
        return {"actors": info.get("actors"), "recorder_events": (info.get("recorder") or {}).get("events"),
                "responses_stored": (info.get("responses") or {}).get("stored"),
                "sessions_open": len((info.get("sessions") or {}).get("open") or []),
                "kv_cached_blocks": (info.get("scheduler") or {}).get("kv_cached_blocks"),
                "kv_free_blocks": (info.get("scheduler") or {}).get("kv_free_blocks")}


async def run(args: argparse.Namespace, proc: subprocess.Popen, url: str) -> dict[str, Any]:
    soak = Soak(url, args)
    rss, sizes, secs, regions = [], [], [], []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=args.concurrency + 4)) as http:
        sizes.append(await soak.at_rest(http))
        rss.append(round(rss_bytes(proc.pid) / 2**20, 1))
        if args.smaps:
            regions.append(rss_by_region(proc.pid))
        for c in range(args.cycles):
            t0 = time.perf_counter()
            await soak.cycle(http, c)
            secs.append(round(time.perf_counter() - t0, 1))
            sizes.append(await soak.at_rest(http))
            rss.append(round(rss_bytes(proc.pid) / 2**20, 1))
            if args.smaps:
                regions.append(rss_by_region(proc.pid))
            if not args.json:
                print(f"cycle {c + 1}: {secs[-1]} s, RSS {rss[-1]} MB, {sizes[-1]}", file=sys.stderr)
    growth = [round((b - a) / a * 100, 3) for a, b in zip(rss, rss[1:])]
    late = growth[2:]                                      # cycle 3 on
    tail = rss[2:]                                         # the RSS after cycle 2, 3, ...
    trend = None
    if len(tail) >= 3:                                     # least-squares slope, % of the mean
        xm, ym = (len(tail) - 1) / 2, sum(tail) / len(tail)
        slope = sum((i - xm) * (y - ym) for i, y in enumerate(tail)) / sum((i - xm) ** 2 for i in range(len(tail)))
        trend = round(slope / ym * 100, 3)
    return {"bench": "soak", "cpu": cpu_name(), "server_pid_alive": proc.poll() is None, "rss_mb": rss, "growth_pct": growth,
            "max_growth_pct_from_cycle3": max(late) if late else None,
            "trend_pct_per_cycle_from_cycle3": trend,
            "rest_over_start": round(rss[-1] / rss[0], 3), "cycle_s": secs, "server_sizes": sizes,
            "requests": soak.done, "errors": soak.errors,
            **({"rss_by_region_mb": regions} if args.smaps else {}),
            "args": {k: v for k, v in vars(args).items() if k != "json"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--requests", type=int, default=600, help="per cycle")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rest", type=float, default=6.0, help="seconds at rest before each RSS reading (the trim at rest runs after 2-4 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="extra `serve` argument (repeat)")
    p.add_argument("--server-log", default=None, help="write the server's output here")
    p.add_argument("--smaps", action="store_true", help="also the server's RSS by kind of mapping after each cycle")
    p.add_argument("--json", action="store_true", help="print the one JSON line (the only output)")
    args = p.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL
    proc = start_server(port, "--model", args.model, *args.server_arg, stdout=log, stderr=log)
    try:
        asyncio.run(wait_up(url, proc))
        out = asyncio.run(run(args, proc, url))
    finally:
        stop_server(proc)
        if args.server_log:
            log.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
