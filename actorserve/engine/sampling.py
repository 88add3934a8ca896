"""Token sampling: turn one step's logits ``[B, V]`` into one token per sequence.

Design
------
Each row belongs to one `Sequence` and is processed under that sequence's `SamplingParams`
in a fixed pipeline (the same order as HF's logits processors / vLLM's sampler):

1. **Raw log-probabilities** (only if some row asks for them): ``log_softmax`` of the
   logits exactly as the model produced them, before any bias, mask, penalty or temperature.
   The OpenAI ``logprobs`` / ``top_logprobs`` fields report the model's distribution.
2. **Constraints** (rows that have them, on a copy): ``logit_bias`` is added (OpenAI
   semantics), then a constrained row's grammar bitmask sets every token it cannot accept next
   to ``-inf`` (`engine.grammar.mask_rows`; the matcher itself advances after the draw, in
   the runner). So every later stage, greedy included, sees only allowed tokens.
3. **Penalties** (rows with non-default values only, one small scatter per row over the ids
   the row's context holds, kept incrementally per sequence: `PenaltyState`):
   ``repetition_penalty`` with HF semantics over prompt+output tokens (a positive logit is
   divided by the penalty, a negative one multiplied), then ``frequency_penalty`` and
   ``presence_penalty`` with OpenAI semantics over output tokens
   (``logit -= count * frequency + (count > 0) * presence``).
4. **Greedy rows** (``temperature == 0`` or ``top_k == 1``) are grouped and resolved by a
   single batched ``argmax`` over the penalised logits.
5. **Sampling rows**: divide by temperature; rows with any truncation (``top_k``,
   ``top_p``, ``min_p``) are sorted once in descending order and all three masks are
   computed in sorted space (top-k by position, so it is exact under ties; top-p keeps the
   smallest prefix whose mass reaches ``top_p``, always at least one token; min-p drops
   tokens below ``min_p * p_max``). Rows without truncation skip the sort.
6. **Drawing**: unseeded rows share one batched ``torch.multinomial`` call on a
   module-level generator. A row whose params carry a ``seed`` draws alone from its own
   ``torch.Generator`` kept in ``seq.engine_state`` (created and seeded on first use), so
   its token stream depends only on its seed and its own logits, never on which other
   rows share the batch.

`processed_probs` exposes the distribution that step 6 draws from (one-hot for greedy
rows); tests use it to check that a sampled token always had nonzero probability.

``ignore_eos`` and stop conditions are the scheduler's business, not the sampler's.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from .sequence import Sequence

__all__ = ["sample", "processed_probs", "apply_penalties", "apply_constraints", "get_generator", "SampleResult",
           "PenaltyState"]

SampleResult = tuple[int, float | None, list[tuple[int, float]] | None]

_GLOBAL_GENERATOR = torch.Generator(device="cpu")
_GLOBAL_GENERATOR.seed()
_MIN_TEMPERATURE = 1e-5


def get_generator(seq: Sequence, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-sequence generator of a seeded sequence (created on first use), else None.

    ``seq.engine_state`` is shared with the runner, so it is read flexibly: a bare
    ``torch.Generator``, a dict with key ``"generator"``, or an object with a ``generator``
    attribute. When it is ``None`` the generator itself is stored there.
    """
    seed = seq.sampling.seed
    if seed is None:
        return None
    state: Any = seq.engine_state
    gen: torch.Generator | None
    if isinstance(state, torch.Generator):
        gen = state
    elif isinstance(state, dict):
        gen = state.get("generator")
    else:
        gen = getattr(state, "generator", None)
    if gen is not None:
        return gen
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    if state is None:
        seq.engine_state = gen
    elif isinstance(state, dict):
        state["generator"] = gen
    else:
        setattr(state, "generator", gen)
    return gen


def _global_generator(device: torch.device) -> torch.Generator | None:
    # The module generator lives on the CPU; on another device use that device's default.
    return _GLOBAL_GENERATOR if device.type == "cpu" else None


