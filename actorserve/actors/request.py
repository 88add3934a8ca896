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
it stops itself, so neither it nor its mailbox outlives the request.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from ..messages import (
    DEADLINE_EXCEEDED, Aborted, Delivered, Failed, Paused, PoolOut, PrefillProgress, QueueTimeout, Release,
    RequestOutput, Resumed, Retracted, Scheduled, SessionEnd, TokenOut, merge_outputs,
)
from ..statemachines import GENERATION, POOLING, Lifecycle
from .actor import Actor, handles


class OutputStream:
    """What a request actor hands its client: deltas, then one item with `finished`.

    One consumer. `get` wakes on every item (a streaming client); `final` waits for the last
    one only and merges everything at once (a non-streaming client: one wake-up per request,
    not one per token).
    """

    __slots__ = ("_items", "_waiter", "_at_close", "closed", "on_final", "rid")

    def __init__(self, on_final: Callable[[str], None] | None = None, rid: str = "") -> None:
        self._items: list[RequestOutput] = []   # a handful of items: a list is 10x smaller than a deque
        self._waiter: asyncio.Future[None] | None = None
        self._at_close = False      # the waiter wants the last item only
        self.closed = False
        self.on_final = on_final    # called once with `rid`, when the consumer takes the final item
        self.rid = rid

    def put(self, item: RequestOutput) -> None:
        if self.closed:
            return
        self._items.append(item)
        if item.finished:
            self.closed = True
        w = self._waiter
        if w is not None and (self.closed or not self._at_close) and not w.done():
            w.set_result(None)

    async def _wait(self, at_close: bool) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        self._at_close = at_close
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def get(self) -> RequestOutput:
        while not self._items:
            await self._wait(False)
        return self.get_nowait()

    def get_nowait(self) -> RequestOutput:
        """The next item (IndexError if none); taking the final one tells `on_final`."""
        item = self._items.pop(0)
        if item.finished and self.on_final is not None:
            cb, self.on_final = self.on_final, None
            cb(self.rid)
        return item

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._items and self.closed:
            raise StopAsyncIteration
        return await self.get()

    async def final(self) -> RequestOutput:
        """Wait for the end and merge every item into one output (non-streaming clients)."""
        while not self.closed:
            await self._wait(True)
        items, self._items = self._items, []
        if not items:
            raise RuntimeError("the stream was already read to its end")
        last = items[-1]
        if self.on_final is not None and last.finished:
            cb, self.on_final = self.on_final, None
            cb(self.rid)
        return merge_outputs(items)


