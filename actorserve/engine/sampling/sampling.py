"""Token sampling: turn one step's logits ``[B, V]`` into one token per sequence.

Design
------
Each row belongs to one `Sequence` and is processed under that sequence's `SamplingParams`
in a fixed pipeline (the same order as HF's logits processors / vLLM's sampler):

1. **Raw log-probabilities** (only if some row asks for them): ``log_softmax`` of the
   logits exactly as the model produced them, before any bias, mask, penalty or temperature.
   The OpenAI ``logprobs`` / ``top_logprobs`` fields report the model's distribution.
2. **Constraints** (rows that have them, on a copy): ``logit_bias`` is added (OpenAI
   semantics), the ids that would end a row still short of its ``min_tokens`` are set to
   ``-inf`` after the masks below (`Sequence.stop_ids_masked`; not where nothing else would be
   left), then a constrained row's grammar bitmask sets every token it cannot accept next
   to ``-inf`` (`engine.sampling.grammar.mask_rows`; the matcher itself advances after the draw, in
   the runner; a reasoning model's row is not masked inside its reasoning), then a row whose
   thinking budget is spent keeps only its ``</think>`` (`engine.sampling.thinking`). So every later stage, greedy included, sees only allowed tokens.
3. **Penalties** (rows with non-default values only, one small scatter per row over the ids
   the row's context holds, kept incrementally per sequence: `engine.sampling.penalties`):
   ``repetition_penalty`` with HF semantics over prompt+output tokens (a positive logit is
   divided by the penalty, a negative one multiplied), then ``frequency_penalty`` and
   ``presence_penalty`` with OpenAI semantics over output tokens
   (``logit -= count * frequency + (count > 0) * presence``).
4. **Greedy rows** (``temperature == 0`` or ``top_k == 1``) are grouped and resolved by a
   single batched argmax over the penalised logits, in two levels (`first_argmax`: the
   maxima of blocks of 1,024 positions, then the one block that holds the row's maximum):
   ``torch.argmax``'s answer, at a ninth of its time over 32 x 49,152 logits.
5. **Sampling rows**: divide by temperature; rows with any truncation (``top_k``,
   ``top_p``, ``min_p``) compute all three masks in descending order (top-k by position, so
   it is exact under ties; top-p keeps the smallest prefix whose mass reaches ``top_p``,
   always at least one token; min-p drops tokens below ``min_p * p_max``). Each kept set is a
   prefix of that order, so the row is first cut to its top 256 tokens (``torch.topk``), then
   4,096, and sorted whole only when the kept set reaches past those (`_truncate`). Rows
   without truncation take the full softmax and no ordering at all.
6. **Drawing** (`_draw`): the cumulative sum of each row's probabilities (float64) inverted at
   a uniform number -- one batched ``torch.rand`` on a module-level generator for unseeded
   rows. A row whose params carry a ``seed`` takes its number from its own
   ``torch.Generator`` kept in ``seq.engine_state`` (created and seeded on first use), so its
   token stream depends only on its seed and its own logits, never on which other rows share
   the batch. (``torch.multinomial`` and ``exponential_`` cost 30-35 ms for 32 rows of
   SmolLM2's 49,152-token vocabulary on the 2-core box, this about 4 ms.)

`processed_probs` exposes the distribution that step 6 draws from (one-hot for greedy
rows); tests use it to check that a sampled token always had nonzero probability.

``ignore_eos`` and stop conditions are the scheduler's business, not the sampler's.
"""

from __future__ import annotations

from typing import Any

import torch

from .penalties import apply_penalties
from .thinking import apply_budget
from ..scheduling.sequence import Sequence

__all__ = ["sample", "processed_probs", "first_argmax", "apply_penalties", "apply_constraints", "get_generator", "SampleResult"]

SampleResult = tuple[int, float | None, list[tuple[int, float]] | None]

