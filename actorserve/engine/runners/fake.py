"""A fake engine for tests and the lifecycle benchmark: same interface, no model.

Deterministic: the next token of a sequence is a function of its last tokens, so two runs
with the same inputs produce the same outputs whatever the batch composition. It checks the
scheduler's contract on every step (block tables cover the tokens to compute, a sequence
appears once per step, no aborted sequence is stepped) and can inject faults: `fault(batch)`
runs at the start of every step, so a test can raise (a failing step) or block on an event
(a stalled step).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..scheduling.base import EngineInfo, SeqOutput, StepPreempted
from ..scheduling.sequence import Sequence
from ..scheduling.speculative import accepted


class ContractViolation(AssertionError):
    """The scheduler broke the engine interface's contract."""


class FakeEngine:
    verifies_drafts = True        # speculative steps (`engine.scheduling.speculative`) are understood
    def __init__(self, *, num_blocks: int = 1024, block_size: int = 4, max_model_len: int = 4096,
                 vocab_size: int = 1000, eos_token_id: int = 0,
                 fault: Callable[[list[tuple[Sequence, int]]], None] | None = None,
                 keep_history: bool = True, alphabet: int | None = None, loras: int = 0,
                 lora_gate: Any = None) -> None:
        self.info = EngineInfo("fake", block_size, num_blocks, max_model_len, (eos_token_id,), vocab_size)
        # With `alphabet`: the next token depends on the last two only, one of 1..alphabet (never
        # EOS), so outputs fall into loops: what n-gram speculation feeds on.
        self.alphabet = alphabet
        self.fault = fault
        self.keep_history = keep_history
        self.history: list[list[tuple[str, int]]] = []
        self.released: set[str] = set()
        self.steps = 0
        self.preempt = threading.Event()   # set: the next step is given up (`StepPreempted`)
        self.preempted = 0
        # LoRA adapters (`engine.runners.fake_lora`): with `loras` slots, a sequence's tokens under an
        # adapter are the base's shifted by its digest; None: no adapters (like the HF fallback)
        self.lora: Any = None
        if loras:
            from .fake_lora import FakeLoraSlots
            self.lora = FakeLoraSlots(loras, gate=lora_gate)

    @staticmethod
    def next_token(token_ids: list[int], vocab_size: int) -> int:
        a = token_ids[-1] if token_ids else 0
        b = token_ids[-2] if len(token_ids) > 1 else 7
        return 1 + (a * 31 + b * 17 + len(token_ids)) % (vocab_size - 1)  # never 0 (eos)

    def token_after(self, token_ids: list[int]) -> int:
        """This engine's next token after `token_ids` (`next_token`, or the looping variant)."""
        if self.alphabet is None:
            return self.next_token(token_ids, self.info.vocab_size)
        a = token_ids[-1] if token_ids else 0
        b = token_ids[-2] if len(token_ids) > 1 else 7
        return 1 + (a * 31 + b * 17) % self.alphabet

    def _next_of(self, seq: Sequence) -> int:
        """`token_after(seq.token_ids())`, read from the sequence's last two ids without
        copying its whole context each step."""
        out, prompt = seq.output_ids, seq.prompt_ids
        tail = out[-2:] if len(out) >= 2 else (prompt[-2:] + out)[-2:]
        if len(prompt) + len(out) > len(tail):
            return self.token_after_tail(tail, len(prompt) + len(out))
        return self.token_after(tail)

    def token_after_tail(self, tail: list[int], n: int) -> int:
        """`token_after` of a context of `n` ids that ends in the two ids `tail`."""
        a, b = tail[-1], tail[-2]
        if self.alphabet is None:
            return 1 + (a * 31 + b * 17 + n) % (self.info.vocab_size - 1)
        return 1 + (a * 31 + b * 17) % self.alphabet

    def execute(self, batch: list[tuple[Sequence, int]]) -> list[SeqOutput]:
        self.steps += 1
        if self.preempt.is_set():         # as the runner does at its first layer boundary
            self.preempted += 1
            raise StepPreempted(f"step {self.steps}")
        if self.fault is not None:
            self.fault(batch)
        seen: set[str] = set()
        outs: list[SeqOutput] = []
        bs = self.info.block_size
        released = self.released
        for seq, n in batch:
            rid = seq.rid
            if rid in seen:
                raise ContractViolation(f"{rid} twice in one step")
            seen.add(rid)
            if rid in released:
                raise ContractViolation(f"{rid} stepped after release")
            done, total, draft = seq.num_computed, len(seq.prompt_ids) + len(seq.output_ids), seq.draft
            if n < 1 or done + n > total + len(draft):
                raise ContractViolation(f"{rid}: bad chunk {n} at {done}/{total}")
            if draft and (seq.pooling is not None or done + n != total + len(draft)):
                raise ContractViolation(f"{rid}: drafts on a step that does not verify them all")
            if len(seq.block_table) * bs < done + n:
                raise ContractViolation(f"{rid}: block table too short")
            if draft:
                outs.append(self._verify(seq))
            elif done + n < total:
                outs.append(SeqOutput(seq))
            elif seq.pooling is not None:
                ids = seq.prompt_ids
                outs.append(SeqOutput(seq, pooled=[float(len(ids)), float(sum(ids) % 97)]))
            else:
                tok = self._next_of(seq)
                outs.append(SeqOutput(seq, tok if seq.lora is None else self._under_lora(seq, tok)))
        if self.keep_history:
            self.history.append([(s.rid, n) for s, n in batch])
        return outs

    def _under_lora(self, seq: Sequence, tok: int) -> int:
        """The token under the sequence's adapter (its slot checked, as the runner does)."""
        if seq.lora is None:
            return tok
        if self.lora is None:
            raise ValueError(f"{seq.rid}: LoRA adapter {seq.lora.name!r} on an engine without adapters")
        shift = self.lora.shift(self.lora.resolve(seq.lora), self.info.vocab_size)
        return 1 + (tok - 1 + shift) % (self.info.vocab_size - 1)

    def _verify(self, seq: Sequence) -> SeqOutput:
        """A speculative step: the token after the context and after each draft prefix, the
        drafts accepted while they match (as the real runner does)."""
        ctx = seq.token_ids()
        picks = [self._under_lora(seq, self.token_after(ctx + seq.draft[:j])) for j in range(len(seq.draft) + 1)]
        a = accepted(seq.draft, picks)
        out = SeqOutput(seq, token_id=picks[0])
        out.extra = [SeqOutput(seq, token_id=t) for t in picks[1:a + 1]]
        return out

    def release(self, seq: Sequence) -> None:
        self.released.add(seq.rid)


class FakeDetokenizer:
    """Token i reads as ``<i>``; knows stop strings, like the real incremental detokenizer."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop = stop
        self.text = ""
        self.stopped: str | None = None

    def add(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        delta = "".join(f"<{t}>" for t in token_ids)
        before = len(self.text)
        self.text += delta
        for s in self.stop:
            at = self.text.find(s)
            if at >= 0:
                self.stopped = s
                self.text = self.text[:at]
                return self.text[before:] if at > before else ""
        return delta

    def finish(self) -> str:
        return ""


def fake_tokens(text: str) -> list[int]:
    """A toy tokenizer for tests: one token per character."""
    return [1 + (ord(c) % 997) for c in text] or [1]


__all__: list[Any] = ["FakeEngine", "FakeDetokenizer", "ContractViolation", "fake_tokens"]