class RequestActor(Actor):
    """Shared plumbing: the lifecycle, the stream, abort and failure."""

    __slots__ = ("rid", "state", "scheduler", "stream", "is_probe", "prompt_tokens",
                 "cached_tokens", "t_arrival", "t_first", "t_done", "deadline", "on_deadline",
                 "_deadline_timer", "durations", "_t_entered", "queue_deadline", "_queue_timer",
                 "priority", "on_scheduled")
    lifecycle: Lifecycle
    mailbox_capacity = 4096

    def __init__(self, rid: str, *, scheduler: Actor, prompt_tokens: int, is_probe: bool = False) -> None:
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
        # (actor, message): told once, when the scheduler first takes the request (a stored
        # response's `ResponseStarted`)
        self.on_scheduled: tuple[Actor, Any] | None = None
        self.durations: dict[str, float] = {}    # state name -> seconds spent in it so far
        self._t_entered = 0.0                    # when the current state was entered

    # -- lifecycle -----------------------------------------------------------------------------
    def on_start(self) -> None:
        sysm = self.system
        assert sysm is not None
        self.t_arrival = self._t_entered = sysm.clock.now()
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
        if self.scheduler.alive:
            self.scheduler.tell(QueueTimeout(self.rid))

    def _cancel_queue_timer(self) -> None:
        if self._queue_timer is not None:
            self._queue_timer.cancel()
            self._queue_timer = None

    def on_stop(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._cancel_queue_timer()

    def fire(self, event: str) -> None:
        sysm = self.system
        src = self.state
        self.lifecycle.fire(self, event, observer=sysm.recorder if sysm is not None else None)
        if sysm is not None:         # the time in `src` ends with this transition
            now = sysm.clock.now()
            self.durations[src.name] = self.durations.get(src.name, 0.0) + (now - self._t_entered)
            self._t_entered = now

    @property
    def terminal(self) -> bool:
        return self.state in self.lifecycle.terminal

    def _final(self, item: RequestOutput) -> None:
        """Put the last output on the stream; the request ends when its client took it."""
        item.finished = True
        item.prompt_tokens = self.prompt_tokens
        item.cached_tokens = self.cached_tokens
        if not self.terminal:        # it has its result (detok, pool): its time per state
            item.timings = dict(self.durations)
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
            (actor, note), self.on_scheduled = self.on_scheduled, None
            if actor.alive:
                actor.tell(note)

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
            if self.scheduler.alive:
                self.scheduler.tell(Release(self.rid, "error"))
            self._finish(RequestOutput(self.rid, finish_reason="error", error=error))


class GenerationActor(RequestActor):
    __slots__ = ("want_logprobs", "completion_tokens", "session", "out_ids", "spec", "versions")
    lifecycle = GENERATION

    def __init__(self, rid: str, *, scheduler: Actor, prompt_tokens: int,
                 logprobs: bool = False, is_probe: bool = False,
                 session: tuple[Actor, str] | None = None) -> None:
        super().__init__(rid, scheduler=scheduler, prompt_tokens=prompt_tokens, is_probe=is_probe)
        self.want_logprobs = logprobs
        self.completion_tokens = 0
        # (session actor, session id): told `SessionEnd` with the output ids when the request ends
        self.session = session
        self.out_ids: list[int] | None = [] if session is not None else None
        self.spec: tuple[int, int, int] | None = None    # (verify steps, drafts, accepted)
        # its tokens per weight version: ((version, start, end), ...), one span per run of tokens
        # made by the same weights (a request retracted and resumed under new ones has two)
        self.versions: tuple[tuple[str, int, int], ...] = ()

    def _final(self, item: RequestOutput) -> None:
        if self.session is not None:
            actor, sid = self.session
            self.session = None
            if actor.alive:
                actor.tell(SessionEnd(sid, self.rid, tuple(self.out_ids or ()), item.finish_reason))
        super()._final(item)

    def _fill_usage(self, item: RequestOutput) -> None:
        item.completion_tokens = self.completion_tokens
        item.spec = self.spec
        item.weight_versions = self.versions

    def _version(self, version: str | None) -> None:
        """Token number `completion_tokens` (just counted) was made by weights `version`."""
        n, spans = self.completion_tokens, self.versions
        if version is None:            # made outside a scheduler step (tests): nothing to say
            return
        if spans and spans[-1][0] == version and spans[-1][2] == n - 1:
            self.versions = spans[:-1] + ((version, spans[-1][1], n),)
        else:
            self.versions = spans + ((version, n - 1, n),)

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
        self.completion_tokens += 1
        self._version(msg.weight_version)
        if msg.spec is not None:
            steps, drafts, accepted = self.spec or (0, 0, 0)
            self.spec = (steps + 1, drafts + msg.spec[0], accepted + msg.spec[1])
        if self.out_ids is not None:
            self.out_ids.append(msg.token_id)
        lp = [(msg.token_id, msg.logprob, msg.top_logprobs, msg.ids_logprobs)] if self.want_logprobs else None
        if msg.finish_reason is None:
            self.stream.put(RequestOutput(self.rid, text=msg.text, token_ids=[msg.token_id], logprobs=lp,
                                          prompt_logprobs=msg.prompt_logprobs, weight_versions=self.versions))
            return
        self.fire("finish")           # the last token is known: detok until the client has it
        self._final(RequestOutput(self.rid, text=msg.text, token_ids=[msg.token_id], logprobs=lp,
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

    def __init__(self, rid: str, *, scheduler: Actor, prompt_tokens: int,
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
