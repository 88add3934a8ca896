"""Pause, continue, flush and idle waits: the part of the scheduler that the control plane drives.

Every phase is a state of the SCHEDULER lifecycle (`statemachines.lifecycles`), fired on the
scheduler actor itself, so the diagram, the recording and the code agree:

* `Pause(mode)` with no step in flight goes ``idle | pending | windowing -> paused_<mode>`` at
  once. `abort` aborts everything in flight; `retract` frees all KV and puts running requests back
  at the front of the queue (recomputed on continue); `in_place` forms no new batch and keeps the
  KV. While paused in any mode new requests queue up.
* A pause that arrives while a step runs goes ``stepping -> pausing``: it takes effect at the
  step boundary (`_apply_pending_pause`, after the output stage has answered), and its reply
  waits for it. A `Continue` before then cancels it (``pausing -> stepping``).
* `Pause("wait")` (vLLM's ``/pause?mode=wait``) drains first: no request is admitted from the
  queue any more, the running ones go on stepping, each drain step ``pending -> pausing``
  (``drain_step``) so that the pause stays pending across steps, and when none is left running the
  pause applies as ``retract`` (nothing is left to retract: the queued requests stay queued and run
  on continue). Its reply waits for that.
* `Continue` goes ``paused_<mode> -> pending | idle``.
* `LoadWeights` copies weights already read and checked off the loop (by the control actor)
  into the engine in place (`engine.refit.apply_checked`) when no step is in flight and no
  request holds KV (else answers busy, and the control actor waits for idle as a flush does).
  It flushes the prefix cache first, then runs the copy where the steps run: on their worker
  thread, queued so that the next step starts after it (its outcome comes back to the scheduler
  as `WeightsApplied`), or inline when steps run inline. No forward mixes two weight versions
  and no KV of the old weights is reused. Requests waiting in the queue (a retract pause
  included) run later under the new weights.
* The weights' label (`weight_version`): every step takes the label current when it starts
  (`step_version`) and every token it yields carries it, so a request knows which weights made
  each of its tokens. `LoadWeights` with a `weight_version` relabels when the copy is queued
  (every later step runs after the copy; a copy that fails puts the old label back);
  `SetWeightVersion` (a rename) relabels the steps that start from then on. Each change is on
  the recording (a ``sched``/``weight_version`` note, between the steps it separates).
* `Flush` clears the prefix cache when no request holds KV and no step is in flight (requests
  that only wait in the queue hold none), else answers busy; waiting for
  idle is the control record's `waiting` state, not the scheduler's: the control actor asks
  `WhenIdle` and flushes again when the answer comes. `WhenIdle` is answered the moment the
  scheduler has no request and no step (a waiting flush, a drain).

`SchedulerControl` is the scheduler actor's base class; the state it reads (the `Queues` part,
the block manager, the step in flight) belongs to `SchedulerActor`. Its guards ask the
SCHEDULER table (`_can`): a pause is deferred where ``defer_pause`` leaves the state (a step or
an isolation in flight), refused as pending where ``cancel_pause`` does.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..messages import (
    AbortRequest, Continue, ControlResult, Flush, GetWeightsByName, LoadWeights, Pause, Paused, Resumed,
    Retracted, SetWeightVersion, WeightsApplied, WhenIdle,
)
from ..statemachines import PAUSE_MODES, PAUSED_MODE, SCHEDULER, STEP_IN_FLIGHT, SchedulerState
from .actor import handles
from .scheduler_lora import SchedulerLora



class SchedulerControl(SchedulerLora):
    # owned by SchedulerActor
    state: SchedulerState
    queues: Any             # its `Queues` (queues.py): `running`, `lane`, `seqs` below are the part's
    running: list[Any]
    lane: Any               # a `Lane`
    seqs: dict[str, Any]
    bm: Any
    _pending_pause: tuple[str, asyncio.Future[ControlResult]] | None
    _idle_waiters: list[asyncio.Future[bool]]
    pause_retractions = 0   # running requests retracted by pause(retract) (a counter, per instance)
    step_in_thread: bool
    runner: Any             # re-execution's step holder (steps then never reach the step thread)
    engine: Any
    _loading: tuple[LoadWeights, int, asyncio.Future[ControlResult]] | None = None  # a copy on the step thread
    weight_version: str     # the label of the weights steps run with (`SchedulerActor.__init__`)
    _label_before: str | None = None   # the label to put back if the queued copy fails
    # re-execution's holder of a weight copy (called like `runner`; None: the step thread or inline)
    load_runner: Any = None
    # and its `_abort(AbortRequest)`, `_tell(rid, message)`, `_cancel_window()`, `_settle()`

    def fire(self, event: str) -> None:
        rec = self.system.recorder if self.system is not None else None
        SCHEDULER.fire(self, event, observer=rec)

    def _can(self, event: str) -> bool:
        """Whether the lifecycle's table lets `event` leave the current state: the guard is
        the diagram's edge, not a list of states repeated here."""
        return SCHEDULER.can(self.state, event)

    @property
    def paused_mode(self) -> str | None:
        return PAUSED_MODE.get(self.state)

    @property
    def idle(self) -> bool:
        """No request and no step in flight (paused or not)."""
        return not self.seqs and self.state not in STEP_IN_FLIGHT

    # -- pause / continue ----------------------------------------------------------------------
    @handles(Pause)
    def _pause(self, msg: Pause) -> Any:
        if msg.mode not in PAUSE_MODES and msg.mode != "wait":
            return ControlResult(False, f"unknown pause mode {msg.mode!r}; use one of {PAUSE_MODES + ('wait',)}")
        if self.paused_mode is not None:
            return ControlResult(False, f"already paused ({self.paused_mode}); continue first")
        if self._can("cancel_pause"):
            return ControlResult(False, "a pause is already pending")
        if self._can("defer_pause"):  # a step is in flight: take effect at its boundary
            fut = asyncio.get_running_loop().create_future()
            self._pending_pause = (msg.mode, fut)
            self.fire("defer_pause")
            return fut
        if msg.mode == "wait" and self.running:   # between steps: drain from here
            if self._can("window_closed"):
                self._cancel_window()
                self.fire("window_closed")
            fut = asyncio.get_running_loop().create_future()
            self._pending_pause = (msg.mode, fut)
            self._drain_or_pause()
            return fut
        return self._apply_pause(msg.mode)

    def _drain_or_pause(self) -> None:
        """A wait pause at a step boundary (``pending``): step the running requests again,
        admitting none, or, with none left running, apply the pause."""
        assert self._pending_pause is not None
        if self.running and self._start_step(drain=True):
            return
        self._settle_pending_pause()

    def _settle_pending_pause(self) -> None:
        """Apply the pause that waited and answer whoever asked for it."""
        assert self._pending_pause is not None
        mode, fut = self._pending_pause
        self._pending_pause = None
        res = self._apply_pause(mode)
        if not fut.done():
            self._reply(fut, res)

    def _apply_pause(self, mode: str) -> ControlResult:
        asked = mode
        if mode == "wait":                 # drained: nothing runs; the queue waits for continue
            mode = "retract"
        if self._can("window_closed"):      # the window ends: nothing will be stepped now
            self._cancel_window()
            self.fire("window_closed")
        n = len(self.running)
        if mode == "abort":
            n = len(self._abort(AbortRequest(abort_all=True)))
        self.fire(f"pause_{mode}")
        if mode == "retract":
            self.pause_retractions += len(self.running)
            for seq in self.running:
                self.bm.free(seq)
                self._tell(seq.rid, Retracted(seq.rid, "pause"))
            self.queues.requeue(self.running)   # a probe back to the probe lane, the rest to theirs
            self.running.clear()
        elif mode == "in_place":  # a pooling forward has no paused state: it just is not stepped
            for seq in self.running:
                if seq.pooling is None:
                    self._tell(seq.rid, Paused(seq.rid))
        detail = {"mode": mode, "affected": n}
        if asked != mode:
            detail["asked"] = asked
        return ControlResult(True, f"paused ({asked})", detail)

    @handles(Continue)
    def _continue(self, msg: Continue) -> ControlResult:
        if self._can("cancel_pause"):  # not applied yet: cancel it, nothing to resume
            assert self._pending_pause is not None
            _, fut = self._pending_pause
            self._pending_pause = None
            self.fire("cancel_pause")
            if not fut.done():
                self._reply(fut, ControlResult(False, "pause cancelled by continue_generation"))
            return ControlResult(True, "continued (a pending pause was cancelled)", {"was": None})
        mode = self.paused_mode
        if mode is None:
            return ControlResult(True, "was not paused", {"was": None})
        self.fire("resume")
        if mode == "in_place":
            for seq in self.running:
                if seq.pooling is None:
                    self._tell(seq.rid, Resumed(seq.rid, seq.prefill_complete))
        self._settle()
        self._check_idle()
        return ControlResult(True, "continued", {"was": mode})

    def _apply_pending_pause(self) -> None:
        """The step is over (its outputs decided): a pause that waited for it applies now."""
        if self._pending_pause is not None:
            if self._pending_pause[0] == "wait":
                self._drain_or_pause()
            else:
                self._settle_pending_pause()

    # -- flush and idle ------------------------------------------------------------------------
    @handles(Flush)
    def _flush(self, msg: Flush) -> ControlResult:
        if self.paused_mode == "in_place":
            return ControlResult(False, "cannot flush while paused in_place: the KV is kept")
        if self.running or self.state in STEP_IN_FLIGHT:
            return ControlResult(False, f"engine busy: {len(self.running)} requests hold KV",
                                 {"busy": len(self.running)})
        n = self.bm.flush()          # queued requests hold no KV: they match prefixes when admitted
        return ControlResult(True, "prefix cache flushed", {"freed_blocks": n})

    # -- weights -------------------------------------------------------------------------------
    @handles(LoadWeights)
    def _load_weights(self, msg: LoadWeights) -> Any:
        from ..engine import refit
        if self.state in STEP_IN_FLIGHT or self.running:
            return ControlResult(False, f"engine busy: {len(self.running)} requests hold KV",
                                 {"busy": len(self.running)})
        if self._loading is not None:
            return ControlResult(False, "another weight load is being applied")
        freed = self.bm.flush()       # first: a request admitted meanwhile computes its KV after the copy
        # a stand-in engine (re-execution) applies its own way; a served model is copied into
        apply = getattr(self.engine, "apply_weights", None) or (lambda t: refit.apply_checked(self.engine, t))
        if self.load_runner is None and (not self.step_in_thread or self.runner is not None):
            try:
                n = apply(msg.tensors)
            except Exception as exc:
                return ControlResult(False, f"applying the weights failed: {type(exc).__name__}: {exc}")
            if msg.weight_version is not None:
                self._relabel(msg.weight_version, "load")
            return self._loaded(msg, n, freed)
        assert self.system is not None
        fut: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self._loading = (msg, freed, fut)
        if msg.weight_version is not None:   # every step from now on runs after the copy
            self._label_before = self.weight_version
            self._relabel(msg.weight_version, "load")
        if self.load_runner is not None:
            self.load_runner(self.ref, apply, msg.tensors, wrap=self._applied)
        else:
            self.system.pipe(self.system.call_on_step_thread(apply, msg.tensors),
                             self, off_loop=True, wrap=self._applied)
        return fut

    def _applied(self, n: Any, err: BaseException | None) -> WeightsApplied:
        """The copy came back from the step thread (on the loop, outside any turn): an input
        to the actors, on the recording like a step's end."""
        rec = self.system.recorder if self.system is not None else None
        if rec is not None:
            rec.input("weights_applied", data={"sched": self.name, "tensors": n or 0,
                                               "error": None if err is None else f"{type(err).__name__}: {err}"})
        return WeightsApplied(n or 0, err)

    @handles(WeightsApplied)
    def _weights_applied(self, msg: WeightsApplied) -> None:
        if self._loading is None:
            return
        load, freed, fut = self._loading
        self._loading = None
        before, self._label_before = self._label_before, None
        if msg.error is not None and before is not None:
            self._relabel(before, "load_failed")
        res = (self._loaded(load, msg.tensors, freed) if msg.error is None else
               ControlResult(False, f"applying the weights failed: {type(msg.error).__name__}: {msg.error}; "
                                      "the copy may have stopped part way: update again before serving on"))
        if not fut.done():
            self._reply(fut, res)

    def _loaded(self, msg: LoadWeights, n: int, freed: int) -> ControlResult:
        return ControlResult(True, f"loaded {n} tensors from {msg.model_path}; prefix cache flushed",
                             {"tensors": n, "freed_blocks": freed, "waiting": len(self.seqs)})

    @handles(SetWeightVersion)
    def _set_weight_version(self, msg: SetWeightVersion) -> None:
        self._relabel(msg.version, "rename")

    def _relabel(self, version: str, cause: str) -> None:
        """The steps that start from now on run with weights labelled `version`."""
        if version == self.weight_version:
            return
        self.weight_version = version
        rec = self.system.recorder if self.system is not None else None
        if rec is not None:
            rec.note("sched", "weight_version", data={"sched": self.name, "version": version, "cause": cause})

    @handles(GetWeightsByName)
    def _weights_by_name(self, msg: GetWeightsByName) -> ControlResult:
        from ..engine import refit
        if self._loading is not None:
            return ControlResult(False, "the weights are being updated; ask again when the update is done")
        try:
            values = refit.weights_by_name(self.engine, msg.name, msg.truncate_size)
        except refit.WeightsMismatch as exc:
            return ControlResult(False, str(exc))
        return ControlResult(True, msg.name, {"values": values})

    @handles(WhenIdle)
    def _when_idle(self, msg: WhenIdle) -> Any:
        if self.idle:
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        return fut

    def _check_idle(self) -> None:
        """Called wherever the last request may have left: answer who waits for idle."""
        if self._idle_waiters and self.idle:
            waiters, self._idle_waiters = self._idle_waiters, []
            for fut in waiters:
                if not fut.done():
                    self._reply(fut, True)

    def _answer_waiters(self, why: str) -> None:
        """Teardown: a pending pause or an idle wait will never happen."""
        if self._pending_pause is not None and not self._pending_pause[1].done():
            self._reply(self._pending_pause[1], ControlResult(False, why))
        self._pending_pause = None
        if self._loading is not None and not self._loading[2].done():
            self._reply(self._loading[2], ControlResult(False, why))
        self._loading = None
        for fut in self._idle_waiters:
            if not fut.done():
                self._reply(fut, False)
        self._idle_waiters = []
