"""The served weights as a lifecycle: `/update_weights_from_disk`, `/update_weights_from_tensor`,
`/update_weight_version` and `/get_weights_by_name`, the control actor's part (`WeightsControl`, a base of `ControlActor`).

The weights are a `WeightsModel` walking the WEIGHTS lifecycle
(``serving -> updating -> serving``, or ``updating -> failed -> serving`` when the load fails
and the old weights go on serving; ``rename`` relabels the version). Its `version` is the
serving label; each change is on the recording (a ``weights_version`` note beside the
transition) and goes to the scheduler (`LoadWeights.weight_version`, `SetWeightVersion`), whose
steps stamp it on every token they make (a response's ``weight_versions``).

An update is a control record like a flush, in two phases. First the folder (or the sent
safetensors blobs, `engine.weights.refit_tensors`: any subset of the parameters) is read and checked
against the served model's names and shapes (`engine.weights.refit.read_checked`, disk I/O and CPU) on a
worker thread, off the event loop: requests go on being served meanwhile, and its outcome comes
back as a `WeightsRead` message (noted ``weights_read`` on the recording). A bad folder ends the
update there, nothing touched. ``abort_all_requests`` aborts every request when the update
starts (through the ordinary abort, so each ends ``abort`` with its partial output). Then the
scheduler is asked `LoadWeights` with the checked tensors, which it applies only between steps
with no request holding KV, on the thread the steps run on. The record is ``working`` while the
read runs, then ``asking``. While requests run the scheduler answers busy, and the record waits
(``busy``: ``waiting_idle``) for its idle answer and asks again (``retry``): the update is a
barrier, never a forward that mixes two versions. The load flushes the prefix cache, so no KV
of the old weights is reused.
"""

from __future__ import annotations

import time
from typing import Any

from ..messages import (
    AbortRequest, ControlResult, GetWeightsByName, LoadWeights, SetWeightVersion, UpdateWeightVersion,
    UpdateWeightsFromDisk, UpdateWeightsFromTensor, WeightsRead,
)
from ..statemachines import WEIGHTS, IllegalTransition, ServerState, WeightsState
from .actor import Actor, handles

WEIGHT_OPS = ("update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed")


class WeightsModel:
    __slots__ = ("rid", "state", "version", "updates", "last_error")

    def __init__(self, version: str = "default") -> None:
        self.rid = "weights"
        self.state = WEIGHTS.initial
        self.version = version
        self.updates = 0            # updates applied
        self.last_error = ""


