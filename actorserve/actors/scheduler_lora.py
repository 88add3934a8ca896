"""LoRA adapters as a lifecycle: the scheduler's part (`lora_part.SchedulerLoraPart`, handed
to `SchedulerActor` as `adapters=`; its thin handlers are `SchedulerLora`, a base of the actor).

Each adapter is a `LoraModel` walking the LORA lifecycle (``loading -> ready -> unloading ->
unloaded``, ``loading -> failed``, ``ready -> unloaded`` when evicted), created and fired here,
on the recording like every lifecycle. The engine's slots (``engine.weights.lora``: `engine.weights.lora.LoraSlots`,
or the fake engine's) hold the weights; this module decides when they are touched:

* **Load** (`LoadLora`, asked by the control actor): a new ``loading`` model, and the folder is
  read and placed in a free slot on a worker thread (not the step thread: steps go on; the
  slots only take their lock to assign the slot, which no step reads), its outcome coming back
  as `LoraRead` (an input on the recording). A second load of a name that is still loading
  joins the first (one read, one answer for both); a load of a ready name is refused (vLLM's
  and SGLang's answer). When every slot is taken, the least recently used adapter that is
  ready, unpinned and held by no request is evicted first (``evict``); none: the load is
  refused and nothing changes.
* **Holds**: a request naming an adapter holds it from its admission here (`Submit.lora`:
  ``engine.weights.lora.acquire``, ``seq.lora`` set) until its sequence is released after its end,
  whatever the end (done, stop string, abort, failure, deadline, shutdown): the scheduler
  releases the hold where it releases the sequence (`_lora_release`, after the step in flight
  when the sequence is in it), so no step can read a slot that is being freed. A request that
  names an adapter still loading is parked (it holds nothing, steps in nothing, can be aborted)
  and joins the queue when the load is done, or fails with the load's error.
* **Unload** (`UnloadLora`): ``ready -> unloading`` at once, so requests naming it from now on
  fail at admission; the slot is freed (``unloaded``) when the last holder is released, and
  the control actor's record waits for that (or, with ``abort``, aborts the holders first).
* **Per step**: ``--max-loras`` is the batch policy's (`BatchConfig.max_loras`).
"""

from __future__ import annotations

from typing import Any

from ..messages import Failed, LoadLora, LoraRead, LoraWait, UnloadLora
from .actor import Actor, handles
from .lora_part import LoraHooks, LoraModel, SchedulerLoraPart, _StateWait

__all__ = ["LoraModel", "SchedulerLora", "SchedulerLoraPart"]


class SchedulerLora(Actor):
    """The actor's LoRA handlers: thin, they call its `SchedulerLoraPart` (`self.adapters`)."""
    # owned by SchedulerActor
    engine: Any
    seqs: dict[str, Any]
    lane: Any
    adapters: SchedulerLoraPart
    _lora_hooks: LoraHooks | None = None
    # re-execution's holder of an adapter's read, called (scheduler, rid, fn, name, path, wrap=...)
    lora_runner: Any = None
    # and its `_end`, `_drop`

    def _init_lora(self, adapters: SchedulerLoraPart | None = None) -> None:
        self.adapters = adapters or SchedulerLoraPart()

    @property
    def lora_slots(self) -> Any:
        return getattr(self.engine, "lora", None)

    @property
    def loras(self) -> dict[str, LoraModel]:
        return self.adapters.loras

    @property
    def lora_requests(self) -> dict[str, int]:
        return self.adapters.lora_requests

    @property
    def lora_events(self) -> dict[str, int]:
        return self.adapters.lora_events

    @property
    def _lh(self) -> LoraHooks:
        h = self._lora_hooks
        if h is None:
            assert self.system is not None
            loop = self.system.loop
            h = self._lora_hooks = LoraHooks(
                slots=lambda: self.lora_slots,
                recorder=lambda: self.system.recorder if self.system is not None else None,
                name=self.name, read=self._lora_read_off_loop, seqs=self.seqs,
                fail=lambda seq, why: self._end(seq, self._drop(seq.rid), Failed(seq.rid, why)),
                enqueue=lambda seq: self.lane.append(seq), future=loop.create_future,
                state_wait=lambda: _StateWait(loop=loop), reply=self._reply)
        return h

    def _lora_read_off_loop(self, rid: str, fn: Any, name: str, path: str, wrap: Any) -> None:
        assert self.system is not None
        if self.lora_runner is not None:
            self.lora_runner(self.ref, rid, fn, name, path, wrap=wrap)
            return
        fut = self.system.loop.run_in_executor(None, fn)
        self.system.pipe(fut, self, off_loop=True, wrap=wrap)

    # -- admission and release (called by the scheduler) -------------------------------------------
    def _lora_check(self, name: str) -> "LoraModel | str":
        return self.adapters.check(name, self._lh)

    def _lora_hold_or_park(self, seq: Any, m: LoraModel) -> bool:
        return self.adapters.hold_or_park(seq, m, self._lh)

    def _lora_release(self, seq: Any) -> None:
        if seq.lora is not None:
            self.adapters.release(seq, self._lh)

    # -- messages --------------------------------------------------------------------------------
    @handles(LoadLora)
    def _load_lora(self, msg: LoadLora) -> Any:
        return self.adapters.load(msg, self._lh)

    @handles(LoraRead)
    def _lora_read(self, msg: LoraRead) -> None:
        self.adapters.read_back(msg, self._lh)

    @handles(UnloadLora)
    def _unload_lora(self, msg: UnloadLora) -> Any:
        return self.adapters.unload(msg, self._lh)

    @handles(LoraWait)
    def _lora_wait(self, msg: LoraWait) -> Any:
        return self.adapters.wait(msg, self._lh)

    def describe_loras(self) -> list[dict[str, Any]]:
        return self.adapters.describe(self._lh)

    def _lora_teardown(self, why: str) -> None:
        self.adapters.teardown(why, self._lh)
