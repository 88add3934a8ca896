"""An RL framework's rollout loop against a live server: N rollouts, a weight update every K s.

Starts `actorserve serve` as a subprocess (`serverproc.py`, 127.0.0.1, a free port,
`--weight-version 0`) and keeps ``--rollouts`` rollouts running: each a `/generate` with
``input_ids``, ``return_logprob: true`` (streamed unless ``--no-stream``), sampled, for
``--max-new-tokens``; a finished rollout is replaced by a fresh one. Every ``--every`` seconds
one weight update runs, cycling through the clients' exact sequences and sources:

* ``slime``: ``POST /pause_generation {}`` -> ``POST /flush_cache`` retried until 200 ->
  ``/update_weights_from_disk`` (``model_path``, ``weight_version: N``, ``flush_cache: false``)
  or ``/update_weights_from_tensor`` (``load_format: safetensors``, base64 safetensors blobs
  in buckets, ``flush_cache: false``, ``weight_version: N``) -> ``POST /continue_generation``;
* ``areal``: ``POST /pause_generation`` -> the same update with ``abort_all_requests: true``
  -> ``POST /continue_generation``.

The ``gloo`` source is a trainer process (``python -m actorserve.engine.weights.weights_group``, SGLang's
recipe): at the start it joins the server's ``/init_weights_update_group`` as rank 0 (gloo, the
TCP store on a free port); for each update it posts ``/update_weights_from_distributed`` (``names``,
``dtypes``, ``shapes``, and the sequence's ``weight_version`` / ``flush_cache`` /
``abort_all_requests``) while it broadcasts every tensor; at the end it destroys the group.
Its ``update_ms`` is that post's time (the broadcast runs within it); ``gloo_join_ms`` is the join's.
``--sources`` picks the sources cycled through (default ``disk,tensor,gloo``).

An aborted rollout (the pause aborts what runs) is resubmitted as AReaL does (slime's partial
rollouts the same): ``input_ids + output_ids`` and ``max_new_tokens`` minus what it already has.
The weights alternate between the served folder and a copy perturbed with a fixed seed
(transformers, ``save_pretrained`` into a temp dir); the tensor source sends the same weights.

Prints one JSON line; per sequence and source (``slime_disk``, ...): ``pause_ms`` (the pause
call: pause-to-barrier), ``flush_ms`` and ``flush_tries`` (slime), ``update_ms``,
``continue_ms``, ``continue_to_first_token_ms`` (from continue's answer to the next token of any
rollout; with ``--no-stream`` to the next whole response with tokens, so much longer), each as p50/p95 over that kind's updates. Across the run: ``stale_tokens`` (must be 0:
streamed, a chunk's new tokens are stale when they arrive after an update's answer carrying an
older `meta_info.weight_version`; not streamed, a response is stale when its request was sent
after an update's answer and it names an older version -- a request whose tokens all came
before an update may carry the old version), ``versions_seen`` (the versions responses named),
``aborted`` (requests an update's pause ended with finish_reason abort), ``partial_outputs`` (those that returned their partial ``output_ids`` with one logprob
per token), ``aborted_empty`` (aborted before their first token), ``aborted_at_end`` (by the
benchmark's own ``abort_all`` when the duration is up), ``rollouts_completed``, ``errors`` (any
control call that did not answer 200: route, body and answer),
``tokens``, the CPU model and the arguments. Also: ``responses_spanning_versions``,
``live_requests_after`` (requests the server still runs or queues at the end: must be 0),
``step_gap_p50_ms``/``step_gap_p99_ms`` (a stream's gaps between chunks outside updates, as the
client sees a model step) against ``pause_p99_ms``; and from the server's own recording
(``--record``): ``server_step_p50_ms``/``p99`` (each model step, its ``step`` note to its
``step_end``), ``server_pause_barrier_p50_ms``/``p99`` (a pause's control record, created to
answered) and ``server_pause_barrier_p99_over_step_p99`` (goal <= 1). ``--rollouts-total N``
ends the run once N rollouts have completed (the soak: 1000 with ``--every 5``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aiohttp  # noqa: E402

from serverproc import cpu_name, free_port, start_server, stop_server, wait_up  # noqa: E402

COMBOS = [("slime", "disk"), ("slime", "tensor"), ("slime", "gloo"),
          ("areal", "disk"), ("areal", "tensor"), ("areal", "gloo")]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def make_weights(model: str, tmp: str, seed: int, bucket_mb: float) -> tuple[Path, Path, dict, list]:
    """The served folder, a perturbed copy, and each one's tensor buckets (base64 safetensors)."""
    import torch
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actorserve.engine.weights.models import resolve_model

    served = resolve_model(model)
    m = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32)
    orig = {n: p.detach().clone() for n, p in m.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=gen) * (0.05 * float(p.std()) if p.numel() > 1 else 0.0))
    pert = Path(tmp) / "perturbed"
    m.save_pretrained(pert)
    perturbed = {n: p.detach().clone() for n, p in m.named_parameters()}

    def buckets(named: dict) -> list[str]:
        out, cur, size = [], {}, 0
        for n, t in named.items():
            cur[n] = t.contiguous()
            size += t.numel() * t.element_size()
            if size >= bucket_mb * 2**20:
                out.append(base64.b64encode(save(cur)).decode())
                cur, size = {}, 0
        if cur:
            out.append(base64.b64encode(save(cur)).decode())
        return out

    tok = AutoTokenizer.from_pretrained(served)
    blobs = {str(served): buckets(orig), str(pert): buckets(perturbed)}
    prompts = [tok(f"Rollout {i}: write a short story about a robot learning to paint.")["input_ids"]
               for i in range(64)]
    return served, pert, blobs, prompts


