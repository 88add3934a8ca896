"""The output stage: where a step's tokens become text, and a stop string ends a request.

SGLang splits its server into a tokenizer manager, a scheduler and a detokenizer manager; this
actor is the third. After every model step the scheduler sends it one batched `StepOutputs`
(asked, not told) and plans nothing until the answer is back, so:

* each member's token is detokenized here (an `IncrementalDetokenizer` per request, kept from
  `Track` to the request's end), and its stable text delta goes to the request actor in a
  `TokenOut`;
* stop strings are recognised here; a request that hit one finishes with ``stop`` and its rid is
  in the answer (`OutputsDone.stopped`), so the scheduler frees its KV *before* it plans the next
  step: no forward is spent on a request that has already ended;
* every other finish (EOS, stop ids, a grammar's end, the length limits) was decided before
  the item left the scheduler (`step_outputs.decide`) and passes through on it; the request's
  last `TokenOut` carries the whole remaining text (what the detokenizer held back);
* the answer also says how many tokens of business traffic were output, which is what the
  scheduler counts as generated (a speculative step's tokens past a stop string never are);
* a request that ended on ``stop`` says what matched (``TokenOut.matched``, SGLang's
  ``matched_stop``): the stop token id when the scheduler ended it (EOS, ``stop_token_ids``, a
  grammar's end), else the stop string. As in SGLang and vLLM, the stop token's own text is
  not part of the output unless the detokenizer keeps stops (``include_stop``: SGLang's
  ``no_stop_trim``, vLLM's ``include_stop_str_in_output``).

A generation request's `Aborted` / `Failed` also come through here (the scheduler sends them to
the stage, not to the actor): they are ordered after any `TokenOut` of the same request, and they
carry the text the detokenizer still held, so a client that is cut off keeps its partial text.

This is also where grammar-constrained sampling state and tool-call parsers will live: they
advance per token, next to the detokenizer, and may end a request the same way a stop string does.
"""

from __future__ import annotations

from typing import Any

from ..messages import Aborted, Failed, Forget, OutputsDone, StepOutputs, Track
from .actor import Actor, ActorRef, handles


class _Tracked:
    __slots__ = ("actor", "detok", "tokens")

    def __init__(self, actor: ActorRef, detok: Any) -> None:
        self.actor = actor           # the request actor's ref
        self.detok = detok
        self.tokens = 0          # tokens of this request seen here


class OutputStage(Actor):
    mailbox_capacity = 1 << 16

    def __init__(self, *, name: str = "output") -> None:
        super().__init__(name)
        self.tracked: dict[str, _Tracked] = {}
        self.tokens = 0                  # tokens detokenized (for the stats)
        self.stop_strings = 0            # requests this stage finished on a stop string

    @handles(Track)
    def _track(self, msg: Track) -> None:
        self.tracked[msg.rid] = _Tracked(msg.ref, msg.detokenizer)

    @handles(Forget)
    def _forget(self, msg: Forget) -> None:
        self.tracked.pop(msg.rid, None)

    @handles(StepOutputs)
    def _step(self, msg: StepOutputs) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        """Answers (rids finished on a stop string, rids whose output failed here, how many
        tokens of business traffic it output: the scheduler's count of generated tokens, which
        leaves out a speculative step's tokens past a stop string, never output). A
        detokenizer that raises fails its own request only."""
        stopped: list[str] = []
        failed: list[str] = []
        output = 0
        rec = self.system.recorder if self.system is not None else None
        tracked = self.tracked
        for item in msg.items:
            t = tracked.get(item.rid)
            if t is None:
                continue           # aborted or released while its step ran, or ended just now
            try:
                text, finish, matched = self._detokenize(t, item, rec)
            except Exception as exc:
                del tracked[item.rid]
                failed.append(item.rid)
                if t.actor.alive:
                    t.actor.tell(Failed(item.rid, f"output stage failed on its token: "
                                                  f"{type(exc).__name__}: {exc}"))
                continue
            if finish is not None:
                del tracked[item.rid]
                if item.finish_reason is None:
                    stopped.append(item.rid)
            output += not item.probe
            # the same message goes on to the request actor, with its text and finish filled in
            item.text, item.finish_reason, item.matched = text, finish, matched
            t.actor.tell_if_alive(item)
        return tuple(stopped), tuple(failed), output

    def _detokenize(self, t: _Tracked, item: Any, rec: Any) -> tuple[str, str | None, int | str | None]:
        """(stable text, finish reason, what matched a ``stop``)."""
        detok = t.detok
        finish = item.finish_reason
        self.tokens += 1
        t.tokens += 1
        matched: int | str | None = item.token_id if finish == "stop" else None
        if detok is None:
            return "", finish, matched
        # a stop token's text is trimmed, unless stops are kept
        keep = matched is None or getattr(detok, "include_stop", False)
        text = detok.add((item.token_id,)) if keep else ""
        if finish is None and detok.stopped:
            finish, matched = "stop", detok.stopped
            self.stop_strings += 1
            if rec is not None:    # the detokenizer's verdict, at its n-th token: re-execution plays it back
                rec.note("detok", "stop_string", rid=item.rid, data={"at": t.tokens})
        if finish is not None:
            text += detok.finish()
        return text, finish, matched

    def _ending(self, msg: Aborted | Failed) -> None:
        t = self.tracked.pop(msg.rid, None)
        if t is None:
            return                 # never tracked, or ended already: the actor knows
        tail = t.detok.finish() if t.detok is not None else ""
        if t.actor.alive:
            if isinstance(msg, Aborted):
                t.actor.tell(Aborted(msg.rid, msg.reason, tail))
            else:
                t.actor.tell(Failed(msg.rid, msg.error, tail))

    @handles(Aborted)
    def _aborted(self, msg: Aborted) -> None:
        self._ending(msg)

    @handles(Failed)
    def _failed(self, msg: Failed) -> None:
        self._ending(msg)

    def on_stop(self) -> None:
        """Every request still tracked ends ``aborted`` with the text its detokenizer held."""
        for rid, t in list(self.tracked.items()):
            tail = t.detok.finish() if t.detok is not None else ""
            t.actor.tell_if_alive(Aborted(rid, "server shutting down", tail))
        self.tracked.clear()


def outputs_done(step: int):  # type: ignore[no-untyped-def]
    """How the scheduler wraps the stage's answer (a pipe's `wrap`)."""
    def wrap(res: Any, err: BaseException | None) -> OutputsDone:
        stopped, failed, output = res if res is not None else ((), (), 0)
        return OutputsDone(step, stopped, failed, err, output)
    return wrap
