"""Priority scheduling, queue deadlines and admission by queued tokens: exact, over the fake
engine, a manual clock and inline steps; then over HTTP with the official openai client."""

from __future__ import annotations

import asyncio

import pytest

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Overloaded, Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.scheduling.block_manager import BlockManager
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import ParamError, SamplingParams
from actorserve.engine.scheduling.priority import PriorityLane, PriorityPolicy
from actorserve.engine.scheduling.sequence import Sequence
from actorserve.messages import QUEUE_TIMEOUT, ContinueGeneration, PauseGeneration
from actorserve.replay.check import check
from actorserve.replay.recorder import FlightRecorder
from actorserve.replay.reexec import reexecute
from actorserve.statemachines import LIFECYCLES

from runtime_helpers import assert_nothing_held

PRIO = dict(scheduling_policy="priority")


async def make(*, batch: BatchConfig | None = None, engine: FakeEngine | None = None, **cfg):
    clock = ManualClock()
    rec = FlightRecorder(clock=clock, capacity=200_000, lifecycles=LIFECYCLES.values())
    rt = Runtime(engine or FakeEngine(), config=SchedulerConfig(
        batch=batch or BatchConfig(max_num_seqs=1, **PRIO), step_in_thread=False, **cfg),
        clock=clock, recorder=rec)
    await rt.start()
    return rt, rec, clock


def admitted_order(rec: FlightRecorder) -> list[str]:
    return [e.rid for e in rec.events(kind="generation") if e.event == "schedule"]


async def finish(rt: Runtime, rec: FlightRecorder) -> None:
    await rt.quiesce()
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()
    report = await reexecute(rec.events())
    assert report.ok, report.format()


def sp(n: int = 1) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


# -- ordering ---------------------------------------------------------------------------------------
async def test_the_waiting_queue_goes_by_priority_and_equal_priorities_stay_fcfs():
    rt, rec, _ = await make()
    assert (await rt.control(PauseGeneration("in_place"))).ok
    want = {"a": 5, "b": 1, "c": 5, "d": 1, "e": 0, "f": 1}
    handles = [rt.generate([1, 2], sp(), rid=rid, priority=p) for rid, p in want.items()]
    await rt.control(ContinueGeneration())
    outs = [await h.stream.final() for h in handles]
    assert [o.finish_reason for o in outs] == ["length"] * 6
    assert admitted_order(rec) == ["e", "b", "d", "f", "a", "c"]    # lower first; ties by arrival
    created = {e.rid: e.data for e in rec.events(kind="generation") if e.event == "create"}
    assert created["a"] == {"priority": 5} and created["e"] is None  # the recording shows it
    await finish(rt, rec)


async def test_sglang_order_serves_higher_values_first():
    rt, rec, _ = await make(batch=BatchConfig(max_num_seqs=1, priority_low_first=False, **PRIO))
    assert (await rt.control(PauseGeneration("in_place"))).ok
    handles = [rt.generate([3], sp(), rid=rid, priority=p) for rid, p in (("x", 1), ("y", 9), ("z", 1))]
    await rt.control(ContinueGeneration())
    for h in handles:
        await h.stream.final()
    assert admitted_order(rec) == ["y", "x", "z"]
    await finish(rt, rec)


async def test_under_fcfs_a_non_default_priority_is_vllms_400_and_the_default_passes():
    rt, rec, _ = await make(batch=BatchConfig(max_num_seqs=1))
    with pytest.raises(ParamError) as err:
        rt.generate([1], sp(), priority=3)
    assert str(err.value) == "Got priority 3 but Priority scheduling is not enabled."
    assert err.value.param == "priority"
    assert (await rt.generate([1], sp(), priority=0).stream.final()).finish_reason == "length"
    assert (await rt.generate([1], sp(), priority=None).stream.final()).finish_reason == "length"
    await finish(rt, rec)


