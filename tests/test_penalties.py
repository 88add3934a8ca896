"""Incremental penalties (`penalties.PenaltyState`) against the dense computation they replace.

`dense_penalties` is the former `apply_penalties`, copied verbatim: it rebuilt the counts from
the whole context of every sequence each step. The incremental one must agree with it bit for
bit (compared as integers, so ``-0.0`` against ``0.0`` counts as a difference) over random
sequences, params and steps, including the ways a sequence's token lists can change under it.
"""

from __future__ import annotations

import random

import pytest
import torch

from actorserve.engine.sampling import sampling
from actorserve.engine.scheduling.block_manager import BlockManager
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.engine.sampling.penalties import PenaltyState
from actorserve.engine.sampling.sampling import apply_penalties, processed_probs
from actorserve.engine.scheduling.sequence import Sequence


def dense_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The reference: `apply_penalties` as it was before `PenaltyState` (unchanged copy)."""
    out = logits.clone()
    vocab = out.shape[-1]
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        rep, freq, pres = sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty
        if rep != 1.0:
            ids = seq.prompt_ids + seq.output_ids
            if ids:
                idx = torch.tensor(ids, dtype=torch.long, device=out.device).unique()
                idx = idx[(idx >= 0) & (idx < vocab)]
                vals = out[i, idx]
                out[i, idx] = torch.where(vals > 0, vals / rep, vals * rep)
        if (freq != 0.0 or pres != 0.0) and seq.output_ids:
            idx = torch.tensor(seq.output_ids, dtype=torch.long, device=out.device)
            idx = idx[(idx >= 0) & (idx < vocab)]
            counts = torch.bincount(idx, minlength=vocab).to(out.dtype)
            out[i] -= counts * freq + (counts > 0).to(out.dtype) * pres
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64,
                   torch.bfloat16: torch.int16}[t.dtype])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = (_bits(a) != _bits(b)).nonzero().tolist()
    assert not diff, f"{len(diff)} entries differ, first {diff[:3]}: {a[tuple(zip(*diff[:3]))]} vs " \
                     f"{b[tuple(zip(*diff[:3]))]}"


_REP = [1.0, 1.0, 1.3, 0.7, 2.0]
_FREQ = [0.0, 0.0, 0.5, -1.0, 2.0, -0.0, 1.0]
_PRES = [0.0, 0.0, 1.0, -0.5, -2.0, 2.0, -0.0]


def _logits(rng: random.Random, b: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(b, vocab, generator=gen) * 3
    # Edge values the penalties treat specially: signed zeros, infinities, exact ties.
    for _ in range(rng.randrange(0, vocab // 2 + 1)):
        x[rng.randrange(b), rng.randrange(vocab)] = rng.choice([0.0, -0.0, float("inf"), float("-inf"), 1.0, -1.0])
    return x.to(dtype)


def _token(rng: random.Random, vocab: int) -> int:
    # Mostly a small alphabet (so repeats, counts > 1), sometimes anything, sometimes out of range.
    r = rng.random()
    if r < 0.6:
        return rng.randrange(min(vocab, 6))
    if r < 0.95:
        return rng.randrange(vocab)
    return rng.choice([-1, vocab, vocab + 3])


def _mutate(rng: random.Random, seq: Sequence, vocab: int, bm: BlockManager) -> None:
    """One step's change to a sequence: mostly a token appended (the scheduler's only change),
    sometimes the other things that can happen to its lists or its KV."""
    r = rng.random()
    out = seq.output_ids
    if r < 0.70:
        out.append(_token(rng, vocab))
    elif r < 0.76:
        out.extend(_token(rng, vocab) for _ in range(rng.randrange(2, 6)))   # several at once
    elif r < 0.80:
        pass                                                       # no new token this step
    elif r < 0.84:                                                 # retraction and recompute:
        if bm.allocate(seq, seq.num_uncomputed):                   # blocks go, tokens stay
            seq.num_computed = seq.num_tokens
            bm.commit(seq)
        bm.free(seq)
        cached = bm.match_prefix(seq)
        assert cached <= seq.num_tokens
        bm.abort_match(seq)
    elif r < 0.88 and out:                                         # truncated (a test's pop)
        del out[rng.randrange(len(out)):]
    elif r < 0.91 and out:                                         # last token replaced
        out[-1] = (out[-1] + 1) % vocab
    elif r < 0.94:                  # a new output list: other tokens, the same last one, one more
        seq.output_ids = [_token(rng, vocab) for _ in out[1:]] + out[-1:] + [_token(rng, vocab)]
    elif r < 0.955:                                                # a new prompt (a session turn)
        seq.prompt_ids = seq.prompt_ids + out[:2] + [_token(rng, vocab)]
    elif r < 0.97:                                                 # ...of the same length
        seq.prompt_ids = [_token(rng, vocab) for _ in seq.prompt_ids]
    else:                                                          # the same prompt list, grown
        seq.prompt_ids.append(_token(rng, vocab))


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(repetition_penalty=rng.choice(_REP), frequency_penalty=rng.choice(_FREQ),
                          presence_penalty=rng.choice(_PRES), temperature=rng.choice([0.0, 0.8]))


@pytest.mark.parametrize("seed", range(12))
def test_incremental_penalties_are_bit_identical_to_the_dense_ones(seed):
    rng = random.Random(seed)
    vocab = rng.choice([5, 17, 64, 300])
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16])
    bm = BlockManager(4096, rng.choice([1, 4, 16]))
    seqs = []
    for j in range(rng.randrange(1, 7)):
        prompt = [_token(rng, vocab) for _ in range(rng.choice([0, 1, 5, 40, 200]))]
        if not prompt and rng.random() < 0.5:
            prompt = [0]
        seq = Sequence(f"s{j}", prompt, sampling=_params(rng))
        seq.output_ids.extend(_token(rng, vocab) for _ in range(rng.choice([0, 0, 3])))
        seqs.append(seq)
    for step in range(60):
        batch = [s for s in seqs if rng.random() < 0.85] or seqs[:1]
        if rng.random() < 0.1:
            batch = batch + batch[:1]                              # the same sequence twice
        logits = _logits(rng, len(batch), vocab, dtype)
        before = logits.clone()
        got, want = apply_penalties(logits, batch), dense_penalties(logits, batch)
        assert_same_bits(got, want)
        assert_same_bits(logits, before)                           # a copy; the input is kept
        if dtype == torch.float32:                                 # and through the sampler
            assert_same_bits(processed_probs(logits, batch),
                             _processed_with(dense_penalties, logits, batch))
        for s in seqs:
            _mutate(rng, s, vocab, bm)
    bm.check()


def _processed_with(penalties, logits, seqs):
    real = sampling.apply_penalties
    sampling.apply_penalties = penalties
    try:
        return processed_probs(logits, seqs)
    finally:
        sampling.apply_penalties = real


def test_a_vocab_change_rebuilds():
    seq = Sequence("s", [1, 2, 9], sampling=SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0))
    seq.output_ids.extend([9, 3, 3])
    for vocab in (4, 12, 4):
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(vocab))
        assert_same_bits(apply_penalties(logits, [seq]), dense_penalties(logits, [seq]))
        assert seq.penalty_state.vocab == vocab


def test_a_decode_step_folds_in_only_the_new_token(monkeypatch):
    """After the first step the state is never rebuilt, and each step reads only the tokens
    appended since: the prompt (2k tokens) is not read again."""
    rng = random.Random(7)
    vocab = 1000
    seqs = [Sequence(f"s{j}", [rng.randrange(vocab) for _ in range(2048)],
                     sampling=SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5,
                                             presence_penalty=0.25)) for j in range(4)]
    built: list[str] = []
    real_init = PenaltyState.__init__

    def counting_init(self, seq, *a):
        built.append(seq.rid)
        real_init(self, seq, *a)
    monkeypatch.setattr(PenaltyState, "__init__", counting_init)
    read: list[int] = []
    real_advance = PenaltyState._advance

    def counting_advance(self, out):
        read.append(len(out) - self.n_out)
        real_advance(self, out)
    monkeypatch.setattr(PenaltyState, "_advance", counting_advance)
    for step in range(50):
        logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(step))
        assert_same_bits(apply_penalties(logits, seqs), dense_penalties(logits, seqs))
        for s in seqs:
            s.output_ids.append(rng.randrange(vocab))
    assert built == ["s0", "s1", "s2", "s3"]                  # once each, on the first step
    assert read[:4] == [0, 0, 0, 0] and set(read[4:]) == {1}   # then one new token a step
    st = seqs[0].penalty_state
    assert st.n_rep == len(set(seqs[0].prompt_ids + seqs[0].output_ids[:-1]))
    assert st.cnt[:len(st.pos)].sum().item() == 49 and len(st.pos) == len(set(seqs[0].output_ids[:-1]))


def test_unpenalised_rows_get_no_state():
    plain = Sequence("p", [1, 2, 3])
    plain.output_ids.append(2)
    pen = Sequence("q", [1, 2, 3], sampling=SamplingParams(presence_penalty=1.0))
    pen.output_ids.append(2)
    logits = torch.zeros(2, 5)
    out = apply_penalties(logits, [plain, pen])
    assert plain.penalty_state is None and pen.penalty_state is not None
    assert out[0].tolist() == [0.0] * 5 and out[1].tolist() == [0.0, 0.0, -1.0, 0.0, 0.0]
