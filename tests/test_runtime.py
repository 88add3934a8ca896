"""Requests through the real actors and scheduler, over the fake engine."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from actorserve.actors.runtime import DuplicateRequestId
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeDetokenizer, FakeEngine
from actorserve.engine.scheduling.params import PoolingParams, SamplingParams
from actorserve.messages import (
    Aborted, AbortRequest, ContinueGeneration, FlushCache, PauseGeneration, Release,
)
from actorserve.replay.check import check

from runtime_helpers import assert_nothing_held, make_runtime
from waiting import until
from actor_access import actor_of


def expected_tokens(prompt: list[int], n: int, vocab: int = 1000) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(n):
        t = FakeEngine.next_token(ids, vocab)
        ids.append(t)
        out.append(t)
    return out


async def test_generation_and_pooling_walk_their_own_lifecycles():
    rt, engine, rec, _ = await make_runtime()
    g = rt.generate([5, 6, 7], SamplingParams(max_new_tokens=3), detokenizer=FakeDetokenizer())
    p = rt.pool([1, 2, 3, 4], PoolingParams())
    go, po = await g.stream.final(), await p.stream.final()
    assert go.token_ids == expected_tokens([5, 6, 7], 3) and go.finish_reason == "length"
    assert go.text == "".join(f"<{t}>" for t in go.token_ids)
    assert po.pooled == [4.0, 10.0] and po.finish_reason == "stop"
    await rt.quiesce()
    path = [(e.event, e.dst) for e in rec.events(rid=g.rid, kind="generation")]
    assert path == [("create", "queued"), ("schedule", "prefill"), ("first_token", "decode"),
                    ("finish", "detok"), ("deliver", "done")]
    path = [(e.event, e.dst) for e in rec.events(rid=p.rid, kind="pooling")]
    assert path == [("create", "queued"), ("schedule", "forward"), ("forward_done", "pool"),
                    ("deliver", "done")]
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_chunked_prefill_stays_in_prefill():
    rt, engine, rec, _ = await make_runtime(batch=BatchConfig(max_prefill_chunk=4))
    g = rt.generate(list(range(1, 11)), SamplingParams(max_new_tokens=1))
    out = await g.stream.final()
    assert out.token_ids == expected_tokens(list(range(1, 11)), 1)
    await rt.quiesce()          # `deliver` follows the client's taking of the final output
    evs = [e.event for e in rec.events(rid=g.rid, kind="generation")]
    assert evs == ["create", "schedule", "prefill_chunk", "prefill_chunk", "first_token", "finish", "deliver"]
    assert [n for step in engine.history for (_, n) in step] == [4, 4, 2]
    await rt.shutdown()


async def test_abort_reaches_a_running_request_before_the_next_step():
    gate = threading.Event()
    started = threading.Event()
    stalls = {"on": True}

    def fault(batch):
        if stalls["on"]:
            started.set()
            gate.wait(10)

    rt, engine, rec, _ = await make_runtime(in_thread=True, fault=fault)
    a = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=50))
    b = rt.generate([4, 5, 6], SamplingParams(max_new_tokens=5))
    assert await asyncio.to_thread(started.wait, 10)
    steps_before = engine.steps
    rt.abort(a.rid)
    out = await asyncio.wait_for(a.stream.final(), 5)   # answered while the step still runs
    assert out.finish_reason == "abort" and engine.steps == steps_before
    stalls["on"] = False
    gate.set()
    assert (await b.stream.final()).finish_reason == "length"
    await rt.quiesce()
    later = [rids for rids in engine.history[steps_before:]]
    assert all(rid != a.rid for step in later for rid, _ in step)
    assert a.rid in engine.released
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_a_handler_that_raises_fails_its_request_and_the_runtime_goes_on():
    class BadDetok(FakeDetokenizer):
        def add(self, ids):
            raise ValueError("cannot decode")

    rt, engine, rec, _ = await make_runtime()
    bad = rt.generate([1, 2], SamplingParams(max_new_tokens=5), detokenizer=BadDetok())
    good = rt.generate([3, 4], SamplingParams(max_new_tokens=5), detokenizer=FakeDetokenizer())
    bo, go = await bad.stream.final(), await good.stream.final()
    assert bo.finish_reason == "error"
    assert "output stage" in bo.error and "ValueError: cannot decode" in bo.error
    assert go.finish_reason == "length" and len(go.token_ids) == 5
    await rt.quiesce()
    assert [e.dst for e in rec.events(rid=bad.rid, kind="generation")][-1] == "failed"
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_a_failing_model_step_fails_its_members_only():
    boom = {"n": 0}

    def fault(batch):
        boom["n"] += 1
        if boom["n"] == 2:
            raise RuntimeError("device lost")

    rt, engine, rec, _ = await make_runtime(fault=fault)
    a = rt.generate([1], SamplingParams(max_new_tokens=4))
    out = await a.stream.final()
    assert out.finish_reason == "error" and "device lost" in out.error
    b = rt.generate([2], SamplingParams(max_new_tokens=4))
    assert (await b.stream.final()).finish_reason == "length"
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_and_continue_give_the_same_tokens(mode):
    rt, engine, rec, _ = await make_runtime()
    prompts = [[i, i + 1, i + 2] for i in range(1, 6)]
    hs = [rt.generate(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    await until(lambda: rt.stats().generated_tokens >= 5 * 6, poll=0)   # halfway through decoding
    res = await rt.control(PauseGeneration(mode))
    assert res.ok and rt.snapshot().pause_mode == mode and rt.server_state == "serving"
    await rt.quiesce()
    st = rt.stats()
    if mode == "retract":
        assert st.kv_used_blocks == 0 and st.running == 0 and st.waiting == 5
    else:
        assert st.kv_used_blocks > 0 and st.running == 5
    late = rt.generate([9, 9], SamplingParams(max_new_tokens=2))  # waits, is not rejected
    await rt.quiesce()
    assert rt.stats().waiting == (6 if mode == "retract" else 1) and not late.stream.closed
    assert rt.request_info(late.rid)["state"] == "queued"
    assert (await rt.control(ContinueGeneration())).ok and rt.snapshot().pause_mode is None
    for h, p in zip(hs, prompts):
        out = await h.stream.final()
        assert out.token_ids == expected_tokens(p, 12), mode
    assert (await late.stream.final()).finish_reason == "length"
    await rt.quiesce()
    events = {e.event for e in rec.events(kind="generation")}
    assert ("retract" in events) == (mode == "retract") and ("pause" in events) == (mode == "in_place")
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_pause_abort_ends_everything_in_flight():
    rt, engine, rec, _ = await make_runtime()
    hs = [rt.generate([i], SamplingParams(max_new_tokens=40)) for i in range(1, 9)]
    await until(lambda: rt.stats().running == 8, poll=0)
    bad = await rt.control(PauseGeneration("sideways"))
    assert not bad.ok and "unknown pause mode" in bad.message and rt.server_state == "serving"
    res = await rt.control(PauseGeneration("abort"))
    assert res.ok and res.detail["affected"] == 8
    for h in hs:
        assert (await h.stream.final()).finish_reason == "abort"
    assert not (await rt.control(PauseGeneration("in_place"))).ok   # already paused
    await rt.control(ContinueGeneration())
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_a_request_actor_that_ended_on_its_own_is_never_told_again():
    """Found by the re-execution chaos run: an actor that ended on its own (a stop string) stops
    before the scheduler handles its `Release`. A `Continue` from in_place, or the next step's
    token, must not be sent to it (it used to raise `ActorDeadError` inside the handler and
    leave every other paused request without its `Resumed`)."""
    rt, engine, rec, clock = await make_runtime()
    gone = rt.generate([3, 1, 4], SamplingParams(max_new_tokens=20, ignore_eos=True))
    other = rt.generate([2, 7], SamplingParams(max_new_tokens=20, ignore_eos=True))
    pause = rt.control(PauseGeneration("in_place"))
    await rt.quiesce()
    gone_actor, other_actor = rt.system.get(f"req:{gone.rid}"), rt.system.get(f"req:{other.rid}")
    assert (await pause).ok and gone_actor.state.name == "paused"
    gone_actor.tell(Aborted(gone.rid, "ended on its own"))   # through its lifecycle; the
    await rt.quiesce()                                       # scheduler has not heard of it
    assert gone_actor.state.name == "aborted" and not gone_actor.alive and gone.rid in actor_of(rt, "scheduler").seqs
    res = await rt.control(ContinueGeneration())
    assert res.ok, res
    await rt.quiesce()
    assert (await other.stream.final()).finish_reason == "length"
    await rt.quiesce()
    assert other_actor.alive is False
    actor_of(rt, "scheduler").tell(Release(gone.rid, "stop"))
    await rt.quiesce()
    assert rt.system.failures == []
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_abort_by_rid_prefix_and_all_and_empty_rid_matches_nothing():
    rt, engine, rec, _ = await make_runtime()
    await rt.control(PauseGeneration("in_place"))
    hs = {rid: rt.generate([1, 2], SamplingParams(max_new_tokens=5), rid=rid)
          for rid in ("a-1", "a-2", "b-1", "b-2", "c-1")}
    await rt.quiesce()
    assert not (await rt.control(AbortRequest(rid=""))).ok
    assert (await rt.control(AbortRequest(rid="", prefix=True))).ok is False
    assert (await rt.control(AbortRequest(rid="b-1"))).detail["aborted"] == 1
    assert (await rt.control(AbortRequest(rid="a-", prefix=True))).detail["aborted"] == 2
    assert (await rt.control(AbortRequest(abort_all=True))).detail["aborted"] == 2
    for h in hs.values():
        assert (await h.stream.final()).finish_reason == "abort"
    await rt.control(ContinueGeneration())
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_abort_all_over_ten_thousand_queued_requests_ends_each_aborted_exactly_once():
    """The waiting lanes remove in O(1) (`engine.scheduling.lane`); abort-all over 10,000 queued requests
    (and a few running ones) ends each of them aborted, once, and leaves nothing held."""
    rt, engine, rec, _ = await make_runtime()
    running = [rt.generate([1, i], SamplingParams(max_new_tokens=50, ignore_eos=True)) for i in range(3)]
    await until(lambda: rt.stats().running == 3, poll=0)
    assert (await rt.control(PauseGeneration("in_place"))).ok
    queued = [rt.generate([2, i % 97], SamplingParams(max_new_tokens=5)) for i in range(10_000)]
    await rt.quiesce()
    assert (rt.stats().waiting, rt.stats().running) == (10_000, 3)
    res = await rt.control(AbortRequest(abort_all=True))
    assert res.ok and res.detail["aborted"] == 10_003
    assert rt.stats().waiting == 0 and len(actor_of(rt, "scheduler").lane) == 0
    for h in running + queued:
        assert (await h.stream.final()).finish_reason == "abort"
    await rt.control(ContinueGeneration())
    await rt.quiesce()
    report = check(rec.events())
    assert report.ok, report.violations[:3]
    ends = [(e.rid, e.dst) for e in rec.events() if e.kind == "generation" and e.dst in ("aborted", "done", "failed")]
    assert sorted(ends) == sorted((h.rid, "aborted") for h in running + queued)
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_flush_refused_when_busy_waits_with_timeout_and_times_out():
    gate = threading.Event()
    rt, engine, rec, clock = await make_runtime(in_thread=True, fault=lambda b: gate.wait(10))
    h = rt.generate([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=2))
    busy = await rt.control(FlushCache())          # the scheduler has the request: busy
    assert not busy.ok and "busy" in busy.message
    waiting = rt.control(FlushCache(timeout_s=5))  # in the control actor's mailbox in this order:
    second = await rt.control(FlushCache(timeout_s=5))   # the first is waiting when this arrives
    assert not second.ok and "already waiting" in second.message
    gate.set()
    assert (await waiting).ok
    await h.stream.final()
    await rt.quiesce()
    flushes = [e.rid for e in rec.events(kind="control") if e.event == "create" and e.data["op"] == "flush_cache"]
    paths = [[e.dst for e in rec.events(rid=rid, kind="control")] for rid in flushes]
    # busy without a timeout: asked, refused; the timed one is busy, waits for idle, asks again
    # and applies; a second timed one while the first waits is refused at once
    assert paths == [["received", "asking", "rejected"],
                     ["received", "asking", "waiting_idle", "asking", "applied"], ["received", "rejected"]]
    events = [[e.event for e in rec.events(rid=rid, kind="control")] for rid in flushes]
    assert events[1] == ["create", "ask", "busy", "retry", "apply"]
    # time out: the engine stays busy longer than the timeout
    gate.clear()
    h2 = rt.generate([7, 8], SamplingParams(max_new_tokens=1))
    pending = rt.control(FlushCache(timeout_s=2))
    # a step blocked in its thread keeps `quiesce` from returning: wait on the record instead
    def waits_for_idle() -> bool:      # the newest flush record answered busy
        last = [e for e in rec.events(kind="control") if e.event == "create"][-1]
        return last.rid not in flushes and any(e.event == "busy" for e in rec.events(rid=last.rid, kind="control"))
    await until(waits_for_idle, poll=0)
    clock.advance(2.0)                             # the timeout's timer is armed: fire it
    res = await pending
    assert not res.ok and "timed out" in res.message
    last = [e for e in rec.events(kind="control") if e.event == "create"][-1]
    assert [e.event for e in rec.events(rid=last.rid, kind="control")] == ["create", "ask", "busy", "time_out"]
    gate.set()
    await h2.stream.final()
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_flush_clears_the_prefix_cache_when_idle():
    rt, engine, rec, _ = await make_runtime()
    p = list(range(1, 30))
    await rt.generate(p, SamplingParams(max_new_tokens=1)).stream.final()
    second = await rt.generate(p, SamplingParams(max_new_tokens=1)).stream.final()
    assert second.cached_tokens == 28
    await rt.quiesce()
    assert (await rt.control(FlushCache())).ok
    third = await rt.generate(p, SamplingParams(max_new_tokens=1)).stream.final()
    assert third.cached_tokens == 0 and third.token_ids == second.token_ids
    await rt.shutdown()


async def test_kv_pressure_retracts_and_everything_still_completes_identically():
    rt, engine, rec, _ = await make_runtime(num_blocks=24, block_size=4)
    prompts = [[i] * 6 for i in range(1, 9)]
    hs = [rt.generate(p, SamplingParams(max_new_tokens=20)) for p in prompts]
    for h, p in zip(hs, prompts):
        assert (await h.stream.final()).token_ids == expected_tokens(p, 20)
    await rt.quiesce()
    assert any(e.event == "retract" for e in rec.events(kind="generation"))
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_prompt_that_can_never_fit_fails_with_a_reason_and_duplicates_are_refused():
    rt, engine, rec, _ = await make_runtime(num_blocks=4, block_size=4)
    out = await rt.generate(list(range(1, 40)), SamplingParams(max_new_tokens=1)).stream.final()
    assert out.finish_reason == "error" and "capacity" in out.error
    rt.generate([1], SamplingParams(max_new_tokens=3), rid="dup")
    with pytest.raises(DuplicateRequestId):
        rt.generate([1], rid="dup")
    await rt.quiesce()
    await rt.shutdown()


async def test_probes_take_the_priority_lane():
    rt, engine, rec, _ = await make_runtime(batch=BatchConfig(max_num_seqs=1))
    hs = [rt.generate([i], SamplingParams(max_new_tokens=3)) for i in range(1, 4)]
    probe = rt.generate([9], SamplingParams(max_new_tokens=1), is_probe=True)
    await probe.stream.final()
    for h in hs:
        await h.stream.final()
    first = [step[0][0] for step in engine.history]
    assert first.index(probe.rid) < first.index(hs[1].rid)
    await rt.shutdown()


@pytest.mark.parametrize("in_thread,seed", [(False, 4321), (False, 7), (False, 99), (True, 1234)])
async def test_a_thousand_concurrent_requests_with_random_aborts_and_pauses(in_thread, seed):
    rng = random.Random(seed)
    rt, engine, rec, clock = await make_runtime(
        in_thread=in_thread, num_blocks=512, block_size=4, keep_history=False,
        batch=BatchConfig(max_num_seqs=48, max_batch_tokens=256, max_prefill_chunk=32))
    shared = [rng.randrange(1, 999) for _ in range(16)]
    handles = []
    controls = []
    for i in range(1000):
        prompt = (shared if rng.random() < 0.3 else []) + [rng.randrange(1, 999) for _ in range(rng.randrange(1, 24))]
        if rng.random() < 0.25:
            handles.append(rt.pool(prompt, PoolingParams()))
        else:
            handles.append(rt.generate(prompt, SamplingParams(max_new_tokens=rng.randrange(1, 16)),
                                       detokenizer=FakeDetokenizer(stop=("<5",) if i % 7 == 0 else ())))
        r = rng.random()
        if r < 0.15:
            rt.abort(rng.choice(handles).rid)
        elif r < 0.17:
            controls.append(asyncio.ensure_future(
                rt.control(PauseGeneration(rng.choice(["abort", "retract", "in_place"])))))
        elif r < 0.20:
            controls.append(asyncio.ensure_future(rt.control(ContinueGeneration())))
        elif r < 0.21:
            controls.append(asyncio.ensure_future(rt.control(FlushCache())))
        if i % 10 == 0:
            for _ in range(rng.randrange(0, 4)):
                await asyncio.sleep(0)  # sleep-ok: a random number of loop turns between arrivals is the chaos
    await asyncio.gather(*controls)
    await rt.control(ContinueGeneration())
    outs = await asyncio.wait_for(asyncio.gather(*(h.stream.final() for h in handles)), 120)
    await rt.quiesce()
    reasons = {o.finish_reason for o in outs}
    assert not [o.error for o in outs if o.error][:3]
    assert reasons <= {"length", "stop", "abort"}, reasons      # no 'error': the engine contract held
    assert all(o.finished for o in outs)
    report = check(rec.events())
    assert report.ok, report.violations[:5]
    gen_pool = sum(n for (kind, _), n in report.terminal.items() if kind in ("generation", "pooling"))
    assert gen_pool == 1000
    assert report.requests["generation"] + report.requests["pooling"] == 1000
    assert_nothing_held(rt)
    await rt.shutdown()
