"""Weights as a lifecycle: `/update_weights_from_disk`, `/update_weight_version`,
`/get_weights_by_name` on the tiny model, over a real HTTP server."""

from __future__ import annotations

import asyncio
import json

import pytest

from actorserve.replay.check import check

from http_support import assert_error, load_tiny, serve, settle
from test_http_control import Stall
from waiting import until
from actor_access import actor_of

PROMPT = [5 + (i * 7) % 150 for i in range(40)]       # > two blocks of 16: a prefix-cache hit


def _gen(max_new: int = 8, **sp):
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                     "ignore_eos": True, **sp}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A copy of the tiny model with other weights (fixed seed) and one of another shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from actorserve.engine.weights.models import resolve_model

    src = resolve_model("tiny")
    new = tmp_path_factory.mktemp("tiny_new")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, local_files_only=True)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (float(p.float().std()) or 0.02))
    model.save_pretrained(str(new))
    AutoTokenizer.from_pretrained(str(src), local_files_only=True).save_pretrained(str(new))
    other = tmp_path_factory.mktemp("tiny_other")
    cfg = AutoConfig.from_pretrained(str(src), local_files_only=True)
    cfg.intermediate_size = cfg.intermediate_size * 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(other))
    return new, other


async def _ids(http, **kw):
    r = await http.post("/generate", json=_gen(**kw))
    assert r.status == 200, await r.text()
    body = await r.json()
    return body["output_ids"], body["meta_info"]


async def test_update_from_disk_serves_the_new_weights(folders):
    new, _ = folders
    async with serve(load_tiny()) as (http, rt):
        before, meta = await _ids(http)
        assert meta["weight_version"] == "default"
        _, meta = await _ids(http)
        assert meta["cached_tokens"] > 0                         # the prefix cache is warm
        r = await http.post("/update_weights_from_disk", json={"model_path": str(new), "weight_version": "v2"})
        body = await r.json()
        assert r.status == 200, body
        assert body["success"] is True and body["num_paused_requests"] == 0 and body["message"]
        after, meta = await _ids(http)
        assert after != before
        assert meta["weight_version"] == "v2"
        info = await (await http.get("/model_info")).json()
        assert info["weight_version"] == "v2" and info["model_path"] == str(new)
        assert meta["cached_tokens"] == 0                        # old KV never reused by new weights
        from openai import AsyncOpenAI
        async with AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0) as oai:
            chat = await oai.chat.completions.create(model="tiny-llama", max_tokens=2,
                                                     messages=[{"role": "user", "content": "hi"}])
            assert chat.metadata["weight_version"] == "v2"                           # SGLang's place
            assert json.loads(chat.metadata["weight_versions"]) == [
                {"version": "v2", "start": 0, "end": chat.usage.completion_tokens}]
            comp = await oai.completions.create(model="tiny-llama", max_tokens=2, prompt="hi")
            assert comp.model_extra["metadata"]["weight_version"] == "v2"
        # get_weights_by_name reads the new values
        import torch
        from transformers import AutoModelForCausalLM
        ref = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32, local_files_only=True)
        name = "model.layers.0.mlp.down_proj.weight"
        r = await http.post("/get_weights_by_name", json={"name": name, "truncate_size": 2})
        got = await r.json()
        assert r.status == 200 and got == ref.get_parameter(name)[:2].tolist()
        r = await http.get("/get_weights_by_name", params={"name": name, "truncate_size": "1"})
        assert (await r.json()) == ref.get_parameter(name)[:1].tolist()
        r = await http.post("/get_weights_by_name", json={"name": "no.such.weight"})
        assert r.status == 400
        assert_error(await r.json())
        await settle(rt)
        events = rt.recorder.events(kind="weights")
        assert [e.event for e in events] == ["create", "update", "loaded"]
        versions = rt.recorder.events(kind="weights_version")
        assert [e.data["version"] for e in versions] == ["v2"]
        assert check(rt.recorder.events()).ok
    # a fresh server loaded from the new folder answers the same
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer
    from actorserve.http.edge.server import FALLBACK_CHAT_TEMPLATE
    model, hf_tok, _ = load_model(str(new), threads=1)
    async with serve((model, hf_tok, TextTokenizer(hf_tok, chat_template=FALLBACK_CHAT_TEMPLATE))) as (http, rt):
        fresh, _ = await _ids(http)
        assert fresh == after


