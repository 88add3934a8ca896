"""The output stage, detok as a real state, and every abort as a control record.

Over the fake engine with a manual clock: each check is exact (quiesce, then look), no sleeps.
"""

from __future__ import annotations

from actorserve.engine.runners.fake import FakeDetokenizer, FakeEngine
from actorserve.engine.scheduling.params import PoolingParams, SamplingParams
from actorserve.messages import AbortRequest, ContinueGeneration, FlushCache, PauseGeneration

from runtime_helpers import assert_nothing_held, make_runtime
from actor_access import actor_of


def steps_with(engine: FakeEngine, rid: str) -> list[int]:
    return [i for i, step in enumerate(engine.history) if any(r == rid for r, _ in step)]


def expected(prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        t = FakeEngine.next_token(ids, 1000)
        ids.append(t)
        out.append(t)
    return out


async def test_a_stop_string_finish_is_in_no_later_step_and_frees_its_kv_before_the_next():
    rt, engine, rec, _ = await make_runtime()
    prompt = [5, 6, 7]
    toks = expected(prompt, 6)
    stop = f"<{toks[2]}>"                     # the third token's text is the stop string
    stopper = rt.generate(prompt, SamplingParams(max_new_tokens=20), detokenizer=FakeDetokenizer((stop,)))
    other = rt.generate([9, 9, 9], SamplingParams(max_new_tokens=8, ignore_eos=True))
    out = await stopper.stream.final()
    assert out.finish_reason == "stop" and out.token_ids == toks[:3]
    assert out.text == "".join(f"<{t}>" for t in toks[:2])          # cut before the stop string
    await other.stream.final()
    await rt.quiesce()
    mine = steps_with(engine, stopper.rid)
    # prefill + 2 decodes: the step that produced the stop token was its last
    assert len(mine) == 3 and mine == list(range(3))
    assert steps_with(engine, other.rid)[-1] > mine[-1]              # the batch went on without it
    notes = [e for e in rec.events(kind="detok") if e.rid == stopper.rid]
    assert [e.event for e in notes] == ["stop_string"]
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_detok_lasts_until_the_client_takes_the_final_output():
    rt, engine, rec, clock = await make_runtime()
    h = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True), detokenizer=FakeDetokenizer())
    await rt.quiesce()
    assert rt.request_info(h.rid)["state"] == "detok"           # the result is known, not taken
    assert rt.stats().live_requests == 0 and rt.stats().kv_used_blocks == 0   # KV already freed
    clock.advance(0.25)
    out = await h.stream.final()
    await rt.quiesce()
    assert out.finish_reason == "length" and rt.request_info(h.rid) is None
    evs = rec.events(rid=h.rid, kind="generation")
    finish = next(e for e in evs if e.event == "finish")
    deliver = next(e for e in evs if e.event == "deliver")
    assert deliver.t_ns - finish.t_ns == 250_000_000            # the time in detok is measured
    assert [e.event for e in rec.events(rid=h.rid, kind="input")] == ["generate", "delivered"]
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_every_abort_is_a_control_record_with_its_reason_across_schedulers():
    rt, engine, rec, _ = await make_runtime()
    g = rt.generate([4, 5, 6], SamplingParams(max_new_tokens=50, ignore_eos=True))
    p = rt.pool([1, 2, 3], PoolingParams())
    res = await rt.abort(g.rid, "client went away")
    assert res.ok and res.detail["aborted"] == 1
    out = await g.stream.final()
    assert out.finish_reason == "abort" and out.error == "client went away"
    await p.stream.final()
    await rt.quiesce()
    recs = [e for e in rec.events(kind="control") if e.event == "create"]
    assert [e.data["op"] for e in recs] == ["abort_request"]
    assert [e.dst for e in rec.events(rid=recs[0].rid, kind="control")] == ["received", "asking", "applied"]
    inp = [e for e in rec.events(kind="input") if e.event == "control"]
    assert inp[0].data == {"op": "AbortRequest", "args": {"rid": g.rid, "prefix": False,
                                                          "abort_all": False, "reason": "client went away",
                                                          "lora": None}}
    assert not any(e.event == "abort" for e in rec.events(kind="input"))
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_an_abort_reaches_a_request_whose_result_waits_for_its_client():
    rt, engine, rec, _ = await make_runtime()
    h = rt.generate([1, 2], SamplingParams(max_new_tokens=1, ignore_eos=True))
    await rt.quiesce()
    assert rt.request_info(h.rid)["state"] == "detok"
    res = await rt.control(AbortRequest(abort_all=True, reason="client went away"))
    await rt.quiesce()
    assert res.ok and res.detail["aborted"] == 1
    assert [e.dst for e in rec.events(rid=h.rid, kind="generation")][-1] == "aborted"
    assert rt.request_info(h.rid) is None
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_a_control_that_fails_in_the_scheduler_ends_rejected_after_many_controls():
    """ControlDone's error path used to look its record up in a 32-entry history."""
    rt, engine, rec, _ = await make_runtime()
    for _ in range(40):
        assert (await rt.control(ContinueGeneration())).ok
    def broken() -> int:
        raise RuntimeError("disk on fire")
    actor_of(rt, "scheduler").bm.flush = broken
    res = await rt.control(FlushCache())
    await rt.quiesce()
    assert not res.ok and "disk on fire" in res.message
    last = [e for e in rec.events(kind="control") if e.event == "create"][-1]
    assert [e.dst for e in rec.events(rid=last.rid, kind="control")] == ["received", "asking", "rejected"]
    assert actor_of(rt, "control").open == {}
    await rt.shutdown()


async def test_drain_answers_when_the_last_request_has_left():
    rt, engine, rec, _ = await make_runtime()
    h = rt.generate([3, 4], SamplingParams(max_new_tokens=3, ignore_eos=True))
    pause = await rt.control(PauseGeneration("in_place"))
    assert pause.ok
    drained = rt.drain("test")
    await rt.quiesce()
    assert rt.server_state == "draining" and not drained.done()   # paused: the request is still there
    await rt.control(ContinueGeneration())
    out = await h.stream.final()
    await rt.quiesce()
    assert drained.done() and (await drained).ok and out.finish_reason == "length"
    sched = [e.event for e in rec.events(rid="scheduler", kind="scheduler")]
    assert sched[:3] == ["create", "admit", "step"] and "pause_in_place" in sched
    await rt.shutdown()