async def test_probes_keep_their_lane_ahead_of_any_priority():
    rt, rec, _ = await make()
    assert (await rt.control(PauseGeneration("in_place"))).ok
    busy = [rt.generate([1, 2], sp(), rid=f"hi{i}", priority=-100) for i in range(3)]
    probe = rt.generate([1], sp(), rid="probe", is_probe=True)
    await rt.control(ContinueGeneration())
    for h in busy + [probe]:
        await h.stream.final()
    assert admitted_order(rec)[0] == "probe"
    await finish(rt, rec)


# -- preemption ---------------------------------------------------------------------------------------
async def test_a_higher_priority_arrival_retracts_the_lowest_priority_running_request():
    """6 blocks of 4 tokens. lo1 (priority 5) and lo2 (priority 9) prefill 8 tokens each and take
    a third block each on their first decode: the cache is full. hi (priority 0) arrives during
    that step; it needs 2 blocks: lo2, the lowest priority, is retracted for it (recorded with
    its cause), lo1 goes on, and everyone completes."""
    rt: Runtime | None = None

    def arrive(batch):
        if engine.steps == 2:
            arrivals.append(rt.generate(list(range(40, 48)), sp(1), rid="hi", priority=0))

    arrivals: list = []
    engine = FakeEngine(num_blocks=6, block_size=4, fault=arrive)
    rt, rec, _ = await make(batch=BatchConfig(max_num_seqs=8, **PRIO), engine=engine)
    lo1 = rt.generate(list(range(10, 18)), sp(6), rid="lo1", priority=5)
    lo2 = rt.generate(list(range(20, 28)), sp(6), rid="lo2", priority=9)
    outs = [await h.stream.final() for h in (lo1, lo2)]
    hi = await arrivals[0].stream.final()
    assert [o.finish_reason for o in outs + [hi]] == ["length"] * 3
    assert [o.completion_tokens for o in outs] == [6, 6]
    retracts = [(e.rid, e.data["cause"], e.data["priority"]) for e in rec.events(kind="sched")
                if e.event == "retract"]
    # for hi; later, when lo1 grows into the last free block, lo2 (the worst rank) again
    assert retracts == [("lo2", "priority:hi", 9), ("lo2", "kv_pressure", 9)]
    assert admitted_order(rec) == ["lo1", "lo2", "hi", "lo2", "lo2"]
    lo2_path = [e.event for e in rec.events(rid="lo2", kind="generation")]
    assert lo2_path[:5] == ["create", "schedule", "first_token", "retract", "schedule"]
    st = rt.stats()
    assert st.preemptions == 2 and st.preempted_by_priority == ((9, 2),)
    await finish(rt, rec)


def test_the_policy_retracts_only_strictly_lower_priorities_and_the_worst_first():
    bm = BlockManager(4, 4, enable_prefix_cache=False)
    pol = PriorityPolicy(BatchConfig(max_num_seqs=8, **PRIO))

    def seq(rid, prio, order, n=7):
        s = Sequence(rid, list(range(n)), sampling=sp(4), priority=prio)
        s.order = order
        return s

    a, b = seq("a", 3, 1), seq("b", 3, 2)
    lane = pol.new_lane()
    lane.append(a)
    lane.append(b)
    running: list = []
    plan = pol.plan(running, [lane], bm)                    # both prefill: 4 blocks, all of them
    assert [s.rid for s, _ in plan.batch] == ["a", "b"] and bm.num_available == 0
    for s, n in plan.batch:
        s.num_computed += n
        s.output_ids.append(1)           # their next decode fits in their second block
    same = seq("same", 3, 3)
    lane.append(same)
    plan = pol.plan(running, [lane], bm)                    # an equal priority waits: no retraction
    assert plan.retracted == [] and same in lane
    urgent = seq("urgent", 1, 4)
    lane.append(urgent)
    plan = pol.plan(running, [lane], bm)
    assert [s.rid for s in plan.retracted] == ["b"] and plan.causes == ["priority:urgent"]
    # urgent's prefill has the step to itself: a, still running with its blocks, sits it out
    assert [s.rid for s, _ in plan.batch] == ["urgent"] and urgent not in lane
    assert [s.rid for s in running] == ["a", "urgent"]


