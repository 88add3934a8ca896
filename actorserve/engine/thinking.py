"""The thinking budget: at most N tokens inside a reasoning model's ``<think>`` ... ``</think>``.

A request's `SamplingParams` carries ``thinking_budget`` (N), ``think_ids`` (the start and end
tags' token ids) and ``think_open`` (whether its output begins inside reasoning: the chat
template opened ``<think>`` in the prompt, or the format always starts there, DeepSeek-R1's).
`ThinkCounter` follows the sequence's output tokens: a start tag opens reasoning, an end tag
closes it, every token in between counts. Once N have been counted and reasoning is still open,
the sampler's constraint stage (`engine.sampling.apply_constraints`, after ``logit_bias`` and
the grammar mask) leaves only the end tag drawable: the model writes ``</think>`` itself, its
KV is computed like any other token's, and the answer follows. The count is a function of the
output tokens alone, so a retracted or paused sequence resumes with the same count, and a
recording re-executes from its tokens.

The budget is over the whole output (a second ``<think>`` block spends what is left). No torch
import here: the HTTP layer counts ``reasoning_tokens`` for ``usage`` with the same rule.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["ThinkCounter", "count_reasoning", "apply_budget", "over_budget"]


class ThinkCounter:
    """Reasoning tokens among a stream of output tokens (``start`` opens, ``end`` closes)."""

    __slots__ = ("start", "end", "open", "count", "seen")

    def __init__(self, start: int, end: int, open_: bool) -> None:
        self.start, self.end = start, end
        self.open = open_
        self.count = 0          # tokens inside reasoning so far (the tags themselves not counted)
        self.seen = 0           # output tokens fed

    def feed(self, ids: Iterable[int]) -> "ThinkCounter":
        for t in ids:
            self.seen += 1
            if t == self.start:           # opens reasoning (a repeated one is not counted)
                self.open = True
            elif t == self.end and self.open:
                self.open = False
            elif self.open:
                self.count += 1
        return self


def count_reasoning(ids: Iterable[int], start: int, end: int, open_: bool) -> int:
    """How many of the output tokens `ids` lie inside reasoning."""
    return ThinkCounter(start, end, open_).feed(ids).count


def _counter(seq: Any) -> ThinkCounter:
    """The sequence's counter (kept on ``seq.thinking``), brought up to its output."""
    sp = seq.sampling
    c = seq.thinking
    if c is None or c.seen > len(seq.output_ids):
        start, end = sp.think_ids
        c = seq.thinking = ThinkCounter(start, end, sp.think_open)
    if c.seen < len(seq.output_ids):
        c.feed(seq.output_ids[c.seen:])
    return c


def over_budget(seq: Any) -> int | None:
    """The token `seq` must draw next (its end tag) when its budget is spent, else None."""
    sp = seq.sampling
    if sp.thinking_budget is None or sp.think_ids is None:
        return None
    c = _counter(seq)
    return c.end if c.open and c.count >= sp.thinking_budget else None


def apply_budget(logits: Any, seqs: list[Any]) -> None:
    """In place on ``logits`` ``[B, V]``: each row whose budget is spent keeps only its end tag."""
    for i, seq in enumerate(seqs):
        end = over_budget(seq)
        if end is not None and end < logits.shape[-1]:
            keep = logits[i, end].clone()
            logits[i].fill_(float("-inf"))
            logits[i, end] = keep if bool(keep.isfinite()) else 0.0
