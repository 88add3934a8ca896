"""Speculative decoding without a draft model: n-gram (prompt-lookup) proposals.

A request that decodes greedily often writes what its context already holds: a quoted passage,
a code span it edits, a list it repeats, the loop a small model falls into. The proposer looks
for the longest recent n-gram (``max_ngram`` down to ``min_ngram`` tokens) that ends the
sequence and occurred earlier in its prompt or output, and proposes the tokens that followed
that earlier occurrence (its latest one), up to ``k`` of them. The runner then computes the
sequence's last token and the ``k`` drafts in one step (a chunk of ``1 + k`` rows, the KV of
all of them written) and takes the model's own greedy choice at every row: the drafts are
accepted while they equal it, and the first row that disagrees gives the next token itself.
So a step yields ``1 + accepted`` tokens, every one the token plain greedy decoding would
have produced at that position; KV written for rejected drafts lies beyond ``num_computed``
and is overwritten by the next step.

Which requests speculate (`eligible`): greedy generation with nothing that reads the output
token by token while sampling: no penalties (they count the tokens before each position), no
grammar (its matcher advances token by token), no thinking budget (it counts the output
tokens before each position), nothing still short of its ``min_tokens`` (the ending ids are
masked by the count of tokens before the step). Logprobs, top logprobs, ``logit_bias``, stop
strings and stop tokens all work: each verified row is sampled like a plain decode row, and
the scheduler applies its verdicts token by token, dropping what follows a finish. A
non-greedy request decodes one token per step in the same batch.

Pure Python over token ids (no torch): `NgramIndex` lives on the sequence and is updated
incrementally (each new token adds ``max_ngram - min_ngram + 1`` dict entries), so proposing
costs O(1) per step however long the context is.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import Sequence

METHODS = ("ngram",)


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """How a scheduler speculates (part of `BatchConfig`, so recorded and re-executed)."""

    method: str | None = None      # None = off; "ngram"
    num_tokens: int = 4            # drafts proposed per step and sequence (at most)
    max_ngram: int = 3             # longest suffix looked up
    min_ngram: int = 1             # shortest suffix looked up
    max_batch: int = 8             # speculate only while at most this many sequences decode

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError(f"speculative num_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}")
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be >= 1, got {self.max_batch}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


def eligible(seq: Sequence) -> bool:
    """May this sequence's decode step carry drafts (module docstring)?"""
    sp = seq.sampling
    return (seq.pooling is None and not seq.is_probe and sp.greedy and sp.grammar is None
            and sp.thinking_budget is None
            and sp.repetition_penalty == 1.0 and sp.frequency_penalty == 0.0
            and sp.presence_penalty == 0.0 and len(seq.output_ids) >= sp.min_tokens)


class NgramIndex:
    """For each n-gram of the sequence's tokens (``min_n..max_n`` long) that has a token after
    it: the index of that token at its latest occurrence. Grown as the sequence grows."""

    __slots__ = ("min_n", "max_n", "table", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.table: dict[tuple[int, ...], int] = {}
        self.indexed = 0          # n-grams ending before this index are in the table

    def update(self, seq: Sequence) -> None:
        """Add the n-grams ending at ``indexed .. num_tokens - 2`` (each has a successor)."""
        end = seq.num_tokens - 1
        if self.indexed >= end:
            return
        lo = max(0, self.indexed - self.max_n + 1)
        toks = seq.token_slice(lo, end)           # the n-grams' tokens, not their successors
        table = self.table
        for e in range(self.indexed, end):
            j = e - lo                            # position of e in toks
            for n in range(self.min_n, self.max_n + 1):
                if j - n + 1 < 0:
                    break
                table[tuple(toks[j - n + 1:j + 1])] = e + 1
        self.indexed = end

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        found; [] if none."""
        if k <= 0:
            return []
        self.update(seq)
        total = seq.num_tokens
        tail = seq.token_slice(max(0, total - self.max_n), total)
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            at = self.table.get(tuple(tail[len(tail) - n:]))
            if at is not None:
                return seq.token_slice(at, min(at + k, total))
        return []


def propose(seq: Sequence, cfg: SpecConfig, k: int) -> list[int]:
    """The drafts for `seq`'s next step (at most `k`), its index made on first use."""
    index = seq.spec_index
    if index is None or index.min_n != cfg.min_ngram or index.max_n != cfg.max_ngram:
        index = seq.spec_index = NgramIndex(cfg.min_ngram, cfg.max_ngram)
    return index.propose(seq, k)


def accepted(draft: list[int], picks: list[int]) -> int:
    """How many drafts the model's own picks confirm: ``picks[j]`` is its token after the
    context plus ``draft[:j]``; the drafts count while they equal it."""
    a = 0
    while a < len(draft) and draft[a] == picks[a]:
        a += 1
    return a