def test_a_best_class_prompts_last_step_is_its_own_and_its_earlier_chunks_keep_the_decoders():
    """The step that samples a best-class prompt's first token holds only that class's
    prompts: its decoding members sit it out (one step's turn, drafts dropped), as do lower
    classes. A longer prompt's earlier chunks keep the class's decoders beside them."""
    bm = BlockManager(64, 4, enable_prefix_cache=False)
    pol = PriorityPolicy(BatchConfig(max_num_seqs=8, max_batch_tokens=16, **PRIO))

    def seq(rid, prio, order, n):
        s = Sequence(rid, list(range(3, 3 + n)), sampling=sp(8), priority=prio)
        s.order = order
        return s

    def step(plan):
        for s, n in plan.batch:
            s.num_computed += n
            if s.num_computed >= s.num_tokens:
                s.output_ids.append(1)

    hi, lo = seq("hi", 1, 1, 5), seq("lo", 5, 2, 5)
    lane = pol.new_lane()
    lane.append(hi)
    lane.append(lo)
    running: list = []
    step(pol.plan(running, [lane], bm))      # hi's prompt alone (lo sits it out)
    step(pol.plan(running, [lane], bm))      # lo's prompt, hi decodes beside it
    assert hi.prefill_complete and lo.prefill_complete
    hi.draft = [7]
    short = seq("short", 1, 3, 6)
    lane.append(short)
    plan = pol.plan(running, [lane], bm)
    assert [(s.rid, n) for s, n in plan.batch] == [("short", 6)]      # its first token, alone
    assert hi.draft == [] and {s.rid for s in running} == {"hi", "lo", "short"}
    step(plan)
    plan = pol.plan(running, [lane], bm)      # then everyone decodes again
    assert sorted(s.rid for s, _ in plan.batch) == ["hi", "lo", "short"]
    step(plan)
    long = seq("long", 1, 4, 40)              # 16 tokens a step: chunks
    lane.append(long)
    plans = []
    while not long.prefill_complete:
        plan = pol.plan(running, [lane], bm)
        plans.append(sorted((s.rid, n) for s, n in plan.batch))
        step(plan)
    assert len(plans) >= 3 and sum(n for p in plans for rid, n in p if rid == "long") == 40
    for p in plans[:-1]:                      # its chunks before the last: the decoders beside it
        assert [rid for rid, _ in p] == ["hi", "long", "short"], plans
    assert [rid for rid, _ in plans[-1]] == ["long"], plans     # its last: they sit out


def test_priority_lane_orders_by_rank_and_removes_from_anywhere():
    lane = PriorityLane()
    seqs = []
    for i, p in enumerate([4, 2, 4, 1, 2]):
        s = Sequence(f"s{i}", [1] * (i + 1), priority=p)
        s.order = i + 1
        seqs.append(s)
        lane.append(s)
    assert lane.tokens == 15 and len(lane) == 5
    assert [s.rid for s in lane] == ["s3", "s1", "s4", "s0", "s2"]
    assert lane.discard(seqs[1]) and not lane.discard(seqs[1]) and lane.tokens == 13
    assert lane.popleft().rid == "s3" and lane.peek().rid == "s4"
    lane.appendleft(seqs[3])                 # put back: its rank's place, the head again
    assert lane.peek().rid == "s3" and seqs[3] in lane and seqs[1] not in lane
    with pytest.raises(ValueError):
        lane.append(seqs[0])