async def test_a_bad_update_is_a_400_and_the_old_weights_serve(folders, tmp_path):
    _, other = folders
    async with serve(load_tiny()) as (http, rt):
        before, _ = await _ids(http)
        for path in (str(tmp_path / "missing"), str(other)):
            r = await http.post("/update_weights_from_disk", json={"model_path": path, "weight_version": "bad"})
            body = await r.json()
            assert r.status == 400, body
            assert body["success"] is False and body["num_paused_requests"] == 0
            assert body["error"]["param"] == "model_path" and body["message"] == body["error"]["message"]
        assert "intermediate" in body["message"] or "shape" in body["message"]
        after, meta = await _ids(http)
        assert after == before and meta["weight_version"] == "default"
        r = await http.post("/update_weights_from_disk", json={"model_path": str(other), "bogus": 1})
        assert r.status == 400
        assert_error(await r.json())
        await settle(rt)
        events = [e.event for e in rt.recorder.events(kind="weights")]
        assert events == ["create"] + ["update", "load_failed", "keep_old"] * 2
        assert [e.event for e in rt.recorder.events(kind="weights_read")] == ["failed"] * 2
        assert check(rt.recorder.events()).ok


async def test_the_server_answers_while_the_folder_is_read(folders, monkeypatch):
    """The folder is read and checked on a worker thread: while that read is held, /health and
    a /generate (under the old weights) are answered; released, the copy runs on the step
    thread and the new weights answer as a fresh load of the folder does."""
    import threading

    from actorserve.engine.weights import refit
    new, _ = folders
    entered, gate, threads = threading.Event(), threading.Event(), {}
    real_read, real_apply = refit._read_folder, refit.apply_checked

    def held_read(path, fmt):
        threads["read"] = threading.current_thread()
        entered.set()
        assert gate.wait(30)
        return real_read(path, fmt)

    def apply(engine, tensors):
        threads["apply"] = threading.current_thread()
        return real_apply(engine, tensors)

    monkeypatch.setattr(refit, "_read_folder", held_read)
    monkeypatch.setattr(refit, "apply_checked", apply)
    async with serve(load_tiny()) as (http, rt):
        before, _ = await _ids(http)
        update = asyncio.ensure_future(http.post("/update_weights_from_disk",
                                                 json={"model_path": str(new), "weight_version": "v6"}))
        await until(entered.is_set)
        r = await http.get("/health")
        assert r.status == 200
        during, meta = await _ids(http)
        assert during == before and meta["weight_version"] == "default"
        assert not update.done() and actor_of(rt, "control").weights.state.name == "updating"
        gate.set()
        r = await update
        body = await r.json()
        assert r.status == 200 and body["success"] is True and body["weight_version"] == "v6", body
        after, meta = await _ids(http)
        assert after != before and meta["weight_version"] == "v6" and meta["cached_tokens"] == 0
        assert threads["read"] is not threading.current_thread()
        assert not threads["read"].name.startswith("actorserve-step")
        assert threads["apply"].name.startswith("actorserve-step")      # where the steps run
        await settle(rt)
        assert [e.event for e in rt.recorder.events(kind="weights")] == ["create", "update", "loaded"]
        reads = rt.recorder.events(kind="weights_read")
        assert [e.event for e in reads] == ["read"] and reads[0].data["tensors"] > 0
        assert check(rt.recorder.events()).ok
    async with serve(_tiny(str(new))) as (http, rt):
        fresh, _ = await _ids(http)
    assert fresh == after


async def test_the_server_answers_during_the_copy_and_no_step_overlaps_it(folders, monkeypatch):
    """The copy (held here) runs on the step thread: /health is answered meanwhile, and a
    request that arrives during the copy waits for it and runs entirely under the new weights
    (no KV of the old ones: the cache was flushed before the copy)."""
    import threading

    from actorserve.engine.weights import refit
    new, _ = folders
    entered, gate, real_apply = threading.Event(), threading.Event(), refit.apply_checked

    def held_apply(engine, tensors):
        entered.set()
        assert gate.wait(30)
        return real_apply(engine, tensors)

    monkeypatch.setattr(refit, "apply_checked", held_apply)
    async with serve(load_tiny()) as (http, rt):
        await _ids(http)                                         # the prefix cache is warm
        update = asyncio.ensure_future(http.post("/update_weights_from_disk",
                                                 json={"model_path": str(new), "weight_version": "v8"}))
        await until(entered.is_set)
        assert (await http.get("/health")).status == 200
        during = asyncio.ensure_future(_ids(http))
        await until(lambda: actor_of(rt, "scheduler").seqs)                   # admitted, its step queued behind the copy
        assert not during.done() and not update.done()
        gate.set()
        r = await update
        assert r.status == 200, await r.text()
        out, meta = await during
        assert meta["cached_tokens"] == 0
        after, meta2 = await _ids(http)
        assert out == after and meta2["weight_version"] == "v8"
        await settle(rt)
        assert check(rt.recorder.events()).ok


