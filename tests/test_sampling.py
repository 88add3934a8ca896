"""Sampler: greedy, temperature, truncation masks, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from actorserve.engine.params import SamplingParams
from actorserve.engine.sampling import apply_penalties, get_generator, processed_probs, sample
from actorserve.engine.sequence import Sequence


def _seq(prompt=(1, 2, 3), output=(), rid="r", **params) -> Sequence:
    s = Sequence(rid, list(prompt), sampling=SamplingParams(**params))
    s.output_ids = list(output)
    return s


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    seqs = [_seq(temperature=0.0), _seq(top_k=1), _seq(temperature=0.0),
            _seq(temperature=0.7, top_k=1), _seq(temperature=0.0)]
    out = sample(logits, seqs)
    assert [t for t, _, _ in out] == logits.argmax(dim=-1).tolist()
    assert all(lp is None and top is None for _, lp, top in out)


def test_empty_batch_and_shape_check():
    assert sample(torch.zeros(0, 4), []) == []
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 4), [_seq()])


def test_temperature_frequencies_follow_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (1.0, 0.5):
        seq = _seq(temperature=temperature, seed=1234)
        counts = [0] * 4
        for _ in range(4000):
            counts[sample(logits, [seq])[0][0]] += 1
        expected = torch.softmax(logits[0] / temperature, dim=-1).tolist()
        for c, p in zip(counts, expected):
            assert abs(c / 4000 - p) < 0.03, (temperature, counts, expected)
        # Deterministic: the same seed reproduces the exact same counts.
        seq2 = _seq(temperature=temperature, seed=1234)
        counts2 = [0] * 4
        for _ in range(4000):
            counts2[sample(logits, [seq2])[0][0]] += 1
        assert counts2 == counts


def test_top_k_never_leaves_the_top_k():
    logits = torch.tensor([[0.5, 3.0, 0.4, 2.9, 0.3, 0.2]])
    seq = _seq(temperature=5.0, top_k=2, seed=7)
    seen = {sample(logits, [seq])[0][0] for _ in range(500)}
    assert seen == {1, 3}


def test_top_p_mask():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: tokens 0 and 1 survive, renormalised.
    p = processed_probs(logits, [_seq(top_p=0.7)])[0]
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    # Top token alone is enough when top_p is tiny.
    p = processed_probs(logits, [_seq(top_p=0.01)])[0]
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]
    # top_p just above a boundary keeps the next token too.
    p = processed_probs(logits, [_seq(top_p=0.81)])[0]
    assert (p > 0).tolist() == [True, True, True, False]


def test_min_p_mask():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().unsqueeze(0)
    p = processed_probs(logits, [_seq(min_p=0.45)])[0]   # threshold 0.18 keeps 0.4, 0.3, 0.2
    assert torch.allclose(p, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]), atol=1e-6)
    p = processed_probs(logits, [_seq(min_p=0.6)])[0]    # threshold 0.24 keeps 0.4, 0.3
    assert torch.allclose(p, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]), atol=1e-6)
    p = processed_probs(logits, [_seq(min_p=1.0)])[0]
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_combined_top_k_top_p_min_p_and_temperature():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = processed_probs(logits, [_seq(temperature=2.0, top_k=3, top_p=0.99, min_p=0.0)])[0]
    ref = torch.softmax(logits[0, :3] / 2.0, dim=-1)
    assert torch.allclose(p[:3], ref, atol=1e-6) and p[3:].tolist() == [0.0, 0.0]


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    seq = _seq(prompt=[0], output=[1, 1], repetition_penalty=2.0)
    out = apply_penalties(logits, [seq])[0]
    assert out.tolist() == [1.0, -4.0, 2.0, -2.0, 1.0]
    assert logits[0].tolist() == [2.0, -2.0, 2.0, -2.0, 1.0]  # input untouched


def test_frequency_and_presence_penalties_openai_semantics():
    logits = torch.zeros(1, 5)
    # Prompt tokens do not count for frequency/presence; output token 2 thrice, 4 once.
    seq = _seq(prompt=[0, 0, 1], output=[2, 4, 2, 2], frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [seq])[0]
    assert out.tolist() == pytest.approx([0.0, 0.0, -(3 * 0.5 + 0.25), 0.0, -(0.5 + 0.25)])


def test_penalties_only_touch_their_row_and_steer_greedy():
    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    seqs = [_seq(output=[0], temperature=0.0, presence_penalty=0.5),
            _seq(output=[0], temperature=0.0)]
    assert [t for t, _, _ in sample(logits, seqs)] == [1, 0]


def test_same_seed_same_tokens_regardless_of_batch():
    torch.manual_seed(3)
    steps = 30
    logits = torch.randn(steps, 6, 100)

    def run(row: int, others: list[dict], seed: int = 42) -> list[int]:
        target = _seq(rid="t", temperature=0.9, top_p=0.95, seed=seed)
        batch = [_seq(rid=f"o{j}", **kw) for j, kw in enumerate(others)]
        batch.insert(row, target)
        tokens = []
        for step in range(steps):
            lg = logits[step, :len(batch)].clone()
            lg[row] = logits[step, 5]
            tokens.append(sample(lg, batch)[row][0])
        return tokens

    alone = run(0, [])
    assert run(0, [{"temperature": 1.0}, {"temperature": 0.0}]) == alone
    assert run(2, [{"temperature": 1.0, "seed": 42}, {"top_k": 5}, {"min_p": 0.1}]) == alone
    assert run(1, [{"temperature": 1.0, "top_p": 0.5}]) == alone
    assert run(0, [{"temperature": 0.9, "top_p": 0.95, "seed": 43}]) == alone
    assert run(0, [], seed=43) != alone


def test_seed_generator_lives_in_engine_state():
    seq = _seq(seed=5)
    assert seq.engine_state is None
    sample(torch.zeros(1, 8), [seq])
    gen = seq.engine_state
    assert isinstance(gen, torch.Generator) and get_generator(seq) is gen
    dict_state = _seq(seed=5)
    dict_state.engine_state = {"other": 1}
    sample(torch.zeros(1, 8), [dict_state])
    assert isinstance(dict_state.engine_state["generator"], torch.Generator)
    assert get_generator(_seq()) is None


def test_logprobs_equal_raw_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    seqs = [_seq(temperature=0.0, logprobs=True, top_logprobs=5, repetition_penalty=1.5, output=[7]),
            _seq(temperature=0.8, logprobs=True, seed=9, frequency_penalty=1.0, output=[3]),
            _seq(temperature=0.8, top_logprobs=3, seed=9)]
    out = sample(logits, seqs)
    ref = torch.log_softmax(logits, dim=-1)
    for row, (tok, lp, top) in enumerate(out):
        if seqs[row].sampling.logprobs:
            assert lp == pytest.approx(ref[row, tok].item(), abs=1e-6)
        else:
            assert lp is None
        k = seqs[row].sampling.top_logprobs
        if k:
            v, i = ref[row].topk(k)
            assert [t for t, _ in top] == i.tolist()
            assert [x for _, x in top] == pytest.approx(v.tolist(), abs=1e-6)
            assert all(math.isfinite(x) for _, x in top)
        else:
            assert top is None


params_strategy = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    "top_k": st.sampled_from([-1, 1, 2, 5, 20]),
    "top_p": st.sampled_from([1.0, 0.9, 0.5, 0.05]),
    "min_p": st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    "repetition_penalty": st.sampled_from([1.0, 1.3, 0.8]),
    "frequency_penalty": st.sampled_from([0.0, 1.0, -1.0]),
    "presence_penalty": st.sampled_from([0.0, 2.0]),
    "seed": st.one_of(st.none(), st.integers(0, 2**31)),
})


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(params_strategy,
                               st.lists(st.floats(-20, 20, width=32), min_size=12, max_size=12),
                               st.lists(st.integers(0, 11), max_size=6)),
                     min_size=1, max_size=4))
def test_sampled_token_has_nonzero_probability(rows):
    logits = torch.tensor([lg for _, lg, _ in rows], dtype=torch.float32)
    seqs = [_seq(output=out, rid=str(i), **params) for i, (params, _, out) in enumerate(rows)]
    probs = processed_probs(logits, seqs)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(len(rows)), atol=1e-4)
    for _ in range(3):
        for row, (tok, _, _) in enumerate(sample(logits, seqs)):
            assert 0 <= tok < 12
            assert probs[row, tok] > 0, (row, tok, probs[row])


def test_degenerate_rows_do_not_crash():
    logits = torch.tensor([[float("nan")] * 4, [float("-inf")] * 4, [0.0, 1.0, 2.0, 3.0]])
    out = sample(logits, [_seq(seed=1), _seq(), _seq(temperature=0.0)])
    assert all(0 <= t < 4 for t, _, _ in out) and out[2][0] == 3
