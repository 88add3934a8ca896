"""LoRA adapters as a lifecycle, through the real actors over the fake engine (`engine.runners.fake_lora`):
holds from admission to every end, unload waiting for holders, shared loads, LRU eviction."""

from __future__ import annotations

import asyncio
import json
import random
import threading

from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.runners.fake_lora import FakeLoraSlots
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import (
    AbortRequest, ContinueGeneration, LoadLoraAdapter, PauseGeneration, UnloadLoraAdapter,
)
from actorserve.replay.check import check

from runtime_helpers import assert_nothing_held, make_runtime
from waiting import until
from actor_access import actor_of


def adapter(tmp_path, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "name": name}))
    return str(folder)


def expected(engine: FakeEngine, prompt: list[int], n: int, name: str | None) -> list[int]:
    ref = None if name is None else engine.lora.get(name)
    shift = FakeLoraSlots.shift(ref, engine.info.vocab_size)
    ids, out = list(prompt), []
    for _ in range(n):
        t = FakeEngine.next_token(ids, engine.info.vocab_size)
        t = 1 + (t - 1 + shift) % (engine.info.vocab_size - 1)
        ids.append(t)
        out.append(t)
    return out


def holds(engine: FakeEngine) -> int:
    return sum(engine.lora._holds.values())


async def test_load_generate_unload_walks_the_lora_lifecycle(tmp_path):
    rt, engine, rec, _ = await make_runtime(loras=4)
    res = await rt.control(LoadLoraAdapter("a1", adapter(tmp_path, "a1")))
    assert res.ok, res
    assert rt.lora_state("a1") == "ready"
    g = rt.generate([5, 6, 7], SamplingParams(max_new_tokens=4), lora="a1")
    b = rt.generate([5, 6, 7], SamplingParams(max_new_tokens=4))
    go, bo = await g.stream.final(), await b.stream.final()
    assert go.token_ids == expected(engine, [5, 6, 7], 4, "a1")
    assert bo.token_ids == expected(engine, [5, 6, 7], 4, None) != go.token_ids
    await rt.quiesce()
    assert holds(engine) == 0
    res = await rt.control(UnloadLoraAdapter("a1"))
    assert res.ok, res
    assert rt.lora_state("a1") is None and engine.lora.loaded() == []
    path = [(e.event, e.dst) for e in rec.events(kind="lora")]
    assert path == [("create", "loading"), ("loaded", "ready"), ("unload", "unloading"), ("unloaded", "unloaded")]
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


def refs_of(engine: FakeEngine) -> dict:
    return {r.name: r for r in engine.lora.loaded()}


def expected_under(engine: FakeEngine, prompt: list[int], n: int, ref) -> list[int]:
    shift = FakeLoraSlots.shift(ref, engine.info.vocab_size)
    ids, out = list(prompt), []
    for _ in range(n):
        t = FakeEngine.next_token(ids, engine.info.vocab_size)
        t = 1 + (t - 1 + shift) % (engine.info.vocab_size - 1)
        ids.append(t)
        out.append(t)
    return out


