"""Priority scheduling under overload: does a high-priority class keep its TTFT while low-priority
traffic arrives at twice what the server can serve, and does the low class still complete?

Starts `actorserve serve --scheduling-policy priority` as a subprocess on 127.0.0.1 (a free
port; the tiny model by default, ``--model default`` for SmolLM2-135M) and drives it with
aiohttp over SGLang's streaming ``/generate`` (top-level ``priority``; TTFT is the first event
that carries a token):

1. capacity: a burst of ``--calibrate`` low-class requests at once; completed requests per
   second is what the server can serve of that class;
2. unloaded: the high class alone (``--high`` requests, priority 0, one every
   ``--high-interval`` seconds), its TTFT;
3. loaded: the same high-class schedule while low-class requests (priority 10) arrive evenly at
   ``--overload`` (2) x capacity for ``--duration`` seconds; every request is awaited to its end
   (nothing is shed, nothing times out).

With ``--rounds N`` the unloaded and loaded phases alternate N times each (the low class's
backlog drained between rounds), so slow drift of the shared box weighs on both alike; the p95s
pool every round's samples, and ``round_p95_ratios`` gives each round's own ratio.

Prints one JSON line: the high class's p50/p95 TTFT unloaded and loaded and their ratio (goal:
p95 ratio <= 1.2), low-class requests sent and completed (all must complete), the server's
preemption count (retractions, from /metrics) and wall time. Both TTFT figures come from the
same run on the same machine.

    .venv/bin/python benchmarks/priority.py --json

Both the client's TTFT and the server's own (``create`` to ``first_token`` on the flight
recording, read back through ``/debug/requests``: the server runs with ``--debug-routes
--record``) are reported, with the server-side p50 of the wait before a step takes the request.

2026-12-06, tiny model, 2-core AMD EPYC (quiet box), --max-num-seqs 16, 60 KV blocks: capacity
51.9 req/s, low class at 103.8 req/s streamed; high-class TTFT p50/p95 9.3/13.6 ms unloaded,
18.4/55.5 ms loaded (client, p95 ratio 4.10); server-side 7.2/10.2 -> 11.0/43.5 ms (ratio 4.27),
its wait for a step p50 0.7 -> 4.3 ms; 1038 of 1038 low-priority requests completed, 33
preemptions. The 1.2 goal is not met.

What the loaded TTFT is made of (``--record PATH``, then ``benchmarks/priority_tail.py PATH``:
per high request, the residual of the step in flight at its arrival, the loop's turnaround,
its own step's duration and width, and the output stage): on the box shared with other work
(load average 4.5-6 on its 2 cores, so capacity only 8-18 req/s), before the changes below, the
own step (p50 45-84 ms, 16 wide, a prefill among 15 decodes) and the step in flight (p50
11-24 ms, p95 50-76 ms) were all of it; the turnaround and the stage about 1 ms each. Of the
arrivals, 32 in 40 found another high request in the step in flight.

Changes, measured A/B back to back (3 runs each, alternating, medians; loaded server p95):
* giving up the step in flight at a layer boundary for an arrival that outranks every member
  (`actors/step_preempt.py`) alone: no better (server p95 ratio 5.9 vs 7.5 unchanged code,
  client 7.1 vs 7.2, loaded p95 208 vs 198 ms: noise): it rarely applied (2-33 asks a run,
  0-11 steps given up);
* with a step of its own for the best class's prefill and the ask extended to a step that holds
  the arrival's own class as long as none outranks it: server TTFT p95 loaded 56/61/123 ms vs
  94/190/267 (server p95 ratio 3.1 vs 6.0; client p95 ratio 4.3 vs 5.1, client p95 loaded
  120 vs 202 ms); its own step p50 24 ms (1-2 wide) vs 74 ms, the step in flight p50 8.6 vs
  14.3 ms; all low-class requests completed (320, 353, 277); 39-40 asks a run, 12-24 given up
  (the rest came after the last boundary: the forward of the 2-layer tiny model is a small
  part of its step, and sampling is not interruptible);
* ``--switch-interval 0.0005`` (the step thread's GIL turns; the server's flag, default
  Python's 5 ms) with preemption alone: no gain (2 runs: server p95 ratio 9.9 vs 5.9, loaded
  p95 199 vs 208 ms). With both changes, on a box then far busier (load 8-10, the unloaded
  phase itself 3x slower, so the ratios mean nothing; 2 runs each): loaded server p95 83 ms
  with it vs 138 without, and 103 with the low class answered whole (``--low-whole``): a hint
  that the last A/B below did not confirm.

Last A/B, both changes vs the code before them (2 runs each, alternating, load 5-8): client
high-class TTFT p95 loaded 66/125 ms vs 211/218 (p95 ratio 2.2/1.7 vs 5.9/9.9; the second's
unloaded p95 had a 72 ms stall), server-side p95 loaded 45/73 ms vs 191/189 (ratio 2.0/1.1 vs
6.4/11.4); own step p50 16/25 ms (1 wide) vs 91 ms (16 wide); step in flight p50 6/11 ms vs
22/35 ms; every low-class request completed (194, 361 vs 156, 256). With ``--switch-interval
0.0005`` on top: ratio 2.1/2.4, server p95 44/68 ms: the same.

What is left, on this box: the high request's own narrow step runs 2-5x slower than unloaded
(the event loop streaming the low class's tokens, the client on the same 2 cores and the
other load take the CPU and the GIL), the asks that land too late, and the client's own lag
(its p95 is 35-100 ms above the server's). A step of its own was tried before preemption and
measured no better (p95 ratio 5.1 vs 3.6): the step in flight dominated then.

2026-12-07, quiet box (load ~1), AMD EPYC. Tiny model, the defaults (40 high requests): client
p95 ratio 1.198 / 1.623 / 1.126 (server 1.274 / 1.523 / 1.196); with ``--high 100
--high-interval 0.15`` (a p95 of 100 samples, not of 40) 1.35 / 1.36 / 1.34 / 1.42 / 1.33.
``--server-args "--threads 1"`` halves the tiny model's TTFT (server p95 unloaded 5.7 vs
9.7-10.7 ms, loaded 9.6-9.9 vs 15-16) but not the ratio (client 1.21 / 1.40). With ``--model
default`` (SmolLM2 q4, ``--high 60 --high-interval 0.25``) the step in flight at an arrival is
often a fused q4 decode step (every layer in one C call), which was asked only after its last
layer: its residual's p95 was 23-31 ms. Since the fused step reads the flag at each layer
boundary (`PreemptFlag`), 10-13 ms, and the client p95 ratio went 1.59 / 1.68 -> 1.43 / 1.27
(A/B alternated). What is left there: (1) a mixed step (a prompt's chunk beside 15 decodes,
the plain path) is given up at the next layer boundary, but under load its layers take 5-10x
their time alone (the event loop, busy with the arrival and the low class's SSE, and the step
thread take turns on the GIL at each of a layer's ~20 torch calls); (2) the high request's own
13-token prefill runs ~25% slower than unloaded (p50 38-42 vs 29-35 ms): the low class's
streaming and the client share the 2 cores with the step's two threads (answered whole,
``--low-whole``, +10%). The 1.2 goal is not met on this box for the default model either.

2026-12-07, later (AMD EPYC; ``--model default --high 100 --high-interval 0.15 --rounds 3``,
the high class's prompts now all 13 tokens). A short prompt's prefill is one fused C call (no
GIL turns), the step that ends a best-class prompt holds only that class's prompts, and the
Python paths read the ask between attention and MLP too. Against the code before (61b43ec),
two alternations: pooled client p95 ratio 1.525 / 1.507 against 1.532 / 1.71 (loaded p95
55.9 / 55.4 ms against 63.8 / 63.8; unloaded 36.6 / 36.8 against 41.6 / 37.3); each round's
own ratio 1.11-1.75 against 1.43-2.11. A recorded run (server side, per round): the arrival's
own step, now always 1 wide, p50 33-34 ms loaded against 29-34 unloaded and p95 41-46 against
31-38; the step in flight's residual p95 7.6-8.7 ms. The own step, a fused C call that needs
no GIL, is the larger part of what is left: it shares the 2 cores with the event loop's
arrivals and the client. Not met.

2026-12-07, a fresh session (AMD EPYC, quiet box; the same command). Until now the client
read each high request's server-side TTFT (``/debug/requests/r{i}``) right after its answer,
in the middle of the phase. Each read scanned the whole flight recorder (100,000 events) on the
server's event loop, holding the GIL ~4 ms while the next high request arrived: a py-spy
profile of the loaded phase gave that scan a quarter of the loop's samples, and the mixed steps
in flight (plain path, a GIL turn per torch call) took 10-31 ms to give up. Two changes: the
reads come after the phase (`server_ttfts`), and the recorder's chunks carry a mask of their
request ids, so a read unpacks only the chunks that may hold the request. Pooled client p95
ratio, 3 rounds each: 1.144 / 1.311 / 1.499 / 1.384 before; 1.154 / 1.151 / 1.178 / 1.113 after
(loaded p95 42.2-48.5 ms against 53.5-59.6, unloaded 37.9-41.2 against 39.3-46.8); every low
request completed. The server's change alone does it: the old client (reads in the phase)
against the new server, 1.160 / 1.110. A recorded run after: the step in flight's residual p95 4.5 ms (was 11.1),
the arrival's own step p95 36.3 ms loaded against 34.9 unloaded. ``--switch-interval 0.001``:
1.165 / 1.137, no change. The goal (<= 1.2) is met in each pooled run; single rounds still
range 0.97-1.39.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import re
import subprocess
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
from serverproc import cpu_name, free_port, start_server, stop_server, wait_up  # noqa: E402

LOW, HIGH = 10, 0          # vLLM's order: a lower value is served first


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else float("nan")


async def one(http: aiohttp.ClientSession, url: str, i: int, priority: int, max_tokens: int,
              stream: bool = True) -> tuple[float, bool]:
    """One /generate: (TTFT in seconds, completed with all its tokens). Not streamed, the
    "first token" is the whole answer (the low class's background work has no TTFT)."""
    # the id zero-padded: every request's prompt has the same length (with "request {i}", the
    # loaded phase's high class, ids 1000-1039, had 11 tokens against the unloaded phase's 9)
    body = {"text": f"request {i:06d}: tell me a story", "stream": stream, "priority": priority, "rid": f"r{i}",
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft = float("nan")
    last: dict[str, Any] = {}
    async with http.post(f"{url}/generate", json=body) as r:
        if r.status != 200:
            return ttft, False
        if not stream:
            last = await r.json()
            reason = (last.get("meta_info") or {}).get("finish_reason") or {}
            return time.perf_counter() - t0, reason.get("type") == "length"
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if ttft != ttft and event.get("output_ids"):
                ttft = time.perf_counter() - t0
            last = event
    reason = (last.get("meta_info") or {}).get("finish_reason") or {}
    return ttft, reason.get("type") == "length"


async def preemptions(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    m = re.search(r"^actorserve_num_preemptions_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return int(float(m.group(1))) if m else -1


async def server_ttft(http: aiohttp.ClientSession, url: str, i: int) -> tuple[float, float]:
    """The server's own TTFT of request i (s): from its ``create`` to its ``first_token``
    transition on the flight recording (`/debug/requests`), free of the client's event-loop lag;
    and of that, the part before its ``schedule`` (waiting for a step to take it)."""
    async with http.get(f"{url}/debug/requests/r{i}") as r:
        hist = (await r.json())["history"]
    t = {e["event"]: e["t_ns"] for e in hist
         if e["kind"] == "generation" and e["event"] in ("create", "schedule", "first_token")}
    return (t["first_token"] - t["create"]) / 1e9, (t["schedule"] - t["create"]) / 1e9


async def high_class(http: aiohttp.ClientSession, url: str, args: argparse.Namespace,
                     base: int) -> list[float]:
    """The high class's TTFTs as the client saw them."""
    async def at(k: int) -> float:
        await asyncio.sleep(k * args.high_interval)
        ttft, ok = await one(http, url, base + k, HIGH, args.high_tokens)
        assert ok, "a high-priority request did not complete"
        return ttft
    return list(await asyncio.gather(*(at(k) for k in range(args.high))))


async def server_ttfts(http: aiohttp.ClientSession, url: str, args: argparse.Namespace,
                       base: int) -> list[tuple[float, float]]:
    """The same requests' TTFTs as the server recorded them, read once the phase is over: a
    read scans the flight recorder on the server's event loop, which must not happen while
    the phase is measured."""
    return [await server_ttft(http, url, base + k) for k in range(args.high)]


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=args.timeout)) as http:
        await one(http, url, -1, LOW, 4)                    # warm-up
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(http, url, 100_000 + i, LOW, args.low_tokens, args.low_stream)
                                      for i in range(args.calibrate)))
        capacity = sum(ok for _, ok in done) / (time.perf_counter() - t0)
        rate = args.overload * capacity
        n_low = max(1, int(rate * args.duration))
        before = await preemptions(http, url)
        unloaded: list[float] = []
        loaded: list[float] = []
        unloaded_srv: list[tuple[float, float]] = []
        loaded_srv: list[tuple[float, float]] = []
        rounds: list[float] = []
        sent = completed = 0
        wall = 0.0
        for r in range(args.rounds):      # unloaded, then loaded, in turn: both see the same box
            u = await high_class(http, url, args, 2000 * r)
            u_srv = await server_ttfts(http, url, args, 2000 * r)
            low_base = 200_000 + 20_000 * r

            async def low(i: int) -> bool:
                await asyncio.sleep(i / rate)
                return (await one(http, url, low_base + i, LOW, args.low_tokens, args.low_stream))[1]

            t1 = time.perf_counter()
            lows = asyncio.gather(*(low(i) for i in range(n_low)))
            await asyncio.sleep(min(2.0, args.duration / 4))    # the backlog is building
            lo = await high_class(http, url, args, 2000 * r + 1000)
            completed += sum(await lows)
            sent += n_low
            wall += time.perf_counter() - t1
            lo_srv = await server_ttfts(http, url, args, 2000 * r + 1000)
            unloaded += u
            loaded += lo
            unloaded_srv += u_srv
            loaded_srv += lo_srv
            rounds.append(round(pct(lo, 0.95) / pct(u, 0.95), 3))
        after = await preemptions(http, url)
    ms = 1e3
    p95_u, p95_l = pct(unloaded, 0.95), pct(loaded, 0.95)
    return {
        "capacity_rps": round(capacity, 2), "low_rate_rps": round(rate, 2),
        "high_ttft_p50_unloaded_ms": round(pct(unloaded, 0.5) * ms, 1),
        "high_ttft_p95_unloaded_ms": round(p95_u * ms, 1),
        "high_ttft_p50_loaded_ms": round(pct(loaded, 0.5) * ms, 1),
        "high_ttft_p95_loaded_ms": round(p95_l * ms, 1),
        "high_p95_ratio": round(p95_l / p95_u, 3), "rounds": args.rounds, "round_p95_ratios": rounds,
        **server_figures(unloaded_srv, loaded_srv),
        "high_requests": args.high * args.rounds, "low_sent": sent, "low_completed": completed,
        "preemptions": after - before, "loaded_wall_s": round(wall, 1),
    }


