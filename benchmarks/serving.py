"""End-to-end serving throughput against the bare engine loop, in one run.

Starts the HTTP server in-process on 127.0.0.1 (an ephemeral port) with the chosen model, sends
``--requests`` streaming chat requests, ``--concurrency`` at a time, with aiohttp, each asking
for exactly ``--max-tokens`` tokens (greedy, ``ignore_eos``), and measures client-side time to
first token and inter-token latency. Then, in the same process and on the same weights, it
drives ``runner.execute`` directly (a fresh engine and block manager, no actors, no HTTP) over
the same prompts in batches of ``--concurrency``: prefill the batch, then decode step by step.
That loop is the floor the server cannot beat; ``ratio_to_floor`` is server / floor throughput.

Prints one JSON line (``--json``) or a short table:

    server_tokens_per_s  floor_tokens_per_s  ratio_to_floor  ttft_p50_ms  itl_p50_ms
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

import aiohttp  # noqa: E402

from actorserve.config import ModelConfig, SchedulerConfig, ServerConfig  # noqa: E402
from actorserve.engine.scheduling.batching import BatchConfig  # noqa: E402
from actorserve.http.edge.server import build_runtime, serve_async  # noqa: E402

TOPICS = ["the sea", "a robot", "autumn", "a lighthouse", "bread", "mountains", "a cat", "the moon"]


def prompt_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Request {i}: write a short story about {TOPICS[i % len(TOPICS)]}."}]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_request(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int,
                      ttfts: list[float], itls: list[float]) -> int:
    body = {"model": "default", "messages": prompt_messages(i), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - t0)
            else:
                itls.append(now - last)
            last = now
    return tokens


async def drive_server(url: str, args: argparse.Namespace) -> dict[str, Any]:
    ttfts: list[float] = []
    itls: list[float] = []
    sem = asyncio.Semaphore(args.concurrency)

    async def bounded(session: aiohttp.ClientSession, i: int) -> int:
        async with sem:
            return await one_request(session, url, i, args.max_tokens, ttfts, itls)

    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        await one_request(s, url, 10_000, 2, [], [])          # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(bounded(s, i) for i in range(args.requests)))
        dt = time.perf_counter() - t0
    return {"server_tokens_per_s": sum(counts) / dt, "ttft_p50_ms": pct(ttfts, 0.5) * 1e3,
            "itl_p50_ms": pct(itls, 0.5) * 1e3, "server_tokens": sum(counts), "server_s": dt}


async def run_server(config: ServerConfig, built: Any, args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve_async(config, built=built, stop=stop,
                                             on_ready=lambda u: ready.set_result(u)))
    try:
        url = await asyncio.wait_for(asyncio.shield(ready), 120)
        return await drive_server(url, args)
    finally:
        stop.set()
        await task


def run_floor(built: Any, config: ServerConfig, args: argparse.Namespace) -> dict[str, Any]:
    """The bare loop: runner.execute over batches of `concurrency`, scheduler bookkeeping inline."""
    from actorserve.engine.scheduling.block_manager import BlockManager
    from actorserve.engine.scheduling.params import SamplingParams
    from actorserve.engine.runners.runner import build_engine
    from actorserve.engine.scheduling.sequence import Sequence

    served = built.runtime.engine
    model = getattr(served, "model", None)
    info = served.info
    engine = build_engine(model, num_blocks=info.num_blocks, block_size=info.block_size,
                          threads=config.model.threads, model_name=info.model_name)
    bm = BlockManager(info.num_blocks, info.block_size)
    sp = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    chunk = config.scheduler.batch.max_batch_tokens
    prompts = [built.tokenizer.apply_chat_template(prompt_messages(i)) for i in range(args.requests)]

    def step(batch: list[tuple[Any, int]]) -> None:
        for seq, n in batch:
            if not bm.allocate(seq, n):
                raise RuntimeError("floor: out of KV blocks")
        outs = engine.execute(batch)
        for (seq, n), out in zip(batch, outs):
            seq.num_computed += n
            bm.commit(seq)
            if out.token_id is not None:
                seq.output_ids.append(out.token_id)

    warm = Sequence("warm", prompts[0], sampling=SamplingParams(max_new_tokens=2, temperature=0.0))
    step([(warm, warm.num_uncomputed)])
    engine.release(warm)
    bm.free(warm)
    t0 = time.perf_counter()
    generated = 0
    for start in range(0, len(prompts), args.concurrency):
        seqs = [Sequence(f"f{i}", p, sampling=sp) for i, p in enumerate(prompts[start:start + args.concurrency],
                                                                         start)]
        while any(len(s.output_ids) < args.max_tokens for s in seqs):
            budget = chunk
            batch = []
            for s in seqs:
                if len(s.output_ids) >= args.max_tokens or budget <= 0:
                    continue
                n = min(s.num_uncomputed, budget)
                budget -= n
                batch.append((s, n))
            step(batch)
        for s in seqs:
            generated += len(s.output_ids)
            engine.release(s)
            bm.free(s)
    dt = time.perf_counter() - t0
    return {"floor_tokens_per_s": generated / dt, "floor_tokens": generated, "floor_s": dt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="default: enough for --concurrency sequences of 512 tokens, plus slack")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    blocks = args.kv_blocks or args.concurrency * 32 + 64
    config = ServerConfig(host="127.0.0.1", port=0,
                          model=ModelConfig(model=args.model, threads=args.threads, kv_blocks=blocks),
                          scheduler=SchedulerConfig(batch=BatchConfig(max_num_seqs=max(64, args.concurrency))))
    built = build_runtime(config)
    release_idle_threads()          # as `serve` does: the step thread's OpenMP team is the only one
    server = asyncio.run(run_server(config, built, args))
    floor = run_floor(built, config, args)
    result = {"model": built.served_name, "concurrency": args.concurrency, "requests": args.requests,
              "max_tokens": args.max_tokens, **server, **floor,
              "ratio_to_floor": server["server_tokens_per_s"] / floor["floor_tokens_per_s"]}
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>22}  {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