class Bench:
    def __init__(self, url: str, args: argparse.Namespace, prompts: list[list[int]]) -> None:
        self.url, self.args, self.prompts = url, args, prompts
        self.answered: list[tuple[float, int]] = [(0.0, 0)]   # (update answer time, version)
        self.waiting_first: asyncio.Future | None = None
        self.stale = self.tokens = self.completed = self.aborted = 0
        self.partial = self.aborted_empty = self.requests = 0
        self.errors: list[str] = []
        self.versions_seen: set[str] = set()
        self.stop = False
        self.aborted_at_end = 0
        self.combos = [c for c in COMBOS if c[1] in args.sources]
        self.trainer: asyncio.subprocess.Process | None = None
        self.gloo_join_s: float | None = None
        self.updating = False                 # between an update's pause call and its continue's answer
        self.gaps: list[float] = []           # a stream's gaps between chunks with tokens, outside updates
        self.spanning = 0                     # responses whose tokens came from two or more versions

    async def trainer_ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.trainer is not None and self.trainer.stdin is not None and self.trainer.stdout is not None
        self.trainer.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.trainer.stdin.drain()
        raw = await asyncio.wait_for(self.trainer.stdout.readline(), 600)
        if not raw:
            raise RuntimeError(f"the trainer exited ({await self.trainer.wait()})")
        return json.loads(raw)

    async def start_trainer(self, served: Path, pert: Path) -> None:
        """The gloo source's trainer process, joined to the server's group (rank 0)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
        self.trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "actorserve.engine.weights.weights_group", "--server", self.url,
            "--weights", f"served={served}", "--weights", f"pert={pert}",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        raw = await asyncio.wait_for(self.trainer.stdout.readline(), 600)   # type: ignore[union-attr]
        if not raw or json.loads(raw).get("op") != "ready":
            raise RuntimeError(f"the trainer did not start: {raw!r}")
        joined = await self.trainer_ask(op="join", master_port=free_port())
        if joined.get("status") != 200:
            raise RuntimeError(f"/init_weights_update_group: {json.dumps(joined)[:500]}")
        self.gloo_join_s = joined["s"]

    async def stop_trainer(self) -> None:
        if self.trainer is None:
            return
        try:
            gone = await self.trainer_ask(op="destroy")
            if gone.get("status") != 200:
                self.errors.append(f"/destroy_weights_update_group: {json.dumps(gone)[:500]}")
        finally:
            assert self.trainer.stdin is not None
            self.trainer.stdin.close()
            try:
                await asyncio.wait_for(self.trainer.wait(), 60)
            except asyncio.TimeoutError:
                self.trainer.kill()
                await self.trainer.wait()

    def version_at(self, t: float) -> int:
        return max(v for ta, v in self.answered if ta <= t)

    def saw_tokens(self, t: float, n: int, version: Any, spans: list[dict[str, Any]] | None = None,
                   first: int = 0) -> None:
        """`n` new tokens (output positions ``first`` on) arrived at `t`: stale when made by
        weights older than the last update answered before they arrived. With the per-token
        spans (`meta_info.weight_versions`) each token is judged by its own version."""
        self.tokens += n
        now = self.version_at(t)
        if spans:
            for sp in spans:
                lo, hi = max(first, int(sp["start"])), min(first + n, int(sp["end"]))
                if hi > lo and int(sp["version"]) < now:
                    self.stale += hi - lo
        elif int(version) < now:
            self.stale += n
        f = self.waiting_first
        if f is not None and not f.done():
            f.set_result(t)

    async def one_request(self, http: aiohttp.ClientSession, ids: list[int], max_new: int) -> tuple[list[int], str]:
        """One /generate; returns (output_ids, finish type)."""
        self.requests += 1
        body = {"input_ids": ids, "return_logprob": True, "stream": self.args.stream,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, "top_p": 0.95}}
        sent = time.perf_counter()
        last: dict[str, Any] | None = None
        async with http.post(self.url + "/generate", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"/generate {r.status}: {await r.text()}")
            if self.args.stream:
                seen, t_prev = 0, None
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    last = json.loads(line[6:])
                    n = len(last["output_ids"]) - seen
                    if n > 0:
                        now = time.perf_counter()
                        if t_prev is not None and not self.updating and now - t_prev < 5:
                            self.gaps.append(now - t_prev)
                        t_prev = None if self.updating else now
                        meta = last["meta_info"]
                        self.saw_tokens(now, n, meta["weight_version"], meta.get("weight_versions"), seen)
                        seen += n
            else:
                last = await r.json()
                n = len(last["output_ids"])
                self.tokens += n
                if n and int(last["meta_info"]["weight_version"]) < self.version_at(sent):
                    self.stale += n
                f = self.waiting_first
                if n and f is not None and not f.done():
                    f.set_result(time.perf_counter())
        assert last is not None
        out = list(last["output_ids"])
        meta = last["meta_info"]
        self.versions_seen.add(str(meta["weight_version"]))
        if len({sp["version"] for sp in meta.get("weight_versions") or [] if sp["end"] > sp["start"]}) > 1:
            self.spanning += 1
        finish = (meta.get("finish_reason") or {}).get("type", "none")
        if finish == "abort" and self.stop:
            self.aborted_at_end += 1       # the benchmark's own abort_all at the end, not an update's
        elif finish == "abort":
            self.aborted += 1
            if not out:
                self.aborted_empty += 1
            elif len(meta.get("output_token_logprobs") or []) == len(out):
                self.partial += 1
        return out, finish

    async def rollout_worker(self, http: aiohttp.ClientSession, i: int) -> None:
        for k in itertools.count():
            if self.stop:
                return
            ids = list(self.prompts[(i * 7 + k) % len(self.prompts)])
            budget = self.args.max_new_tokens
            while True:
                out, finish = await self.one_request(http, ids, budget)
                budget -= len(out)
                if finish != "abort" or budget <= 0:
                    break
                if self.stop:
                    return
                ids = ids + out            # AReaL's resubmission: the prompt grows by the partial output
            self.completed += 1

    async def post(self, http: aiohttp.ClientSession, route: str, body: Any) -> tuple[int, Any, float]:
        t0 = time.perf_counter()
        async with http.post(self.url + route, json=body) as r:
            text = await r.text()
            status = r.status
        dt = time.perf_counter() - t0
        try:
            ans = json.loads(text)
        except ValueError:
            ans = text
        return status, ans, dt

    async def update(self, http: aiohttp.ClientSession, seq: str, source: str, version: int,
                     target: Path, blobs: list[str]) -> dict[str, float]:
        rec: dict[str, float] = {}

        async def must(route: str, body: Any) -> float:
            status, ans, dt = await self.post(http, route, body)
            if status != 200:
                msg = f"{seq}/{source} {route} {json.dumps(body)[:300]} -> {status} {json.dumps(ans)[:500]}"
                self.errors.append(msg)
                raise RuntimeError(msg)
            return dt

        self.updating = True
        rec["pause"] = await must("/pause_generation", {})
        if seq == "slime":
            tries, t0 = 0, time.perf_counter()
            while True:
                tries += 1
                status, ans, _ = await self.post(http, "/flush_cache", {})
                if status == 200:
                    break
                if tries >= 200:
                    self.errors.append(f"/flush_cache never 200: {status} {ans}")
                    raise RuntimeError("flush never succeeded")
                await asyncio.sleep(0.05)
            rec["flush"], rec["flush_tries"] = time.perf_counter() - t0, tries
        extra = {"abort_all_requests": True} if seq == "areal" else {"flush_cache": False}
        if source == "gloo":
            route = "/update_weights_from_distributed"
            body = {"weight_version": str(version), **extra}
            done = await self.trainer_ask(op="update", weights="pert" if target.name == "perturbed" else "served",
                                          fields=body)
            status, ans, dt = done["status"], done["answer"], done["s"]
        elif source == "disk":
            body = {"model_path": str(target), "weight_version": str(version), **extra}
            route = "/update_weights_from_disk"
        else:
            body = {"serialized_named_tensors": blobs, "load_format": "safetensors",
                    "weight_version": str(version), **extra}
            route = "/update_weights_from_tensor"
        if source != "gloo":
            status, ans, dt = await self.post(http, route, body)
        if status != 200 or not (isinstance(ans, dict) and ans.get("success")):
            shown = {k: (v if k != "serialized_named_tensors" else f"<{len(v)} blobs>") for k, v in body.items()}
            self.errors.append(f"{seq}/{source} {route} {json.dumps(shown)} -> {status} {json.dumps(ans)[:500]}")
            await must("/continue_generation", {})
            self.updating = False
            raise RuntimeError(self.errors[-1])
        self.answered.append((time.perf_counter(), version))
        rec["update"] = dt
        self.waiting_first = asyncio.get_running_loop().create_future()
        rec["continue"] = await must("/continue_generation", {})
        self.updating = False
        t_cont = time.perf_counter()
        try:
            t_first = await asyncio.wait_for(asyncio.shield(self.waiting_first), 30)
            rec["continue_to_first_token"] = max(0.0, t_first - t_cont)
        except asyncio.TimeoutError:
            self.errors.append(f"{seq}/{source}: no token within 30 s of continue")
        return rec

    async def run(self, served: Path, pert: Path, blobs: dict) -> dict[str, Any]:
        a = self.args
        conn = aiohttp.TCPConnector(limit=a.rollouts + 8)
        per: dict[str, list[dict[str, float]]] = {f"{s}_{src}": [] for s, src in self.combos}
        if "gloo" in a.sources:
            await self.start_trainer(served, pert)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
            workers = [asyncio.ensure_future(self.rollout_worker(http, i)) for i in range(a.rollouts)]
            t_end = time.perf_counter() + a.duration
            version = 0
            combos = itertools.cycle(self.combos)
            try:
                while True:
                    await asyncio.sleep(min(a.every, max(0.0, t_end - time.perf_counter())))
                    if time.perf_counter() >= t_end - 1e-3:
                        break
                    if a.rollouts_total and self.completed >= a.rollouts_total:
                        break
                    for w in workers:
                        if w.done() and w.exception() is not None:
                            raise w.exception()
                    seq, src = next(combos)
                    version += 1
                    target = pert if version % 2 else served
                    try:
                        per[f"{seq}_{src}"].append(
                            await self.update(http, seq, src, version, target, blobs[str(target)]))
                    except RuntimeError:
                        version -= 1
            finally:
                self.stop = True
                await self.post(http, "/abort_request", {"abort_all": True})
                res = await asyncio.gather(*workers, return_exceptions=True)
                await self.stop_trainer()
            for r in res:
                if isinstance(r, BaseException):
                    self.errors.append(f"rollout worker: {r!r}")
            live = await self.live_requests(http)
        out: dict[str, Any] = {}
        pauses = [r["pause"] for recs in per.values() for r in recs if "pause" in r]
        step_p99 = pct(self.gaps, 0.99) if self.gaps else None
        pause_p99 = pct(pauses, 0.99) if pauses else None
        out["step_gap_p50_ms"] = round(pct(self.gaps, 0.5) * 1e3, 2) if self.gaps else None
        out["step_gap_p99_ms"] = round(step_p99 * 1e3, 2) if step_p99 else None
        out["pause_p99_ms"] = round(pause_p99 * 1e3, 2) if pause_p99 else None
        out["pause_p99_over_step_p99"] = round(pause_p99 / step_p99, 3) if pause_p99 and step_p99 else None
        for kind, recs in per.items():
            d: dict[str, Any] = {"updates": len(recs)}
            for key in ("pause", "flush", "update", "continue", "continue_to_first_token"):
                vals = [r[key] for r in recs if key in r]
                if vals:
                    d[f"{key}_p50_ms"] = round(pct(vals, 0.5) * 1e3, 2)
                    d[f"{key}_p95_ms"] = round(pct(vals, 0.95) * 1e3, 2)
            tries = [r["flush_tries"] for r in recs if "flush_tries" in r]
            if tries:
                d["flush_tries_max"] = int(max(tries))
            out[kind] = d
        out.update({"stale_tokens": self.stale, "tokens": self.tokens, "requests": self.requests,
                    "aborted": self.aborted, "partial_outputs": self.partial,
                    "aborted_empty": self.aborted_empty, "rollouts_completed": self.completed,
                    "aborted_at_end": self.aborted_at_end,
                    "gloo_join_ms": None if self.gloo_join_s is None else round(self.gloo_join_s * 1e3, 2),
                    "final_weight_version": self.answered[-1][1],
                    "versions_seen": sorted(self.versions_seen, key=int),
                    "responses_spanning_versions": self.spanning, "live_requests_after": live,
                    "errors": self.errors})
        return out

    async def live_requests(self, http: aiohttp.ClientSession) -> float | None:
        """Requests the server still runs or queues once every rollout has ended (must be 0);
        read from `/metrics` after the server has had its turn to end the last aborts."""
        for _ in range(100):
            async with http.get(self.url + "/metrics") as r:
                text = await r.text()
            live = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(("sglang:num_running_reqs", "sglang:num_queue_reqs")))
            if live == 0:
                return 0
            await asyncio.sleep(0.1)
        return live


def server_timings(path: str) -> dict[str, Any]:
    """From the server's own recording: each model step's duration (its ``step`` note to its
    ``step_end`` input) and each pause's barrier latency (the pause control record's creation to
    its answer: everything the server did for it, without HTTP), p50/p99 and their ratio (the
    issue's goal: the pause barrier within one model step, p99)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from actorserve.replay.recorder import read_recording
    started: dict[int, int] = {}
    steps: list[float] = []
    opened: dict[str, int] = {}
    pauses: list[float] = []
    for e in read_recording(path)[1]:
        d = e.data or {}
        if e.kind == "step" and d.get("sched") == "scheduler":
            started[int(d["step"])] = e.t_ns
        elif e.kind == "input" and e.event == "step_end" and d.get("sched") == "scheduler":
            t0 = started.pop(int(d["step"]), None)
            if t0 is not None:
                steps.append((e.t_ns - t0) / 1e9)
        elif e.kind == "control" and e.event == "create" and d.get("op") == "pause_generation":
            opened[e.rid] = e.t_ns
        elif e.kind == "control" and e.rid in opened and e.event in ("apply", "reject"):
            pauses.append((e.t_ns - opened.pop(e.rid)) / 1e9)
    out: dict[str, Any] = {"server_steps": len(steps), "server_pauses": len(pauses)}
    for name, vals in (("step", steps), ("pause_barrier", pauses)):
        for q in (0.5, 0.99):
            out[f"server_{name}_p{int(q * 100)}_ms"] = round(pct(vals, q) * 1e3, 2) if vals else None
    if steps and pauses:
        out["server_pause_barrier_p99_over_step_p99"] = round(pct(pauses, 0.99) / pct(steps, 0.99), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (default) or default (SmolLM2-135M)")
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--every", type=float, default=4.0, help="seconds between weight updates")
    p.add_argument("--duration", type=float, default=20.0, help="seconds (a cap with --rollouts-total)")
    p.add_argument("--rollouts-total", type=int, default=0,
                   help="stop once this many rollouts have completed (the soak: 1000)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--bucket-mb", type=float, default=16.0, help="tensor source: bucket size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sources", type=lambda v: [x for x in v.split(",") if x], default=["disk", "tensor", "gloo"],
                   help="weight sources cycled through: disk, tensor, gloo (comma-separated)")
    p.add_argument("--json", action="store_true", help="print the one JSON line (the only output)")
    args = p.parse_args(argv)
    random.seed(args.seed)
    tmp = tempfile.TemporaryDirectory()
    served, pert, blobs, prompts = make_weights(args.model, tmp.name, args.seed, args.bucket_mb)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    blocks = (args.rollouts + 4) * ((args.max_new_tokens + 64) // 16 + 4)
    record = os.path.join(tmp.name, "rollout.jsonl")
    proc = start_server(port, "--model", args.model, "--embedding-model", "none", "--weight-version", "0",
                        "--record", record,
                        "--kv-blocks", str(blocks), "--max-num-seqs", str(max(8, args.rollouts)),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_up(url, proc))
        bench = Bench(url, args, prompts)
        res = asyncio.run(bench.run(served, pert, blobs))
        stop_server(proc)
        res.update(server_timings(record))
    finally:
        stop_server(proc)
        tmp.cleanup()
    out = {"model": args.model, "cpu": cpu_name(), "args": sys.argv[1:] if argv is None else argv,
           **res, "server_rc": proc.returncode}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