async def test_steps_inline_the_copy_runs_inline(folders, monkeypatch):
    """With the steps on the loop (``step_in_thread=False``) the copy runs in the scheduler's
    turn, as the steps do; the read still runs on a worker thread."""
    import threading

    import torch

    from actorserve.actors.runtime import Runtime
    from actorserve.config import SchedulerConfig
    from actorserve.engine.weights import refit
    from actorserve.engine.runners.runner import build_engine
    from actorserve.messages import GetWeightsByName, UpdateWeightsFromDisk
    from actorserve.replay.recorder import FlightRecorder
    from actorserve.statemachines import LIFECYCLES
    from transformers import AutoModelForCausalLM

    new, _ = folders
    threads, real_read, real_apply = {}, refit._read_folder, refit.apply_checked
    monkeypatch.setattr(refit, "_read_folder", lambda path, fmt: (
        threads.setdefault("read", threading.current_thread()), real_read(path, fmt))[1])
    monkeypatch.setattr(refit, "apply_checked", lambda engine, tensors: (
        threads.setdefault("apply", threading.current_thread()), real_apply(engine, tensors))[1])
    model, hf_tok, _ = load_tiny()
    engine = build_engine(model, num_blocks=64, block_size=16, tokenizer=hf_tok, model_name="tiny")
    rt = Runtime(engine, config=SchedulerConfig(step_in_thread=False),
                 recorder=FlightRecorder(lifecycles=LIFECYCLES.values()))
    await rt.start()
    try:
        res = await rt.control(UpdateWeightsFromDisk(str(new), weight_version="v7"))
        assert res.ok, res.message
        assert threads["read"] is not threading.current_thread()
        assert threads["apply"] is threading.current_thread()           # the loop, where steps run
        name = "model.layers.0.mlp.down_proj.weight"
        got = await rt.control(GetWeightsByName(name, 2))
        ref = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32, local_files_only=True)
        assert got.ok and got.detail["values"] == ref.get_parameter(name)[:2].tolist()
        assert check(rt.recorder.events()).ok
    finally:
        await rt.shutdown()


async def test_update_weight_version(folders):
    async with serve(load_tiny()) as (http, rt):
        r = await http.post("/update_weight_version", json={"new_version": "step-7"})
        body = await r.json()
        assert r.status == 200 and body["success"] is True and body["new_version"] == "step-7"
        _, meta = await _ids(http)
        assert meta["weight_version"] == "step-7"
        assert (await (await http.get("/get_weight_version")).json()) == {"weight_version": "step-7"}
        assert (await (await http.get("/model_info")).json())["weight_version"] == "step-7"
        r = await http.post("/update_weight_version", json={"new_version": ""})
        assert r.status == 400
        assert_error(await r.json())


async def test_an_update_waits_for_the_step_barrier(folders):
    """Without abort_all_requests an update waits until no request holds KV: the running
    request ends entirely under the old weights, then the new ones serve."""
    new, _ = folders
    async with serve(load_tiny()) as (http, rt):
        ref_old, _ = await _ids(http, max_new=6)
        stall = Stall(rt.engine)
        stall.armed = True
        running = asyncio.ensure_future(http.post("/generate", json=_gen(max_new=6)))
        assert await asyncio.to_thread(stall.started.wait, 30)
        update = asyncio.ensure_future(http.post("/update_weights_from_disk", json={"model_path": str(new)}))
        await until(lambda: any(r.op == "update_weights_from_disk" and r.state.name == "waiting_idle"   # busy:
                                for r in actor_of(rt, "control").open.values()), timeout=30)     # the record waits
        assert [r.state.name for r in actor_of(rt, "control").open.values()
                if r.op == "update_weights_from_disk"] == ["waiting_idle"]
        assert not update.done() and actor_of(rt, "control").weights.state.name == "updating"
        stall.release()
        r = await running
        body = await r.json()
        assert body["output_ids"] == ref_old and body["meta_info"]["finish_reason"]["type"] == "length"
        assert body["meta_info"]["weight_version"] == "default"
        r = await update
        assert r.status == 200 and (await r.json())["success"] is True
        after, _ = await _ids(http, max_new=6)
        assert after != ref_old
        await settle(rt)
        assert check(rt.recorder.events()).ok


