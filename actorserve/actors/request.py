"""Request actors: one per request, each the model of its kind's lifecycle machine.

The actor *is* the machine's model: its `state` slot is written only by
`Lifecycle.fire`, inside a handler, so every change is a recorded transition caused by a
recorded message. Generation and pooling actors share the abort / fail / stream plumbing
and differ in the path between `queued` and `done`:

    generation  Scheduled -> schedule; PrefillProgress -> prefill_chunk;
                TokenOut (from the output stage, already text) -> first_token; the last one
                -> finish (``detok``); Delivered -> deliver (``done``)
    pooling     Scheduled -> schedule; PrefillProgress -> forward_chunk;
                PoolOut -> forward_done (``pool``), the pooling head; Delivered -> deliver

Outputs go to the client through an `OutputStream` (a one-consumer async queue that never
blocks the actor). The request is ``done`` when its client has taken the final output off the
stream: the stream tells the runtime, which tells the actor `Delivered`. So ``detok`` (and
``pool``) last from the moment the result is known until the client has it, and a client that
leaves before then aborts a request that is still live. When the actor reaches a terminal state
it stops itself, so neither it nor its mailbox outlives the request. A request actor stopped
from outside before its end (the server shutting down) ends ``aborted`` in its own teardown.

A request actor holds refs only (its scheduler's, its session's); it registers in the system's
request registry (`registry.py`) while it runs and publishes its state there on each transition.
"""

from __future__ import annotations

from typing import Any, Callable

from ..messages import (
    DEADLINE_EXCEEDED, Aborted, Delivered, Failed, Paused, PoolOut, PrefillProgress, QueueTimeout, Release,
    RequestOutput, Resumed, Retracted, Scheduled, SessionEnd, TokenOut,
)
from ..statemachines import GENERATION, POOLING, GenState, Lifecycle, PoolState
from .actor import Actor, ActorRef, handles
from .registry import RequestEntry
from .stream import OutputStream

#: the states in which a request's result is known and its client has not yet taken it: it is
#: in no scheduler any more, and the request registry lists it for an abort to find
DELIVERING = (GenState.detok, PoolState.pool)
_PREFILL = GenState.prefill


