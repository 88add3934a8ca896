"""Weight updates in a re-execution (`reexec`): each one reloaded where it can be, played back
where it cannot, and the report says which and why.

A live update has two results that come from outside the actors, both on the recording as
inputs: the read of the new weights (``weights_read``, back from a worker thread at the control
actor) and, when steps run on their thread, the copy (``weights_applied``, back at the
scheduler). Re-execution holds each until its recorded point, as it holds a model step:

* an update from a folder that still exists is **reloaded**: the folder is read again at that
  point and its tensors go to the stand-in engine; a folder that now reads another number of
  tensors than the recording's (or fails to read, or reads where the recording failed) is a
  difference (`ReexecReport.weights_diffs`);
* an update from a folder that is gone, or from tensors (`/update_weights_from_tensor`: the
  recording keeps the blobs' sizes, never their bytes), cannot be reloaded: its recorded outcome
  (ok and how many tensors, or the error) is played back, and the report says so.

The tokens are the recording's either way (the engine is a stand-in): what re-execution checks
is that today's actors take the same path through the update (the barrier, the retracted
requests, the version each step runs with: `versions.token_versions` of both runs).
A recording made before these results were inputs cannot place them: `RecordingError`.
"""

from __future__ import annotations

import os
from typing import Any

from .. import messages as M
from .recorder import Event

UPDATES = ("UpdateWeightsFromDisk", "UpdateWeightsFromTensor")
OPS = (*UPDATES, "UpdateWeightVersion")


class RecordedTensors:
    """What a played-back read hands on: as many tensors as the recording's read had."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class WeightsPlayback:
    def __init__(self, driver: Any, inputs: list[Event], error: type[Exception]) -> None:
        self.driver = driver
        self.notes: list[str] = []            # per update: reloaded, or why not
        self.diffs: list[str] = []            # a reload that does not match the recording
        self.reads: dict[str, tuple[Any, Any]] = {}        # control record rid -> (msg, wrap)
        self.loads: dict[str, tuple[Any, Any, Any, Any]] = {}  # sched -> (target, fn, tensors, wrap)
        self.msg_seq: dict[int, int] = {}     # id(msg) -> the seq of its control input
        ops = [e for e in inputs if e.event == "control" and (e.data or {}).get("op") in UPDATES]
        if ops and not any(e.event == "weights_read" for e in inputs):
            raise error(f"seq {ops[0].seq}: a weight update recorded before its read was an input "
                        "(an older recording): where its outcome came back is unknown, so it cannot "
                        "be placed; re-execute a recording made by this version")
        driver.rt.take_over(weight_reads=self._hold_read)
        if any(e.event == "weights_applied" for e in inputs):    # the live copy ran on the step thread
            driver.rt.take_over(loads=self._hold_load)

    # -- the control input ---------------------------------------------------------------------
    def message(self, e: Event, op: str, args: dict[str, Any]) -> Any:
        if op == "UpdateWeightsFromTensor":      # the sizes are recorded, never the bytes
            msg = M.UpdateWeightsFromTensor(blobs=(), abort_all=args.get("abort_all", False),
                                            weight_version=args.get("weight_version"))
        else:
            msg = getattr(M, op)(**args)
        self.msg_seq[id(msg)] = e.seq
        return msg

    # -- the held results ----------------------------------------------------------------------
    def _hold_read(self, rid: str, msg: Any, wrap: Any) -> None:
        self.reads[rid] = (msg, wrap)

    def _hold_load(self, target: Any, fn: Any, tensors: Any, *, wrap: Any) -> None:
        self.loads[target.name] = (target, fn, tensors, wrap)

    def feed(self, e: Event) -> bool:
        """A ``weights_read`` / ``weights_applied`` input; False when nothing waits for it (drift)."""
        d = e.data or {}
        if e.event == "weights_read":
            held = self.reads.pop(e.rid or "", None)
            if held is None:
                return False
            msg, wrap = held
            out = self._read(e, msg, d, wrap)
            target = self.driver.rt.control_ref
        else:
            held = self.loads.pop(d.get("sched", "scheduler"), None)
            if held is None:
                return False
            target, fn, tensors, wrap = held
            if d.get("error"):
                out = wrap(None, RuntimeError(f"recorded failure: {d['error']}"))
            else:
                out = wrap(fn(tensors), None)
        if target.alive:
            target.tell(out)
        return True

    def _read(self, e: Event, msg: Any, d: dict[str, Any], wrap: Any) -> Any:
        """Reload the folder when it is still there; else play the recorded outcome back."""
        seq = self.msg_seq.get(id(msg), e.seq)
        recorded_ok, n = bool(d.get("ok")), int(d.get("tensors") or 0)
        played = (f"played back the recorded outcome ({n} tensors)" if recorded_ok
                  else f"played back the recorded failure ({d.get('error')})")
        if isinstance(msg, M.UpdateWeightsFromTensor):
            self.notes.append(f"seq {seq}: update_weights_from_tensor cannot be reloaded: the recording "
                              f"keeps its tensors' sizes, never their bytes; {played}")
            return self._played(wrap, recorded_ok, n, d)
        path = msg.model_path
        from ..engine.weights import refit
        try:
            tensors = refit.read_folder(path, msg.load_format)
        except Exception as exc:
            if recorded_ok and not os.path.exists(path):
                self.notes.append(f"seq {seq}: update_weights_from_disk {path} cannot be reloaded: the "
                                  f"folder no longer exists; {played}")
                return self._played(wrap, recorded_ok, n, d)
            if recorded_ok:
                self.diffs.append(f"seq {seq}: reloading {path} failed ({type(exc).__name__}: {exc}); "
                                  f"the recording read {n} tensors")
            else:
                self.notes.append(f"seq {seq}: reloading {path} failed again, as recorded")
            return wrap(None, exc)
        if not recorded_ok:
            self.diffs.append(f"seq {seq}: {path} reads now ({len(tensors)} tensors); the recorded "
                              f"read failed ({d.get('error')})")
        elif len(tensors) != n:
            self.diffs.append(f"seq {seq}: {path} reads {len(tensors)} tensors now, the recording "
                              f"read {n}: the folder changed")
        else:
            self.notes.append(f"seq {seq}: reloaded {path} ({n} tensors, as recorded)")
        return wrap((tensors, 0.0), None)

    @staticmethod
    def _played(wrap: Any, ok: bool, n: int, d: dict[str, Any]) -> Any:
        if ok:
            return wrap((RecordedTensors(n), 0.0), None)
        return wrap(None, RuntimeError(f"recorded failure: {d.get('error')}"))


def compare_versions(recorded: list[Event], replayed: list[Event]) -> list[str]:
    """Each step's weights label, recorded against replayed (per scheduler, the first that
    differs); nothing to compare in a recording made before labels were recorded."""
    from .versions import token_versions
    a, b = token_versions(recorded), token_versions(replayed)
    if not a.known:
        return []
    out = []
    for sched in sorted(set(a.step_versions) | set(b.step_versions)):
        ra, rb = a.step_versions.get(sched, []), b.step_versions.get(sched, [])
        for i, (x, y) in enumerate(zip(ra, rb)):
            if x != y:
                out.append(f"{sched} step {i + 1} ran with weights {x!r} in the recording, {y!r} replayed")
                break
    return out