class PenaltyState:
    """What the penalties read of one sequence (``seq.penalty_state``), on the logits' device:
    ``rep[:n_rep]`` the distinct in-vocab ids of prompt+output, ``ids``/``cnt`` (``len(pos)``
    used) the distinct in-vocab output ids and their counts. A step folds in only the tokens
    appended since the last (the scheduler only appends to ``output_ids``); `current` rebuilds
    it when the lists are not the ones it follows (other list objects, a shorter output, a
    changed last token, another prompt length, vocab or device)."""

    __slots__ = ("prompt", "prompt_len", "output", "n_out", "last", "vocab", "device",
                 "seen", "rep", "n_rep", "pos", "ids", "cnt")

    def __init__(self, seq: Sequence, vocab: int, device: torch.device) -> None:
        sp = seq.sampling
        self.prompt, self.prompt_len = seq.prompt_ids, len(seq.prompt_ids)
        self.output, self.n_out, self.last = seq.output_ids, 0, None
        self.vocab, self.device = vocab, device
        self.rep = self.ids = self.cnt = torch.zeros(0, dtype=torch.long, device=device)
        self.n_rep = 0
        self.seen: set[int] | None = set() if sp.repetition_penalty != 1.0 else None
        self.pos: dict[int, int] | None = {} if sp.frequency_penalty or sp.presence_penalty else None
        if self.seen is not None:
            self._see(seq.prompt_ids)
        self._advance(seq.output_ids)

    @classmethod
    def current(cls, seq: Sequence, vocab: int, device: torch.device) -> "PenaltyState":
        """``seq``'s state, brought up to date (made or rebuilt when it cannot be)."""
        st: PenaltyState | None = seq.penalty_state
        out, sp = seq.output_ids, seq.sampling
        if (st is None or st.output is not out or st.prompt is not seq.prompt_ids
                or st.prompt_len != len(seq.prompt_ids) or len(out) < st.n_out
                or (st.n_out and out[st.n_out - 1] != st.last) or st.vocab != vocab
                or st.device != device or (st.seen is None and sp.repetition_penalty != 1.0)
                or (st.pos is None and (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0))):
            st = seq.penalty_state = cls(seq, vocab, device)
        elif len(out) > st.n_out:
            st._advance(out)
        return st

    def _advance(self, out: list[int]) -> None:
        new = out[self.n_out:]
        if new:
            if self.seen is not None:
                self._see(new)
            if self.pos is not None:
                self._count(new)
            self.n_out, self.last = len(out), out[-1]

    def _put(self, buf: torch.Tensor, n: int, vals: list[int]) -> torch.Tensor:
        """``buf`` (grown if full) with ``vals`` written at ``n``."""
        if n + len(vals) > buf.numel():
            grown = buf.new_zeros(max(2 * buf.numel(), n + len(vals), 16))
            grown[:n] = buf[:n]
            buf = grown
        if len(vals) == 1:
            buf[n:n + 1].fill_(vals[0])      # a scalar write: no host-to-device tensor
        else:
            buf[n:n + len(vals)] = torch.tensor(vals, dtype=torch.long, device=self.device)
        return buf

    def _see(self, tokens: list[int]) -> None:
        seen, vocab = self.seen, self.vocab
        assert seen is not None
        fresh = [t for t in dict.fromkeys(tokens) if t not in seen and 0 <= t < vocab]
        if fresh:
            seen.update(fresh)
            self.rep = self._put(self.rep, self.n_rep, fresh)
            self.n_rep += len(fresh)

    def _count(self, tokens: list[int]) -> None:
        pos, vocab = self.pos, self.vocab
        assert pos is not None
        inc = Counter(t for t in tokens if 0 <= t < vocab)
        seen = [(pos[t], k) for t, k in inc.items() if t in pos]
        fresh = [t for t in inc if t not in pos]
        if fresh:
            n = len(pos)
            self.ids = self._put(self.ids, n, fresh)
            self.cnt = self._put(self.cnt, n, [inc[t] for t in fresh])
            pos.update((t, n + j) for j, t in enumerate(fresh))
        if len(seen) == 1:
            self.cnt[seen[0][0]:seen[0][0] + 1].add_(seen[0][1])
        elif seen:
            at, ks = torch.tensor(seen, dtype=torch.long, device=self.device).unbind(1)
            self.cnt.index_add_(0, at, ks)


