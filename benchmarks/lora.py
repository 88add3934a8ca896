"""Multi-LoRA decode speed (issue 30): streams spread over adapters against the same streams on the base.

Adapters: ``--adapters`` (4) rank-``--rank`` (16) PEFT LoRA adapters of the embedded
SmolLM2-135M-Instruct on q/k/v/o/gate/up/down_proj, built here with ``peft`` (fixed seeds, A and
B drawn at random so every adapter changes the output) and saved into a temporary folder.

(a) engine (in process, no HTTP): the paged runner as ``actorserve serve`` builds it (dtype and
quantization ``auto``), each adapter loaded into a slot (``load_s``: read, checked, placed);
``--streams`` (16) greedy streams of the same 12-token prompt prefilled together, then
``--steps`` decode steps of all of them in one step each (``--rows`` splits them into steps
of that many rows instead, the scheduler's ``max_num_seqs``), the streams on adapter
``i % adapters`` against the same streams on the base model; ``--passes`` alternations, the
best of each. Figures: decode tok/s and ms per step, and ``ratio`` = adapters / base (goal
>= 0.75).

(b) server: ``actorserve serve --lora-paths a1=... a2=...`` (``make serve``'s defaults
otherwise), ``--streams`` concurrent greedy ``/v1/completions`` of ``--max-tokens`` tokens
(``ignore_eos``), ``model`` ``"a1"`` .. ``"aN"`` in turn, against the same on the base model:
output tok/s (completion tokens over the wall time, prefill included) and the ratio. A server
that refuses ``--lora-paths`` is reported as not available.

(c) the peer: vLLM's CPU backend (``--vllm-python``, docs/peers.md) with ``--enable-lora
--lora-modules a1=... --max-lora-rank R --max-loras N``, the same load as (b); its tok/s and
actorserve / vLLM.

    .venv/bin/python benchmarks/lora.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
import torch  # noqa: E402

from serverproc import cpu_name, free_port, stop_server, wait_up  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Once upon a time, in a land far away, there lived"


def build_adapters(root: Path, n: int, rank: int) -> dict[str, str]:
    """`n` PEFT adapters of the default model saved under `root`; name -> folder."""
    import peft
    from transformers import AutoModelForCausalLM

    from actorserve.engine.weights.models import resolve_model

    clean = AutoModelForCausalLM.from_pretrained(str(resolve_model("default")), dtype=torch.float32,
                                                 local_files_only=True).eval()
    out = {}
    for i in range(n):
        torch.manual_seed(1000 + i)
        model = peft.get_peft_model(copy.deepcopy(clean), peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=MODULES))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:           # PEFT starts B at zero: the adapter would change nothing
                    p.normal_(0, 0.02)
        folder = root / f"a{i + 1}"
        model.save_pretrained(str(folder))
        out[f"a{i + 1}"] = str(folder)
    return out


# -- (a) the engine -------------------------------------------------------------------------------
def _decode(engine: Any, prompt: list[int], names: list[str | None], steps: int, rows: int) -> tuple[float, list[list[int]]]:
    """Seconds of `steps` decode steps of one stream per entry of `names` (its adapter or None),
    `rows` streams a step; and each stream's tokens."""
    from actorserve.engine.scheduling.params import SamplingParams
    from actorserve.engine.scheduling.sequence import Sequence

    bs = engine.kv.block_size
    need = -(-(len(prompt) + steps + 2) // bs)
    seqs = []
    for i, name in enumerate(names):
        lora = None if name is None else engine.lora.acquire(name)
        s = Sequence(f"s{i}", prompt, sampling=SamplingParams(temperature=0.0, max_new_tokens=steps), lora=lora)
        s.block_table = list(range(i * need, (i + 1) * need))
        seqs.append(s)
    try:
        for s, o in zip(seqs, engine.execute([(s, s.num_tokens) for s in seqs])):
            s.num_computed = s.num_tokens
            s.output_ids.append(o.token_id)
        t0 = time.perf_counter()
        for _ in range(steps):
            for at in range(0, len(seqs), rows):
                part = seqs[at:at + rows]
                for s, o in zip(part, engine.execute([(s, 1) for s in part])):
                    s.num_computed += 1
                    s.output_ids.append(o.token_id)
        return time.perf_counter() - t0, [s.output_ids for s in seqs]
    finally:
        for s in seqs:
            if s.lora is not None:
                engine.lora.release(s.lora)


def run_engine(args: argparse.Namespace, folders: dict[str, str]) -> dict[str, Any]:
    from actorserve.config import ModelConfig
    from actorserve.engine.weights.dtype import resolve_dtype
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.runners.runner import PagedLlamaRunner

    mc = ModelConfig()                                  # the server's defaults: dtype and quantization auto
    model, tok, _ = load_model("default", threads=args.threads, dtype=resolve_dtype(mc.dtype)[0],
                               quantization=mc.quantization)
    prompt = tok.encode(PROMPT)
    need = -(-(len(prompt) + args.steps + 2) // 16) * args.streams
    engine = PagedLlamaRunner(model, num_blocks=need + 8, block_size=16, max_loaded_loras=len(folders),
                              max_lora_rank=args.rank)
    load_s = {}
    for name, folder in folders.items():
        t0 = time.perf_counter()
        engine.lora.load(name, folder)
        load_s[name] = round(time.perf_counter() - t0, 3)
    names = list(folders)
    lora_names = [names[i % len(names)] for i in range(args.streams)]
    out: dict[str, Any] = {"dtype": str(engine.dtype).removeprefix("torch."),
                           "quantized": getattr(model, "actorserve_quant", None) is not None,
                           "fused_step": engine.fused is not None, "streams": args.streams,
                           "rows_per_step": [], "load_s": load_s}
    for rows in args.rows:
        base_s, lora_s = [], []
        tokens: dict[str, Any] = {}
        for _ in range(args.passes):
            t, tokens["base"] = _decode(engine, prompt, [None] * args.streams, args.steps, rows)
            base_s.append(t)
            t, tokens["lora"] = _decode(engine, prompt, lora_names, args.steps, rows)
            lora_s.append(t)
        steps = args.steps * -(-args.streams // rows)
        base_tps = args.streams * args.steps / min(base_s)
        lora_tps = args.streams * args.steps / min(lora_s)
        out["rows_per_step"].append({
            "rows": rows, "base_tok_s": round(base_tps, 1), "lora_tok_s": round(lora_tps, 1),
            "base_ms_per_step": round(min(base_s) / steps * 1e3, 2),
            "lora_ms_per_step": round(min(lora_s) / steps * 1e3, 2), "ratio": round(lora_tps / base_tps, 3),
            # each adapter's streams must differ from the base's (the deltas are really added)
            "adapters_change_output": all(a != b for a, b in zip(tokens["lora"][:len(names)], tokens["base"])),
        })
    return out


# -- (b) and (c): servers -------------------------------------------------------------------------
async def _one(http: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{model}: HTTP {r.status}: {str(data)[:300]}")
        return int(data["usage"]["completion_tokens"])


async def _load(url: str, models: list[str], max_tokens: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        await _one(http, url, models[0], 4)                        # warm up
        t0 = time.perf_counter()
        done = await asyncio.gather(*(_one(http, url, m, max_tokens) for m in models))
        wall = time.perf_counter() - t0
    return {"tok_s": round(sum(done) / wall, 1), "completion_tokens": sum(done), "wall_s": round(wall, 2)}


def _serve(name: str, cmd: list[str], port: int, args: argparse.Namespace, base_model: str,
           adapters: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    log = Path(args.log_dir) / f"lora_{name}.log"
    result: dict[str, Any] = {"cmd": " ".join(cmd)}
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        try:
            url = f"http://127.0.0.1:{port}"
            t0 = time.perf_counter()
            asyncio.run(wait_up(url, proc, timeout=args.start_timeout))
            result["startup_s"] = round(time.perf_counter() - t0, 2)
            streams = args.streams
            result["base"] = asyncio.run(_load(url, [base_model] * streams, args.max_tokens))
            result["lora"] = asyncio.run(_load(url, [adapters[i % len(adapters)] for i in range(streams)],
                                               args.max_tokens))
            result["ratio"] = round(result["lora"]["tok_s"] / result["base"]["tok_s"], 3)
        except Exception as e:  # noqa: BLE001 - a server that fails is reported, not raised
            result["error"] = f"{type(e).__name__}: {e}"
            result["log_tail"] = log.read_text(errors="replace")[-600:] if log.exists() else ""
        finally:
            stop_server(proc)
            try:                                    # vLLM's engine core is a child in the group
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return result


def run_server(args: argparse.Namespace, folders: dict[str, str]) -> dict[str, Any]:
    probe = subprocess.run([sys.executable, "-m", "actorserve.cli", "serve", "--help"],
                           capture_output=True, text=True, timeout=300)
    if "--lora-paths" not in probe.stdout:
        return {"available": False, "reason": "server: not available (no --lora-paths)"}
    port = free_port()
    cmd = [sys.executable, "-m", "actorserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--lora-paths", *(f"{n}={p}" for n, p in folders.items())]
    out = _serve("actorserve", cmd, port, args, "default", list(folders))
    return {"available": "error" not in out, **out}


def run_vllm(args: argparse.Namespace, folders: dict[str, str]) -> dict[str, Any]:
    from actorserve.engine.weights.models import resolve_model

    import peer_vllm

    if not Path(args.vllm_python).exists():
        return {"available": False, "reason": f"peer not installed: {args.vllm_python} missing (docs/peers.md)"}
    port = free_port()
    cores = len(os.sched_getaffinity(0))
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model("default")),
           "--served-model-name", "default", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", "4096", "--enable-lora", "--lora-modules",
           *(f"{n}={p}" for n, p in folders.items()), "--max-lora-rank", str(args.rank),
           "--max-loras", str(len(folders))]
    out = _serve("vllm", cmd, port, args, "default", list(folders), env=peer_vllm.env(cores))
    out["version"] = peer_vllm.version(args.vllm_python)
    return {"available": "error" not in out, **out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--steps", type=int, default=24, help="engine: decode steps measured")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="engine: rows a step, comma-separated (default: all streams in one step)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64, help="server: tokens a request")
    p.add_argument("--parts", default="engine,server,vllm", help="which of engine, server, vllm to run")
    p.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.rows = args.rows or [args.streams]
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {"bench": "lora", "cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)),
                              "loadavg_before": [round(x, 2) for x in os.getloadavg()],
                              "adapters": args.adapters, "rank": args.rank, "streams": args.streams,
                              "modules": MODULES}
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
        t0 = time.perf_counter()
        folders = build_adapters(Path(tmp), args.adapters, args.rank)
        result["build_s"] = round(time.perf_counter() - t0, 1)
        if "engine" in parts:
            result["engine"] = run_engine(args, folders)
        if "server" in parts:
            result["server"] = run_server(args, folders)
        if "vllm" in parts:
            result["vllm"] = run_vllm(args, folders)
            ours = result.get("server", {})
            if ours.get("available") and result["vllm"].get("available"):
                result["actorserve_vs_vllm"] = {
                    k: round(ours[k]["tok_s"] / result["vllm"][k]["tok_s"], 3) for k in ("base", "lora")}
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
