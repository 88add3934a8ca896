"""The scheduler's control handlers: pause, continue, flush and idle waits (thin: they call the
`PauseControl` part, `pause_control.py`, with the `PauseHooks` it may act through), and the
weights (`LoadWeights`, `SetWeightVersion`, `GetWeightsByName`).

* `LoadWeights` copies weights already read and checked off the loop (by the control actor)
  into the engine in place (`engine.weights.refit.apply_checked`) when no step is in flight and no
  request holds KV (else answers busy, and the control record waits for idle as a flush does).
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

`SchedulerControl` is a base of `SchedulerActor`; the state it reads (the `Queues` part, the
block manager, the step in flight) is the actor's. Guards ask the SCHEDULER table (`_can`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..messages import (
    AbortRequest, Continue, ControlResult, Flush, GetWeightsByName, LoadWeights, Pause, SetWeightVersion,
    WeightsApplied, WhenIdle,
)
from ..statemachines import PAUSED_MODE, SCHEDULER, STEP_IN_FLIGHT, SchedulerState
from .actor import handles
from .pause_control import PauseControl, PauseHooks
from .scheduler_lora import SchedulerLora



class SchedulerControl(SchedulerLora):
    # owned by SchedulerActor
    state: SchedulerState
    queues: Any             # its `Queues` (queues.py): `running`, `lane`, `seqs` below are the part's
    running: list[Any]
    lane: Any               # a `Lane`
    seqs: dict[str, Any]
    bm: Any
    pause_control: PauseControl   # pause, continue, flush, idle waits (pause_control.py)
    _pause_hooks: PauseHooks | None = None
    step_in_thread: bool
    runner: Any             # re-execution's step holder (steps then never reach the step thread)
    engine: Any
    _loading: tuple[LoadWeights, int, asyncio.Future[ControlResult]] | None = None  # a copy on the step thread
    weight_version: str     # the label of the weights steps run with (`SchedulerActor.__init__`)
    _label_before: str | None = None   # the label to put back if the queued copy fails
    # re-execution's holder of a weight copy (called like `runner`; None: the step thread or inline)
    load_runner: Any = None
    # and its `_abort(AbortRequest)`, `_tell(rid, message)`, `_cancel_window()`, `_settle()`, `_start_step()`

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

    # -- pause / continue / flush / idle: the PauseControl part ---------------------------------
    @property
    def pause_retractions(self) -> int:
        return self.pause_control.retractions

    @property
    def _ph(self) -> PauseHooks:
        """What the pause part may do here (built once: bound methods and the running list)."""
        h = self._pause_hooks
        if h is None:
            assert self.system is not None
            loop = self.system.loop
            h = self._pause_hooks = PauseHooks(
                can=self._can, fire=self.fire, paused_mode=lambda: self.paused_mode,
                in_flight=lambda: self.state in STEP_IN_FLIGHT, idle=lambda: self.idle,
                running=self.running, requeue=self.queues.requeue, free_kv=self.bm.free,
                flush_kv=lambda: self.bm.flush(),
                abort_all=lambda: len(self._abort(AbortRequest(abort_all=True))), tell=self._tell,
                close_window=self._close_window, drain_step=lambda: self._start_step(drain=True),
                settle=self._settle, future=loop.create_future, reply=self._reply)
        return h

    def _close_window(self) -> None:
        if self._can("window_closed"):
            self._cancel_window()
            self.fire("window_closed")

    @handles(Pause)
    def _pause(self, msg: Pause) -> Any:
        return self.pause_control.pause(msg.mode, self._ph)

    @handles(Continue)
    def _continue(self, msg: Continue) -> ControlResult:
        return self.pause_control.resume(self._ph)

    def _apply_pending_pause(self) -> None:
        self.pause_control.step_over(self._ph)

    @handles(Flush)
    def _flush(self, msg: Flush) -> ControlResult:
        return self.pause_control.flush(self._ph)

    @handles(WhenIdle)
    def _when_idle(self, msg: WhenIdle) -> Any:
        return self.pause_control.when_idle(self._ph)

    def _check_idle(self) -> None:
        self.pause_control.check_idle(self._ph)

    # -- weights -------------------------------------------------------------------------------
    @handles(LoadWeights)
    def _load_weights(self, msg: LoadWeights) -> Any:
        from ..engine.weights import refit
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
        from ..engine.weights import refit
        if self._loading is not None:
            return ControlResult(False, "the weights are being updated; ask again when the update is done")
        try:
            values = refit.weights_by_name(self.engine, msg.name, msg.truncate_size)
        except refit.WeightsMismatch as exc:
            return ControlResult(False, str(exc))
        return ControlResult(True, msg.name, {"values": values})

    def _answer_waiters(self, why: str) -> None:
        """Teardown: a pending pause, a weight copy or an idle wait will never happen."""
        if self._loading is not None and not self._loading[2].done():
            self._reply(self._loading[2], ControlResult(False, why))
        self._loading = None
        self.pause_control.teardown(why, self._ph)