def server_figures(unloaded: list[tuple[float, float]], loaded: list[tuple[float, float]]) -> dict[str, Any]:
    """The server-side TTFTs (p50, p95, their p95 ratio) and the p50 of the wait for a step."""
    ttft_u, ttft_l = [t for t, _ in unloaded], [t for t, _ in loaded]
    out = {}
    for name, v in (("unloaded", ttft_u), ("loaded", ttft_l)):
        out[f"server_ttft_p50_{name}_ms"] = round(pct(v, 0.5) * 1e3, 1)
        out[f"server_ttft_p95_{name}_ms"] = round(pct(v, 0.95) * 1e3, 1)
    out["server_p95_ratio"] = round(pct(ttft_l, 0.95) / pct(ttft_u, 0.95), 3)
    out["server_wait_for_step_p50_ms"] = {"unloaded": round(pct([w for _, w in unloaded], 0.5) * 1e3, 1),
                                          "loaded": round(pct([w for _, w in loaded], 0.5) * 1e3, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (default) or default (SmolLM2-135M)")
    p.add_argument("--json", action="store_true", help="print one JSON line (the only output)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks (default: a little short of max-num-seqs full requests: KV pressure)")
    p.add_argument("--low-tokens", type=int, default=48)
    p.add_argument("--high-tokens", type=int, default=8)
    p.add_argument("--high", type=int, default=40, help="high-priority requests per phase")
    p.add_argument("--rounds", type=int, default=1,
                   help="unloaded and loaded phases in turn, this many of each; the p95s pool every "
                        "round's samples (round_p95_ratios: each round's own ratio)")
    p.add_argument("--high-interval", type=float, default=0.25)
    p.add_argument("--calibrate", type=int, default=64)
    p.add_argument("--overload", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--low-whole", dest="low_stream", action="store_false",
                   help="answer the low class whole, not streamed (background work: more of it "
                        "per second at the same 2x, so a heavier load)")
    p.add_argument("--switch-interval", default=None,
                   help="the server's --switch-interval (seconds; default: Python's 0.005)")
    p.add_argument("--server-args", default="",
                   help="more arguments for the server, one string (e.g. \"--threads 1\")")
    p.add_argument("--record", default=None,
                   help="keep the server's flight recording (JSONL) at this path, for "
                        "benchmarks/priority_tail.py (default: a temporary file)")
    args = p.parse_args(argv)
    port = free_port()
    tmp = tempfile.TemporaryDirectory()
    record = args.record or os.path.join(tmp.name, "priority.jsonl")     # the flight recorder feeds /debug/requests
    url = f"http://127.0.0.1:{port}"
    blocks = args.kv_blocks or max(16, (args.max_num_seqs * (args.low_tokens // 16 + 2)) * 3 // 4)
    proc = start_server(port, "--model", args.model, "--embedding-model", "none",
                        "--kv-blocks", str(blocks), "--max-num-seqs", str(args.max_num_seqs),
                        "--scheduling-policy", "priority", "--debug-routes", "--record", record,
                        *(["--switch-interval", args.switch_interval] if args.switch_interval else []),
                        *shlex.split(args.server_args),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_up(url, proc))
        result = asyncio.run(measure(url, args))
    finally:
        stop_server(proc)
        tmp.cleanup()
    out = {"model": args.model, "max_num_seqs": args.max_num_seqs, "kv_blocks": blocks,
           "low_streamed": args.low_stream, "cpu": cpu_name(), **result, "server_rc": proc.returncode}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
