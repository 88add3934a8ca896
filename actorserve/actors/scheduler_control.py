"""Pause, continue and flush: the part of the scheduler actor that the control plane drives.

Pause modes: `abort` aborts everything in flight; `retract` frees all KV and puts running
requests back at the front of the queue (recomputed on continue); `in_place` forms no new
batch and keeps the KV. While paused in any mode new requests queue up; `Continue` resumes.

A pause that arrives while a step runs waits for the step boundary (`_apply_pending_pause`,
called by the scheduler when the step is back); a `Continue` before then cancels it. A flush
refused because requests are in flight may wait for idle (`_settle_flush`, called whenever the
scheduler's mailbox drains) until the control actor's `FlushTimeout`.

`SchedulerControl` is the scheduler actor's base class; the state it reads (queues, block
manager, in-flight step) belongs to `SchedulerActor`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from ..messages import (
    Abort, Continue, ControlResult, Flush, FlushTimeout, Pause, Paused, Resumed, Retracted,
)
from .actor import Actor, handles

PAUSE_MODES = ("abort", "retract", "in_place")


class SchedulerControl(Actor):
    # owned by SchedulerActor
    running: list[Any]
    lane: deque[Any]
    seqs: dict[str, Any]
    bm: Any
    inflight: dict[str, Any] | None
    paused_mode: str | None
    _pending_pause: tuple[str, asyncio.Future[ControlResult]] | None
    _flush_waiter: asyncio.Future[ControlResult] | None
    # and its `_abort(Abort)` and `_tell(rid, message)`

    @handles(Pause)
    def _pause(self, msg: Pause) -> Any:
        if msg.mode not in PAUSE_MODES:
            return ControlResult(False, f"unknown pause mode {msg.mode!r}; use one of {PAUSE_MODES}")
        if self.paused_mode is not None:
            return ControlResult(False, f"already paused ({self.paused_mode}); continue first")
        if self.inflight is not None:  # take effect at the step boundary
            if self._pending_pause is not None:
                return ControlResult(False, "a pause is already pending")
            fut = asyncio.get_running_loop().create_future()
            self._pending_pause = (msg.mode, fut)
            return fut
        return self._apply_pause(msg.mode)

    def _apply_pause(self, mode: str) -> ControlResult:
        self.paused_mode = mode
        n = len(self.running)
        if mode == "abort":
            n = self._abort(Abort(abort_all=True))
        elif mode == "retract":
            for seq in self.running:
                self.bm.free(seq)
                self._tell(seq.rid, Retracted(seq.rid))
            self.lane.extendleft(reversed(self.running))
            self.running.clear()
        else:  # a pooling forward has no paused state: it just is not stepped until continue
            for seq in self.running:
                if seq.pooling is None:
                    self._tell(seq.rid, Paused(seq.rid))
        return ControlResult(True, f"paused ({mode})", {"mode": mode, "affected": n})

    @handles(Continue)
    def _continue(self, msg: Continue) -> ControlResult:
        if self._pending_pause is not None:  # not applied yet: cancel it, nothing to resume
            _, fut = self._pending_pause
            self._pending_pause = None
            if not fut.done():
                self._reply(fut, ControlResult(False, "pause cancelled by continue_generation"))
            return ControlResult(True, "continued (a pending pause was cancelled)", {"was": None})
        mode, self.paused_mode = self.paused_mode, None
        if mode == "in_place":
            for seq in self.running:
                if seq.pooling is None:
                    self._tell(seq.rid, Resumed(seq.rid))
        return ControlResult(True, "continued" if mode else "was not paused", {"was": mode})

    @property
    def idle(self) -> bool:
        return not self.seqs and self.inflight is None

    @handles(Flush)
    def _flush(self, msg: Flush) -> Any:
        if self.paused_mode == "in_place":
            return ControlResult(False, "cannot flush while paused in_place: the KV is kept")
        if self.idle:
            return self._do_flush()
        if not msg.wait:
            return ControlResult(False, f"engine busy: {len(self.seqs)} requests in flight",
                                 {"busy": len(self.seqs)})
        fut = asyncio.get_running_loop().create_future()
        if self._flush_waiter is not None:
            self._reply(fut, ControlResult(False, "another flush is already waiting for idle"))
        else:
            self._flush_waiter = fut
        return fut

    @handles(FlushTimeout)
    def _flush_timeout(self, msg: FlushTimeout) -> None:
        w, self._flush_waiter = self._flush_waiter, None
        if w is not None and not w.done():
            self._reply(w, ControlResult(False, "timed out waiting for the engine to become idle",
                                         {"busy": len(self.seqs)}))

    def _do_flush(self) -> ControlResult:
        n = self.bm.flush()
        return ControlResult(True, "prefix cache flushed", {"freed_blocks": n})

    # -- hooks the scheduler calls -------------------------------------------------------------
    def _apply_pending_pause(self) -> None:
        """The step is back: a pause that waited for its boundary takes effect now."""
        if self._pending_pause is not None:
            mode, fut = self._pending_pause
            self._pending_pause = None
            res = self._apply_pause(mode)
            if not fut.done():
                self._reply(fut, res)

    def _settle_flush(self) -> None:
        """The mailbox drained with no step in flight: a waiting flush runs once idle."""
        if self._flush_waiter is not None and self.idle and self.paused_mode != "in_place":
            w, self._flush_waiter = self._flush_waiter, None
            if not w.done():
                self._reply(w, self._do_flush())

    def _answer_waiters(self, why: str) -> None:
        """Teardown: a waiting flush or pending pause will never happen."""
        for fut in (self._flush_waiter, self._pending_pause[1] if self._pending_pause else None):
            if fut is not None and not fut.done():
                self._reply(fut, ControlResult(False, why))