def _gather(out: torch.Tensor, groups: dict, view) -> tuple[torch.Tensor, list]:
    """Flat indices into ``out`` of each group's ``(row, id)``s in turn, and each group's span."""
    parts, starts, lens, spans, at = [], [], [], [], 0
    for key, members in groups.items():
        first = at
        for i, st in members:
            parts.append(view(st))
            starts.append(i * out.shape[-1])
            lens.append(parts[-1].numel())
            at += lens[-1]
        spans.append((key, first, at))
    sl = torch.tensor(starts + lens, dtype=torch.long, device=out.device)
    return torch.cat(parts) + torch.repeat_interleave(sl[:len(lens)], sl[len(lens):], output_size=at), spans


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Return a copy of ``logits`` with repetition/frequency/presence penalties applied.

    Only each row's context ids are touched (`PenaltyState`), one gather and scatter for the
    batch, each elementwise op shared by rows with equal penalties (as Python scalars, like the
    dense form, whose result this is bit for bit: repetition over ``unique(prompt + output)``,
    then ``row -= counts * frequency + (counts > 0) * presence``, ``counts`` a vocab bincount;
    its zeros subtract ``-0.0`` when both penalties are negative, making ``-0.0`` logits 0.0)."""
    out = logits.clone(memory_format=torch.contiguous_format)
    vocab = out.shape[-1]
    reps: dict[float, list] = {}
    freqs: dict[tuple[float, float], list] = {}
    negzero: list[int] = []
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        rep, freq, pres = sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty
        if rep == 1.0 and freq == 0.0 and pres == 0.0:
            continue
        st = PenaltyState.current(seq, vocab, out.device)
        if rep != 1.0 and st.n_rep:
            reps.setdefault(rep, []).append((i, st))
        if (freq != 0.0 or pres != 0.0) and seq.output_ids:
            if st.pos:
                freqs.setdefault((freq, pres), []).append((i, st))
            if math.copysign(1.0, 0.0 * freq + 0.0 * pres) < 0:
                negzero.append(i)
    flat = out.view(-1)
    if reps:
        idx, spans = _gather(out, reps, lambda st: st.rep[:st.n_rep])
        vals = flat.index_select(0, idx)
        new = []
        for rep, a, b in spans:
            v = vals[a:b]
            new.append(torch.where(v > 0, v / rep, v * rep))
        flat.index_copy_(0, idx, torch.cat(new))
    if freqs:
        idx, spans = _gather(out, freqs, lambda st: st.ids[:len(st.pos)])
        counts = torch.cat([st.cnt[:len(st.pos)] for g in freqs.values() for _, st in g]).to(out.dtype)
        deltas = []
        for (freq, pres), a, b in spans:
            c = counts[a:b]
            deltas.append(c * freq + (c > 0).to(out.dtype) * pres)
        res = flat.index_select(0, idx) - torch.cat(deltas)
    for i in negzero:
        out[i] -= -0.0                  # the dense form's zero counts, on the rest of the row
    if freqs:
        flat.index_copy_(0, idx, res)
    return out


def _needs_truncation(seq: Sequence) -> bool:
    sp = seq.sampling
    return sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0


def _truncated_sorted_probs(
    scaled: torch.Tensor, seqs: list[Sequence]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row descending and mask by top-k, top-p, min-p.

    Returns ``(probs_sorted, order)``: renormalised probabilities in sorted order and the
    token id at each sorted position.
    """
    n, vocab = scaled.shape
    device = scaled.device
    values, order = torch.sort(scaled, dim=-1, descending=True)
    pos = torch.arange(vocab, device=device).expand(n, vocab)

    top_k = torch.tensor([s.sampling.top_k if s.sampling.top_k > 0 else vocab for s in seqs],
                         device=device)
    keep = pos < top_k.unsqueeze(1)

    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    top_p = torch.tensor([s.sampling.top_p for s in seqs], dtype=probs.dtype, device=device)
    # Mass strictly before each position; a token is kept while that mass is below top_p,
    # so the first token always survives.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= mass_before < top_p.unsqueeze(1)

    min_p = torch.tensor([s.sampling.min_p for s in seqs], dtype=probs.dtype, device=device)
    keep &= probs >= (min_p * probs[:, 0]).unsqueeze(1)
    keep[:, 0] = True

    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    return probs, order


def _plan(logits: torch.Tensor, seqs: list[Sequence]):
    """Shared front half of `sample` and `processed_probs`."""
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(f"logits must be [B, V] with B == len(seqs); got {tuple(logits.shape)} "
                         f"for {len(seqs)} sequences")
    raw = logits = logits.float()
    if any(s.sampling.logit_bias or s.grammar is not None for s in seqs):
        logits = logits.clone()           # raw stays the model's own distribution
        apply_constraints(logits, seqs)
    if any(s.sampling.repetition_penalty != 1.0 or s.sampling.frequency_penalty != 0.0
           or s.sampling.presence_penalty != 0.0 for s in seqs):
        work = apply_penalties(logits, seqs)
    else:
        work = logits
    greedy = [i for i, s in enumerate(seqs) if s.sampling.greedy]
    plain = [i for i, s in enumerate(seqs) if not s.sampling.greedy and not _needs_truncation(s)]
    trunc = [i for i, s in enumerate(seqs) if not s.sampling.greedy and _needs_truncation(s)]
    return raw, work, greedy, plain, trunc


