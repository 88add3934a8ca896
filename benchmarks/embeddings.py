"""Embeddings per second through the server vs a bare batched forward of the same model.

Starts the server in-process on 127.0.0.1 (ephemeral port) with a generation model (``--model``,
default the 1M-parameter "tiny", so the embedding side dominates) and the embedding model
(``--embedding-model``, default the embedded all-MiniLM-L6-v2), then ``--concurrency`` clients
send ``--requests`` single-input `/v1/embeddings` requests in total with aiohttp
(``encoding_format`` base64 by default, as the official openai client sends). Then, in the
same process and on the same weights, the floor: the tokenizer and a bare transformers forward
over the same texts in batches of ``--concurrency`` (padded to the batch's longest), mean
pooling and L2 normalisation — no actors, no scheduler, no HTTP.

Runs ``--rounds`` floor/server pairs (a fresh runtime each) and prints one JSON line with the
medians: ``server_embeddings_per_s``, ``floor_embeddings_per_s``, ``ratio`` (goal >= 0.8), and
each round's ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402

from actorserve.config import ModelConfig, SchedulerConfig, ServerConfig  # noqa: E402
from actorserve.http.edge.server import build_runtime, serve_async  # noqa: E402

SUBJECTS = ["A man", "The woman", "A child", "Our neighbour", "The old dog", "A young cat", "The chef", "A pilot"]
ACTIONS = ["is eating food", "is riding a horse", "reads a long book about the history of Berlin",
           "plays the guitar in the park", "is cooking dinner for friends", "walks along the sea at night"]


def texts(n: int) -> list[str]:
    return [f"{SUBJECTS[i % len(SUBJECTS)]} {ACTIONS[(i // 3) % len(ACTIONS)]} (item {i})." for i in range(n)]


async def run_server(config: ServerConfig, built: Any, args: argparse.Namespace) -> dict[str, float]:
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(serve_async(config, built=built, stop=stop, on_ready=ready.set_result))
    url = await asyncio.wait_for(ready, 120)
    # The load generator runs in its own process, as real clients do: in-process it would
    # share the server's event loop and bill its own JSON and HTTP work to the server.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", url, "--requests", str(args.requests),
        "--concurrency", str(args.concurrency), "--encoding-format", args.encoding_format,
        stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    res = json.loads(out.decode().strip().splitlines()[-1])
    done, dt = res["done"], res["seconds"]
    stop.set()
    await server
    return {"server_embeddings_per_s": done / dt, "server_s": dt}


async def drive(url: str, args: argparse.Namespace) -> dict[str, float]:
    inputs = texts(args.requests)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for t in inputs:
        queue.put_nowait(t)
    done = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while not queue.empty():
            text = queue.get_nowait()
            body = {"input": text, "encoding_format": args.encoding_format}
            async with session.post(url + "/v1/embeddings", json=body) as resp:
                resp.raise_for_status()
                body = await resp.json()
                assert len(body["data"][0]["embedding"]) > 0
                done += 1

    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        async with session.post(url + "/v1/embeddings", json={"input": ["warm up"] * 4}) as r:  # warm-up
            r.raise_for_status()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(args.concurrency)))
        dt = time.perf_counter() - t0
    return {"done": done, "seconds": dt}


def run_floor(built: Any, args: argparse.Namespace) -> dict[str, float]:
    import torch

    pm = built.pool_models["embed"]
    model, tok = pm.engine.model, pm.tokenizer
    inputs = texts(args.requests)

    def batch(chunk: list[str]) -> torch.Tensor:
        enc = tok(chunk, padding=True, truncation=True, max_length=pm.max_tokens, return_tensors="pt")
        h = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)

    with torch.inference_mode():
        batch(inputs[:4])                                    # warm-up
        t0 = time.perf_counter()
        for i in range(0, len(inputs), args.concurrency):
            batch(inputs[i:i + args.concurrency])
        dt = time.perf_counter() - t0
    return {"floor_embeddings_per_s": len(inputs) / dt, "floor_s": dt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--embedding-model", default="embed")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3, help="floor/server pairs; medians are reported")
    p.add_argument("--encoding-format", default="base64", choices=("base64", "float"),
                   help="base64 is what the official openai client asks for by default")
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(drive(args.client, args))))
        return 0
    config = ServerConfig(host="127.0.0.1", port=0,
                          model=ModelConfig(model=args.model, threads=args.threads, kv_blocks=64,
                                            embedding_model=args.embedding_model),
                          scheduler=SchedulerConfig())
    servers, floors = [], []
    for _ in range(args.rounds):      # alternate, so drifting load on a shared box hits both sides
        built = build_runtime(config)
        floors.append(run_floor(built, args)["floor_embeddings_per_s"])
        servers.append(asyncio.run(run_server(config, built, args))["server_embeddings_per_s"])
    server, floor = statistics.median(servers), statistics.median(floors)
    result = {"model": built.pool_models["embed"].name, "concurrency": args.concurrency,
              "encoding_format": args.encoding_format, "threads": args.threads,
              "requests": args.requests, "rounds": args.rounds,
              "server_embeddings_per_s": server, "floor_embeddings_per_s": floor,
              "ratio": server / floor, "ratios": [round(a / b, 3) for a, b in zip(servers, floors)]}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
