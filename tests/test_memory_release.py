"""Memory release and resume (`/release_memory_occupation`, `/resume_memory_occupation`, vLLM's
`/sleep`, `/wake_up`, `/is_sleeping`) over HTTP, on the tiny model and on SmolLM2 as `make serve`
loads it (bf16 where the CPU computes it, q4 where it re-quantizes exactly, the fused step).

What is checked: the engine really holds no KV and no weight bytes while released (every
parameter's storage is empty); greedy outputs after the resume are the ones before; requests
sent while released queue (nothing steps) and are served after the resume; the refusals; the
clients' exact request sequences (verl, slime, vLLM's)."""

from __future__ import annotations

import asyncio

import pytest

from actorserve.engine.weights import memory_release as mr
from actorserve.replay.check import check

from http_support import assert_error, load_tiny, settle
from waiting import until
from test_http_control import Stall, serve
from actor_access import actor_of

PROMPT = [5 + (i * 7) % 150 for i in range(40)]       # > two blocks of 16: a prefix-cache hit


def _gen(max_new: int = 8, **extra):
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                     "ignore_eos": True}, **extra}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 with `make serve`'s defaults: --dtype auto, --quantization auto."""
    from actorserve.engine.weights.dtype import resolve_dtype
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer

    model, hf_tok, _ = load_model("default", threads=2, dtype=resolve_dtype("auto")[0], quantization="auto")
    return model, hf_tok, TextTokenizer(hf_tok, generation_config=model.generation_config)


async def _ids(http, **kw):
    r = await http.post("/generate", json=_gen(**kw))
    assert r.status == 200, await r.text()
    body = await r.json()
    return body["output_ids"], body["meta_info"]


async def _post(http, path, body=None, status=200, **kw):
    r = await http.post(path, json=body, **kw) if body is not None else await http.post(path, **kw)
    text = await r.text()
    assert r.status == status, (path, body, text)
    return (await r.json()) if text else None


def _assert_nothing_held(rt):
    assert mr.memory_bytes(rt.engine) == {"kv_cache": 0, "weights": 0}
    model = rt.engine.model
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(k.numel() == 0 for k in rt.engine.kv.k + rt.engine.kv.v)


def _memory_events(rec, tag):
    return [e.event for e in rec.events(kind="memory") if e.rid == f"memory:{tag}"]


async def _steps_stay(rt, rec, pending):
    """Nothing moves: every actor idle, no step ran, the request still waits."""
    steps = actor_of(rt, "scheduler").steps_done
    await rt.quiesce()
    assert actor_of(rt, "scheduler").steps_done == steps and not pending.done()