_ARGMAX_BLOCK = 1024

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


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's ``argmax`` of ``x`` ``[B, V]``, as ``torch.argmax`` answers it (the first
    position of the maximum; a NaN counts as the largest, the first one), in two levels:
    ``amax`` over blocks of `_ARGMAX_BLOCK` positions (a vectorised reduction), the first block
    that holds the row's maximum, then the first position of it inside that block; the
    positions past the last whole block are compared last. ``torch.argmax`` over 32 x 49,152
    float32 logits took 1.36 ms on one thread of the 2-core AMD EPYC, this 0.15 ms."""
    B, V = x.shape
    nb = V // _ARGMAX_BLOCK
    if nb < 2 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    whole = nb * _ARGMAX_BLOCK
    blocks = x[:, :whole].view(B, nb, _ARGMAX_BLOCK)
    peaks = blocks.amax(dim=-1)                                   # [B, nb]
    bi = peaks.argmax(dim=-1)                                     # the first block of the maximum
    rows = torch.arange(B, device=x.device)
    pos = bi * _ARGMAX_BLOCK + blocks[rows, bi].argmax(dim=-1)
    if whole < V:                    # the rest: it wins only past the blocks' maximum
        rest, at = x[:, whole:].max(dim=-1)
        best = peaks[rows, bi]
        later = (rest > best) | (rest.isnan() & ~best.isnan())
        pos = torch.where(later, at + whole, pos)
    return pos


def _needs_truncation(seq: Sequence) -> bool:
    sp = seq.sampling
    return sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0


# Candidate widths tried in turn by `_truncate`: the top 256 tokens hold the kept set of nearly
# every real row; a flatter row (or a wide top_k) takes 4,096, and only what is left the full sort.
_WIDTHS = (256, 4096)


def _masks(values: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Top-k, top-p and min-p over the first ``W`` tokens of each row in descending order
    (`values`), the probabilities under ``lse`` (the log-normaliser of the row after top-k):
    the keep mask."""
    width = values.shape[1]
    keep = torch.arange(width, device=values.device) < k.unsqueeze(1)
    probs = torch.exp(values - lse.unsqueeze(1)).masked_fill_(~keep, 0.0)
    top_p = torch.tensor([s.sampling.top_p for s in seqs], dtype=probs.dtype, device=probs.device)
    # mass strictly before each position; a token is kept while that mass is below top_p,
    # so the first token always survives
    keep &= (torch.cumsum(probs, dim=-1) - probs) < top_p.unsqueeze(1)
    min_p = torch.tensor([s.sampling.min_p for s in seqs], dtype=probs.dtype, device=probs.device)
    keep &= probs >= (min_p * probs[:, 0]).unsqueeze(1)
    keep[:, 0] = True
    return keep


def _truncate(scaled: torch.Tensor, seqs: list[Sequence]
              ) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Top-k, top-p and min-p of each row (all three kept sets are prefixes of the row in
    descending order), without sorting the vocabulary when the kept set lies among the row's
    top `_WIDTHS` tokens: each width is tried on the rows the last one did not settle (a row is
    settled when its last candidate is dropped), the rest are sorted whole.

    Returns groups ``(rows, probs, order)``: renormalised probabilities of the kept tokens in
    descending order (0 past them) and the token id at each position, for those rows."""
    n, vocab = scaled.shape
    device = scaled.device
    k_all = torch.tensor([s.sampling.top_k if 0 < s.sampling.top_k < vocab else vocab for s in seqs],
                         device=device)
    groups: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    left = list(range(n))
    for width in (*(w for w in _WIDTHS if w < vocab), vocab):
        rows = torch.tensor(left, device=device)
        sub = scaled.index_select(0, rows)
        k = k_all.index_select(0, rows)
        if width < vocab:
            values, order = torch.topk(sub, width, dim=-1)
        else:
            values, order = torch.sort(sub, dim=-1, descending=True)
        inside = k <= width          # the top-k set is among the candidates: normalise over it
        lse = torch.logsumexp(values.masked_fill(torch.arange(width, device=device) >= k.unsqueeze(1),
                                                 float("-inf")), dim=-1)
        if not bool(inside.all()):
            lse = torch.where(inside, lse, torch.logsumexp(sub, dim=-1))
        row_seqs = [seqs[i] for i in left]
        keep = _masks(values, k, lse, row_seqs)
        done = (~keep[:, -1]) | (width == vocab)
        probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
        if bool(done.all()):
            groups.append((left, probs, order))
            break
        at = done.nonzero()[:, 0]
        if at.numel():
            groups.append(([left[i] for i in at.tolist()], probs.index_select(0, at), order.index_select(0, at)))
        left = [left[i] for i in (~done).nonzero()[:, 0].tolist()]
    return groups


def _plan(logits: torch.Tensor, seqs: list[Sequence]):
    """Shared front half of `sample` and `processed_probs`."""
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(f"logits must be [B, V] with B == len(seqs); got {tuple(logits.shape)} "
                         f"for {len(seqs)} sequences")
    raw = logits = logits.float()
    if any(s.sampling.logit_bias or s.grammar is not None or s.sampling.thinking_budget is not None
           or s.stop_ids_masked() for s in seqs):
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
    """``logit_bias``, the grammar masks, thinking budgets, then ``min_tokens``' mask of the
    ending ids (lifted for a row where it would leave nothing: a grammar that can only end), in
    place (module docstring, step 2)."""
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
    if any(s.sampling.thinking_budget is not None for s in seqs):
        apply_budget(logits, seqs)         # a spent thinking budget leaves only </think>
    for i, seq in enumerate(seqs):
        banned = seq.stop_ids_masked()     # min_tokens: no end before it ...
        if banned:
            idx = torch.tensor([t for t in banned if t < vocab], dtype=torch.long, device=logits.device)
            kept = logits[i, idx].clone()
            logits[i, idx] = float("-inf")
            if not bool(torch.isfinite(logits[i]).any()):
                logits[i, idx] = kept      # ... unless nothing else is allowed (a grammar at its end)


def _scaled(work: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> torch.Tensor:
    """`rows` of `work` over their temperatures: `work` itself when that is every row at
    temperature 1 (the callers do not write to it), no copy of the rows when it is every row."""
    t = [max(seqs[i].sampling.temperature, _MIN_TEMPERATURE) for i in rows]
    every = len(rows) == work.shape[0]
    if every and all(x == 1.0 for x in t):
        return work
    temps = torch.tensor(t, dtype=work.dtype, device=work.device).unsqueeze(1)
    return (work if every else work[rows]) / temps


def processed_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The ``[B, V]`` distribution each row is sampled from (one-hot for greedy rows)."""
    _, work, greedy, plain, trunc = _plan(logits, seqs)
    out = torch.zeros_like(work)
    if greedy:
        out[greedy, first_argmax(work[greedy])] = 1.0
    if plain:
        out[plain] = torch.softmax(_scaled(work, plain, seqs), dim=-1)
    if trunc:
        for rows, probs, order in _truncate(_scaled(work, trunc, seqs), [seqs[i] for i in trunc]):
            out[[trunc[j] for j in rows]] = torch.zeros(len(rows), work.shape[1]).scatter_(1, order, probs)
    return out


