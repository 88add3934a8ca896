"""Giving up the step in flight for an arrival that outranks it (priority policy), and a step of
its own for the best class's prefill:
the scheduler asks (``preempt_step``, recorded), the engine raises `StepPreempted` at a layer
boundary, no member advances, the next step holds the arrival, and every request's tokens are
those of a run without it; re-execution replays it exactly. Fake engine, manual clock, steps
held and released by the test."""

from __future__ import annotations

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.base import StepPreempted
from actorserve.engine.scheduling.batching import BatchConfig, BatchPolicy
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.engine.scheduling.priority import PriorityPolicy
from actorserve.engine.scheduling.sequence import Sequence
from actorserve.replay.check import check
from actorserve.replay.recorder import FlightRecorder
from actorserve.replay.reexec import reexecute
from actorserve.statemachines import LIFECYCLES

from runtime_helpers import assert_nothing_held
from actor_access import actor_of

PRIO = dict(scheduling_policy="priority", max_num_seqs=8)
WANT = {"lo1": ([1, 2, 3], 5, 4), "lo2": ([4, 5, 6], 5, 4), "hi": ([7, 8, 9], 0, 2)}


class Held:
    """Holds every model step; `release()` runs the oldest and tells its answer, as the worker
    thread would (a `StepPreempted` is the step's error)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt, self.steps = rt, []
        actor_of(rt, "scheduler").runner = lambda target, fn, batch, *, wrap: self.steps.append((target, fn, batch, wrap))

    async def release(self) -> list[tuple[str, int]]:
        await self.rt.quiesce()
        target, fn, batch, wrap = self.steps.pop(0)
        try:
            res, err = fn(batch), None
        except StepPreempted as exc:
            res, err = None, exc
        target.tell(wrap(res, err))
        await self.rt.quiesce()
        return [(s.rid, n) for s, n in batch]


async def make(engine: FakeEngine, batch: BatchConfig):
    clock = ManualClock()
    rec = FlightRecorder(clock=clock, capacity=200_000, lifecycles=LIFECYCLES.values())
    rt = Runtime(engine, config=SchedulerConfig(batch=batch, step_in_thread=False), clock=clock, recorder=rec)
    await rt.start()
    return rt, rec


def sp(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


async def reference() -> dict[str, list[int]]:
    """The same requests, all at once, nothing given up: the tokens each must get."""
    rt, _ = await make(FakeEngine(), BatchConfig(**PRIO))
    hs = {rid: rt.generate(ids, sp(n), rid=rid, priority=p) for rid, (ids, p, n) in WANT.items()}
    out = {rid: (await h.stream.final()).token_ids for rid, h in hs.items()}
    await rt.shutdown()
    return out


async def test_an_arrival_that_outranks_the_step_gives_it_up_and_its_first_token_has_a_step_alone():
    engine = FakeEngine()
    rt, rec = await make(engine, BatchConfig(**PRIO))
    held = Held(rt)

    def next_batch() -> list[tuple[str, int]]:
        return [(s.rid, n) for s, n in held.steps[0][2]]

    def asks() -> int:
        return sum(1 for e in rec.events(kind="scheduler") if e.event == "preempt_step")

    hs = {rid: rt.generate(ids, sp(n), rid=rid, priority=p) for rid, (ids, p, n) in WANT.items() if p}
    assert await held.release() == [("lo1", 3), ("lo2", 3)]           # prefill: first tokens
    assert next_batch() == [("lo1", 1), ("lo2", 1)] and not engine.preempt.is_set()
    hs["hi"] = rt.generate(WANT["hi"][0], sp(WANT["hi"][2]), rid="hi", priority=0)
    await rt.quiesce()
    assert engine.preempt.is_set()                                     # asked, recorded:
    got = [(e.src, e.dst) for e in rec.events(kind="scheduler") if e.event == "preempt_step"]
    assert got == [("stepping", "stepping")]
    assert await held.release() == [("lo1", 1), ("lo2", 1)]            # given up
    assert engine.preempted == 1
    ends = [e.data for e in rec.events() if e.kind == "input" and e.event == "step_end"]
    assert ends[-1]["preempted"] is True and ends[-1]["out"] is None
    # hi's prefill has the step to itself; the lows (nothing advanced) sit it out
    assert next_batch() == [("hi", 3)] and not engine.preempt.is_set()
    # arrivals that outrank no member of it ask nothing: an equal priority, a lower one
    hs["eq"] = rt.generate([9, 9], sp(1), rid="eq", priority=0)
    hs["lo3"] = rt.generate([5, 5], sp(1), rid="lo3", priority=5)
    await rt.quiesce()
    assert not engine.preempt.is_set() and asks() == 1
    await held.release()
    assert next_batch() == [("eq", 2)]           # eq's first token: its prompt alone (hi sits out too)
    await held.release()
    assert next_batch() == [("hi", 1), ("lo1", 1), ("lo2", 1), ("lo3", 2)]   # eq done: everyone else
    await held.release()
    assert next_batch() == [("lo1", 1), ("lo2", 1)]                    # hi, eq and lo3 done: the lows
    # a step of lower priorities only: a new arrival of priority 0 asks again
    hs["hi2"] = rt.generate([3, 1], sp(1), rid="hi2", priority=0)
    await rt.quiesce()
    assert engine.preempt.is_set() and asks() == 2
    while held.steps:
        await held.release()
    outs = {rid: await h.stream.final() for rid, h in hs.items()}
    assert {rid: o.finish_reason for rid, o in outs.items()} == dict.fromkeys(hs, "length")
    want = await reference()
    assert {rid: outs[rid].token_ids for rid in WANT} == want          # exact, as if never given up
    assert engine.preempted == 2
    await rt.quiesce()
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()
    report = await reexecute(rec.events())                             # the recorded give-ups replay
    assert report.ok, report.format()


async def test_a_request_that_comes_too_late_leaves_the_step_whole():
    """The ask came after the engine's last layer boundary: the step's answer counts, and the
    flag is cleared before the next step."""
    engine = FakeEngine()
    rt, rec = await make(engine, BatchConfig(**PRIO))
    held = Held(rt)
    lo = rt.generate([1, 2, 3], sp(2), rid="lo", priority=5)
    await rt.quiesce()
    lo_seq = actor_of(rt, "scheduler").seqs["lo"]
    hi = rt.generate([7, 8], sp(1), rid="hi", priority=0)
    await rt.quiesce()
    assert engine.preempt.is_set()
    target, fn, batch, wrap = held.steps.pop(0)
    engine.preempt.clear()                    # as if the engine had passed its last boundary
    target.tell(wrap(fn(batch), None))
    await rt.quiesce()
    assert lo_seq.num_computed == 3                                    # lo advanced
    assert [(s.rid, n) for s, n in held.steps[0][2]] == [("hi", 2)]
    while held.steps:
        await held.release()
    assert (await lo.stream.final()).completion_tokens == 2
    assert (await hi.stream.final()).completion_tokens == 1
    assert engine.preempted == 0
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()
    report = await reexecute(rec.events())
    assert report.ok, report.format()


def test_who_preempts_outranks_some_member_and_is_outranked_by_none_never_a_probe_never_under_fcfs():
    def seq(rid: str, p: int, probe: bool = False) -> Sequence:
        return Sequence(rid, [1, 2], sampling=sp(1), priority=p, is_probe=probe)

    pol = PriorityPolicy(BatchConfig(**PRIO))
    low, mid = seq("a", 5), seq("b", 3)
    assert pol.preempts(seq("h", 0), [low, mid])
    assert pol.preempts(seq("h", 3), [low, mid])              # its own class in it, and a lower one
    assert not pol.preempts(seq("h", 4), [low, mid])          # mid outranks it
    assert not pol.preempts(seq("h", 3), [mid, seq("m2", 3)])   # outranks none
    assert not pol.preempts(seq("h", 0), [])                  # nothing in flight
    assert not pol.preempts(seq("p", 0, probe=True), [low])   # a probe waits for the boundary
    assert not pol.preempts(seq("h", 0), [seq("q", 9, probe=True)])   # nor is a probe's step given up
    sglang = PriorityPolicy(BatchConfig(scheduling_policy="priority", priority_low_first=False))
    assert sglang.preempts(seq("h", 9), [low]) and not sglang.preempts(seq("h", 0), [low])
    assert not BatchPolicy(BatchConfig()).preempts(seq("h", 0), [low])


def test_the_runner_gives_up_at_a_layer_boundary_and_the_rerun_is_exact():
    """The real runner (tiny model): the flag set once the first layer wrote its K/V, the
    step raises `StepPreempted`; the scheduler's bookkeeping stays as before the step, and
    running it again (the KV written past ``num_computed`` overwritten) gives the tokens of a
    run that was never interrupted."""
    import pytest

    from actorserve.engine.weights import models
    from actorserve.engine.scheduling.block_manager import BlockManager
    from actorserve.engine.runners.runner import PagedLlamaRunner

    from engine_driver import Driver

    model, _, _ = models.load_model("tiny")
    prompts = [[1, 415, 2936, 9060, 285, 1142], [1, 22, 4], [1, 28705, 13, 1270]]

    def run(interrupt: bool) -> list[list[int]]:
        eng = PagedLlamaRunner(model, num_blocks=64, block_size=4)
        d = Driver(eng, BlockManager(64, 4))
        seqs = [d.new(f"r{i}", p) for i, p in enumerate(prompts)]
        d.step([(s, s.num_uncomputed) for s in seqs])
        if interrupt:
            write = eng.kv.write

            def write_then_ask(li, *a):
                write(li, *a)
                eng.preempt.set()             # the scheduler's ask lands mid-step
            eng.kv.write = write_then_ask
            before = [(s.num_computed, len(s.output_ids)) for s in seqs]
            for s in seqs:
                assert d.bm.allocate(s, 1)
            # read again between layer 0's attention and its MLP: the MLP never runs
            with pytest.raises(StepPreempted, match="in layer 0, before its MLP"):
                eng.execute([(s, 1) for s in seqs])
            assert [(s.num_computed, len(s.output_ids)) for s in seqs] == before
            eng.kv.write = write
            eng.preempt.clear()               # as `SchedulerActor._run` does
        for _ in range(5):
            d.step([(s, 1) for s in seqs])
        return [s.output_ids for s in seqs]

    assert len(model.model.layers) > 1
    assert run(True) == run(False)


def test_a_fused_q4_decode_step_gives_up_at_its_own_layer_boundary_and_the_rerun_is_exact():
    """q4's fused decode step runs every layer in one C call (`fused_step`) and reads the
    runner's flag at each layer boundary: the ask lands while layer 0's attention runs, the
    call returns at layer 1 (without the C check it would run on and be given up only after
    its last layer), no member advances, and the tokens are those of a run never interrupted."""
    import ctypes

    import pytest
    import torch
    import transformers as tr

    from actorserve.engine.kernels import quant
    from test_model_families import COMMON, PROMPTS, make

    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(tr.LlamaConfig(**{**COMMON, "num_attention_heads": 2,
                                                  "num_key_value_heads": 1}, head_dim=32)).eval()
    model.actorserve_quant = quant.quantize_model(model, "q4")
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    attention_t = ctypes.CFUNCTYPE(i, p, p, p, i, p, i, p, i, i, i, i, i, f, f, p, i)   # decode_step.c's

    def run(interrupt: bool) -> list[list[int]]:
        d, _ = make(model)
        eng = d.engine
        assert eng.fused is not None and len(model.model.layers) == 2
        seqs = [d.new(f"r{i}", p) for i, p in enumerate(PROMPTS)]
        d.step([(s, s.num_uncomputed) for s in seqs])
        if interrupt:
            real = attention_t(eng.fused._attention)
            calls = []

            def attention_then_ask(*args):
                calls.append(1)
                eng.preempt.set()             # the scheduler's ask lands mid-step
                return real(*args)
            hook = attention_t(attention_then_ask)
            eng.fused._attention = ctypes.cast(hook, p).value
            before = [(s.num_computed, len(s.output_ids)) for s in seqs]
            for s in seqs:
                assert d.bm.allocate(s, 1)
            with pytest.raises(StepPreempted, match="at layer 1"):
                eng.execute([(s, 1) for s in seqs])
            assert calls == [1]               # layer 1's attention never ran
            assert [(s.num_computed, len(s.output_ids)) for s in seqs] == before
            eng.fused._attention = ctypes.cast(real, p).value
            eng.preempt.clear()
        for _ in range(5):
            d.step([(s, 1) for s in seqs])
        return [s.output_ids for s in seqs]

    assert run(True) == run(False)


def test_switch_interval_sets_the_interpreters_and_refuses_a_non_positive_one():
    import sys

    import pytest

    from actorserve.http.edge import serve_cli

    was = sys.getswitchinterval()
    try:
        serve_cli.switch_interval(None)
        assert sys.getswitchinterval() == was
        serve_cli.switch_interval(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        for bad in (0.0, -1.0):
            with pytest.raises(ValueError, match="--switch-interval must be > 0"):
                serve_cli.switch_interval(bad)
    finally:
        sys.setswitchinterval(was)
