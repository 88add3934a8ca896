"""Repetition, frequency and presence penalties, kept incrementally per sequence.

`PenaltyState` lives on ``seq.penalty_state`` and holds what the penalties read of one
sequence, on the logits' device; `apply_penalties` applies them to a batch's logits in one
gather/scatter (step 3 of the pipeline in `engine.sampling.sampling`, which is where they run).
"""

from __future__ import annotations

import math
from collections import Counter
import torch

from ..scheduling.sequence import Sequence


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