async def test_abort_all_requests_ends_running_ones_with_their_partial_tokens(folders):
    new, _ = folders
    async with serve(load_tiny()) as (http, rt):
        stall = Stall(rt.engine)
        running = asyncio.ensure_future(http.post("/generate", json=_gen(max_new=200)))
        def three_out() -> bool:                   # let it produce a few tokens, then stall a step
            seq = next(iter(actor_of(rt, "scheduler").seqs.values()), None)
            if seq is not None and len(seq.output_ids) >= 3:
                stall.armed = True
            return stall.armed
        await until(three_out, timeout=30, poll=0.002)
        assert await asyncio.to_thread(stall.started.wait, 30)
        update = asyncio.ensure_future(http.post("/update_weights_from_disk", json={
            "model_path": str(new), "abort_all_requests": True, "weight_version": "v3"}))
        await until(lambda: actor_of(rt, "control").weights.state.name == "updating", timeout=30)
        stall.release()
        body = await (await running).json()
        assert body["meta_info"]["finish_reason"]["type"] == "abort"
        assert 3 <= len(body["output_ids"]) < 200
        r = await update
        assert r.status == 200 and (await r.json())["success"] is True
        _, meta = await _ids(http)
        assert meta["weight_version"] == "v3"
        await settle(rt)
        assert check(rt.recorder.events()).ok


def _tiny(folder: str = "tiny", quantization: str | None = None):
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer
    from actorserve.http.edge.server import FALLBACK_CHAT_TEMPLATE
    model, hf_tok, _ = load_model(folder, threads=1, quantization=quantization)
    return model, hf_tok, TextTokenizer(hf_tok, chat_template=FALLBACK_CHAT_TEMPLATE)


async def test_quantized_copies_and_the_fused_step_are_rebuilt(folders):
    """q4: the quantized copies, their groups and the fused decode step are derived again, so
    decode (narrow steps through the q4 kernels) equals a fresh q4 load of the new folder."""
    new, _ = folders
    tiny = _tiny(quantization="q4")
    assert tiny[0].actorserve_quant is not None
    async with serve(tiny) as (http, rt):
        fused = getattr(rt.engine, "fused", None)
        before, _ = await _ids(http, max_new=12)
        r = await http.post("/update_weights_from_disk", json={"model_path": str(new)})
        assert r.status == 200, await r.text()
        after = getattr(rt.engine, "fused", None)     # rebuilt where there was one (a C compiler)
        assert (after is None) == (fused is None) and (fused is None or after is not fused)
        after, _ = await _ids(http, max_new=12)
    async with serve(_tiny(str(new), quantization="q4")) as (http, rt):
        fresh, _ = await _ids(http, max_new=12)
    assert after == fresh and after != before


async def test_sglangs_whole_request_body_is_accepted(folders):
    """`UpdateWeightFromDiskReqInput` serialised whole, as a dataclass client sends it."""
    new, _ = folders
    async with serve(load_tiny()) as (http, rt):
        body = {"model_path": str(new), "load_format": None, "abort_all_requests": False,
                "weight_version": "v4", "is_async": False, "torch_empty_cache": False, "keep_pause": False,
                "recapture_cuda_graph": False, "token_step": 3, "flush_cache": True, "manifest": None}
        r = await http.post("/update_weights_from_disk", json=body)
        assert r.status == 200, await r.text()
        notes = rt.recorder.events(kind="weights_version")
        assert [(e.data["version"], e.data["token_step"]) for e in notes] == [("v4", 3)]
        for field in ("is_async", "keep_pause"):
            r = await http.post("/update_weights_from_disk", json={**body, field: True})
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["param"] == field
        assert [e.event for e in rt.recorder.events(kind="weights")] == ["create", "update", "loaded"]