class RequestActor(Actor):
    """Shared plumbing: the lifecycle, the stream, abort and failure."""

    __slots__ = ("rid", "state", "scheduler", "stream", "is_probe", "prompt_tokens",
                 "cached_tokens", "t_arrival", "t_first", "t_done", "deadline", "on_deadline",
                 "_deadline_timer", "durations", "_t_entered", "queue_deadline", "_queue_timer",
                 "priority", "on_scheduled", "_entry")
    lifecycle: Lifecycle
    mailbox_capacity = 4096

    def __init__(self, rid: str, *, scheduler: ActorRef, prompt_tokens: int, is_probe: bool = False) -> None:
        super().__init__(f"req:{rid}")
        self.rid = rid
        self.state = self.lifecycle.initial
        self.scheduler = scheduler
        self.stream = OutputStream()
        self.is_probe = is_probe
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.t_arrival = 0.0
        self.t_first: float | None = None
        self.t_done: float | None = None
        self.deadline: float | None = None          # seconds after arrival (set by the runtime)
        self.on_deadline: Callable[[str], None] | None = None
        self._deadline_timer: Any = None
        self.queue_deadline: float | None = None    # --max-queue-time: seconds after arrival
        self._queue_timer: Any = None
        self.priority = 0                        # the request's scheduling priority
        # (ref, message): told once, when the scheduler first takes the request (a stored
        # response's `ResponseStarted`)
        self.on_scheduled: tuple[ActorRef, Any] | None = None
        self._entry: RequestEntry | None = None
        self.durations: dict[Any, float] = {}    # state -> seconds spent in it so far
        self._t_entered = 0.0                    # when the current state was entered

    # -- lifecycle -----------------------------------------------------------------------------
    def on_start(self) -> None:
        sysm = self.system
        assert sysm is not None
        self.t_arrival = self._t_entered = sysm.clock.now()
        self._entry = RequestEntry(self.ref, self.lifecycle.name, self.state, self.is_probe)
        sysm.requests.add(self.rid, self._entry)
        if sysm.recorder is not None:
            data = {"probe": True} if self.is_probe else {"priority": self.priority} if self.priority else None
            sysm.recorder.created(self.lifecycle, self, data)
        if self.deadline is not None and self.on_deadline is not None:
            rid, cb = self.rid, self.on_deadline
            self._deadline_timer = sysm.call_later(self.deadline, lambda: cb(rid), f"req:{rid}:deadline")
        if self.queue_deadline is not None:
            self._queue_timer = sysm.call_later(self.queue_deadline, self._queue_deadline_passed,
                                                f"req:{self.rid}:queue_deadline")

    def _queue_deadline_passed(self) -> None:
        """Still queued? The scheduler decides (it may have admitted the request meanwhile)."""
        self._queue_timer = None
        self.scheduler.tell_if_alive(QueueTimeout(self.rid))

    def _cancel_queue_timer(self) -> None:
        if self._queue_timer is not None:
            self._queue_timer.cancel()
            self._queue_timer = None

    def on_stop(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._cancel_queue_timer()
        if not self.terminal:        # stopped from outside (shutdown) before its end
            self._aborted(Aborted(self.rid, "server shutting down"))
        if self._entry is not None and self.system is not None:
            self.system.requests.remove(self.rid, self._entry)

    def fire(self, event: str) -> None:
        sysm = self.system
        src = self.state
        self.lifecycle.fire(self, event, observer=sysm.recorder if sysm is not None else None)
        if sysm is not None:         # the time in `src` ends with this transition
            now = sysm.clock.now()
            d = self.durations
            d[src] = d.get(src, 0.0) + (now - self._t_entered)
            self._t_entered = now
        entry = self._entry
        if entry is not None:        # publish the new state in the registry
            dst = entry.state = self.state
            if dst in DELIVERING:
                sysm.requests.delivering[self.rid] = entry.ref   # type: ignore[union-attr]
            elif src in DELIVERING:
                sysm.requests.delivering.pop(self.rid, None)     # type: ignore[union-attr]

    @property
    def terminal(self) -> bool:
        return self.state in self.lifecycle.terminal

    def _final(self, item: RequestOutput) -> None:
        """Put the last output on the stream; the request ends when its client took it."""
        item.finished = True
        item.prompt_tokens = self.prompt_tokens
        item.cached_tokens = self.cached_tokens
        if not self.terminal:        # it has its result (detok, pool): its time per state
            item.timings = {state.name: t for state, t in self.durations.items()}
        self._fill_usage(item)
        self.stream.put(item)

    def _finish(self, item: RequestOutput) -> None:
        """Deliver the last output and stop at once (aborted, failed): the request is over."""
        self._final(item)
        self._stop()

    def _stop(self) -> None:
        assert self.system is not None
        self.t_done = self.system.clock.now()
        self.stop()

    @handles(Delivered)
    def _delivered(self, msg: Delivered) -> None:
        self.fire("deliver")
        self._stop()

    def _fill_usage(self, item: RequestOutput) -> None:
        pass

    # -- messages common to all kinds ----------------------------------------------------------
    @handles(Scheduled)
    def _scheduled(self, msg: Scheduled) -> None:
        self.cached_tokens = msg.cached_tokens
        self._cancel_queue_timer()            # admitted: the queue deadline is over
        self.fire("schedule")
        if self.on_scheduled is not None:
            (ref, note), self.on_scheduled = self.on_scheduled, None
            ref.tell_if_alive(note)

    @handles(Aborted)
    def _aborted(self, msg: Aborted) -> None:
        where = self.state.name          # the state it was caught in
        self.fire("abort")
        reason = "timeout" if msg.reason == DEADLINE_EXCEEDED else "abort"
        self._finish(RequestOutput(self.rid, text=msg.text, finish_reason=reason,
                                   error=None if msg.reason == "abort" else msg.reason, aborted_in=where))

    @handles(Failed)
    def _failed(self, msg: Failed) -> None:
        self.fire("fail")
        self._finish(RequestOutput(self.rid, text=msg.text, finish_reason="error", error=msg.error))

    def on_failure(self, message: Any, exc: BaseException) -> None:
        """A handler raised: this request fails with the reason; the runtime goes on."""
        super().on_failure(message, exc)
        if self.terminal or not self.alive:
            return
        error = f"internal error in {type(message).__name__} handler: {type(exc).__name__}: {exc}"
        try:
            self.fire("fail")
        finally:
            self.scheduler.tell_if_alive(Release(self.rid, "error"))
            self._finish(RequestOutput(self.rid, finish_reason="error", error=error))


class GenerationActor(RequestActor):
    __slots__ = ("want_logprobs", "completion_tokens", "session", "out_ids", "spec",
                 "_vdone", "_vcur", "_vstart", "_vend")
    lifecycle = GENERATION

    def __init__(self, rid: str, *, scheduler: ActorRef, prompt_tokens: int,
                 logprobs: bool = False, is_probe: bool = False,
                 session: tuple[ActorRef, str] | None = None) -> None:
        super().__init__(rid, scheduler=scheduler, prompt_tokens=prompt_tokens, is_probe=is_probe)
        self.want_logprobs = logprobs
        self.completion_tokens = 0
        # (session actor's ref, session id): told `SessionEnd` with the output ids when the request ends
        self.session = session
        self.out_ids: list[int] | None = [] if session is not None else None
        self.spec: tuple[int, int, int] | None = None    # (verify steps, drafts, accepted)
        # its tokens per weight version (`versions`): the spans closed so far, and the open one
        # (version, start, end), kept apart so that a token of the same version only moves `end`
        self._vdone: tuple[tuple[str, int, int], ...] = ()
        self._vcur: str | None = None
        self._vstart = self._vend = 0

    @property
    def versions(self) -> tuple[tuple[str, int, int], ...]:
        """Its tokens per weight version: ((version, start, end), ...), one span per run of tokens
        made by the same weights (a request retracted and resumed under new ones has two)."""
        cur = self._vcur
        return self._vdone if cur is None else self._vdone + ((cur, self._vstart, self._vend),)

    def _final(self, item: RequestOutput) -> None:
        if self.session is not None:
            ref, sid = self.session
            self.session = None
            ref.tell_if_alive(SessionEnd(sid, self.rid, tuple(self.out_ids or ()), item.finish_reason))
        super()._final(item)

    def _fill_usage(self, item: RequestOutput) -> None:
        item.completion_tokens = self.completion_tokens
        item.spec = self.spec
        item.weight_versions = self.versions

    def _version(self, version: str | None) -> None:
        """Token number `completion_tokens` (just counted) was made by weights `version`."""
        n = self.completion_tokens
        if version is None:            # made outside a scheduler step (tests): nothing to say
            return
        if version == self._vcur and self._vend == n - 1:
            self._vend = n
            return
        if self._vcur is not None:
            self._vdone += ((self._vcur, self._vstart, self._vend),)
        self._vcur, self._vstart, self._vend = version, n - 1, n

    @handles(PrefillProgress)
    def _progress(self, msg: PrefillProgress) -> None:
        self.fire("prefill_chunk")

    @handles(TokenOut)
    def _token(self, msg: TokenOut) -> None:
        if self.lifecycle.can(self.state, "first_token"):     # the first token: prefill is over
            self.fire("first_token")
        if self.t_first is None:
            assert self.system is not None
            self.t_first = self.system.clock.now()
        n = self.completion_tokens = self.completion_tokens + 1
        v = msg.weight_version
        if v is not None and v == self._vcur and self._vend == n - 1:
            self._vend = n                   # the open span goes on (the common case, inline)
        else:
            self._version(v)
        if msg.spec is not None:
            steps, drafts, accepted = self.spec or (0, 0, 0)
            self.spec = (steps + 1, drafts + msg.spec[0], accepted + msg.spec[1])
        if self.out_ids is not None:
            self.out_ids.append(msg.token_id)
        lp = (msg.token_id, msg.logprob, msg.top_logprobs, msg.ids_logprobs) if self.want_logprobs else None
        if msg.finish_reason is None:
            self.stream.put_token(msg.text, msg.token_id, lp, msg.prompt_logprobs,
                                  self._vdone, self._vcur, self._vstart, self._vend)
            return
        self.fire("finish")           # the last token is known: detok until the client has it
        self._final(RequestOutput(self.rid, text=msg.text, token_ids=[msg.token_id],
                                  logprobs=None if lp is None else [lp],
                                  finish_reason=msg.finish_reason, matched_stop=msg.matched,
                                  prompt_logprobs=msg.prompt_logprobs))

    @handles(Paused)
    def _paused(self, msg: Paused) -> None:
        self.fire("pause")

    @handles(Resumed)
    def _resumed(self, msg: Resumed) -> None:
        self.fire("resume_decode" if msg.prefill_complete else "resume_prefill")

    @handles(Retracted)
    def _retracted(self, msg: Retracted) -> None:
        self.fire("retract")


class PoolingActor(RequestActor):
    __slots__ = ("head",)
    lifecycle = POOLING

    def __init__(self, rid: str, *, scheduler: ActorRef, prompt_tokens: int,
                 head: Callable[[Any], Any] | None = None, is_probe: bool = False) -> None:
        super().__init__(rid, scheduler=scheduler, prompt_tokens=prompt_tokens, is_probe=is_probe)
        self.head = head          # the request's pooling head (from its PoolingParams)

    @handles(PrefillProgress)
    def _progress(self, msg: PrefillProgress) -> None:
        self.fire("forward_chunk")

    @handles(Retracted)
    def _retracted(self, msg: Retracted) -> None:
        self.fire("retract")

    @handles(PoolOut)
    def _pooled(self, msg: PoolOut) -> None:
        self.fire("forward_done")
        value = self.head(msg.pooled) if self.head is not None else msg.pooled
        self._final(RequestOutput(self.rid, pooled=value, finish_reason="stop"))
