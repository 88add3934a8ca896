"""LoRA adapters as a lifecycle: the scheduler's part (`SchedulerLora`, a base of `SchedulerActor`).

Each adapter is a `LoraModel` walking the LORA lifecycle (``loading -> ready -> unloading ->
unloaded``, ``loading -> failed``, ``ready -> unloaded`` when evicted), created and fired here,
on the recording like every lifecycle. The engine's slots (``engine.lora``: `engine.lora.LoraSlots`,
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
  ``engine.lora.acquire``, ``seq.lora`` set) until its sequence is released after its end,
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

import asyncio
import itertools
import time
from typing import Any

from ..messages import ControlResult, Failed, LoadLora, LoraRead, LoraWait, UnloadLora
from ..messages_lora import lora_refusal
from ..statemachines import LORA, LoraState
from .actor import Actor, handles

L = LoraState
_HELD = (L.loading, L.ready, L.unloading)      # states that take (or will take) a slot


class LoraModel:
    __slots__ = ("rid", "name", "path", "state", "pinned", "ref", "last_used", "waiters",
                 "unload_waiters", "parked", "requests", "error", "read_s", "loads")

    def __init__(self, rid: str, name: str, path: str, pinned: bool) -> None:
        self.rid = rid
        self.name = name
        self.path = path
        self.state = LORA.initial
        self.pinned = pinned
        self.ref: Any = None                 # its `LoraRef` once ready
        self.last_used = 0                   # LRU tick of its last admission (or its load)
        self.waiters: list[asyncio.Future[Any]] = []         # loads (and LoraWait) sharing this load
        self.unload_waiters: list[asyncio.Future[Any]] = []
        self.parked: list[Any] = []          # sequences of requests waiting for this load
        self.requests = 0                    # requests admitted under it
        self.error = ""
        self.read_s = 0.0
        self.loads = 1                       # load requests this one read answered


class SchedulerLora(Actor):
    # owned by SchedulerActor
    engine: Any
    seqs: dict[str, Any]
    actors: dict[str, Any]    # rid -> ActorRef
    lane: Any
    # re-execution's holder of an adapter's read, called (scheduler, rid, fn, name, path, wrap=...)
    lora_runner: Any = None
    # and its `_end`, `_drop`

    def _init_lora(self) -> None:
        self.loras: dict[str, LoraModel] = {}      # live adapters (not unloaded / failed) by name
        self.lora_requests: dict[str, int] = {}    # requests admitted per adapter name (a counter)
        self.lora_events: dict[str, int] = {"loaded": 0, "failed": 0, "unloaded": 0, "evicted": 0}
        self._lora_ids = itertools.count(1)
        self._lora_tick = itertools.count(1)
        self._lora_by_rid: dict[str, LoraModel] = {}

    @property
    def lora_slots(self) -> Any:
        return getattr(self.engine, "lora", None)

    def _lora_fire(self, m: LoraModel, event: str) -> None:
        rec = self.system.recorder if self.system is not None else None
        LORA.fire(m, event, observer=rec)

    # -- admission and release -------------------------------------------------------------------
    def _lora_check(self, name: str) -> "LoraModel | str":
        """At `Submit`: the adapter a request names, or why it cannot run under it."""
        m = self.loras.get(name)
        if self.lora_slots is None:
            return "this engine serves no LoRA adapters"
        if m is None:
            return lora_refusal(name, "is not loaded")
        if m.state is L.unloading:
            return lora_refusal(name, "is being unloaded")
        return m

    def _lora_hold_or_park(self, seq: Any, m: LoraModel) -> bool:
        """Hold a ready adapter (True: queue the request), or park the request (in `seqs`, in
        no queue) until the adapter's load is over (False)."""
        if m.state is L.loading:
            m.parked.append(seq)
            return False
        self._lora_hold(seq, m)
        return True

    def _lora_hold(self, seq: Any, m: LoraModel) -> None:
        seq.lora = self.lora_slots.acquire(m.name)
        m.last_used = next(self._lora_tick)
        m.requests += 1
        self.lora_requests[m.name] = self.lora_requests.get(m.name, 0) + 1

    def _lora_release(self, seq: Any) -> None:
        """The sequence is released (no step reads it any more): let its adapter go."""
        ref = seq.lora
        if ref is None:
            return
        seq.lora = None
        slots = self.lora_slots
        if slots is not None:
            slots.release(ref)
        m = self.loras.get(ref.name)
        if m is not None and m.state is L.unloading and m.ref is not None and m.ref.uid == ref.uid:
            self._lora_try_unload(m)

    # -- load ------------------------------------------------------------------------------------
    @handles(LoadLora)
    def _load_lora(self, msg: LoadLora) -> Any:
        slots = self.lora_slots
        if slots is None:
            return ControlResult(False, "this engine serves no LoRA adapters (the paged runner does; "
                                        "this model runs on the HF fallback)", {"status": 400})
        m = self.loras.get(msg.name)
        if m is not None:
            if m.state is L.loading:           # share the load in flight
                if m.path != msg.path:
                    return ControlResult(False, f"LoRA adapter {msg.name!r} is already loading from "
                                                f"{m.path!r}", {"status": 400})
                m.loads += 1
                m.pinned = m.pinned or msg.pinned
                fut = asyncio.get_running_loop().create_future()
                m.waiters.append(fut)
                return fut
            why = "has already been loaded" if m.state is L.ready else "is being unloaded"
            return ControlResult(False, f"The LoRA adapter '{msg.name}' {why}.", {"status": 400})
        if sum(1 for x in self.loras.values() if x.state in _HELD) >= slots.max_loaded and self._lru() is None:
            return self._no_room()
        m = LoraModel(f"lora:{msg.name}#{next(self._lora_ids)}", msg.name, msg.path, msg.pinned)
        rec = self.system.recorder if self.system is not None else None
        if rec is not None:
            rec.created(LORA, m, {"name": m.name, "path": m.path, "pinned": m.pinned})
        self.loras[m.name] = m
        self._lora_by_rid[m.rid] = m
        fut = asyncio.get_running_loop().create_future()
        m.waiters.append(fut)
        self._read_lora(m)
        return fut

    def _no_room(self) -> ControlResult:
        return ControlResult(False, f"every LoRA slot holds an adapter that is pinned, loading or in use "
                                    f"({self.lora_slots.max_loaded} loaded: --max-loaded-loras)", {"status": 400})

    def _place(self, m: LoraModel, adapter: Any) -> Any:
        """A read that succeeded: evict the least recently used adapter if every slot is taken
        (only now: a folder that fails to read evicts nothing), then take a slot. Returns the
        `LoraRef`, or the error that stops the load."""
        slots = self.lora_slots
        if len(slots.loaded()) >= slots.max_loaded:
            victim = self._lru()
            if victim is None:
                return ValueError(self._no_room().message)
            self._lora_evict(victim)
        try:
            return slots.place(m.name, adapter)
        except ValueError as exc:              # engine.lora's LoraError: the name, the slots
            return exc

    def _lru(self) -> LoraModel | None:
        slots = self.lora_slots
        free = [m for m in self.loras.values()
                if m.state is L.ready and not m.pinned and slots.holders(m.name) == 0]
        return min(free, key=lambda m: m.last_used, default=None)

    def _lora_evict(self, m: LoraModel) -> None:
        self.lora_slots.unload(m.name)
        self._lora_fire(m, "evict")
        self._lora_gone(m)
        self.lora_events["evicted"] += 1

    def _read_lora(self, m: LoraModel) -> None:
        """Read the folder and place it in a slot on a worker thread; `LoraRead` comes back."""
        assert self.system is not None
        slots, rid, name, path = self.lora_slots, m.rid, m.name, m.path

        def read() -> tuple[Any, float]:           # the folder only: the slot is taken on the loop
            t0 = time.perf_counter()
            return slots.read(name, path), time.perf_counter() - t0

        def wrap(res: Any, err: BaseException | None) -> LoraRead:
            out = LoraRead(rid, None, err) if err is not None else LoraRead(rid, res[0], None, res[1])
            rec = self.system.recorder if self.system is not None else None
            if rec is not None:
                rec.input("lora_read", rid=rid, data={
                    "sched": self.name, "ok": err is None,
                    "error": None if err is None else f"{type(err).__name__}: {err}"})
            return out

        if self.lora_runner is not None:
            self.lora_runner(self.ref, rid, read, name, path, wrap=wrap)
            return
        fut = self.system.loop.run_in_executor(None, read)
        self.system.pipe(fut, self, off_loop=True, wrap=wrap)

    @handles(LoraRead)
    def _lora_read(self, msg: LoraRead) -> None:
        m = self._lora_by_rid.get(msg.rid)
        if m is None or m.state is not L.loading:     # nobody wants it any more: never placed
            return
        waiters, m.waiters = m.waiters, []
        parked, m.parked = m.parked, []
        if msg.error is None:
            placed = self._place(m, msg.ref)
            if isinstance(placed, BaseException):
                msg = LoraRead(msg.rid, None, placed, msg.read_s)
            else:
                msg = LoraRead(msg.rid, placed, None, msg.read_s)
        if msg.error is not None:
            m.error = str(msg.error)
            self._lora_fire(m, "load_failed")
            self._lora_gone(m)
            self.lora_events["failed"] += 1
            res = ControlResult(False, f"Failed to load LoRA adapter {m.name!r}: {m.error}",
                                {"status": 400, "lora_name": m.name, "param": "lora_path"})
            for seq in parked:
                if self.seqs.get(seq.rid) is seq:
                    self._end(seq, self._drop(seq.rid), Failed(seq.rid, res.message))
        else:
            m.ref, m.read_s = msg.ref, msg.read_s
            m.last_used = next(self._lora_tick)
            self._lora_fire(m, "loaded")
            self.lora_events["loaded"] += 1
            res = ControlResult(True, f"Success: LoRA adapter '{m.name}' added successfully.",
                                {"lora_name": m.name, "lora_path": m.path, "pinned": m.pinned,
                                 "read_ms": round(m.read_s * 1e3, 3), "shared_by": m.loads})
            for seq in parked:
                if self.seqs.get(seq.rid) is seq:
                    self._lora_hold(seq, m)
                    self.lane.append(seq)
        for fut in waiters:
            if not fut.done():
                self._reply(fut, res if not isinstance(fut, _StateWait) else m.state.name)

    # -- unload ----------------------------------------------------------------------------------
    @handles(UnloadLora)
    def _unload_lora(self, msg: UnloadLora) -> Any:
        m = self.loras.get(msg.name)
        if m is None:
            return ControlResult(False, f"The lora adapter '{msg.name}' cannot be found.",
                                 {"status": 404, "lora_name": msg.name})
        if m.state is L.loading:
            return ControlResult(False, f"LoRA adapter {msg.name!r} is still loading; unload it once "
                                        "it is loaded", {"status": 400, "lora_name": msg.name})
        fut = asyncio.get_running_loop().create_future()
        m.unload_waiters.append(fut)
        if LORA.can(m.state, "unload"):      # else unloading already: it waits with the others
            self._lora_fire(m, "unload")
            self._lora_try_unload(m)
        return fut

    def _lora_try_unload(self, m: LoraModel) -> None:
        """Free the slot of an unloading adapter once no sequence holds it."""
        if self.lora_slots.holders(m.name):
            return
        self.lora_slots.unload(m.name)
        self._lora_fire(m, "unloaded")
        self._lora_gone(m)
        self.lora_events["unloaded"] += 1
        waiters, m.unload_waiters = m.unload_waiters, []
        res = ControlResult(True, f"Success: LoRA adapter '{m.name}' removed successfully.",
                            {"lora_name": m.name})
        for fut in waiters:
            if not fut.done():
                self._reply(fut, res)

    def _lora_gone(self, m: LoraModel) -> None:
        if self.loras.get(m.name) is m:
            del self.loras[m.name]
        self._lora_by_rid.pop(m.rid, None)

    @handles(LoraWait)
    def _lora_wait(self, msg: LoraWait) -> Any:
        m = self.loras.get(msg.name)
        if m is None:
            return None
        if m.state is not L.loading:
            return m.state.name
        fut = _StateWait(loop=asyncio.get_running_loop())
        m.waiters.append(fut)
        return fut

    # -- introspection and teardown --------------------------------------------------------------
    def describe_loras(self) -> list[dict[str, Any]]:
        slots = self.lora_slots
        out = []
        for m in self.loras.values():
            held = slots.holders(m.name) if slots is not None and m.ref is not None else 0
            out.append({"name": m.name, "path": m.path, "state": m.state.name, "pinned": m.pinned,
                        "holders": held, "parked": len(m.parked), "requests": m.requests,
                        "slot": None if m.ref is None else m.ref.slot})
        return out

    def _lora_teardown(self, why: str) -> None:
        for m in list(self.loras.values()):
            for fut in (*m.waiters, *m.unload_waiters):
                if not fut.done():
                    self._reply(fut, ControlResult(False, why) if not isinstance(fut, _StateWait) else None)
            m.waiters, m.unload_waiters = [], []


class _StateWait(asyncio.Future):   # type: ignore[type-arg]
    """A `LoraWait`'s answer: the state name once the load is over (not a `ControlResult`)."""