async def test_pause_retract_then_update_then_continue(folders):
    """AReaL's sequence: the retracted request waits through the update (SGLang's
    num_paused_requests), then is recomputed and finishes under the new weights; paused
    in_place the update is refused at once (the parked requests hold the old KV)."""
    new, _ = folders
    async with serve(load_tiny()) as (http, rt):
        stall = Stall(rt.engine)
        stall.armed = True
        running = asyncio.ensure_future(http.post("/generate", json=_gen(max_new=30)))
        assert await asyncio.to_thread(stall.started.wait, 30)
        pause = asyncio.ensure_future(http.post("/pause_generation", json={"mode": "retract"}))
        await until(lambda: actor_of(rt, "scheduler").state.name == "pausing", timeout=30)
        stall.release()
        r = await pause
        assert r.status == 200 and (await r.json())["affected"] == 1
        r = await http.post("/update_weights_from_disk", json={"model_path": str(new), "weight_version": "v5"})
        body = await r.json()
        assert r.status == 200 and body["success"] is True and body["num_paused_requests"] == 1, body
        assert not running.done()
        assert (await http.post("/continue_generation", json={})).status == 200
        body = await (await running).json()
        assert body["meta_info"]["finish_reason"]["type"] == "length" and len(body["output_ids"]) == 30
        assert body["meta_info"]["weight_version"] == "v5"
        r = await http.post("/pause_generation", json={"mode": "in_place"})
        assert r.status == 200
        r = await http.post("/update_weights_from_disk", json={"model_path": str(new)})
        body = await r.json()
        assert r.status == 400 and "in_place" in body["message"]
        assert (await http.post("/continue_generation", json={})).status == 200
        await settle(rt)
        assert [e.event for e in rt.recorder.events(kind="weights")] == ["create", "update", "loaded"]
        assert check(rt.recorder.events()).ok


async def test_smollm2_q4_fused_decode_follows_the_weights(monkeypatch):
    """SmolLM2 with its q4 copies and the fused decode step: swapped layers change the greedy
    output, and swapping them back gives the first output exactly (no derived copy is stale).
    The folder read is replaced by the model's own tensors (no 500 MB written to disk)."""
    from actorserve.engine.weights import refit
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer

    model, hf_tok, _ = load_model("default", threads=2, quantization="auto")
    smol = (model, hf_tok, TextTokenizer(hf_tok, generation_config=model.generation_config))
    assert model.actorserve_quant is not None
    orig = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    swapped = dict(orig)
    for k in orig:
        if k.startswith("model.layers.0."):
            other = k.replace("model.layers.0.", "model.layers.1.", 1)
            swapped[k], swapped[other] = orig[other], orig[k]
    monkeypatch.setattr(refit, "_read_folder", lambda path, fmt: swapped if path == "swapped" else orig)
    body = {"text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    async with serve(smol, name="smol") as (http, rt):
        assert rt.engine.fused is not None           # narrow q4 decode steps run fused
        first = (await (await http.post("/generate", json=body)).json())["output_ids"]
        for path, expect_same in (("swapped", False), ("original", True)):
            r = await http.post("/update_weights_from_disk", json={"model_path": path})
            assert r.status == 200, await r.text()
            assert rt.engine.fused is not None
            out = (await (await http.post("/generate", json=body)).json())["output_ids"]
            assert (out == first) is expect_same, (path, out, first)


def _safetensors_b64(tensors) -> str:
    import base64

    from safetensors.torch import save
    return base64.b64encode(save({k: v.contiguous() for k, v in tensors.items()})).decode()


def _subset(folder):
    """Layer 0's and the final norm's tensors of `folder`'s model: a partial update."""
    import torch
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    return {k: v.detach().clone() for k, v in ref.state_dict().items()
            if k.startswith("model.layers.0.") or k == "model.norm.weight"}


async def test_update_from_tensor_a_subset_serves_as_a_fresh_server_with_those_weights(folders, tmp_path):
    new, _ = folders
    subset = _subset(new)
    half = len(subset) // 2
    names = sorted(subset)
    blobs = [_safetensors_b64({k: subset[k] for k in names[:half]}),      # two blobs, as buckets
             _safetensors_b64({k: subset[k] for k in names[half:]})]
    async with serve(load_tiny()) as (http, rt):
        before, meta = await _ids(http)
        _, meta = await _ids(http)
        assert meta["cached_tokens"] > 0
        r = await http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": blobs, "load_format": "safetensors", "flush_cache": False,
            "abort_all_requests": False, "weight_version": "t1"})
        body = await r.json()
        assert r.status == 200, body
        assert body["success"] is True and body["weight_version"] == "t1"
        assert f"loaded {len(subset)} tensors" in body["message"]
        after, meta = await _ids(http)
        assert after != before and meta["weight_version"] == "t1" and meta["cached_tokens"] == 0
        name = "model.layers.0.mlp.down_proj.weight"
        got = await (await http.post("/get_weights_by_name", json={"name": name, "truncate_size": 1})).json()
        assert got == subset[name][:1].tolist()
        untouched = "model.layers.1.mlp.down_proj.weight"
        got = await (await http.post("/get_weights_by_name", json={"name": untouched, "truncate_size": 1})).json()
        assert got == load_tiny()[0].get_parameter(untouched)[:1].tolist()
        await settle(rt)
        assert [e.event for e in rt.recorder.events(kind="weights")] == ["create", "update", "loaded"]
        control = [e for e in rt.recorder.events() if e.event == "control"
                   and e.data.get("op") == "UpdateWeightsFromTensor"]
        assert control and "blobs" not in control[0].data["args"]      # sizes recorded, not the bytes
        assert check(rt.recorder.events()).ok
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actorserve.engine.weights.models import load_model, resolve_model
    from actorserve.engine.text.tokenizer import TextTokenizer
    from actorserve.http.edge.server import FALLBACK_CHAT_TEMPLATE
    src = resolve_model("tiny")                       # a folder: tiny with those weights
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        for k, v in subset.items():
            ref.get_parameter(k).copy_(v)
    ref.save_pretrained(str(tmp_path))
    AutoTokenizer.from_pretrained(str(src), local_files_only=True).save_pretrained(str(tmp_path))
    model, hf_tok, _ = load_model(str(tmp_path), threads=1)      # a fresh server loaded from it
    async with serve((model, hf_tok, TextTokenizer(hf_tok, chat_template=FALLBACK_CHAT_TEMPLATE))) as (http, rt):
        fresh, _ = await _ids(http)
        assert fresh == after


