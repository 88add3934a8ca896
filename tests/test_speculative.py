"""Speculative decoding without a draft model (`engine.scheduling.speculative`, ``--speculative ngram``).

The promise: a greedy request's output is the same token for token with and without
speculation, however its step ends (length, EOS or a stop token inside the accepted drafts, a
stop string, an abort), while fewer steps are spent; the acceptance is visible per request
(``meta_info``, the recording) and in /metrics; a recording of a speculative run re-executes
step for step, drafts included.
"""

from __future__ import annotations

import random

import pytest

from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeDetokenizer
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.engine.scheduling.sequence import Sequence
from actorserve.engine.scheduling.speculative import NgramIndex, SpecConfig, accepted, eligible
from actorserve.replay.check import check
from actorserve.replay.reexec import reexecute, steps_of
from actorserve.replay.stats import speculation
from runtime_helpers import assert_nothing_held, make_runtime
from actor_access import actor_of

SPEC = BatchConfig(max_num_seqs=8, max_batch_tokens=64, max_prefill_chunk=16, speculative="ngram")
PLAIN = BatchConfig(max_num_seqs=8, max_batch_tokens=64, max_prefill_chunk=16)


def brute_propose(tokens: list[int], k: int, lo: int = 1, hi: int = 3) -> list[int]:
    """The definition: the longest suffix (hi..lo) with an earlier occurrence that has a token
    after it; the tokens after its latest such occurrence."""
    L = len(tokens)
    for n in range(min(hi, L), lo - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):        # occurrences ending before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_the_incremental_index_proposes_what_the_definition_says():
    rng = random.Random(3)
    for trial in range(40):
        prompt = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))]
        seq = Sequence("s", prompt)
        index = NgramIndex(1, 3)
        for _ in range(30):                   # grow the output, proposing at every length
            k = rng.randrange(1, 6)
            assert index.propose(seq, k) == brute_propose(seq.token_ids(), k), (trial, seq.token_ids())
            seq.output_ids.append(rng.randrange(1, 6))


def test_proposals_prefer_the_longest_suffix_and_its_latest_occurrence():
    seq = Sequence("s", [7, 1, 2, 9, 3, 1, 2, 8, 5, 1, 2])
    index = NgramIndex(1, 3)
    assert index.propose(seq, 2) == [8, 5]            # (1, 2) last seen before 8, not before 9
    seq.output_ids = [8]                              # suffix (1, 2, 8) occurred once: 5 1 2 8 ...
    assert index.propose(seq, 3) == [5, 1, 2]
    assert NgramIndex(1, 3).propose(Sequence("t", [1, 2, 3]), 4) == []      # nothing repeats
    assert NgramIndex(2, 3).propose(Sequence("u", [4, 5, 4]), 4) == []      # only a 1-gram would


def test_acceptance_and_eligibility():
    assert accepted([5, 6, 7], [5, 6, 9, 1]) == 2 and accepted([5], [4, 5]) == 0
    assert accepted([5, 6], [5, 6, 3]) == 2
    greedy = SamplingParams(temperature=0)
    assert eligible(Sequence("a", [1], sampling=greedy))
    assert not eligible(Sequence("b", [1], sampling=SamplingParams(temperature=0.7)))
    assert not eligible(Sequence("c", [1], sampling=SamplingParams(temperature=0, repetition_penalty=1.2)))
    assert not eligible(Sequence("d", [1], sampling=SamplingParams(temperature=0, grammar=("regex", "a+"))))
    assert not eligible(Sequence("e", [1], sampling=greedy, is_probe=True))
    with pytest.raises(ValueError):
        BatchConfig(speculative="eagle")
    with pytest.raises(ValueError):
        SpecConfig("ngram", min_ngram=3, max_ngram=2)


async def _run(batch: BatchConfig, requests, **engine_kw):
    rt, engine, rec, clock = await make_runtime(batch=batch, alphabet=4, block_size=4, num_blocks=256,
                                                **engine_kw)
    handles = [rt.generate(prompt, sp, detokenizer=FakeDetokenizer(stop=stop)) for prompt, sp, stop in requests]
    outs = []
    for h in handles:
        toks, last = [], None
        async for item in h.stream:
            toks.extend(item.token_ids)
            last = item
        outs.append((toks, last))
    await rt.quiesce()
    stats = rt.stats()
    assert_nothing_held(rt)
    events = rec.events()
    await rt.shutdown()
    return outs, stats, events


