"""The thinking budget: at most N tokens inside a reasoning model's ``<think>`` ... ``</think>``.

A request's `SamplingParams` carries ``thinking_budget`` (N), ``think_ids`` (the start and end
tags' token ids) and ``think_open`` (whether its output begins inside reasoning: the chat
template opened ``<think>`` in the prompt, or the format always starts there, DeepSeek-R1's).
`ThinkCounter` follows the sequence's output tokens: a start tag opens reasoning, an end tag
closes it, every token in between counts. Once N have been counted and reasoning is still open,
the sampler's constraint stage (`engine.sampling.sampling.apply_constraints`, after ``logit_bias`` and
the grammar mask) leaves only the end tag drawable: the model writes ``</think>`` itself, its
KV is computed like any other token's, and the answer follows. The count is a function of the
output tokens alone, so a retracted or paused sequence resumes with the same count, and a
recording re-executes from its tokens.

The budget is over the whole output (a second ``<think>`` block spends what is left). No torch
import here: the HTTP layer counts ``reasoning_tokens`` for ``usage`` with the same rule.

**A constraint after reasoning.** A request with ``grammar_after_think`` (a grammar on a
reasoning model) keeps its grammar out of the reasoning: `GrammarGate` follows the output
tokens through three states. ``think``: the output is inside reasoning (``think_open``, or
its first token was ``<think>``); the grammar neither masks nor advances, and the first
``</think>`` moves it to ``on``. ``maybe`` (only the first token of an output that did not
start inside reasoning): the grammar masks, but ``<think>`` stays drawable too; drawing it
moves to ``think``, any other token (the grammar advances by it) to ``on``. ``on``: the
grammar constrains every token, exactly as without reasoning. Only a ``</think>`` ends the
reasoning (not a ``<tool_call>``: the text split in ``http.openai.reasoning`` follows the same rule).
Like the count, the state is a function of the output tokens alone, so it is exact under
pause, retract and recompute, and a recording re-executes from its params. Once the grammar
is ``on`` the budget no longer applies: what follows ``</think>`` belongs to the grammar.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["ThinkCounter", "count_reasoning", "apply_budget", "over_budget", "GrammarGate", "gate_state",
           "THINK", "MAYBE", "ON"]

THINK, MAYBE, ON = "think", "maybe", "on"


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


class GrammarGate:
    """Whether a reasoning model's grammar applies yet (module docstring: think, maybe, on)."""

    __slots__ = ("start", "end", "state", "seen")

    def __init__(self, start: int, end: int, open_: bool) -> None:
        self.start, self.end = start, end
        self.state = THINK if open_ else MAYBE
        self.seen = 0

    def feed(self, ids: Iterable[int]) -> "GrammarGate":
        for t in ids:
            self.seen += 1
            if self.state == MAYBE:
                self.state = THINK if t == self.start else ON
            elif self.state == THINK and t == self.end:
                self.state = ON
        return self


def gate_state(seq: Any) -> str:
    """Where `seq`'s grammar stands before its next token: ``on`` for a request whose grammar is
    not gated; else its `GrammarGate` (kept on ``seq.think_gate``) brought up to its output."""
    sp = seq.sampling
    if not sp.grammar_after_think or sp.think_ids is None:
        return ON
    g = seq.think_gate
    if g is None or g.seen > len(seq.output_ids):
        g = seq.think_gate = GrammarGate(*sp.think_ids, sp.think_open)
    if g.seen < len(seq.output_ids):
        g.feed(seq.output_ids[g.seen:])
    return g.state


def grammar_takes(seq: Any, token: int) -> bool:
    """Does `seq`'s grammar advance by `token`, its next output token? (Not inside reasoning,
    not the ``<think>`` that opens it, not the ``</think>`` that closes it.)"""
    state = gate_state(seq)
    return state == ON or (state == MAYBE and token != seq.sampling.think_ids[0])


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
    if sp.grammar_after_think and gate_state(seq) == ON:
        return None                       # after reasoning, the answer is the grammar's
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