class WeightsControl(Actor):
    # owned by ControlActor
    weights: WeightsModel
    scheduler: Any          # the generation scheduler's ActorRef
    engine: Any
    server: Any
    open: dict[str, Any]
    # re-execution's holder of an update's read, called (rid, msg, wrap); None: a worker thread
    weights_reader: Any = None
    # and its `pause_mode` (the scheduler's), `_new`, `_end`, `_fire`, `_ask`, `_await_idle`, `_abort`, `_rec`, `_memory_refusal` (memory_control)

    def _weights_fire(self, event: str) -> None:
        WEIGHTS.fire(self.weights, event, observer=self._rec)

    def _set_version(self, version: str, **data: Any) -> None:
        self.weights.version = version
        if self._rec is not None:
            self._rec.note("weights_version", "version", rid="weights", data={"version": version, **data})

    @handles(UpdateWeightsFromDisk, UpdateWeightsFromTensor)
    def _update(self, msg: UpdateWeightsFromDisk | UpdateWeightsFromTensor) -> Any:
        """A folder (`/update_weights_from_disk`) or named tensors (`/update_weights_from_tensor`,
        a subset allowed): the same two phases, only the read differs."""
        rec = self._new("update_weights_from_disk" if isinstance(msg, UpdateWeightsFromDisk)
                        else "update_weights_from_tensor")
        return self._begin_update(rec, msg)

    def _begin_update(self, rec: Any, msg: Any) -> Any:
        """Phase one for any update message (`weights_distributed` adds one): refused unless the
        weights serve and the server can reach a barrier; else read off the loop."""
        if self.weights.state is not WeightsState.serving:
            return self._end(rec, ControlResult(False, f"cannot update the weights while they are "
                                                       f"{self.weights.state.name}"))
        if (why := self._memory_refusal()) is not None:         # memory_control
            return self._end(rec, ControlResult(False, f"cannot update the weights: {why}"))
        if self.server.state in (ServerState.draining, ServerState.stopped):
            return self._end(rec, ControlResult(False, f"cannot update the weights while the server is "
                                                       f"{self.server.state.name}"))
        if self.pause_mode == "in_place":   # it would wait for a continue forever
            return self._end(rec, ControlResult(False, "cannot update the weights while paused in_place: "
                                                       "the parked requests hold KV of the old weights; "
                                                       "pause with abort or retract, or continue first"))
        self._weights_fire("update")
        rec.msg = msg
        if msg.abort_all:
            self._abort(AbortRequest(abort_all=True))      # its own record; reaches the scheduler first
        self._read_off_loop(rec, msg)
        return rec.reply

    def _read_update(self, engine: Any, msg: Any) -> dict[str, Any]:
        """On a worker thread: the update's tensors by name, checked against the served model."""
        from ..engine.weights import refit, refit_tensors
        if isinstance(msg, UpdateWeightsFromTensor):
            return refit_tensors.read_tensors_checked(engine, msg.blobs, msg.load_format)
        return refit.read_checked(engine, msg.model_path, msg.load_format)

    def _read_off_loop(self, rec: Any, msg: UpdateWeightsFromDisk | UpdateWeightsFromTensor) -> None:
        """Phase one: read and check the folder (or the sent tensors) on a worker thread (not
        the step thread: steps go on meanwhile); the outcome comes back as `WeightsRead`."""
        assert self.system is not None
        engine, rid = self.engine, rec.rid
        self._fire(rec, "work")

        def read() -> tuple[Any, float]:
            t0 = time.perf_counter()
            return self._read_update(engine, msg), time.perf_counter() - t0

        def wrap(res: Any, err: BaseException | None) -> WeightsRead:
            """The read came back (on the loop, outside any turn): an input, on the recording."""
            out = WeightsRead(rid, None, err) if err is not None else WeightsRead(rid, res[0], None, res[1])
            rec = self._rec
            if rec is not None:
                rec.input("weights_read", rid=rid, data={
                    "ok": err is None, "tensors": len(out.tensors) if err is None else 0,
                    "error": None if err is None else f"{type(err).__name__}: {err}"})
            return out

        if self.weights_reader is not None:
            self.weights_reader(rid, msg, wrap)
            return
        fut = self.system.loop.run_in_executor(None, read)
        self.system.pipe(fut, self, off_loop=True, wrap=wrap)

    @handles(WeightsRead)
    def _weights_read(self, msg: WeightsRead) -> None:
        rec = self.open.get(msg.rid)
        if rec is None:
            return
        ok = msg.error is None
        if self._rec is not None:
            self._rec.note("weights_read", "read" if ok else "failed", rid=rec.rid,
                           data={"tensors": len(msg.tensors), "read_ms": round(msg.read_s * 1e3, 3)} if ok
                           else {"error": f"{type(msg.error).__name__}: {msg.error}"})
        if not ok:
            from ..engine.weights.refit import WeightsMismatch
            error = msg.error
            detail = str(error) if isinstance(error, WeightsMismatch) else f"{type(error).__name__}: {error}"
            return self._weights_done(rec, ControlResult(False, detail), None)
        rec.data = msg.tensors
        self._weights_idle(rec)

    def _weights_done(self, rec: Any, res: ControlResult | None, error: BaseException | None) -> None:
        """The scheduler's answer to `LoadWeights` (or its failure)."""
        if error is not None:
            res = ControlResult(False, f"{rec.op} failed: {type(error).__name__}: {error}")
        assert res is not None
        if not res.ok and "busy" in res.detail:          # requests hold KV: wait for the barrier
            self._await_idle(rec, (self.scheduler,))
            return
        msg: UpdateWeightsFromDisk | UpdateWeightsFromTensor = rec.msg
        rec.data = None                                  # the tensors are copied (or not wanted)
        if res.ok:
            self._weights_fire("loaded")
            self.weights.updates += 1
            if msg.weight_version is not None or msg.token_step:
                self._set_version(self.weights.version if msg.weight_version is None else msg.weight_version,
                                  model_path=msg.model_path, token_step=msg.token_step)
            res = ControlResult(True, res.message, {**res.detail, "weight_version": self.weights.version})
        else:
            self._weights_fire("load_failed")
            self.weights.last_error = res.message
            self._weights_fire("keep_old")
        self._end(rec, res)

    def _weights_idle(self, rec: Any) -> None:
        """The tensors are read, or the scheduler is idle: ask for the load (again)."""
        self._ask(rec, self.scheduler, LoadWeights(rec.msg.model_path, rec.data, rec.msg.weight_version))

    @handles(UpdateWeightVersion)
    def _update_version(self, msg: UpdateWeightVersion) -> Any:
        rec = self._new("update_weight_version", deferred=False)
        if not msg.new_version:
            return self._end(rec, ControlResult(False, "new_version must be a non-empty string"))
        try:
            self._weights_fire("rename")
        except IllegalTransition:
            return self._end(rec, ControlResult(False, f"cannot rename the weights while they are "
                                                       f"{self.weights.state.name}"))
        if msg.abort_all:
            self._abort(AbortRequest(abort_all=True))
        self._set_version(msg.new_version)
        if self.scheduler.alive:           # the steps that start from now on carry the new label
            self.scheduler.tell(SetWeightVersion(msg.new_version))
        return self._end(rec, ControlResult(True, f"weight version updated to {msg.new_version}",
                                            {"weight_version": msg.new_version}))

    @handles(GetWeightsByName)
    def _get_weights(self, msg: GetWeightsByName) -> Any:
        rec = self._new("get_weights_by_name")
        if (why := self._memory_refusal()) is not None:         # memory_control
            return self._end(rec, ControlResult(False, f"cannot read the weights: {why}"))
        self._ask(rec, self.scheduler, msg)
        return rec.reply
