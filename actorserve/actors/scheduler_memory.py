"""Memory release and resume: the scheduler's part (`SchedulerMemoryPart`, handed to
`SchedulerActor` as `memory=` and acting through its `MemoryHooks`; the handlers are on
`SchedulerMemory`, a base of the actor).

The control actor walks each tag through the MEMORY lifecycle (`actors.memory_control`); the
scheduler does the work, at its barrier:

* `FreeMemory(tags, level)` is refused (busy) while a request holds KV or a step is in flight
  (a request that only waits in the queue holds none: it stays queued). Otherwise the tags go
  into `released` at once -- from then on no step starts (`_start_step` answers no) and newly
  submitted requests queue -- the prefix cache is flushed when the KV cache goes (its blocks'
  contents are about to be freed), and the freeing runs where the steps run: queued on their
  worker thread, or inline when steps run inline (`engine.weights.memory_release`). Its outcome comes
  back as `MemoryApplied`; a tag whose release failed is in place again.
* `RestoreMemory(tags)` brings them back the same way; when no tag is left out, the scheduler
  plans its next step as usual and the queued requests run.

One release or resume at a time; a weight copy (`LoadWeights`) and a memory operation never run
together (each answers the other busy).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, NamedTuple

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
    from ..engine.weights import memory_release as mr
    held: list[Any] = [None]

    def weights() -> int:
        held[0] = mr.release_weights(engine, keep=level < 2, spill_dir=spill_dir)
        return held[0].freed
    return _per_tag(tags, [(WEIGHTS, weights), (KV, lambda: mr.release_kv(engine))]), held[0]


def resume_on_step_thread(engine: Any, tags: tuple[str, ...], held: Any,
                          model_path: str | None) -> tuple[dict[str, Any], Any]:
    from ..engine.weights import memory_release as mr
    weights = (lambda: mr.resume_weights(engine, held, model_path)) if held is not None else (lambda: 0)
    return _per_tag(tags, [(WEIGHTS, weights), (KV, lambda: mr.resume_kv(engine))]), held


class MemoryHooks(NamedTuple):
    """What the memory part may read and do on its scheduler, and nothing more."""
    engine: Any                                  # the engine whose memory is released
    holding: Callable[[], int | None]            # requests holding KV (None: none, no step in flight)
    loading: Callable[[], bool]                  # a weight copy is under way
    flush_kv: Callable[[], int]                  # clear the prefix cache; answers the blocks freed
    inline: Callable[[], bool]                   # the work runs here (steps run inline, or re-execution)
    on_step_thread: Callable[..., None]          # (op, fn, *args): run fn there; `MemoryApplied` comes back
    back: Callable[[], None]                     # every tag is in place again: plan, answer idle waiters
    future: Callable[[], asyncio.Future[Any]]
    reply: Callable[[asyncio.Future[Any], Any], None]


class SchedulerMemoryPart:
    """Memory release and resume, one of the parts a scheduler is built from
    (`SchedulerActor(memory=...)`): which tags are out, what the weights' release keeps, the
    operation under way. It acts only through its `MemoryHooks`."""
    __slots__ = ("released", "weights_held", "op")

    def __init__(self) -> None:
        self.released: frozenset[str] = frozenset()   # tags whose memory is not in place: no step starts
        self.weights_held: Any = None                 # `memory_release.WeightsHeld` while weights are out
        self.op: tuple[str, tuple[str, ...], dict[str, Any], asyncio.Future[ControlResult]] | None = None

    def free(self, msg: FreeMemory, h: MemoryHooks) -> Any:
        if self.op is not None or h.loading():
            return ControlResult(False, "another memory release, resume or weight copy is under way")
        if (n := h.holding()) is not None:
            return ControlResult(False, f"cannot release memory while {n} request(s) hold KV: "
                                        "pause_generation with mode abort or retract first, or wait until "
                                        "they finish", {"busy": n})
        tags = tuple(t for t in msg.tags if t not in self.released)
        freed = h.flush_kv() if KV in tags else 0     # the blocks' contents are about to go
        self.released = self.released | set(tags)
        return self._run("release", tags, {"freed_blocks": freed}, h, release_on_step_thread, h.engine, tags, msg.level)

    def restore(self, msg: RestoreMemory, h: MemoryHooks) -> Any:
        if self.op is not None or h.loading():
            return ControlResult(False, "another memory release, resume or weight copy is under way")
        tags = tuple(t for t in msg.tags if t in self.released)
        return self._run("resume", tags, {}, h, resume_on_step_thread, h.engine, tags, self.weights_held,
                         msg.model_path)

    def _run(self, op: str, tags: tuple[str, ...], extra: dict[str, Any], h: MemoryHooks, fn: Any,
             *args: Any) -> Any:
        """Run `fn` where the steps run (never during one: none is in flight and none starts
        while a tag is out); its outcome comes back as `MemoryApplied`."""
        if h.inline():
            try:
                res = fn(*args)
            except Exception as exc:
                return self._outcome(op, tags, extra, None, exc, h)
            return self._outcome(op, tags, extra, res, None, h)
        fut: asyncio.Future[ControlResult] = h.future()
        self.op = (op, tags, extra, fut)
        h.on_step_thread(op, fn, *args)
        return fut

    def applied(self, msg: MemoryApplied, h: MemoryHooks) -> None:
        if self.op is None:
            return
        op, tags, extra, fut = self.op
        self.op = None
        res = self._outcome(op, tags, extra, msg.outcome, msg.error, h)
        if not fut.done():
            h.reply(fut, res)

    def _outcome(self, op: str, tags: tuple[str, ...], extra: dict[str, Any], res: Any,
                 error: BaseException | None, h: MemoryHooks) -> ControlResult:
        out, held = res if error is None else ({t: _failed(error) for t in tags}, None)
        for tag in tags:
            r = out.get(tag) or {"ok": False, "bytes": 0, "error": "not done"}
            out[tag] = r
            if op == "release" and not r["ok"]:
                self.released = self.released - {tag}          # nothing freed: in place again
            elif op == "resume" and r["ok"]:
                self.released = self.released - {tag}
        if op == "release" and out.get(WEIGHTS, {}).get("ok"):
            self.weights_held = held
        elif op == "resume" and out.get(WEIGHTS, {}).get("ok"):
            self.weights_held = None
        if not self.released:
            h.back()
        ok = all(out[t]["ok"] for t in tags)
        done = ", ".join(t for t in tags if out[t]["ok"]) or "nothing"
        why = "; ".join(f"{t}: {out[t]['error']}" for t in tags if not out[t]["ok"])
        verb = "released" if op == "release" else "resumed"
        return ControlResult(ok, f"{verb} {done}" + (f"; failed: {why}" if why else ""),
                             {"tags": out, "released": sorted(self.released), **extra})

    def teardown(self, why: str, h: MemoryHooks) -> None:
        if self.op is not None and not self.op[3].done():
            h.reply(self.op[3], ControlResult(False, why))
        self.op = None


class SchedulerMemory(Actor):
    """The actor's memory handlers: thin, they call its `SchedulerMemoryPart` (`self.memory`)."""
    # owned by SchedulerActor / SchedulerControl
    state: SchedulerState
    running: list[Any]
    bm: Any
    engine: Any
    step_in_thread: bool
    runner: Any
    _loading: Any
    memory: SchedulerMemoryPart
    _memory_hooks: MemoryHooks | None = None
    # and its `_settle()`, `_check_idle()`

    @property
    def released(self) -> frozenset[str]:
        """Tags whose memory is not in place: no step starts (`_start_step`)."""
        return self.memory.released

    @property
    def _mh(self) -> MemoryHooks:
        h = self._memory_hooks
        if h is None:
            assert self.system is not None
            h = self._memory_hooks = MemoryHooks(
                engine=self.engine,
                holding=lambda: len(self.running) if self.state in STEP_IN_FLIGHT or self.running else None,
                loading=lambda: self._loading is not None, flush_kv=lambda: self.bm.flush(),
                inline=lambda: not self.step_in_thread or self.runner is not None,
                on_step_thread=self._memory_on_step_thread, back=self._memory_back,
                future=self.system.loop.create_future, reply=self._reply)
        return h

    def _memory_on_step_thread(self, op: str, fn: Any, *args: Any) -> None:
        assert self.system is not None
        self.system.pipe(self.system.call_on_step_thread(fn, *args), self, off_loop=True,
                         wrap=lambda res, err: MemoryApplied(op, res, err))

    def _memory_back(self) -> None:
        self._settle()          # type: ignore[attr-defined]
        self._check_idle()      # type: ignore[attr-defined]

    @handles(FreeMemory)
    def _free_memory(self, msg: FreeMemory) -> Any:
        return self.memory.free(msg, self._mh)

    @handles(RestoreMemory)
    def _restore_memory(self, msg: RestoreMemory) -> Any:
        return self.memory.restore(msg, self._mh)

    @handles(MemoryApplied)
    def _memory_applied(self, msg: MemoryApplied) -> None:
        self.memory.applied(msg, self._mh)

    def _answer_waiters(self, why: str) -> None:
        """Teardown: a release or resume under way is answered too (then `SchedulerControl`'s)."""
        self.memory.teardown(why, self._mh)
        super()._answer_waiters(why)  # type: ignore[misc]
