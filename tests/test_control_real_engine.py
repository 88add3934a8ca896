"""Abort, pause and flush on the real paged runner (the tiny fixture), 16 concurrent streams."""

from __future__ import annotations

import functools

import pytest

from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import AbortRequest, ContinueGeneration, FlushCache, PauseGeneration
from actorserve.replay.check import check
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES

import waiting
from http_support import load_tiny
from actor_access import actor_of, live_actors

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


async def runtime(tiny) -> Runtime:
    from actorserve.engine.runners.runner import build_engine
    model, hf_tok, _ = tiny
    engine = build_engine(model, num_blocks=256, block_size=16, tokenizer=hf_tok, model_name="tiny")
    rt = Runtime(engine, config=SchedulerConfig(batch=BatchConfig(max_num_seqs=32), step_in_thread=True),
                 recorder=FlightRecorder(lifecycles=LIFECYCLES.values()))
    await rt.start()
    return rt


def prompts(tok) -> list[list[int]]:
    return [tok.encode(f"Stream number {i} tells a story about the sea and the sky") for i in range(16)]


until = functools.partial(waiting.until, timeout=30.0)     # the real engine's steps are slower


async def settled(rt: Runtime) -> None:
    await until(lambda: rt.stats().live_requests == 0 and not rt.stats().step_in_flight)
    await rt.quiesce()
    st = rt.stats()
    assert st.kv_used_blocks == 0 and st.waiting == 0 and st.running == 0 and live_actors(rt) == []
    actor_of(rt, "scheduler").bm.check()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_then_continue_gives_the_same_greedy_tokens(tiny, mode):
    tok = tiny[2]
    rt = await runtime(tiny)
    base = [h for h in (rt.generate(p, GREEDY) for p in prompts(tok))]
    expected = [(await h.stream.final()).token_ids for h in base]
    hs = [rt.generate(p, GREEDY) for p in prompts(tok)]
    await until(lambda: rt.stats().generated_tokens >= 16 * 24 + 40)   # mid-way through the second run
    assert (await rt.control(PauseGeneration(mode))).ok
    st = rt.stats()
    if mode == "retract":
        assert st.kv_used_blocks == 0 and st.running == 0     # every KV block freed
    else:
        assert st.kv_used_blocks > 0
    late = rt.generate(tok.encode("sent while paused"), SamplingParams(temperature=0.0, max_new_tokens=3))
    await rt.quiesce()                                        # paused: nothing can move now
    assert rt.request_info(late.rid)["state"] == "queued"     # waits, is not rejected
    assert not late.stream.closed
    assert (await rt.control(ContinueGeneration())).ok
    got = [(await h.stream.final()).token_ids for h in hs]
    assert got == expected
    assert (await late.stream.final()).finish_reason == "length"
    await settled(rt)
    assert check(rt.recorder.events()).ok
    await rt.shutdown()


async def test_abort_by_rid_prefix_and_all_under_16_streams(tiny):
    tok = tiny[2]
    rt = await runtime(tiny)
    long = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    hs = {f"{g}-{i}": rt.generate(p, long, rid=f"{g}-{i}")
          for i, p in enumerate(prompts(tok)) for g in ("a" if i < 5 else "b" if i < 10 else "c",)}
    await until(lambda: rt.stats().generated_tokens >= 64)
    assert (await rt.control(AbortRequest(rid="a-0"))).detail["aborted"] == 1
    assert (await rt.control(AbortRequest(rid="b-", prefix=True))).detail["aborted"] == 5
    assert (await rt.control(AbortRequest(abort_all=True))).detail["aborted"] == 10
    outs = [await h.stream.final() for h in hs.values()]
    assert all(o.finish_reason == "abort" for o in outs)
    assert all(0 < o.completion_tokens < 400 for o in outs)   # partial output delivered
    await settled(rt)
    await rt.shutdown()


async def test_pause_abort_and_flush_drop_the_hit_rate_to_zero(tiny):
    tok = tiny[2]
    rt = await runtime(tiny)
    hs = [rt.generate(p, SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True))
          for p in prompts(tok)]
    await until(lambda: rt.stats().generated_tokens >= 32)
    busy = await rt.control(FlushCache())
    assert not busy.ok and "busy" in busy.message
    assert (await rt.control(PauseGeneration("abort"))).ok
    assert all(o.finish_reason == "abort" for o in [await h.stream.final() for h in hs])
    assert (await rt.control(ContinueGeneration())).ok
    p = tok.encode("A shared preamble that is long enough to fill a couple of sixteen token blocks, "
                   "followed by a question")
    await rt.generate(p, SamplingParams(temperature=0.0, max_new_tokens=2)).stream.final()
    again = await rt.generate(p, SamplingParams(temperature=0.0, max_new_tokens=2)).stream.final()
    assert again.cached_tokens > 0 and rt.stats().prefix_hit_rate > 0
    await settled(rt)
    assert (await rt.control(FlushCache(timeout_s=5))).ok
    assert rt.stats().prefix_hit_rate == 0
    third = await rt.generate(p, SamplingParams(temperature=0.0, max_new_tokens=2)).stream.final()
    assert third.cached_tokens == 0 and third.token_ids == again.token_ids
    await settled(rt)
    await rt.shutdown()
