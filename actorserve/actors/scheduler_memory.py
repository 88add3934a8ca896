"""Memory release and resume: the scheduler's part (`SchedulerMemory`, a base of `SchedulerActor`).

The control actor walks each tag through the MEMORY lifecycle (`actors.memory_control`); the
scheduler does the work, at its barrier:

* `FreeMemory(tags, level)` is refused (busy) while a request holds KV or a step is in flight
  (a request that only waits in the queue holds none: it stays queued). Otherwise the tags go
  into `released` at once -- from then on no step starts (`_start_step` answers no) and newly
  submitted requests queue -- the prefix cache is flushed when the KV cache goes (its blocks'
  contents are about to be freed), and the freeing runs where the steps run: queued on their
  worker thread, or inline when steps run inline (`engine.memory_release`). Its outcome comes
  back as `MemoryApplied`; a tag whose release failed is in place again.
* `RestoreMemory(tags)` brings them back the same way; when no tag is left out, the scheduler
  plans its next step as usual and the queued requests run.

One release or resume at a time; a weight copy (`LoadWeights`) and a memory operation never run
together (each answers the other busy).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..messages import ControlResult
from ..messages_memory import FreeMemory, MemoryApplied, RestoreMemory
from ..statemachines import STEP_IN_FLIGHT, SchedulerState
from .actor import Actor, handles

KV, WEIGHTS = "kv_cache", "weights"


def _failed(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "bytes": 0, "error": f"{type(exc).__name__}: {exc}"}


def _per_tag(tags: tuple[str, ...], steps: list[tuple[str, Any]]) -> dict[str, Any]:
    """Run each tag's step in order (those of `tags`), each outcome ``{ok, bytes, error}``: one
    tag's failure does not stop the next."""
    out: dict[str, Any] = {}
    for tag, step in steps:
        if tag in tags:
            try:
                out[tag] = {"ok": True, "bytes": step(), "error": None}
            except Exception as exc:
                out[tag] = _failed(exc)
    return out


def release_on_step_thread(engine: Any, tags: tuple[str, ...], level: int,
                           spill_dir: str | None = None) -> tuple[dict[str, Any], Any]:
    """The weights first (a spill that cannot be written frees nothing), then the KV cache.
    Returns the outcome per tag and what the weights' release keeps (`WeightsHeld`)."""
    from ..engine import memory_release as mr
    held: list[Any] = [None]

    def weights() -> int:
        held[0] = mr.release_weights(engine, keep=level < 2, spill_dir=spill_dir)
        return held[0].freed
    return _per_tag(tags, [(WEIGHTS, weights), (KV, lambda: mr.release_kv(engine))]), held[0]


def resume_on_step_thread(engine: Any, tags: tuple[str, ...], held: Any,
                          model_path: str | None) -> tuple[dict[str, Any], Any]:
    from ..engine import memory_release as mr
    weights = (lambda: mr.resume_weights(engine, held, model_path)) if held is not None else (lambda: 0)
    return _per_tag(tags, [(WEIGHTS, weights), (KV, lambda: mr.resume_kv(engine))]), held


class SchedulerMemory(Actor):
    # owned by SchedulerActor / SchedulerControl
    state: SchedulerState
    running: list[Any]
    bm: Any
    engine: Any
    step_in_thread: bool
    runner: Any
    _loading: Any
    released: frozenset[str] = frozenset()       # tags whose memory is not in place: no step starts
    _weights_held: Any = None                    # `memory_release.WeightsHeld` while weights are out
    _memory_op: tuple[str, tuple[str, ...], dict[str, Any], asyncio.Future[ControlResult]] | None = None
    # and its `_settle()`, `_check_idle()`

    @handles(FreeMemory)
    def _free_memory(self, msg: FreeMemory) -> Any:
        if self._memory_op is not None or self._loading is not None:
            return ControlResult(False, "another memory release, resume or weight copy is under way")
        if self.state in STEP_IN_FLIGHT or self.running:
            return ControlResult(False, f"cannot release memory while {len(self.running)} request(s) hold KV: "
                                        "pause_generation with mode abort or retract first, or wait until "
                                        "they finish", {"busy": len(self.running)})
        tags = tuple(t for t in msg.tags if t not in self.released)
        freed = self.bm.flush() if KV in tags else 0     # the blocks' contents are about to go
        self.released = self.released | set(tags)
        return self._memory_run("release", tags, {"freed_blocks": freed},
                                release_on_step_thread, self.engine, tags, msg.level)

    @handles(RestoreMemory)
    def _restore_memory(self, msg: RestoreMemory) -> Any:
        if self._memory_op is not None or self._loading is not None:
            return ControlResult(False, "another memory release, resume or weight copy is under way")
        tags = tuple(t for t in msg.tags if t in self.released)
        return self._memory_run("resume", tags, {}, resume_on_step_thread, self.engine, tags,
                                self._weights_held, msg.model_path)

    def _memory_run(self, op: str, tags: tuple[str, ...], extra: dict[str, Any], fn: Any, *args: Any) -> Any:
        """Run `fn` where the steps run (never during one: none is in flight and none starts
        while a tag is out); its outcome comes back as `MemoryApplied`."""
        if not self.step_in_thread or self.runner is not None:
            try:
                res = fn(*args)
            except Exception as exc:
                return self._memory_outcome(op, tags, extra, None, exc)
            return self._memory_outcome(op, tags, extra, res, None)
        assert self.system is not None
        fut: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self._memory_op = (op, tags, extra, fut)
        self.system.pipe(self.system.call_on_step_thread(fn, *args), self, off_loop=True,
                         wrap=lambda res, err: MemoryApplied(op, res, err))
        return fut

    @handles(MemoryApplied)
    def _memory_applied(self, msg: MemoryApplied) -> None:
        if self._memory_op is None:
            return
        op, tags, extra, fut = self._memory_op
        self._memory_op = None
        res = self._memory_outcome(op, tags, extra, msg.outcome, msg.error)
        if not fut.done():
            self._reply(fut, res)

    def _memory_outcome(self, op: str, tags: tuple[str, ...], extra: dict[str, Any], res: Any,
                        error: BaseException | None) -> ControlResult:
        out, held = res if error is None else ({t: _failed(error) for t in tags}, None)
        for tag in tags:
            r = out.get(tag) or {"ok": False, "bytes": 0, "error": "not done"}
            out[tag] = r
            if op == "release" and not r["ok"]:
                self.released = self.released - {tag}          # nothing freed: in place again
            elif op == "resume" and r["ok"]:
                self.released = self.released - {tag}
        if op == "release" and out.get(WEIGHTS, {}).get("ok"):
            self._weights_held = held
        elif op == "resume" and out.get(WEIGHTS, {}).get("ok"):
            self._weights_held = None
        if not self.released:
            self._settle()
            self._check_idle()
        ok = all(out[t]["ok"] for t in tags)
        done = ", ".join(t for t in tags if out[t]["ok"]) or "nothing"
        why = "; ".join(f"{t}: {out[t]['error']}" for t in tags if not out[t]["ok"])
        verb = "released" if op == "release" else "resumed"
        return ControlResult(ok, f"{verb} {done}" + (f"; failed: {why}" if why else ""),
                             {"tags": out, "released": sorted(self.released), **extra})

    def _answer_waiters(self, why: str) -> None:
        """Teardown: a release or resume under way is answered too (then `SchedulerControl`'s)."""
        if self._memory_op is not None and not self._memory_op[3].done():
            self._reply(self._memory_op[3], ControlResult(False, why))
        self._memory_op = None
        super()._answer_waiters(why)  # type: ignore[misc]
