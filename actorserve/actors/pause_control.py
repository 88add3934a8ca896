"""Pause, continue, flush and idle waits: one of the parts a scheduler is built from
(`SchedulerActor(pause_control=...)`), like `Queues`, `BatchWindow` and `Isolator`.

`PauseControl` holds what a pause needs besides the scheduler's state (the pause that waits for
a step boundary, who waits for idle, the count of requests a pause retracted) and acts on the
scheduler only through what it is handed (`PauseHooks`): the SCHEDULER machine's `can` and
`fire`, the `Queues` part's running list and requeue, the KV's free and flush, and a few of the
scheduler's own moves (abort all, close the window, a drain step, settle). The message handlers
(`Pause`, `Continue`, `Flush`, `WhenIdle`) stay on the actor (`scheduler_control`) and call it.

Every phase is a state of the SCHEDULER lifecycle, fired through the hooks:

* `Pause(mode)` with no step in flight goes ``idle | pending | windowing -> paused_<mode>`` at
  once. `abort` aborts everything in flight; `retract` frees all KV and puts running requests
  back at the front of their lanes (a probe to the probe lane), recomputed on continue;
  `in_place` forms no new batch and keeps the KV. While paused in any mode new requests queue.
* A pause that arrives while a step runs goes ``stepping -> pausing`` (``defer_pause``): it takes
  effect at the step boundary (`step_over`), and its reply waits for it. A `Continue` before
  then cancels it (``cancel_pause``).
* `Pause("wait")` (vLLM's ``/pause?mode=wait``) drains first: no request is admitted any more,
  the running ones go on stepping (each drain step ``pending -> pausing``, ``drain_step``), and
  when none is left running the pause applies as ``retract`` (the queued requests stay queued
  and run on continue). Its reply waits for that.
* `Continue` goes ``paused_<mode> -> pending | idle``.
* `Flush` clears the prefix cache when no request holds KV and no step is in flight (requests
  that only wait in the queue hold none), else answers busy; waiting for idle is the control
  record's ``waiting_idle`` state, not the scheduler's. `WhenIdle` is answered the moment the
  scheduler has no request and no step (a waiting flush, a weight load, a drain).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, NamedTuple

from ..messages import ControlResult, Paused, Resumed, Retracted
from ..statemachines import PAUSE_MODES


class PauseHooks(NamedTuple):
    """What pause control may read and do on its scheduler, and nothing more."""
    can: Callable[[str], bool]                 # does the SCHEDULER table let this event leave the state?
    fire: Callable[[str], None]                # an event of the scheduler's lifecycle
    paused_mode: Callable[[], str | None]      # the machine's paused_<mode>, or None
    in_flight: Callable[[], bool]              # a model step (or an isolation's re-run) is in flight
    idle: Callable[[], bool]                   # no request and no step
    running: list[Any]                         # the `Queues` part's running requests (they hold KV)
    requeue: Callable[[list[Any]], None]       # back to the front of their lanes (`Queues.requeue`)
    free_kv: Callable[[Any], None]             # free one request's blocks
    flush_kv: Callable[[], int]                # clear the prefix cache; answers the blocks freed
    abort_all: Callable[[], int]               # abort every request; answers how many
    tell: Callable[[str, Any], None]           # tell a request actor (by rid)
    close_window: Callable[[], None]           # an open batching window ends (``window_closed``)
    drain_step: Callable[[], bool]             # a step of the running requests only; did one start?
    settle: Callable[[], None]                 # no request left: ``pending -> idle``
    future: Callable[[], asyncio.Future[Any]]  # a reply that comes later
    reply: Callable[[asyncio.Future[Any], Any], None]


class PauseControl:
    __slots__ = ("pending", "idle_waiters", "retractions")

    def __init__(self) -> None:
        self.pending: tuple[str, asyncio.Future[ControlResult]] | None = None   # waits for a step boundary
        self.idle_waiters: list[asyncio.Future[bool]] = []
        self.retractions = 0        # running requests retracted by pause(retract)

    # -- pause / continue ----------------------------------------------------------------------
    def pause(self, mode: str, h: PauseHooks) -> ControlResult | asyncio.Future[ControlResult]:
        if mode not in PAUSE_MODES and mode != "wait":
            return ControlResult(False, f"unknown pause mode {mode!r}; use one of {PAUSE_MODES + ('wait',)}")
        if (paused := h.paused_mode()) is not None:
            return ControlResult(False, f"already paused ({paused}); continue first")
        if h.can("cancel_pause"):
            return ControlResult(False, "a pause is already pending")
        if h.can("defer_pause"):          # a step is in flight: take effect at its boundary
            fut = self.pending_reply(mode, h)
            h.fire("defer_pause")
            return fut
        if mode == "wait" and h.running:  # between steps: drain from here
            h.close_window()
            fut = self.pending_reply(mode, h)
            self._drain_or_pause(h)
            return fut
        return self._apply(mode, h)

    def pending_reply(self, mode: str, h: PauseHooks) -> asyncio.Future[ControlResult]:
        fut = h.future()
        self.pending = (mode, fut)
        return fut

    def resume(self, h: PauseHooks) -> ControlResult:
        """`Continue`: cancel a pause that waits for its step, or leave ``paused_<mode>``."""
        if h.can("cancel_pause"):          # not applied yet: cancel it, nothing to resume
            assert self.pending is not None
            _, fut = self.pending
            self.pending = None
            h.fire("cancel_pause")
            if not fut.done():
                h.reply(fut, ControlResult(False, "pause cancelled by continue_generation"))
            return ControlResult(True, "continued (a pending pause was cancelled)", {"was": None})
        mode = h.paused_mode()
        if mode is None:
            return ControlResult(True, "was not paused", {"was": None})
        h.fire("resume")
        if mode == "in_place":
            for seq in h.running:
                if seq.pooling is None:
                    h.tell(seq.rid, Resumed(seq.rid, seq.prefill_complete))
        h.settle()
        self.check_idle(h)
        return ControlResult(True, "continued", {"was": mode})

    def step_over(self, h: PauseHooks) -> None:
        """The step is over (its outputs decided): a pause that waited for it applies now."""
        if self.pending is not None:
            if self.pending[0] == "wait":
                self._drain_or_pause(h)
            else:
                self._settle_pending(h)

    def _drain_or_pause(self, h: PauseHooks) -> None:
        """A wait pause at a step boundary (``pending``): step the running requests again,
        admitting none, or, with none left running, apply the pause."""
        if h.running and h.drain_step():
            return
        self._settle_pending(h)

    def _settle_pending(self, h: PauseHooks) -> None:
        """Apply the pause that waited and answer whoever asked for it."""
        assert self.pending is not None
        mode, fut = self.pending
        self.pending = None
        res = self._apply(mode, h)
        if not fut.done():
            h.reply(fut, res)

    def _apply(self, mode: str, h: PauseHooks) -> ControlResult:
        asked = mode
        if mode == "wait":                 # drained: nothing runs; the queue waits for continue
            mode = "retract"
        h.close_window()                   # the window ends: nothing will be stepped now
        n = len(h.running)
        if mode == "abort":
            n = h.abort_all()
        h.fire(f"pause_{mode}")
        if mode == "retract":
            self.retractions += len(h.running)
            for seq in h.running:
                h.free_kv(seq)
                h.tell(seq.rid, Retracted(seq.rid, "pause"))
            h.requeue(list(h.running))     # a probe back to the probe lane, the rest to theirs
            h.running.clear()
        elif mode == "in_place":  # a pooling forward has no paused state: it just is not stepped
            for seq in h.running:
                if seq.pooling is None:
                    h.tell(seq.rid, Paused(seq.rid))
        detail = {"mode": mode, "affected": n}
        if asked != mode:
            detail["asked"] = asked
        return ControlResult(True, f"paused ({asked})", detail)

    # -- flush and idle ------------------------------------------------------------------------
    def flush(self, h: PauseHooks) -> ControlResult:
        if h.paused_mode() == "in_place":
            return ControlResult(False, "cannot flush while paused in_place: the KV is kept")
        if h.running or h.in_flight():
            return ControlResult(False, f"engine busy: {len(h.running)} requests hold KV",
                                 {"busy": len(h.running)})
        n = h.flush_kv()          # queued requests hold no KV: they match prefixes when admitted
        return ControlResult(True, "prefix cache flushed", {"freed_blocks": n})

    def when_idle(self, h: PauseHooks) -> bool | asyncio.Future[bool]:
        if h.idle():
            return True
        fut: asyncio.Future[bool] = h.future()
        self.idle_waiters.append(fut)
        return fut

    def check_idle(self, h: PauseHooks) -> None:
        """Called wherever the last request may have left: answer who waits for idle."""
        if self.idle_waiters and h.idle():
            waiters, self.idle_waiters = self.idle_waiters, []
            for fut in waiters:
                if not fut.done():
                    h.reply(fut, True)

    def teardown(self, why: str, h: PauseHooks) -> None:
        """The scheduler stops: a pending pause or an idle wait will never happen."""
        if self.pending is not None and not self.pending[1].done():
            h.reply(self.pending[1], ControlResult(False, why))
        self.pending = None
        for fut in self.idle_waiters:
            if not fut.done():
                h.reply(fut, False)
        self.idle_waiters = []
