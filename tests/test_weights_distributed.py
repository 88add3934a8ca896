"""Weights from a trainer process over torch.distributed (gloo): `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`, against a server in this
process and a real trainer process (`python -m actorserve.engine.weights.weights_group`, SGLang's
recipe: it joins as rank 0 hosting the TCP store while it posts the init, and broadcasts each
tensor while it posts the update, with SGLang's client bodies)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import pytest

import actorserve
from actorserve.replay.check import check

from http_support import assert_error, load_smol, load_tiny, serve, settle
from waiting import until

GROUP = "weight_update_group"
TINY_PROMPT = [5 + (i * 7) % 150 for i in range(40)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _perturbed(src: str, dest: Path, seed: int, scale: float) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (scale * float(p.float().std()) if p.numel() > 1 else 0.0))
    model.save_pretrained(str(dest))
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(str(dest))
    return dest


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """The tiny model perturbed (fixed seed), and a model of another shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from actorserve.engine.weights.models import resolve_model
    src = str(resolve_model("tiny"))
    new = _perturbed(src, tmp_path_factory.mktemp("tiny_new"), 1234, 1.0)
    other = tmp_path_factory.mktemp("tiny_other")
    cfg = AutoConfig.from_pretrained(src, local_files_only=True)
    cfg.intermediate_size *= 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(other))
    return new, other


class Trainer:
    """The trainer process: one JSON line in, one out (`weights_group.trainer_main`)."""

    def __init__(self, url: str, weights: dict[str, Path]) -> None:
        self.url, self.weights = url, weights
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> "Trainer":
        root = str(Path(actorserve.__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
        args = [a for k, f in self.weights.items() for a in ("--weights", f"{k}={f}")]
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "actorserve.engine.weights.weights_group", "--server", self.url, *args,
            "--timeout", "60", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        ready = await self._line()
        assert ready["op"] == "ready", ready
        return self

    async def _line(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), 180)
        assert raw, f"the trainer exited: {await self.proc.wait()}"
        return json.loads(raw)

    async def ask(self, **cmd) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        return await self._line()

    async def __aexit__(self, *exc) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 60)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        assert self.proc.returncode == 0 or exc[0] is not None, self.proc.returncode


def _served_tensors(engine) -> dict[str, tuple[int, ...]]:
    """The served model's parameters, each storage once (as the trainer sends them)."""
    seen, out = set(), {}
    for name, t in engine.model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = tuple(t.shape)
    return out


def _update_body(engine, **fields) -> dict:
    shapes = _served_tensors(engine)
    return {"names": list(shapes), "dtypes": ["bfloat16"] * len(shapes), "shapes": [list(s) for s in shapes.values()],
            "group_name": GROUP, **fields}


async def _ids(http, prompt, max_new=12):
    r = await http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
    assert r.status == 200, await r.text()
    body = await r.json()
    return body["output_ids"], body["meta_info"]


async def _refused(http, route, body, param, status=400) -> dict:
    r = await http.post(route, json=body)
    got = await r.json()
    assert r.status == status, (route, body, got)
    assert_error(got)
    assert got["error"]["param"] == param, (route, got)
    if "success" in got:
        assert got["success"] is False and got["message"] == got["error"]["message"]
    return got


@pytest.fixture(scope="module")
def smol_new(tmp_path_factory):
    from actorserve.engine.weights.models import resolve_model
    return _perturbed(str(resolve_model("default")), tmp_path_factory.mktemp("smol_new"), 7, 0.05)


async def test_a_trainer_broadcast_of_all_smollm2_weights_serves_as_a_fresh_server(smol_new):
    """All SmolLM2 weights broadcast by a trainer process change the greedy output to what a
    fresh server loaded from those weights answers; no group, or a destroyed one, is a 400."""
    smol = load_smol()
    prompt = smol[1]("The capital of France is")["input_ids"]
    async with serve(smol, name="smol") as (http, rt):
        before, meta = await _ids(http, prompt)
        assert meta["weight_version"] == "default"
        no_group = _update_body(rt.engine, flush_cache=False, weight_version="1")
        got = await _refused(http, "/update_weights_from_distributed", no_group, "group_name")
        assert "/init_weights_update_group" in got["message"]
        async with Trainer(str(http.make_url("")).rstrip("/"), {"new": smol_new}) as trainer:
            port = free_port()
            joined = await trainer.ask(op="join", master_port=port)
            assert joined["status"] == 200 and joined["error"] is None, joined
            assert joined["answer"]["success"] is True and "rank 1 of 2" in joined["answer"]["message"]
            again = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                     "world_size": 2, "group_name": "other", "backend": "gloo"}
            got = await _refused(http, "/init_weights_update_group", again, "master_address")
            assert "already open" in got["message"]
            done = await trainer.ask(op="update", weights="new",
                                     fields={"flush_cache": False, "weight_version": "v2"})
            assert done["status"] == 200, done
            assert done["answer"] == {"success": True, "message": done["answer"]["message"], "weight_version": "v2"}
            after, meta = await _ids(http, prompt)
            assert after != before and meta["weight_version"] == "v2"
            gone = await trainer.ask(op="destroy")
            assert gone["status"] == 200 and gone["answer"]["success"] is True, gone
        await _refused(http, "/update_weights_from_distributed", no_group, "group_name")
        await _refused(http, "/destroy_weights_update_group", {"group_name": GROUP}, "group_name")
        await settle(rt)
        assert [e.event for e in rt.recorder.events(kind="weights")] == ["create", "update", "loaded"]
        reads = rt.recorder.events(kind="weights_read")
        assert [e.event for e in reads] == ["read"] and reads[0].data["tensors"] == len(_served_tensors(rt.engine))
        assert [e.event for e in rt.recorder.events(kind="weights_group")] == ["joined", "destroyed"]
        assert check(rt.recorder.events()).ok
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer
    model, hf_tok, _ = load_model(str(smol_new), threads=2)
    async with serve((model, hf_tok, TextTokenizer(hf_tok, generation_config=model.generation_config)),
                     name="smol") as (http, rt):
        fresh, _ = await _ids(http, prompt)
    assert fresh == after


