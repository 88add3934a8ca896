"""Stand-ins for what re-execution cannot rerun: the model, the detokenizer and wall time.

* `ReplayEngine` has the recorded engine's geometry (`EngineInfo`: block size, KV blocks,
  context length, EOS ids) and answers each step with the tokens the real model gave each
  request, in order, with the engine's own verdicts (a constrained request's grammar ended,
  or refused a token): so a constrained run re-executes without the grammar. A prefill chunk answers nothing, a pooling request a placeholder value.
  A request asked for more tokens than were recorded (possible only after a divergence) gets a
  filler token that ends nothing, so the run goes on and the report can show where it differs.
* `ReplayDetokenizer` stops a request on a stop string after the same number of tokens as the
  recording says the real detokenizer did.
* `ReplayClock` is a `ManualClock` that the driver moves to each input's recorded time without
  firing timers: a timer fires only where the recording says it fired.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

from ..actors.clock import ManualClock
from ..engine.scheduling.base import EngineInfo, SeqOutput
from ..engine.scheduling.batching import BatchConfig
from ..engine.scheduling.sequence import Sequence


class ReplayClock(ManualClock):
    def set_time(self, t: float) -> None:
        """Move to `t` (never backwards) without firing anything."""
        if t > self._now:
            self._now = t

    def fire_labelled(self, label: str) -> bool:
        """Fire the pending timer the recording names (the clock a handler read may have lagged
        behind the live one, so deadlines alone could order two timers differently); False if
        no pending timer has that label."""
        due = [(when, n, timer) for when, n, timer in self._heap
               if not timer.cancelled and timer.label == label]
        if not due:
            return False
        when, _, timer = min(due, key=lambda h: (h[0], h[1]))
        timer.cancelled = True              # it fires now, and never again
        self.set_time(when)
        timer.fn()
        return True

    def fire_next(self) -> bool:
        """Fire the earliest pending timer, whatever its deadline; False if there is none."""
        while self._heap:
            when, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            self.set_time(when)
            timer.fn()
            return True
        return False


class PooledStandIn:
    """What a pooling step answers in re-execution: its value is not recorded, only that it
    came. Any index reads 0.0, so every pooling head (`engine.pooling.heads`) can run on it."""

    def __getitem__(self, i: Any) -> float:
        return 0.0

    def __len__(self) -> int:
        return 1

    def tolist(self) -> list[float]:
        return [0.0]


class ReplayEngine:
    """Plays back the recorded model answers, keyed by request id."""

    verifies_drafts = True        # speculative steps (`engine.scheduling.speculative`) are understood

    def __init__(self, info: dict[str, Any], tokens: dict[str, deque[Any]],
                 batch: dict[str, Any] | None = None) -> None:
        info = dict(info)
        info["eos_token_ids"] = tuple(info.get("eos_token_ids") or ())
        self.info = EngineInfo(**info)
        self.tokens = tokens
        self._batch = batch
        self.filler = next(t for t in range(1, self.info.vocab_size + 1) if t not in self.info.eos_token_ids)
        self.fillers = 0               # tokens made up because the recording had none left

    def batch_config(self) -> BatchConfig:
        """A pooling engine's own batch limits, as recorded."""
        return BatchConfig(**self._batch) if self._batch else BatchConfig()

    def execute(self, batch: list[tuple[Sequence, int]]) -> list[SeqOutput]:
        outs: list[SeqOutput] = []
        for seq, n in batch:
            if seq.num_computed + n < seq.num_tokens:
                outs.append(SeqOutput(seq))
            elif seq.pooling is not None:
                outs.append(SeqOutput(seq, pooled=PooledStandIn()))
            else:
                q = self.tokens.get(seq.rid)
                if q:
                    answer = q.popleft()
                    if isinstance(answer, tuple):     # a speculative step's tokens
                        outs.append(self._spec(seq, answer, q))
                    elif isinstance(answer, list):    # [token, the engine's verdict]
                        tok, verdict = answer
                        err = verdict.get("error") if isinstance(verdict, dict) else None
                        outs.append(SeqOutput(seq, token_id=tok, stop=verdict == "stop", error=err))
                    else:
                        outs.append(SeqOutput(seq, token_id=answer))
                else:
                    self.fillers += 1
                    outs.append(SeqOutput(seq, token_id=self.filler))
        return outs

    @staticmethod
    def _spec(seq: Sequence, tokens: tuple[int, ...], q: deque[Any]) -> SeqOutput:
        """A recorded speculative step's tokens: all of them for a step that verifies as many
        drafts; a step with fewer drafts (a what-if run) takes what it can, the rest stay queued."""
        take = 1 + min(len(seq.draft), len(tokens) - 1)
        q.extendleft(reversed(tokens[take:]))
        out = SeqOutput(seq, token_id=tokens[0])
        out.extra = [SeqOutput(seq, token_id=t) for t in tokens[1:take]]
        return out

    def release(self, seq: Sequence) -> None:
        pass

    def apply_weights(self, tensors: Any) -> int:
        """A weight update's copy (`LoadWeights`): the tokens are the recording's anyway; answers
        how many tensors the (reloaded or played-back) read had."""
        return len(tensors)


class ReplayDetokenizer:
    """Emits no text; reports a stop string after `stop_at` tokens when the recording had one."""

    def __init__(self, stop_at: int | None) -> None:
        self.stop_at = stop_at
        self.count = 0
        self.stopped: str | None = None

    def add(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.count += len(token_ids)
        if self.stop_at is not None and self.count >= self.stop_at:
            self.stopped = "<recorded stop string>"
        return ""

    def finish(self) -> str:
        return ""