async def test_release_frees_everything_queues_requests_and_resume_restores_the_outputs(tiny):
    async with serve(tiny) as (http, rt, rec):
        before, _ = await _ids(http)
        _, meta = await _ids(http)
        assert meta["cached_tokens"] > 0
        held = mr.memory_bytes(rt.engine)
        assert held["kv_cache"] > 0 and held["weights"] > 0
        body = await _post(http, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})   # verl's
        assert body["success"] is True and body["memory"] == {"kv_cache": "released", "weights": "released"}
        assert body["tags"]["weights"]["bytes"] == held["weights"] and body["tags"]["kv_cache"]["bytes"] > 0
        _assert_nothing_held(rt)
        assert await (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        again = await _post(http, "/release_memory_occupation", {})                 # idempotent
        assert again["success"] is True and "already released" in again["message"]
        # the weights cannot be updated or read while they are out
        r = await http.post("/update_weights_from_disk", json={"model_path": "/nowhere"})
        err = await r.json()
        assert r.status == 400 and "resume_memory_occupation" in err["message"], err
        r = await http.post("/get_weights_by_name", json={"name": "model.norm.weight"})
        assert r.status == 400
        assert_error(await r.json())
        # a request sent now queues and nothing steps; a health probe answers without stepping
        pending = asyncio.ensure_future(_ids(http))
        await until(lambda: actor_of(rt, "scheduler").seqs)
        await _steps_stay(rt, rec, pending)
        assert (await http.get("/health_generate")).status == 200
        body = await _post(http, "/resume_memory_occupation", {"tags": None})       # null: all
        assert body["success"] is True and body["memory"] == {"kv_cache": "resident", "weights": "resident"}
        out, meta = await pending
        assert out == before and meta["cached_tokens"] == 0          # no stale KV was reused
        assert (await _post(http, "/flush_cache", {}))["success"] is True     # verl's wake flushes
        assert mr.memory_bytes(rt.engine)["weights"] == held["weights"]
        assert (await _ids(http))[0] == before
        assert await (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
        again = await _post(http, "/resume_memory_occupation")                     # no body: all, idempotent
        assert again["success"] is True and "already resident" in again["message"]
        await settle(rt)
        for tag in ("kv_cache", "weights"):
            assert _memory_events(rec, tag) == ["create", "release", "released", "resume", "resumed"]
        assert check(rec.events()).ok


async def test_release_is_refused_while_a_request_holds_kv_and_allowed_after_a_retract_pause(tiny):
    async with serve(tiny) as (http, rt, rec):
        alone, _ = await _ids(http, max_new=4)
        stall = Stall(rt.engine)
        stall.armed = True
        a = asyncio.ensure_future(_ids(http, max_new=4))
        assert await asyncio.to_thread(stall.started.wait, 10)        # its first step is held
        pause = asyncio.ensure_future(http.post("/pause_generation", json={"mode": "in_place"}))
        await until(lambda: actor_of(rt, "scheduler").state.name == "pausing")
        stall.release()
        assert (await pause).status == 200
        body = await _post(http, "/release_memory_occupation", {}, status=400)
        assert body["success"] is False and "hold KV" in body["message"] and "pause" in body["message"]
        assert body["error"]["param"] == "tags" and body["memory"]["weights"] == "resident"
        assert mr.memory_bytes(rt.engine)["weights"] > 0
        await _post(http, "/continue_generation", {})
        await a
        # a retract pause frees the KV of the running request: the release goes through
        stall = Stall(rt.engine)
        stall.armed = True
        b = asyncio.ensure_future(_ids(http, max_new=4))
        assert await asyncio.to_thread(stall.started.wait, 10)
        pause = asyncio.ensure_future(http.post("/pause_generation", json={"mode": "retract"}))
        await until(lambda: actor_of(rt, "scheduler").state.name == "pausing")
        stall.release()
        assert (await pause).status == 200
        await _post(http, "/release_memory_occupation", {})
        _assert_nothing_held(rt)
        await _post(http, "/continue_generation", {})                 # still released: nothing steps
        await _steps_stay(rt, rec, b)
        await _post(http, "/resume_memory_occupation", {})
        out, _ = await b
        assert out == alone                                              # recomputed, same greedy output
        await settle(rt)
        assert _memory_events(rec, "kv_cache") == ["create", "release", "release_failed", "keep_resident",
                                                   "release", "released", "resume", "resumed"]
        assert check(rec.events()).ok


async def test_bad_tags_and_bodies_are_400s(tiny):
    async with serve(tiny) as (http, rt, rec):
        for body in ({"tags": ["gpu"]}, {"tags": "weights"}, {"tags": ["weights"], "bogus": 1}):
            r = await http.post("/release_memory_occupation", json=body)
            assert r.status == 400, body
            assert_error(await r.json())
        r = await http.post("/resume_memory_occupation", data=b"[1]", headers={"Content-Type": "application/json"})
        assert r.status == 400
        for params in ({"level": "3"}, {"level": "x"}, {"mode": "keep"}):
            r = await http.post("/sleep", params=params)
            assert r.status == 400, params
            assert (await r.json())["error"]["param"] in ("level", "mode")
        r = await http.post("/wake_up", params={"tags": "gpu"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "tags"
        assert mr.memory_bytes(rt.engine)["weights"] > 0 and not actor_of(rt, "control").memory_out
        # only the KV cache released: the weights can still be read
        await _post(http, "/release_memory_occupation", {"tags": ["kv_cache"]})
        r = await http.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 2})
        assert r.status == 200 and len(await r.json()) == 2
        await _post(http, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        await settle(rt)


async def test_vllm_sleep_and_wake_up(tiny):
    async with serve(tiny) as (http, rt, rec):
        before, _ = await _ids(http)
        r = await http.post("/sleep", params={"level": "1"})
        assert r.status == 200 and await r.text() == ""                 # vLLM's empty 200
        _assert_nothing_held(rt)
        assert await (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert (await (await http.get("/is_paused")).json())["is_paused"] is True
        pending = asyncio.ensure_future(_ids(http))
        await until(lambda: actor_of(rt, "scheduler").seqs)
        assert (await http.post("/wake_up", params={"tags": "weights"})).status == 200
        assert await (await http.get("/is_sleeping")).json() == {"is_sleeping": True}    # the KV still out
        assert mr.memory_bytes(rt.engine)["kv_cache"] == 0 and mr.memory_bytes(rt.engine)["weights"] > 0
        await _steps_stay(rt, rec, pending)
        assert (await http.post("/wake_up", params={"tags": "kv_cache"})).status == 200
        assert await (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert (await (await http.get("/is_paused")).json())["is_paused"] is False       # sleep's pause ended
        assert (await pending)[0] == before
        # level 2: the weights are discarded and reloaded from the model folder at the wake
        r = await http.post("/sleep", params={"level": "2"})
        assert r.status == 200
        _assert_nothing_held(rt)
        assert actor_of(rt, "control").memory_snapshot() == {"kv_cache": "released", "weights": "discarded"}
        assert (await http.post("/wake_up")).status == 200
        assert (await _ids(http))[0] == before
        await settle(rt)
        assert _memory_events(rec, "weights") == ["create", "release", "released", "resume", "resumed",
                                                  "release", "discarded", "resume", "resumed"]
        assert check(rec.events()).ok


async def test_vllm_sleep_aborts_a_running_request_first(tiny):
    async with serve(tiny) as (http, rt, rec):
        stall = Stall(rt.engine)
        stall.armed = True
        a = asyncio.ensure_future(http.post("/generate", json=_gen(max_new=50)))
        assert await asyncio.to_thread(stall.started.wait, 10)
        sleep = asyncio.ensure_future(http.post("/sleep"))               # mode=abort, level 1
        await until(lambda: actor_of(rt, "scheduler").state.name == "pausing")
        stall.release()
        assert (await sleep).status == 200
        body = await (await a).json()
        assert body["meta_info"]["finish_reason"]["type"] == "abort"
        _assert_nothing_held(rt)
        assert (await http.post("/wake_up")).status == 200
        assert (await _ids(http, max_new=2))[1]["finish_reason"]["type"] == "length"
        await settle(rt)


async def test_smollm2_verl_and_slime_sequences(smol, tmp_path):
    """SmolLM2 as `make serve` loads it. verl: release(kv_cache, weights), resume, flush_cache.
    slime (colocated): pause, flush, release weights, flush, release kv_cache + cuda_graph,
    resume weights, update_weights_from_disk (allowed: only the KV cache is out), resume
    kv_cache + cuda_graph, continue_generation."""
    model = smol[0]
    folder = str(model.config._name_or_path)
    async with serve(smol) as (http, rt, rec):
        assert getattr(rt.engine, "fused", None) is not None or model.actorserve_quant is None
        before, _ = await _ids(http, max_new=12)
        held = mr.memory_bytes(rt.engine)
        # verl
        await _post(http, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
        _assert_nothing_held(rt)
        await _post(http, "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})
        await _post(http, "/flush_cache", {})
        assert mr.memory_bytes(rt.engine)["weights"] == held["weights"]
        assert (await _ids(http, max_new=12))[0] == before
        # slime
        await _post(http, "/pause_generation", {})
        await _post(http, "/flush_cache", {})
        await _post(http, "/release_memory_occupation", {"tags": ["weights"]})
        await _post(http, "/flush_cache", {})
        await _post(http, "/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
        _assert_nothing_held(rt)
        await _post(http, "/resume_memory_occupation", {"tags": ["weights"]})
        body = await _post(http, "/update_weights_from_disk", {"model_path": folder, "flush_cache": False,
                                                                 "weight_version": "2"})
        assert body["success"] is True and body["weight_version"] == "2"
        await _post(http, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
        await _post(http, "/continue_generation", {})
        out, meta = await _ids(http, max_new=12)
        assert out == before and meta["weight_version"] == "2"
        await settle(rt)
        assert check(rec.events()).ok


async def test_the_spill_is_a_private_safetensors_file_and_a_failed_spill_frees_nothing(tiny, monkeypatch):
    import json
    import os
    import struct

    async with serve(tiny) as (http, rt, rec):
        before, _ = await _ids(http)
        held = mr.memory_bytes(rt.engine)["weights"]
        packed = mr._packed_bytes(rt.engine.model)       # oneDNN's layout: packed again at the resume
        await _post(http, "/release_memory_occupation", {"tags": ["weights"]})
        spill = actor_of(rt, "scheduler").memory.weights_held.spill
        assert spill is not None and not os.path.exists(spill.name if isinstance(spill.name, str) else "")
        fd = spill.fileno()
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        header = json.loads(os.pread(fd, n, 8))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        assert entries and all(v["dtype"] == "U8" for v in entries.values())
        assert sum(v["shape"][0] for v in entries.values()) == held - packed    # every other byte
        assert os.fstat(fd).st_size == 8 + n + held - packed
        await _post(http, "/resume_memory_occupation", {"tags": ["weights"]})
        assert actor_of(rt, "scheduler").memory.weights_held is None and spill.closed
        # a spill that cannot be written: nothing is freed, the weights serve on
        def full(*a, **k):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(mr, "_write_spill", full)
        body = await _post(http, "/release_memory_occupation", {"tags": ["weights"]}, status=400)
        assert "No space left" in body["message"] and body["memory"]["weights"] == "resident"
        assert mr.memory_bytes(rt.engine)["weights"] == held
        assert (await _ids(http))[0] == before
        await settle(rt)
        assert _memory_events(rec, "weights") == ["create", "release", "released", "resume", "resumed",
                                                  "release", "release_failed", "keep_resident"]
        assert check(rec.events()).ok


async def test_a_failed_wake_keeps_the_weights_discarded_and_can_be_retried(tiny):
    from actorserve.http.edge.state import CTX

    async with serve(tiny) as (http, rt, rec):
        before, _ = await _ids(http)
        extra = http.server.app[CTX].extra
        assert (await http.post("/sleep", params={"level": "2"})).status == 200
        extra["model_path"] = "/no/such/model"
        r = await http.post("/wake_up")
        body = await r.json()
        assert r.status == 400 and "/no/such/model" in body["error"]["message"], body
        assert actor_of(rt, "control").memory_snapshot() == {"kv_cache": "resident", "weights": "discarded"}
        assert mr.memory_bytes(rt.engine)["weights"] == 0
        assert await (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        del extra["model_path"]                       # the folder the model was loaded from
        assert (await http.post("/wake_up", params={"tags": "weights"})).status == 200
        assert (await (await http.get("/is_paused")).json())["is_paused"] is False
        assert (await _ids(http))[0] == before
        await settle(rt)
        assert _memory_events(rec, "weights") == ["create", "release", "discarded", "resume", "resume_failed",
                                                  "keep_discarded", "resume", "resumed"]
        assert check(rec.events()).ok