async def test_unload_waits_for_its_holders_and_refuses_new_requests(tmp_path):
    rt, engine, rec, _ = await make_runtime(loras=4)
    assert (await rt.control(LoadLoraAdapter("a1", adapter(tmp_path, "a1")))).ok
    ref = engine.lora.get("a1")
    assert (await rt.control(PauseGeneration("in_place"))).ok
    r = rt.generate([3, 4], SamplingParams(max_new_tokens=20), lora="a1")    # queued: holds a1
    unload = rt.control(UnloadLoraAdapter("a1"))
    await rt.quiesce()
    assert not unload.done() and rt.lora_state("a1") == "unloading" and engine.lora.holders("a1") == 1
    late = rt.generate([3, 4], SamplingParams(max_new_tokens=2), lora="a1")
    base = rt.generate([3, 4], SamplingParams(max_new_tokens=2))
    lo = await late.stream.final()
    assert (await rt.control(ContinueGeneration())).ok
    ro, bo = await r.stream.final(), await base.stream.final()
    assert lo.finish_reason == "error" and "being unloaded" in lo.error
    assert ro.finish_reason == "length" and ro.token_ids == expected_under(engine, [3, 4], 20, ref)
    assert bo.token_ids == expected_under(engine, [3, 4], 2, None)
    res = await unload
    assert res.ok, res
    await rt.quiesce()
    # the unload ended after the holder's last step: its `unloaded` follows the request's finish
    evs = rec.events()
    at = {(e.kind, e.rid, e.event): i for i, e in enumerate(evs) if e.kind in ("lora", "generation")}
    lora_rid = next(e.rid for e in evs if e.kind == "lora")
    last_step = max(i for i, e in enumerate(evs) if e.kind == "step" and any(m[0] == r.rid for m in e.data["batch"]))
    assert last_step < at[("lora", lora_rid, "unloaded")]
    assert at[("lora", lora_rid, "unload")] < at[("generation", r.rid, "finish")]
    assert engine.lora.loaded() == [] and rt.loras() == []
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_unload_with_abort_ends_the_holders_and_a_paused_holder_keeps_its_hold(tmp_path):
    rt, engine, rec, _ = await make_runtime(loras=4)
    assert (await rt.control(LoadLoraAdapter("a1", adapter(tmp_path, "a1")))).ok
    assert (await rt.control(PauseGeneration("retract"))).ok
    queued = [rt.generate([7, i], SamplingParams(max_new_tokens=5), lora="a1") for i in range(3)]
    await rt.quiesce()
    assert engine.lora.holders("a1") == 3            # held from admission, while queued
    unload = rt.control(UnloadLoraAdapter("a1"))
    await rt.quiesce()
    assert not unload.done() and rt.lora_state("a1") == "unloading"
    res = await rt.control(UnloadLoraAdapter("a1", abort=True))   # joins, and aborts the holders
    assert res.ok and (await unload).ok
    outs = [await h.stream.final() for h in queued]
    assert all(o.finish_reason == "abort" for o in outs)
    assert (await rt.control(ContinueGeneration())).ok
    await rt.quiesce()
    assert engine.lora.loaded() == []
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_racing_loads_and_requests_share_one_load(tmp_path):
    gate = threading.Event()
    rt, engine, rec, _ = await make_runtime(loras=4, lora_gate=gate)
    path = adapter(tmp_path, "a1")
    first = rt.control(LoadLoraAdapter("a1", path))
    second = rt.control(LoadLoraAdapter("a1", path, pinned=True))
    await until(lambda: rt.lora_state("a1") == "loading", poll=0)
    req = rt.generate([9, 9], SamplingParams(max_new_tokens=3), lora="a1")   # parked behind the load
    other = rt.control(LoadLoraAdapter("a1", adapter(tmp_path, "elsewhere")))
    assert not (await other).ok                         # another folder under a name that is loading
    assert rt.lora_state("a1") == "loading"
    gate.set()
    r1, r2 = await first, await second
    assert r1.ok and r2.ok and r2.detail["shared_by"] == 2, (r1, r2)
    assert engine.lora.reads == 1
    out = await req.stream.final()
    assert out.token_ids == expected_under(engine, [9, 9], 3, engine.lora.get("a1"))
    assert rt.loras()[0]["pinned"] is True
    again = await rt.control(LoadLoraAdapter("a1", path))
    assert not again.ok and "already been loaded" in again.message
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_a_failed_load_fails_its_parked_requests(tmp_path):
    gate = threading.Event()
    rt, engine, rec, _ = await make_runtime(loras=2, lora_gate=gate)
    load = rt.control(LoadLoraAdapter("bad", str(tmp_path / "missing")))
    await until(lambda: rt.lora_state("bad") == "loading", poll=0)
    req = rt.generate([1, 2], SamplingParams(max_new_tokens=3), lora="bad")
    gate.set()
    res = await load
    assert not res.ok and "adapter_config.json" in res.message and res.detail["param"] == "lora_path"
    out = await req.stream.final()
    assert out.finish_reason == "error" and "Failed to load" in out.error
    await rt.quiesce()
    assert [(e.event, e.dst) for e in rec.events(kind="lora")] == [("create", "loading"), ("load_failed", "failed")]
    assert rt.loras() == [] and engine.lora.loaded() == []
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_lru_eviction_keeps_pinned_and_held_adapters(tmp_path):
    rt, engine, rec, _ = await make_runtime(loras=2)
    assert (await rt.control(LoadLoraAdapter("p", adapter(tmp_path, "p"), pinned=True))).ok
    assert (await rt.control(LoadLoraAdapter("a", adapter(tmp_path, "a")))).ok
    assert (await rt.generate([1], SamplingParams(max_new_tokens=1), lora="p").stream.final()).finish_reason == "length"
    assert (await rt.control(LoadLoraAdapter("b", adapter(tmp_path, "b")))).ok     # evicts a, not pinned p
    assert sorted(refs_of(engine)) == ["b", "p"]
    assert ("evict", "unloaded") in [(e.event, e.dst) for e in rec.events(kind="lora")]
    assert (await rt.control(PauseGeneration("retract"))).ok
    held = rt.generate([2], SamplingParams(max_new_tokens=2), lora="b")      # queued: holds b
    res = await rt.control(LoadLoraAdapter("c", adapter(tmp_path, "c")))
    assert not res.ok and "pinned, loading or in use" in res.message
    assert sorted(refs_of(engine)) == ["b", "p"]
    assert (await rt.control(ContinueGeneration())).ok
    assert (await held.stream.final()).finish_reason == "length"
    await rt.quiesce()
    assert (await rt.control(LoadLoraAdapter("c", adapter(tmp_path, "c")))).ok   # b is free now
    assert sorted(refs_of(engine)) == ["c", "p"]
    assert actor_of(rt, "scheduler").lora_events["evicted"] == 2
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_a_load_that_fails_on_a_full_server_evicts_nothing(tmp_path):
    rt, engine, rec, _ = await make_runtime(loras=1)
    assert (await rt.control(LoadLoraAdapter("a", adapter(tmp_path, "a")))).ok
    res = await rt.control(LoadLoraAdapter("bad", str(tmp_path / "no-such-folder")))
    assert not res.ok and "no readable" in res.message
    assert list(refs_of(engine)) == ["a"] and actor_of(rt, "scheduler").lora_events["evicted"] == 0     # a still serves
    assert (await rt.generate([1], SamplingParams(max_new_tokens=1), lora="a").stream.final()).finish_reason == "length"
    assert (await rt.control(LoadLoraAdapter("b", adapter(tmp_path, "b")))).ok      # a good one evicts a
    assert list(refs_of(engine)) == ["b"] and actor_of(rt, "scheduler").lora_events["evicted"] == 1
    await rt.quiesce()
    assert check(rec.events()).ok
    await rt.shutdown()


