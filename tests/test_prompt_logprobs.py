"""Prompt logprobs in the engine: the runners against an independent HF forward, chunked
prefill, the prefix-cache rule (KV reused only below ``logprob_start_len``) and a recompute after
a retraction; output-token ``token_ids_logprob``."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from actorserve.engine.weights import models
from actorserve.engine.scheduling.block_manager import BlockManager
from actorserve.engine.scheduling.params import ParamError, SamplingParams
from actorserve.engine.runners.runner import HFFallbackRunner, PagedLlamaRunner
from actorserve.engine.scheduling.sequence import Sequence

from engine_driver import Driver

PROMPT = [1, 28705, 13, 1270, 16116, 28732, 28711, 1329, 13, 2287, 513, 307, 523, 28705, 28750,
          28747, 604, 307, 13, 2287, 604, 16116, 28732, 28711, 28733, 28740, 28731]      # 27 tokens


@pytest.fixture(scope="module")
def tiny():
    model, _, _ = models.load_model("tiny")
    return model


@pytest.fixture(scope="module")
def reference(tiny):
    """log_softmax over every prompt position, from the plain HF forward."""
    with torch.inference_mode():
        return torch.log_softmax(tiny(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def driver(model, runner=PagedLlamaRunner, block_size=4) -> Driver:
    return Driver(runner(model, num_blocks=64, block_size=block_size), BlockManager(64, block_size))


def run_prompt(d: Driver, seq: Sequence, chunk: int):
    """Prefill in chunks of `chunk`; the output of the step that samples the first token."""
    while True:
        out = d.step([(seq, min(chunk, seq.num_uncomputed))])[0]
        if out.token_id is not None:
            return out


def check_against(pl, ref: torch.Tensor, start: int, k: int) -> None:
    assert pl.start == start and pl.token_ids == PROMPT[start:]
    assert pl.logprobs[0] is None and pl.ranks[0] is None
    want = [float(ref[p - 1, PROMPT[p]]) for p in range(start + 1, len(PROMPT))]
    torch.testing.assert_close(torch.tensor(pl.logprobs[1:]), torch.tensor(want), atol=1e-4, rtol=0)
    for j, p in enumerate(range(start + 1, len(PROMPT)), start=1):
        row = ref[p - 1]
        assert pl.ranks[j] == int((row >= row[PROMPT[p]]).sum())
        if k:
            ids = [t for t, _ in pl.top[j]]
            assert ids == row.topk(k).indices.tolist()
            vals = [v for _, v in pl.top[j]]
            assert vals == sorted(vals, reverse=True) and len(vals) == k


@pytest.mark.parametrize("runner", [PagedLlamaRunner, HFFallbackRunner])
@pytest.mark.parametrize("chunk", [27, 5])
def test_prompt_logprobs_equal_an_independent_forward(tiny, reference, runner, chunk):
    d = driver(tiny, runner)
    seq = d.new("p", PROMPT, cached=False, prompt_logprobs=3)
    out = run_prompt(d, seq, chunk)
    check_against(out.prompt_logprobs, reference, 0, 3)
    assert out.token_id == int(reference[-1].argmax())
    assert seq.prompt_lp is None                        # handed over, nothing kept
    nxt = d.step([(seq, 1)])[0]
    assert nxt.token_id is not None and nxt.prompt_logprobs is None      # only with the first token


def test_start_position_and_requested_ids(tiny, reference):
    d = driver(tiny)
    seq = d.new("p", PROMPT, cached=False, prompt_logprobs=0, logprob_start_len=10, logprobs=True,
                token_ids_logprob=(5, 7))
    out = run_prompt(d, seq, 8)
    pl = out.prompt_logprobs
    check_against(pl, reference, 10, 0)
    assert pl.top is None and pl.ids[0] is None
    for j, p in enumerate(range(11, len(PROMPT)), start=1):
        assert [t for t, _ in pl.ids[j]] == [5, 7]
        torch.testing.assert_close(torch.tensor([v for _, v in pl.ids[j]]), reference[p - 1, [5, 7]],
                                   atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([v for _, v in out.ids_logprobs]), reference[-1, [5, 7]],
                               atol=1e-4, rtol=0)


def test_last_position_start_scores_nothing(tiny):
    d = driver(tiny)
    seq = d.new("p", PROMPT, cached=False, prompt_logprobs=2, logprob_start_len=40)
    pl = run_prompt(d, seq, 27).prompt_logprobs     # a start past the prompt is its last token
    assert pl.start == 26 and pl.token_ids == [PROMPT[-1]] and pl.logprobs == [None] and pl.top == [None]


def test_prefix_cache_reuses_only_below_the_start(tiny, reference):
    d = driver(tiny)
    d.run([d.new("warm", PROMPT)], 1)                      # 6 full blocks cached
    plain = d.new("plain", PROMPT)
    assert plain.num_cached == 24
    d.finish(plain)
    cold = d.new("all", PROMPT, prompt_logprobs=1)
    assert cold.num_cached == 0                             # start 0: nothing reused
    check_against(run_prompt(d, cold, 27).prompt_logprobs, reference, 0, 1)
    d.finish(cold)
    part = d.new("part", PROMPT, prompt_logprobs=1, logprob_start_len=10)
    assert part.num_cached == 8                             # blocks below position 10
    check_against(run_prompt(d, part, 27).prompt_logprobs, reference, 10, 1)
    assert part.prompt_logprob_from is None                 # delivered: a recompute reuses freely
    d.finish(part)
    again = Sequence("again", PROMPT, sampling=part.sampling)
    again.output_ids.append(5)
    assert d.bm.match_prefix(again) == 24


def test_a_retracted_prefill_recomputes_to_the_same_answer(tiny, reference):
    d = driver(tiny)
    seq = d.new("p", PROMPT, cached=False, prompt_logprobs=2)
    d.step([(seq, 9)])
    d.step([(seq, 9)])
    d.bm.free(seq)                                          # retracted mid-prefill: KV gone
    assert seq.prompt_lp                                    # what it scored so far stays, by position
    d.bm.match_prefix(seq)
    assert seq.num_computed == 0
    check_against(run_prompt(d, seq, 7).prompt_logprobs, reference, 0, 2)


def test_sampling_params_bounds():
    for bad in (dict(prompt_logprobs=21), dict(prompt_logprobs=-1), dict(logprob_start_len=-1),
                dict(token_ids_logprob=(-1,)), dict(token_ids_logprob=tuple(range(129)))):
        with pytest.raises(ParamError):
            SamplingParams(**bad)
    assert SamplingParams(token_ids_logprob=[3, 4]).token_ids_logprob == (3, 4)
