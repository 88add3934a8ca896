"""One poison request never fails its batch: the scheduler bisects a failed step.

Over the fake engine, whose `fault(batch)` raises when a poison token (666) is in the step, like
a value that overflows in sampling. Exact, with a manual clock and quiesce.
"""

from __future__ import annotations

import pytest

from actorserve.engine.scheduling.params import SamplingParams
from actorserve.replay.check import check
from actorserve.replay.reexec import reexecute

from runtime_helpers import assert_nothing_held, make_runtime
from test_runtime import expected_tokens

POISON = 666


def poison_fault(batch):
    for seq, _ in batch:
        if POISON in seq.prompt_ids:
            raise ValueError("Overflow when unpacking long long")


@pytest.mark.parametrize("n_good,poison_at", [(6, 3), (15, 0), (1, 1)])
async def test_only_the_poison_request_fails_and_the_others_lose_no_token(n_good, poison_at):
    rt, engine, rec, _ = await make_runtime(fault=poison_fault)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(n_good)]
    prompts.insert(poison_at, [1, POISON, 2])
    handles = [rt.generate(p, SamplingParams(max_new_tokens=5, ignore_eos=True)) for p in prompts]
    outs = [await h.stream.final() for h in handles]
    await rt.quiesce()
    for i, (p, out) in enumerate(zip(prompts, outs)):
        if i == poison_at:
            assert out.finish_reason == "error" and "model step failed on this request" in out.error
            assert "Overflow" in out.error and out.token_ids == []
        else:
            assert out.finish_reason == "length" and out.token_ids == expected_tokens(p, 5), i
    st = rt.stats()
    assert (st.isolations, st.isolated_failures) == (1, 1)
    poison_rid = handles[poison_at].rid
    notes = [e for e in rec.events(kind="step") if e.event in ("isolate", "isolated")]
    assert [e.event for e in notes] == ["isolate", "isolated"] and notes[1].rid == poison_rid
    assert sorted(notes[0].data["suspects"]) == sorted(h.rid for h in handles)
    sched = [(e.event, e.src, e.dst) for e in rec.events(rid="scheduler", kind="scheduler")]
    assert [t for t in sched if t[0] in ("isolate", "isolated")] == [
        ("isolate", "stepping", "isolating"), ("isolated", "isolating", "stepping")]   # a state, drawn
    i = sched.index(("isolate", "stepping", "isolating"))
    assert sched[i + 1] == ("isolated", "isolating", "stepping")   # the re-runs happen inside it
    reruns = [e for e in rec.events(kind="step") if e.event == "step"
              and notes[0].seq < e.seq < notes[1].seq]
    assert len(reruns) >= 2
    assert [e.dst for e in rec.events(rid=poison_rid, kind="generation")][-1] == "failed"
    # the failed step and its re-runs: every live member was in exactly one successful re-run
    assert check(rec.events()).ok
    assert_nothing_held(rt)
    await rt.shutdown()
    report = await reexecute(rec.events())
    assert report.ok, report.format()


async def test_two_poison_requests_in_one_batch_are_both_found():
    rt, engine, rec, _ = await make_runtime(fault=poison_fault)
    prompts = [[5, 6], [1, POISON], [7, 8], [9, 10], [POISON, 3], [11, 12], [13, 14]]
    handles = [rt.generate(p, SamplingParams(max_new_tokens=3, ignore_eos=True)) for p in prompts]
    outs = [await h.stream.final() for h in handles]
    await rt.quiesce()
    reasons = [o.finish_reason for o in outs]
    assert reasons == ["length", "error", "length", "length", "error", "length", "length"]
    assert rt.stats().isolated_failures == 2
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_a_step_of_one_member_fails_it_without_isolation():
    rt, engine, rec, _ = await make_runtime(fault=poison_fault)
    out = await rt.generate([POISON], SamplingParams(max_new_tokens=3)).stream.final()
    await rt.quiesce()
    assert out.finish_reason == "error" and "model step failed" in out.error
    assert rt.stats().isolations == 0
    good = await rt.generate([4, 5], SamplingParams(max_new_tokens=3, ignore_eos=True)).stream.final()
    assert good.finish_reason == "length"          # the scheduler goes on
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()