def _requests():
    rng = random.Random(7)
    reqs = []
    for i in range(12):
        prompt = [rng.randrange(1, 5) for _ in range(rng.randrange(2, 9))]
        sp = SamplingParams(temperature=0, max_new_tokens=rng.randrange(1, 40),
                            stop_token_ids=(3,) if i % 4 == 1 else (), logprobs=i % 3 == 0)
        reqs.append((prompt, sp, ("<2><4>",) if i % 5 == 2 else ()))
    reqs.append(([1, 2, 3], SamplingParams(temperature=0.8, seed=1, max_new_tokens=20), ()))  # not greedy
    return reqs


async def test_greedy_output_is_identical_with_fewer_steps_and_the_recording_reexecutes():
    reqs = _requests()
    plain, plain_stats, _ = await _run(PLAIN, reqs)
    spec, stats, events = await _run(SPEC, reqs)
    for (a, la), (b, lb), (_, sp, stop) in zip(plain, spec, reqs):
        assert b == a, (sp, stop)
        assert (lb.finish_reason, lb.matched_stop, lb.completion_tokens) == \
            (la.finish_reason, la.matched_stop, la.completion_tokens)
    reasons = {last.finish_reason for _, last in spec}
    assert {"length", "stop"} <= reasons
    assert any(last.matched_stop == 3 for _, last in spec)            # a stop token, often mid-draft
    assert any(last.matched_stop == "<2><4>" for _, last in spec)     # a stop string
    assert spec[-1][1].spec is None                                   # the sampled one never speculates
    assert stats.spec_accepted_tokens > 0 and stats.spec_steps > 0
    assert stats.steps < plain_stats.steps
    assert stats.generated_tokens == plain_stats.generated_tokens
    # counted where they are output: a speculative step's tokens past a stop string never are
    assert stats.generated_tokens == sum(last.completion_tokens for _, last in spec)
    per_request = [last.spec for _, last in spec if last.spec is not None]
    assert sum(s[0] for s in per_request) == stats.spec_steps
    assert sum(s[1] for s in per_request) == stats.spec_draft_tokens
    assert sum(s[2] for s in per_request) == stats.spec_accepted_tokens
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens

    # the recording shows each verify step's drafts and what they yielded, per request
    assert check(events).ok
    s = speculation(events)
    assert (s["verify_steps"], s["draft_tokens"], s["accepted_tokens"]) == \
        (stats.spec_steps, stats.spec_draft_tokens, stats.spec_accepted_tokens)
    by_rid = {last.rid: last.spec for _, last in spec if last.spec is not None}
    assert {rid: tuple(v.values()) for rid, v in s["requests"].items()} == by_rid
    rx = await reexecute(events)
    assert rx.ok, rx.format()
    assert rx.drift == 0 and rx.fillers == 0
    assert any(len(m) == 3 for _, batch in steps_of(events)["scheduler"] for m in batch)  # drafts compared

    # a what-if re-execution without speculation shows where it departs: the first drafting step
    off = await reexecute(events, batch=PLAIN)
    assert not off.ok and off.step_diffs[0].recorded != off.step_diffs[0].replayed


async def test_speculation_stops_above_its_batch_limit_and_for_an_engine_that_cannot_verify():
    reqs = [([1, 2, 1, 2], SamplingParams(temperature=0, max_new_tokens=30), ())] * 3
    _, stats, _ = await _run(BatchConfig(speculative="ngram", speculative_max_batch=2), reqs)
    assert stats.spec_steps == 0         # three decode together: above the limit
    _, stats, _ = await _run(BatchConfig(speculative="ngram", speculative_max_batch=3), reqs)
    assert stats.spec_steps > 0

    from actorserve.engine.runners.fake import FakeEngine

    class Plain(FakeEngine):
        verifies_drafts = False

    from actorserve.actors.runtime import Runtime
    from actorserve.config import SchedulerConfig
    rt = Runtime(Plain(), config=SchedulerConfig(batch=SPEC, step_in_thread=False))
    assert actor_of(rt, "scheduler").policy.config.speculative is None and not actor_of(rt, "scheduler").policy.spec.enabled
    assert rt.setup()["generation"]["batch"]["speculative"] is None       # the recording says so


# -- the real runner ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from http_support import load_tiny
    return load_tiny()