async def test_update_from_tensor_refuses_bad_payloads_and_tensors_and_changes_nothing(folders):
    import base64
    import pickle

    import torch
    new, _ = folders
    subset = _subset(new)
    pickled = base64.b64encode(pickle.dumps({"model.norm.weight": [1.0]})).decode()
    norm = subset["model.norm.weight"]
    cases = [
        ({"serialized_named_tensors": [pickled]}, "serialized_named_tensors"),          # SGLang's form, not pairs
        ({"serialized_named_tensors": [pickled], "load_format": "flattened_bucket"}, "serialized_named_tensors"),
        ({"serialized_named_tensors": [pickled], "load_format": "safetensors"}, "serialized_named_tensors.0"),
        ({"serialized_named_tensors": ["%%%"], "load_format": "safetensors"}, "serialized_named_tensors.0"),
        ({"serialized_named_tensors": [base64.b64encode(b"\x05\0\0\0\0\0\0\0{}").decode()],
          "load_format": "safetensors"}, "serialized_named_tensors.0"),
        ({"serialized_named_tensors": [_safetensors_b64({"no.such.weight": norm})],
          "load_format": "safetensors"}, "serialized_named_tensors"),
        ({"serialized_named_tensors": [_safetensors_b64({"model.norm.weight": norm[:-1]})],
          "load_format": "safetensors"}, "serialized_named_tensors"),
        ({"serialized_named_tensors": [_safetensors_b64({"model.norm.weight": norm}),
                                       _safetensors_b64({"model.norm.weight": norm})],
          "load_format": "safetensors"}, "serialized_named_tensors"),
        ({"serialized_named_tensors": [_safetensors_b64({"model.norm.weight": norm.to(torch.int32)})],
          "load_format": "safetensors"}, "serialized_named_tensors"),
        ({"serialized_named_tensors": [_safetensors_b64({})], "load_format": "safetensors"},
         "serialized_named_tensors"),
        ({"serialized_named_tensors": [], "load_format": "safetensors"}, "serialized_named_tensors"),
    ]
    async with serve(load_tiny()) as (http, rt):
        before, _ = await _ids(http)
        for body, param in cases:
            r = await http.post("/update_weights_from_tensor", json=body)
            got = await r.json()
            assert r.status == 400, (body, got)
            assert_error(got)
            assert got["error"]["param"] == param, (param, got)
            if "success" in got:
                assert got["success"] is False and got["message"] == got["error"]["message"]
        assert "(name, tensor) pairs" in (await (await http.post("/update_weights_from_tensor", json=cases[0][0])
                                                 ).json())["error"]["message"]
        after, meta = await _ids(http)
        assert after == before and meta["weight_version"] == "default"
        norm_now = await (await http.post("/get_weights_by_name", json={"name": "model.norm.weight"})).json()
        assert norm_now == load_tiny()[0].get_parameter("model.norm.weight").tolist()
        await settle(rt)
        assert check(rt.recorder.events()).ok