async def test_bad_bodies_are_400_and_the_server_keeps_serving(monkeypatch):
    from actorserve.engine.weights import weights_group
    monkeypatch.setattr(weights_group, "INIT_TIMEOUT_S", 1.0)
    async with serve(load_tiny()) as (http, rt):
        before, _ = await _ids(http, TINY_PROMPT)
        init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                "group_name": GROUP, "backend": "gloo"}
        got = await _refused(http, "/init_weights_update_group", {**init, "backend": "nccl"}, "backend")
        assert "CPU" in got["error"]["message"] and "gloo" in got["error"]["message"]
        for change, param in (({"rank_offset": 0}, "rank_offset"), ({"rank_offset": 2}, "rank_offset"),
                              ({"world_size": 1}, "world_size"), ({"master_port": "http"}, "master_port"),
                              ({"master_port": 70000}, "master_port"), ({"backend": "mpi"}, "backend"),
                              ({"bogus": 1}, "bogus"), ({"master_address": ""}, "master_address")):
            await _refused(http, "/init_weights_update_group", {**init, **change}, param)
        # no trainer: the join is bounded, a clear 400, and the loop serves meanwhile
        join = asyncio.ensure_future(http.post("/init_weights_update_group",
                                               json={**init, "master_port": str(init["master_port"])}))
        assert (await http.get("/health")).status == 200
        during, _ = await _ids(http, TINY_PROMPT)
        r = await join
        got = await r.json()
        assert r.status == 400 and got["success"] is False, got
        assert "could not join" in got["message"] and "within 1s" in got["message"]
        update = _update_body(rt.engine)
        for change, param in (({"dtypes": ["bfloat16"]}, "dtypes"), ({"shapes": [[1]]}, "shapes"),
                              ({"dtypes": ["int64"] * len(update["names"])}, "dtypes.0"),
                              ({"shapes": [[-1]] * len(update["names"])}, "shapes.0.0"),
                              ({"load_format": "flattened_bucket"}, "load_format"), ({"names": []}, "names"),
                              ({"names": "x"}, "names"), ({"flush_cache": "no"}, "flush_cache")):
            await _refused(http, "/update_weights_from_distributed", {**update, **change}, param)
        await _refused(http, "/update_weights_from_distributed", update, "group_name")   # no group
        await _refused(http, "/destroy_weights_update_group", {"group_name": GROUP}, "group_name")
        await _refused(http, "/destroy_weights_update_group", {"group_name": 3}, "group_name")
        after, meta = await _ids(http, TINY_PROMPT)
        assert before == during == after and meta["weight_version"] == "default"
        await settle(rt)
        assert [e.event for e in rt.recorder.events(kind="weights")] == ["create"]
        assert check(rt.recorder.events()).ok


async def test_a_mismatch_is_received_then_refused_and_the_group_stays_usable(tiny_folders):
    """Tensors of another shape are received in full (the broadcasts stay paired), refused
    with a 400 naming the tensor, the old weights serve; the next update through the same
    group serves; a server shut down with its group open destroys it."""
    from torch.distributed.distributed_c10d import _world
    new, other = tiny_folders
    async with serve(load_tiny()) as (http, rt):
        before, _ = await _ids(http, TINY_PROMPT)
        async with Trainer(str(http.make_url("")).rstrip("/"), {"new": new, "other": other}) as trainer:
            joined = await trainer.ask(op="join", master_port=free_port(), group_name="g2")
            assert joined["status"] == 200, joined
            bad = await trainer.ask(op="update", weights="other", fields={"weight_version": "bad"})
            assert bad["status"] == 400 and bad["answer"]["success"] is False, bad
            assert bad["answer"]["error"]["param"].startswith("shapes.") and "shape" in bad["answer"]["message"]
            same, meta = await _ids(http, TINY_PROMPT)
            assert same == before and meta["weight_version"] == "default"
            good = await trainer.ask(op="update", weights="new", fields={"weight_version": "v3",
                                                                         "abort_all_requests": True})
            assert good["status"] == 200 and good["answer"]["weight_version"] == "v3", good
            after, meta = await _ids(http, TINY_PROMPT)
            assert after != before and meta["weight_version"] == "v3"
            assert "g2" in _world.pg_names.values()
            await settle(rt)
            events = [e.event for e in rt.recorder.events(kind="weights")]
            assert events == ["create", "update", "load_failed", "keep_old", "update", "loaded"]
            assert check(rt.recorder.events()).ok
        # the server (the `serve` block) ends with the group still open: shutdown destroys it
    await until(lambda: "g2" not in _world.pg_names.values())
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer
    from actorserve.http.edge.server import FALLBACK_CHAT_TEMPLATE
    model, hf_tok, _ = load_model(str(new), threads=1)
    async with serve((model, hf_tok, TextTokenizer(hf_tok, chat_template=FALLBACK_CHAT_TEMPLATE))) as (http, rt):
        fresh, _ = await _ids(http, TINY_PROMPT)
    assert fresh == after