# -- queue deadline ---------------------------------------------------------------------------------
async def test_a_request_still_queued_past_max_queue_time_ends_with_sglangs_timeout():
    rt, rec, clock = await make(max_queue_time_s=2.0)
    assert (await rt.control(PauseGeneration("in_place"))).ok
    a = rt.generate([1, 2], sp(), rid="a", priority=1)
    clock.advance(1.0)
    b = rt.generate([3, 4], sp(), rid="b")
    await rt.quiesce()
    clock.advance(1.0)                        # a's deadline; b has 1 s left
    await rt.quiesce()
    out = await a.stream.final()
    assert (out.finish_reason, out.error, out.aborted_in) == ("abort", QUEUE_TIMEOUT, "queued")
    assert rt.request_info("b")["state"] == "queued"
    await rt.control(ContinueGeneration())
    assert (await b.stream.final()).finish_reason == "length"    # admitted in time: it runs
    await rt.quiesce()
    clock.advance(5.0)                        # its timer was cancelled on admission
    await rt.quiesce()
    assert rt.stats().queue_timeouts == 1
    assert [e.data["label"] for e in rec.events(kind="input") if e.event == "timer"] == ["req:a:queue_deadline"]
    probe = rt.generate([9], sp(), is_probe=True)               # probes have no queue deadline
    assert rt.system.get(f"req:{probe.rid}").queue_deadline is None
    await probe.stream.final()
    await finish(rt, rec)


# -- admission by queued prompt tokens ----------------------------------------------------------------
async def test_max_queued_tokens_refuses_like_the_count_limit_and_an_empty_queue_admits():
    rt, rec, _ = await make(max_queued_tokens=10)
    assert (await rt.control(PauseGeneration("in_place"))).ok
    big = rt.generate(list(range(1, 13)), sp(), rid="big")      # 12 > 10, but nothing waits
    await rt.quiesce()
    with pytest.raises(Overloaded) as err:
        rt.generate([1], sp())
    assert err.value.unit == "tokens" and (err.value.queued, err.value.limit) == (12, 10)
    assert "12 prompt tokens are queued (limit 10)" in str(err.value)
    probe = rt.generate([1], sp(), is_probe=True)               # health passes
    await rt.control(ContinueGeneration())
    await big.stream.final()
    await probe.stream.final()
    await rt.control(PauseGeneration("in_place"))
    six = rt.generate(list(range(1, 7)), sp())
    await rt.quiesce()
    four = rt.generate([1, 2, 3, 4], sp())                      # 6 + 4 = 10: admitted
    await rt.quiesce()
    with pytest.raises(Overloaded):
        rt.generate([5], sp())                                  # 11 > 10
    assert rt.shed == 2
    assert [e.data.get("unit") for e in rec.events(kind="input") if e.event == "shed"] == ["tokens", "tokens"]
    await rt.control(ContinueGeneration())
    for h in (six, four):
        assert (await h.stream.final()).finish_reason == "length"
    await finish(rt, rec)


# -- over HTTP ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from http_support import load_tiny
    return load_tiny()


async def test_over_http_priority_with_the_openai_client_and_sglang_generate(tiny):
    import openai
    from openai import AsyncOpenAI

    from http_support import NAME, serve, settle

    msgs = [{"role": "user", "content": "hi"}]
    async with serve(tiny, batch=BatchConfig(**PRIO)) as (http, rt), \
            AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0) as oa:
        r = await oa.chat.completions.create(model=NAME, messages=msgs, max_tokens=2,
                                             extra_body={"priority": -3, "ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        c = await oa.completions.create(model=NAME, prompt="hi", max_tokens=2,
                                        extra_body={"priority": 7, "ignore_eos": True})
        assert c.choices[0].finish_reason == "length"
        resp = await oa.responses.create(model=NAME, input="hi", max_output_tokens=2,
                                         extra_body={"priority": 2})
        assert resp.status in ("completed", "incomplete")
        g = await http.post("/generate", json={"text": "hi", "priority": 4,
                                               "sampling_params": {"max_new_tokens": 2}})
        assert g.status == 200
        bad = await http.post("/generate", json={"text": "hi", "priority": "high"})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "priority"
        metrics = await (await http.get("/metrics")).text()
        assert f'actorserve_priority_queue_time_seconds_count{{model_name="{NAME}",priority="-3"}} 1.0' in metrics
        assert 'priority="4"} 1.0' in metrics and 'priority="2"} 1.0' in metrics
        assert 'priority="7"} 1.0' in metrics
        await settle(rt)
    async with serve(tiny) as (http, rt), \
            AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0) as oa:
        with pytest.raises(openai.BadRequestError) as err:           # fcfs: vLLM's 400
            await oa.chat.completions.create(model=NAME, messages=msgs, max_tokens=2,
                                             extra_body={"priority": 1})
        assert err.value.body["param"] == "priority"
        assert "Priority scheduling is not enabled" in err.value.body["message"]
        ok = await oa.chat.completions.create(model=NAME, messages=msgs, max_tokens=2,
                                              extra_body={"priority": 0})
        assert ok.choices[0].finish_reason is not None
        await settle(rt)


