"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

A step computes the hidden state of every token it is given, but the LM head normally runs on
one row per member: the last, whose logits pick the next token. A sequence that asks for prompt
logprobs (``SamplingParams.prompt_logprobs``, from ``logprob_start_len`` on) also has the head
run on its prompt rows: row ``r`` scores prompt token ``r + 1``. So:

* each step scores the prompt rows it computes (`owed_rows`: a chunked prefill contributes its
  chunk's rows, step by step) and `score` keeps them on the sequence by token position
  (``seq.prompt_lp``), so a recompute after a retraction overwrites rather than appends;
* the step that samples the first token hands them over in order (`assemble`), with the first
  reported token unscored (None), as SGLang and vLLM report it;
* a row must be computed to be scored, so the prefix cache reuses KV only below
  ``logprob_start_len`` for such a sequence (`Sequence.prompt_logprob_from`, read by
  `BlockManager.match_prefix`): a warm cache gives the same numbers as a cold one. SGLang caps
  its radix-cache match the same way; vLLM skips the prefix cache for any request with prompt
  logprobs (the same rule at start 0). Other sequences keep the last-row-only path.

The distribution is the raw one, in float32: ``log_softmax`` of the model's logits, before any
bias, mask, penalty or temperature (the same as output logprobs, `engine.sampling.sampling`). Rows go
through the head in slices of `ROW_SLICE`, so a long prompt never holds a ``[T, V]`` tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..scheduling.base import PromptLogprobs
from ..scheduling.sequence import Sequence

ROW_SLICE = 256


def owed_rows(batch: list[tuple[Sequence, int]], last_rows: list[int]) -> list[tuple[Sequence, int, int, int]]:
    """For each member of a step that still owes prompt logprobs and computes some of their rows:
    ``(seq, first position, end position, flat row of the first position)``."""
    out = []
    for i, (seq, n) in enumerate(batch):
        start = seq.prompt_logprob_from
        if start is None or n <= 0:
            continue
        c0 = seq.num_computed
        lo, hi = max(c0, start), min(c0 + n, len(seq.prompt_ids) - 1)
        if lo < hi:
            out.append((seq, lo, hi, last_rows[i] - n + 1 + (lo - c0)))
    return out


def score_rows(owed: list[tuple[Sequence, int, int, int]],
               logits_of: Callable[[int, int], torch.Tensor]) -> None:
    """Score every owed row; ``logits_of(first_row, end_row)`` gives those flat rows' logits."""
    for seq, lo, hi, row in owed:
        for a in range(lo, hi, ROW_SLICE):
            b = min(a + ROW_SLICE, hi)
            score(seq, a, logits_of(row + a - lo, row + b - lo))


def score(seq: Sequence, pos: int, logits: torch.Tensor) -> None:
    """Keep the scores of prompt rows ``pos, pos + 1, ...`` (`logits` ``[m, V]``): row ``r``
    gives token ``r + 1`` its logprob, rank, top-k and requested ids."""
    sp = seq.sampling
    lp = torch.log_softmax(logits.float(), dim=-1)
    m = lp.shape[0]
    targets = torch.tensor(seq.prompt_ids[pos + 1:pos + 1 + m], dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, targets[:, None])
    ranks = (lp >= chosen).sum(dim=-1).tolist()
    k = min(sp.prompt_logprobs or 0, lp.shape[-1])
    tops: list[list[tuple[int, float]] | None] = [None] * m
    if k:
        top_v, top_i = lp.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    ids: list[list[tuple[int, float]] | None] = [None] * m
    if sp.token_ids_logprob:
        want = list(sp.token_ids_logprob)
        vals = lp[:, torch.tensor(want, dtype=torch.long, device=lp.device)].tolist()
        ids = [list(zip(want, v)) for v in vals]
    buf = seq.prompt_lp if seq.prompt_lp is not None else {}
    for j, value in enumerate(chosen[:, 0].tolist()):
        buf[pos + 1 + j] = (value, int(ranks[j]), tops[j], ids[j])
    seq.prompt_lp = buf


def assemble(seq: Sequence) -> PromptLogprobs:
    """The prompt logprobs of `seq` from its start position to the end of its prompt, in
    order; forgets what `score` kept. Raises if a position was never scored (a bug, and a
    failure of that request only)."""
    start = seq.prompt_logprob_from
    assert start is not None
    buf = seq.prompt_lp or {}
    seq.prompt_lp = None
    positions = range(start + 1, len(seq.prompt_ids))
    missing = [p for p in positions if p not in buf]
    if missing:
        raise RuntimeError(f"{seq.rid}: prompt logprobs of {len(missing)} positions were never "
                           f"computed (first {missing[0]})")
    rows = [buf[p] for p in positions]
    sp = seq.sampling
    return PromptLogprobs(
        start=start, token_ids=list(seq.prompt_ids[start:]),
        logprobs=[None] + [float(r[0]) for r in rows], ranks=[None] + [r[1] for r in rows],
        top=[None] + [r[2] for r in rows] if sp.prompt_logprobs else None,
        ids=[None] + [r[3] for r in rows] if sp.token_ids_logprob else None)


def ids_logprobs(logits: torch.Tensor, seqs: list[Sequence]) -> list[list[tuple[int, float]] | None]:
    """For each row of a step's sampling logits ``[B, V]``: the raw logprobs of its sequence's
    requested ids (``token_ids_logprob`` with ``logprobs``), else None."""
    out: list[list[tuple[int, float]] | None] = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        if sp.token_ids_logprob and sp.logprobs:
            want = list(sp.token_ids_logprob)
            lp = torch.log_softmax(logits[i].float(), dim=-1)
            out[i] = list(zip(want, lp[torch.tensor(want, dtype=torch.long, device=lp.device)].tolist()))
    return out