async def test_max_loras_bounds_the_adapters_of_a_step(tmp_path):
    from actorserve.engine.scheduling.batching import BatchConfig
    rt, engine, rec, _ = await make_runtime(loras=4, batch=BatchConfig(max_loras=2))
    for name in ("a1", "a2", "a3"):
        assert (await rt.control(LoadLoraAdapter(name, adapter(tmp_path, name)))).ok
    refs = refs_of(engine)
    names = [None, "a1", "a2", "a3"] * 4
    hs = [rt.generate([5, i], SamplingParams(max_new_tokens=4), lora=n) for i, n in enumerate(names)]
    outs = [await h.stream.final() for h in hs]
    for i, (n, o) in enumerate(zip(names, outs)):
        assert o.token_ids == expected_under(engine, [5, i], 4, refs.get(n)), (i, n)
    lora_of = {h.rid: n for h, n in zip(hs, names)}
    widths = [len({lora_of[rid] for rid, _ in step if lora_of[rid] is not None}) for step in engine.history]
    assert max(widths) == 2 and all(w <= 2 for w in widths)
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_200_mixed_requests_under_loads_and_unloads(tmp_path):
    """Load/unload under 200 concurrent requests over base + adapters: every request ends (no
    hang), each that ran got exactly its adapter's tokens, the refused ones say why, and no
    hold, sequence or control record is left."""
    rng = random.Random(30)
    rt, engine, rec, _ = await make_runtime(loras=4)
    for name in ("a1", "a2", "a3"):
        assert (await rt.control(LoadLoraAdapter(name, adapter(tmp_path, name)))).ok
    refs = refs_of(engine)
    controls, handles = [], []
    for i in range(200):
        if i == 50:
            controls.append(rt.control(UnloadLoraAdapter("a2")))
        if i == 90:
            controls.append(rt.control(LoadLoraAdapter("a4", adapter(tmp_path, "a4"))))
        if i == 140:
            controls.append(rt.control(UnloadLoraAdapter("a1", abort=True)))
        if i == 170:
            controls.append(rt.control(AbortRequest(handles[160][0].rid)))
        name = rng.choice([None, "a1", "a2", "a3", "a4"])
        prompt = [rng.randrange(1, 900) for _ in range(rng.randrange(1, 12))]
        handles.append((rt.generate(prompt, SamplingParams(max_new_tokens=rng.randrange(1, 9)), lora=name),
                        name, prompt))
        if i % 7 == 0:
            await asyncio.sleep(0)  # sleep-ok: turns between arrivals are the mix under test
    outs = await asyncio.wait_for(asyncio.gather(*(h.stream.final() for h, _, _ in handles)), 60)
    results = await asyncio.wait_for(asyncio.gather(*controls), 60)
    assert all(r.ok for r in results), results
    refs.update({r.name: r for r in engine.lora.loaded()})
    ran = failed = aborted = 0
    for (h, name, prompt), o in zip(handles, outs):
        assert o.finished
        if o.finish_reason == "error":
            failed += 1
            assert name in ("a1", "a2", "a4") and ("being unloaded" in o.error or "not loaded" in o.error), o.error
        elif o.finish_reason == "abort":
            aborted += 1
            assert o.token_ids == expected_under(engine, prompt, 20, refs.get(name))[:len(o.token_ids)]
        else:
            ran += 1
            assert o.token_ids == expected_under(engine, prompt, len(o.token_ids), refs.get(name)), (h.rid, name)
    assert ran > 100 and failed > 0 and ran + failed + aborted == 200
    await rt.quiesce()
    assert sorted(refs_of(engine)) == ["a3", "a4"]
    assert all(v == 0 for v in engine.lora._holds.values())
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_metrics_count_requests_per_adapter(tmp_path):
    from actorserve.http.edge.metrics import Metrics
    rt, engine, rec, _ = await make_runtime(loras=2)
    assert (await rt.control(LoadLoraAdapter("a1", adapter(tmp_path, "a1")))).ok
    for name in ("a1", "a1", None):
        await rt.generate([1, 2], SamplingParams(max_new_tokens=1), lora=name).stream.final()
    text = Metrics(rt.stats, rt.snapshot, rt.pool_stats, model_name="m").exposition().decode()
    st = rt.stats()
    assert st.lora_requests == (("a1", 2),) and st.loras_loaded == 1
    assert 'actorserve_lora_requests_total{lora_name="a1",model_name="m"} 2.0' in text
    assert 'actorserve_lora_adapters_loaded{model_name="m"} 1.0' in text
    await rt.quiesce()
    await rt.shutdown()