def _real_runtime(model, hf_tok, batch: BatchConfig):
    from actorserve.actors.runtime import Runtime
    from actorserve.config import SchedulerConfig
    from actorserve.engine.runners.runner import build_engine
    from actorserve.replay.recorder import FlightRecorder
    from actorserve.statemachines import LIFECYCLES

    engine = build_engine(model, num_blocks=128, block_size=4, tokenizer=hf_tok)
    rec = FlightRecorder(capacity=200_000, lifecycles=LIFECYCLES.values())
    return Runtime(engine, config=SchedulerConfig(batch=batch, step_in_thread=False), recorder=rec)


async def _real(model, hf_tok, batch, prompts, **params):
    rt = _real_runtime(model, hf_tok, batch)
    await rt.start()
    handles = [rt.generate(p, SamplingParams(temperature=0, max_new_tokens=48, **params)) for p in prompts]
    outs = []
    for h in handles:
        toks, lps, last = [], [], None
        async for item in h.stream:
            toks.extend(item.token_ids)
            lps.extend(item.logprobs or ())
            last = item
        outs.append((toks, lps, last))
    await rt.quiesce()
    stats = rt.stats()
    assert_nothing_held(rt)
    events = rt.recorder.events()
    await rt.shutdown()
    return outs, stats, events


async def test_the_paged_runner_speculates_to_the_same_greedy_tokens_and_logprobs(tiny):
    model, hf_tok, _ = tiny
    rng = random.Random(5)
    # prompts that repeat themselves, as extraction and editing do: drafts have something to find
    prompts = [[rng.randrange(5, 3000) for _ in range(6)] * 3 for _ in range(4)]
    plain, plain_stats, plain_events = await _real(model, hf_tok, PLAIN, prompts, logprobs=True, top_logprobs=2)
    spec, stats, events = await _real(model, hf_tok, SPEC, prompts, logprobs=True, top_logprobs=2)
    for (a, la, _), (b, lb, last) in zip(plain, spec):
        assert b == a
        for (t1, lp1, top1, _), (t2, lp2, top2, _) in zip(la, lb):
            assert t1 == t2 and lp2 == pytest.approx(lp1, abs=1e-4)
            assert [t for t, _ in top1] == [t for t, _ in top2]
    assert stats.spec_steps > 0 and stats.spec_accepted_tokens > 0
    def member_steps(evs):           # steps each request was in, summed
        return sum(len(batch) for _, batch in steps_of(evs)["scheduler"])
    assert member_steps(events) <= member_steps(plain_events) - stats.spec_accepted_tokens
    assert (await reexecute(events)).ok


async def test_http_shows_acceptance_per_request_in_metrics_and_server_info(tiny):
    from http_support import serve, settle
    from test_metrics_parity import scrape, value

    rng = random.Random(5)
    ids = [rng.randrange(5, 3000) for _ in range(6)] * 3
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
    async with serve(tiny, metrics_names="vllm") as (http, rt):
        plain = await (await http.post("/generate", json=body)).json()
        assert "spec_verify_ct" not in plain["meta_info"]
    async with serve(tiny, metrics_names="vllm", batch=SPEC) as (http, rt):
        info = await (await http.get("/get_server_info")).json()
        assert (info["speculative_algorithm"], info["speculative_num_draft_tokens"]) == ("NGRAM", 4)
        out = await (await http.post("/generate", json=body)).json()
        assert out["output_ids"] == plain["output_ids"]
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] > 0 and 0 < meta["spec_accepted_tokens"] <= meta["spec_draft_tokens"]
        assert meta["spec_accept_rate"] == pytest.approx(meta["spec_accepted_tokens"] / meta["spec_draft_tokens"])
        await settle(rt)
        fams = await scrape(http)
        assert value(fams, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total") == meta["spec_verify_ct"]
        assert value(fams, "vllm:spec_decode_num_draft_tokens",
                     "vllm:spec_decode_num_draft_tokens_total") == meta["spec_draft_tokens"]
        assert value(fams, "vllm:spec_decode_num_accepted_tokens",
                     "vllm:spec_decode_num_accepted_tokens_total") == meta["spec_accepted_tokens"]
        state = (await (await http.get("/get_server_info")).json())["internal_states"][0]
        assert state["avg_spec_accept_length"] == pytest.approx(
            (meta["spec_verify_ct"] + meta["spec_accepted_tokens"]) / meta["spec_verify_ct"])