def apply_constraints(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """``logit_bias`` then the grammar masks, in place (see the module docstring, step 2)."""
    vocab = logits.shape[-1]
    for i, seq in enumerate(seqs):
        bias = seq.sampling.logit_bias
        if bias:
            idx = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
            val = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
            keep = idx < vocab
            logits[i].index_add_(0, idx[keep], val[keep])
    if any(s.grammar is not None for s in seqs):
        from .grammar import mask_rows     # xgrammar loads only for constrained requests
        mask_rows(logits, seqs)


def _scaled(work: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> torch.Tensor:
    temps = torch.tensor([max(seqs[i].sampling.temperature, _MIN_TEMPERATURE) for i in rows],
                         dtype=work.dtype, device=work.device)
    return work[rows] / temps.unsqueeze(1)


def processed_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The ``[B, V]`` distribution each row is sampled from (one-hot for greedy rows)."""
    _, work, greedy, plain, trunc = _plan(logits, seqs)
    out = torch.zeros_like(work)
    if greedy:
        out[greedy, work[greedy].argmax(dim=-1)] = 1.0
    if plain:
        out[plain] = torch.softmax(_scaled(work, plain, seqs), dim=-1)
    if trunc:
        probs, order = _truncated_sorted_probs(_scaled(work, trunc, seqs), [seqs[i] for i in trunc])
        out[trunc] = torch.zeros_like(probs).scatter_(1, order, probs)
    return out


def _draw(probs: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> list[int]:
    """Draw one position per row of ``probs``; seeded rows draw alone from their generator."""
    result = [0] * len(rows)
    # Garbage in (NaN / all -inf logits) must not crash the whole step: such a row gets a
    # uniform distribution instead of a multinomial error.
    probs = torch.nan_to_num(probs, nan=0.0, posinf=0.0, neginf=0.0)
    dead = ~(probs.sum(dim=-1) > 0)
    if bool(dead.any()):
        probs[dead] = 1.0
    unseeded = [j for j, i in enumerate(rows) if seqs[i].sampling.seed is None]
    if unseeded:
        picks = torch.multinomial(probs[unseeded], 1, generator=_global_generator(probs.device))
        for j, p in zip(unseeded, picks[:, 0].tolist()):
            result[j] = p
    for j, i in enumerate(rows):
        if seqs[i].sampling.seed is not None:
            gen = get_generator(seqs[i], probs.device)
            result[j] = int(torch.multinomial(probs[j], 1, generator=gen).item())
    return result


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
    """Sample one token per row of ``logits`` ``[B, V]`` under each sequence's params.

    Returns ``(token_id, logprob, top_logprobs)`` per row: ``logprob`` is the chosen token's
    log-probability under the raw model distribution when ``sampling.logprobs`` is set,
    ``top_logprobs`` the ``sampling.top_logprobs`` most likely ``(token, logprob)`` pairs
    when that is > 0; otherwise ``None``.
    """
    if not seqs:
        return []
    raw, work, greedy, plain, trunc = _plan(logits, seqs)
    tokens = [0] * len(seqs)

    if greedy:
        for i, t in zip(greedy, work[greedy].argmax(dim=-1).tolist()):
            tokens[i] = t
    if plain:
        probs = torch.softmax(_scaled(work, plain, seqs), dim=-1)
        for i, t in zip(plain, _draw(probs, plain, seqs)):
            tokens[i] = t
    if trunc:
        probs, order = _truncated_sorted_probs(_scaled(work, trunc, seqs), [seqs[i] for i in trunc])
        positions = _draw(probs, trunc, seqs)
        rows = torch.arange(len(trunc), device=order.device)
        picked = order[rows, torch.tensor(positions, dtype=torch.long, device=order.device)].tolist()
        for i, t in zip(trunc, picked):
            tokens[i] = t

    want_lp = [i for i, s in enumerate(seqs) if s.sampling.logprobs or s.sampling.top_logprobs > 0]
    logprobs: list[float | None] = [None] * len(seqs)
    tops: list[list[tuple[int, float]] | None] = [None] * len(seqs)
    if want_lp:
        lp = torch.log_softmax(raw[want_lp], dim=-1)
        chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in want_lp], device=lp.device))
        k_max = max(seqs[i].sampling.top_logprobs for i in want_lp)
        if k_max > 0:
            top_v, top_i = lp.topk(min(k_max, lp.shape[-1]), dim=-1)
            top_v, top_i = top_v.tolist(), top_i.tolist()
        chosen_lp = chosen[:, 0].tolist()        # one transfer, not one .item() per row
        for j, i in enumerate(want_lp):
            sp = seqs[i].sampling
            if sp.logprobs:
                logprobs[i] = float(chosen_lp[j])
            if sp.top_logprobs > 0:
                k = sp.top_logprobs
                tops[i] = [(int(t), float(v)) for t, v in zip(top_i[j][:k], top_v[j][:k])]
    return [(tokens[i], logprobs[i], tops[i]) for i in range(len(seqs))]