def test_cli_flags_for_adapters():
    import argparse

    import pytest as _pytest

    from actorserve.http.edge import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    cfg = serve_cli.config_from_args(p.parse_args([
        "--lora-paths", "a1=/m/a1", "/m/a2", '{"lora_name": "a3", "lora_path": "/m/a3", "pinned": true}',
        "--max-loras", "2", "--max-loaded-loras", "4", "--max-lora-rank", "16", "--enable-lora"]))
    assert cfg.model.lora_paths == (("a1", "/m/a1", False), ("/m/a2", "/m/a2", False), ("a3", "/m/a3", True))
    assert (cfg.model.max_loaded_loras, cfg.model.max_lora_rank, cfg.scheduler.batch.max_loras) == (4, 16, 2)
    vllm = serve_cli.config_from_args(p.parse_args(["--lora-modules", '{"name": "x", "path": "/p"}']))
    assert vllm.model.lora_paths == (("x", "/p", False),) and vllm.scheduler.batch.max_loras is None
    for bad in (["--lora-paths", "a=/x", "a=/y"], ["--lora-paths", "a b=/x"], ["--lora-paths", "{nope"],
                ["--max-loras", "0"], ["--max-lora-rank", "0"]):
        with _pytest.raises(ValueError):
            serve_cli.config_from_args(p.parse_args(bad))


async def test_prefix_cache_is_never_shared_across_adapters(tmp_path):
    rt, engine, rec, _ = await make_runtime(loras=2)
    for name in ("a1", "a2"):
        assert (await rt.control(LoadLoraAdapter(name, adapter(tmp_path, name)))).ok
    prompt = list(range(1, 30))
    cached = {}
    for key, name in (("base", None), ("a1", "a1"), ("a1 again", "a1"), ("a2", "a2"), ("base again", None)):
        out = await rt.generate(prompt, SamplingParams(max_new_tokens=2), lora=name).stream.final()
        cached[key] = out.cached_tokens
    assert cached["base"] == cached["a1"] == cached["a2"] == 0, cached
    assert cached["a1 again"] > 0 and cached["base again"] > 0, cached
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()