async def test_over_http_a_queue_timeout_is_503_with_sglangs_message(tiny):
    from aiohttp.test_utils import TestClient, TestServer

    from actorserve.config import ModelConfig, ServerConfig
    from actorserve.engine.runners.runner import build_engine
    from actorserve.http.edge.app import build_app
    from http_support import NAME, settle, until

    model, hf_tok, tok = tiny
    engine = build_engine(model, num_blocks=64, block_size=16, tokenizer=hf_tok, model_name=NAME)
    rt = Runtime(engine, config=SchedulerConfig(max_queue_time_s=0.2),
                 recorder=FlightRecorder(capacity=100_000, lifecycles=LIFECYCLES.values()))
    app = build_app(rt, tok, ServerConfig(model=ModelConfig(model="tiny", kv_blocks=64)), NAME)
    async with TestServer(app, host="127.0.0.1", port=0) as server, TestClient(server) as http:
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status == 200
        chat = asyncio.ensure_future(http.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}))
        gen = asyncio.ensure_future(http.post("/generate", json={
            "text": "x", "stream": True, "sampling_params": {"max_new_tokens": 2}}))
        await until(lambda: rt.stats().queue_timeouts == 2)
        r = await chat
        assert r.status == 503
        err = (await r.json())["error"]
        assert err["message"] == QUEUE_TIMEOUT and err["code"] == 503
        g = await gen
        body = await g.text()
        assert '"status_code": 503' in body and QUEUE_TIMEOUT in body
        metrics = await (await http.get("/metrics")).text()
        assert f'actorserve_queue_timeouts_total{{model_name="{NAME}"}} 2.0' in metrics
        assert (await http.post("/continue_generation", json={})).status == 200
        await settle(rt)
    await rt.shutdown()


def test_the_flags_in_vllms_and_sglangs_spellings():
    import argparse

    from actorserve.http.edge import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)

    def sched(*argv):
        return serve_cli.config_from_args(p.parse_args(list(argv))).scheduler

    assert sched().batch.scheduling_policy == "fcfs"
    assert sched().max_queue_time_s is None and sched().max_queued_tokens is None
    vllm = sched("--scheduling-policy", "priority").batch
    assert (vllm.scheduling_policy, vllm.priority_low_first) == ("priority", True)
    sglang = sched("--enable-priority-scheduling").batch
    assert (sglang.scheduling_policy, sglang.priority_low_first) == ("priority", False)
    flipped = sched("--enable-priority-scheduling", "--schedule-low-priority-values-first").batch
    assert flipped.priority_low_first is True
    both = sched("--max-queue-time", "2.5", "--max-queued-tokens", "4096")
    assert (both.max_queue_time_s, both.max_queued_tokens) == (2.5, 4096)
    with pytest.raises(ValueError):
        sched("--max-queue-time", "0")
    with pytest.raises(SystemExit):
        p.parse_args(["--scheduling-policy", "lifo"])