_DRAW_BLOCK = 1024      # `_draw` inverts per-block sums first, then one block's cumulative sum


def _draw(probs: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> list[int]:
    """Draw one position per row of ``probs`` by inverting its cumulative sum (float64) at a
    uniform number: one `torch.rand` for the unseeded rows (the module generator), one number
    from its own generator for each seeded row, so a seeded row's draws depend only on its seed
    and its own logits. A position of probability 0 is never drawn. Garbage in (NaN, all
    -inf logits) must not crash the step: such a row draws uniformly.

    In two levels, so no cumulative sum runs over the whole vocabulary (a float64 scan of 32 x
    49,152 was most of a sampled step's extra cost): the row's sums over blocks of
    `_DRAW_BLOCK` positions (a vectorised reduction) are inverted first, then the cumulative sum
    of the one block the number falls in."""
    B, V = probs.shape
    nb = -(-V // _DRAW_BLOCK)
    p = probs if nb * _DRAW_BLOCK == V else torch.nn.functional.pad(probs, (0, nb * _DRAW_BLOCK - V))
    blocks = p.view(B, nb, _DRAW_BLOCK).sum(-1).double()    # float32 sums: a float64 one was 2 ms
    total = blocks.sum(-1)
    dead = ~(total > 0) | ~torch.isfinite(total)
    if bool(dead.any()):
        p = p.clone()
        p[dead] = 0.0
        p[dead, :V] = 1.0
        blocks = p.view(B, nb, _DRAW_BLOCK).sum(-1).double()
    bcdf = blocks.cumsum(-1)
    total = bcdf[:, -1]
    u = torch.empty(len(rows), dtype=torch.float64, device=probs.device)
    unseeded = [j for j, i in enumerate(rows) if seqs[i].sampling.seed is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=probs.device,
                                 generator=_global_generator(probs.device))
    for j, i in enumerate(rows):
        if seqs[i].sampling.seed is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=get_generator(seqs[i], probs.device))[0]
    # below the total: the block found has a sum above zero, whatever u * total rounds to
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total))).unsqueeze(1)
    bi = torch.searchsorted(bcdf, target, right=True).clamp_(max=nb - 1)          # [B, 1]
    before = torch.where(bi > 0, bcdf.gather(1, (bi - 1).clamp_(min=0)), torch.zeros_like(target))
    inner = p.view(B, nb, _DRAW_BLOCK).gather(1, bi.unsqueeze(2).expand(B, 1, _DRAW_BLOCK))[:, 0]
    icdf = inner.cumsum(-1, dtype=torch.float64)
    at = torch.searchsorted(icdf, target - before, right=True)[:, 0]
    # the block's own sum and its scan may round apart: a number at or past the scan's end
    # takes the block's last position of non-zero probability
    past = at >= _DRAW_BLOCK
    if bool(past.any()):
        last = torch.where(inner > 0, torch.arange(_DRAW_BLOCK, device=p.device), -1).amax(-1)
        at = torch.where(past, last.clamp(min=0), at)
    return (bi[:, 0] * _DRAW_BLOCK + at).clamp_(max=V - 1).tolist()


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

    if greedy:          # every row greedy: no copy of the rows first (25 MB at 128 rows)
        rows = work if len(greedy) == len(seqs) else work[greedy]
        for i, t in zip(greedy, first_argmax(rows).tolist()):
            tokens[i] = t
    if plain:
        probs = torch.softmax(_scaled(work, plain, seqs), dim=-1)
        for i, t in zip(plain, _draw(probs, plain, seqs)):
            tokens[i] = t
    if trunc:
        trunc_seqs = [seqs[i] for i in trunc]
        for rows, probs, order in _truncate(_scaled(work, trunc, seqs), trunc_seqs):
            positions = torch.tensor(_draw(probs, rows, trunc_seqs), dtype=torch.long, device=order.device)
            picked = order.gather(1, positions.unsqueeze(1))[:, 0].tolist()
            for j, t in zip(rows, picked):
                tokens[trunc[j]] = t

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
