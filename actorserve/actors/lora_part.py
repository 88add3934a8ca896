"""LoRA adapters, one of the parts a scheduler is built from (`SchedulerActor(adapters=...)`):
`SchedulerLoraPart` holds the adapters (each a `LoraModel` on the LORA lifecycle), their holds
and counters, and acts on the scheduler only through its `LoraHooks` (the engine's slots, the
recorder, a read off the loop, the `Queues` part's sequences, failing or queueing a parked
request, futures and replies). What it decides, and when the slots are touched, is described
in `scheduler_lora` (whose `SchedulerLora` base keeps the actor's thin handlers).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Callable, NamedTuple

from ..messages import ControlResult, LoadLora, LoraRead, LoraWait, UnloadLora
from ..messages_lora import lora_refusal
from ..statemachines import LORA, LoraState

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


class LoraHooks(NamedTuple):
    """What the LoRA part may read and do on its scheduler, and nothing more."""
    slots: Callable[[], Any]                   # the engine's adapter slots (None: it serves none)
    recorder: Callable[[], Any]                # the flight recorder, or None
    name: str                                  # the scheduler's name (on the recording)
    read: Callable[..., None]                  # (rid, fn, name, path, wrap): run fn off the loop, wrap comes back
    seqs: dict[str, Any]                       # the `Queues` part's sequences by rid
    fail: Callable[[Any, str], None]           # end a parked request with this error
    enqueue: Callable[[Any], None]             # a parked request joins its lane
    future: Callable[[], asyncio.Future[Any]]
    state_wait: Callable[[], asyncio.Future[Any]]   # a `LoraWait`'s future (answered with a state name)
    reply: Callable[[asyncio.Future[Any], Any], None]


class SchedulerLoraPart:
    """The adapters of one scheduler: one of the parts it is built from (`SchedulerActor(adapters=...)`)."""

    def __init__(self) -> None:
        self.loras: dict[str, LoraModel] = {}      # live adapters (not unloaded / failed) by name
        self.lora_requests: dict[str, int] = {}    # requests admitted per adapter name (a counter)
        self.lora_events: dict[str, int] = {"loaded": 0, "failed": 0, "unloaded": 0, "evicted": 0}
        self._lora_ids = itertools.count(1)
        self._lora_tick = itertools.count(1)
        self._lora_by_rid: dict[str, LoraModel] = {}

    def fire(self, m: LoraModel, event: str, h: LoraHooks | None = None) -> None:
        LORA.fire(m, event, observer=None if h is None else h.recorder())

    # -- admission and release -------------------------------------------------------------------
    def check(self, name: str, h: LoraHooks) -> "LoraModel | str":
        """At `Submit`: the adapter a request names, or why it cannot run under it."""
        m = self.loras.get(name)
        if h.slots() is None:
            return "this engine serves no LoRA adapters"
        if m is None:
            return lora_refusal(name, "is not loaded")
        if m.state is L.unloading:
            return lora_refusal(name, "is being unloaded")
        return m

    def hold_or_park(self, seq: Any, m: LoraModel, h: LoraHooks) -> bool:
        """Hold a ready adapter (True: queue the request), or park the request (in `seqs`, in
        no queue) until the adapter's load is over (False)."""
        if m.state is L.loading:
            m.parked.append(seq)
            return False
        self.hold(seq, m, h)
        return True

    def hold(self, seq: Any, m: LoraModel, h: LoraHooks) -> None:
        seq.lora = h.slots().acquire(m.name)
        m.last_used = next(self._lora_tick)
        m.requests += 1
        self.lora_requests[m.name] = self.lora_requests.get(m.name, 0) + 1

    def release(self, seq: Any, h: LoraHooks) -> None:
        """The sequence is released (no step reads it any more): let its adapter go."""
        ref = seq.lora
        if ref is None:
            return
        seq.lora = None
        slots = h.slots()
        if slots is not None:
            slots.release(ref)
        m = self.loras.get(ref.name)
        if m is not None and m.state is L.unloading and m.ref is not None and m.ref.uid == ref.uid:
            self.try_unload(m, h)

    # -- load ------------------------------------------------------------------------------------
    def load(self, msg: LoadLora, h: LoraHooks) -> Any:
        slots = h.slots()
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
                fut = h.future()
                m.waiters.append(fut)
                return fut
            why = "has already been loaded" if m.state is L.ready else "is being unloaded"
            return ControlResult(False, f"The LoRA adapter '{msg.name}' {why}.", {"status": 400})
        if sum(1 for x in self.loras.values() if x.state in _HELD) >= slots.max_loaded and self.lru(h) is None:
            return self.no_room(h)
        m = LoraModel(f"lora:{msg.name}#{next(self._lora_ids)}", msg.name, msg.path, msg.pinned)
        rec = h.recorder()
        if rec is not None:
            rec.created(LORA, m, {"name": m.name, "path": m.path, "pinned": m.pinned})
        self.loras[m.name] = m
        self._lora_by_rid[m.rid] = m
        fut = h.future()
        m.waiters.append(fut)
        self.start_read(m, h)
        return fut

    def no_room(self, h: LoraHooks) -> ControlResult:
        return ControlResult(False, f"every LoRA slot holds an adapter that is pinned, loading or in use "
                                    f"({h.slots().max_loaded} loaded: --max-loaded-loras)", {"status": 400})

    def place(self, m: LoraModel, adapter: Any, h: LoraHooks) -> Any:
        """A read that succeeded: evict the least recently used adapter if every slot is taken
        (only now: a folder that fails to read evicts nothing), then take a slot. Returns the
        `LoraRef`, or the error that stops the load."""
        slots = h.slots()
        if len(slots.loaded()) >= slots.max_loaded:
            victim = self.lru(h)
            if victim is None:
                return ValueError(self.no_room(h).message)
            self.evict(victim, h)
        try:
            return slots.place(m.name, adapter)
        except ValueError as exc:              # engine.lora's LoraError: the name, the slots
            return exc

    def lru(self, h: LoraHooks) -> LoraModel | None:
        slots = h.slots()
        free = [m for m in self.loras.values()
                if m.state is L.ready and not m.pinned and slots.holders(m.name) == 0]
        return min(free, key=lambda m: m.last_used, default=None)

    def evict(self, m: LoraModel, h: LoraHooks) -> None:
        h.slots().unload(m.name)
        self.fire(m, "evict", h)
        self.gone(m)
        self.lora_events["evicted"] += 1

    def start_read(self, m: LoraModel, h: LoraHooks) -> None:
        """Read the folder and place it in a slot on a worker thread; `LoraRead` comes back."""
        slots, rid, name, path = h.slots(), m.rid, m.name, m.path

        def read() -> tuple[Any, float]:           # the folder only: the slot is taken on the loop
            t0 = time.perf_counter()
            return slots.read(name, path), time.perf_counter() - t0

        def wrap(res: Any, err: BaseException | None) -> LoraRead:
            out = LoraRead(rid, None, err) if err is not None else LoraRead(rid, res[0], None, res[1])
            rec = h.recorder()
            if rec is not None:
                rec.input("lora_read", rid=rid, data={
                    "sched": h.name, "ok": err is None,
                    "error": None if err is None else f"{type(err).__name__}: {err}"})
            return out

        h.read(rid, read, name, path, wrap)

    def read_back(self, msg: LoraRead, h: LoraHooks) -> None:
        m = self._lora_by_rid.get(msg.rid)
        if m is None or m.state is not L.loading:     # nobody wants it any more: never placed
            return
        waiters, m.waiters = m.waiters, []
        parked, m.parked = m.parked, []
        if msg.error is None:
            placed = self.place(m, msg.ref, h)
            if isinstance(placed, BaseException):
                msg = LoraRead(msg.rid, None, placed, msg.read_s)
            else:
                msg = LoraRead(msg.rid, placed, None, msg.read_s)
        if msg.error is not None:
            m.error = str(msg.error)
            self.fire(m, "load_failed", h)
            self.gone(m)
            self.lora_events["failed"] += 1
            res = ControlResult(False, f"Failed to load LoRA adapter {m.name!r}: {m.error}",
                                {"status": 400, "lora_name": m.name, "param": "lora_path"})
            for seq in parked:
                if h.seqs.get(seq.rid) is seq:
                    h.fail(seq, res.message)
        else:
            m.ref, m.read_s = msg.ref, msg.read_s
            m.last_used = next(self._lora_tick)
            self.fire(m, "loaded", h)
            self.lora_events["loaded"] += 1
            res = ControlResult(True, f"Success: LoRA adapter '{m.name}' added successfully.",
                                {"lora_name": m.name, "lora_path": m.path, "pinned": m.pinned,
                                 "read_ms": round(m.read_s * 1e3, 3), "shared_by": m.loads})
            for seq in parked:
                if h.seqs.get(seq.rid) is seq:
                    self.hold(seq, m, h)
                    h.enqueue(seq)
        for fut in waiters:
            if not fut.done():
                h.reply(fut, res if not isinstance(fut, _StateWait) else m.state.name)

    # -- unload ----------------------------------------------------------------------------------
    def unload(self, msg: UnloadLora, h: LoraHooks) -> Any:
        m = self.loras.get(msg.name)
        if m is None:
            return ControlResult(False, f"The lora adapter '{msg.name}' cannot be found.",
                                 {"status": 404, "lora_name": msg.name})
        if m.state is L.loading:
            return ControlResult(False, f"LoRA adapter {msg.name!r} is still loading; unload it once "
                                        "it is loaded", {"status": 400, "lora_name": msg.name})
        fut = h.future()
        m.unload_waiters.append(fut)
        if LORA.can(m.state, "unload"):      # else unloading already: it waits with the others
            self.fire(m, "unload", h)
            self.try_unload(m, h)
        return fut

    def try_unload(self, m: LoraModel, h: LoraHooks) -> None:
        """Free the slot of an unloading adapter once no sequence holds it."""
        if h.slots().holders(m.name):
            return
        h.slots().unload(m.name)
        self.fire(m, "unloaded", h)
        self.gone(m)
        self.lora_events["unloaded"] += 1
        waiters, m.unload_waiters = m.unload_waiters, []
        res = ControlResult(True, f"Success: LoRA adapter '{m.name}' removed successfully.",
                            {"lora_name": m.name})
        for fut in waiters:
            if not fut.done():
                h.reply(fut, res)

    def gone(self, m: LoraModel) -> None:
        if self.loras.get(m.name) is m:
            del self.loras[m.name]
        self._lora_by_rid.pop(m.rid, None)

    def wait(self, msg: LoraWait, h: LoraHooks) -> Any:
        m = self.loras.get(msg.name)
        if m is None:
            return None
        if m.state is not L.loading:
            return m.state.name
        fut = h.state_wait()
        m.waiters.append(fut)
        return fut

    # -- introspection and teardown --------------------------------------------------------------
    def describe(self, h: LoraHooks) -> list[dict[str, Any]]:
        slots = h.slots()
        out = []
        for m in self.loras.values():
            held = slots.holders(m.name) if slots is not None and m.ref is not None else 0
            out.append({"name": m.name, "path": m.path, "state": m.state.name, "pinned": m.pinned,
                        "holders": held, "parked": len(m.parked), "requests": m.requests,
                        "slot": None if m.ref is None else m.ref.slot})
        return out

    def teardown(self, why: str, h: LoraHooks) -> None:
        for m in list(self.loras.values()):
            for fut in (*m.waiters, *m.unload_waiters):
                if not fut.done():
                    h.reply(fut, ControlResult(False, why) if not isinstance(fut, _StateWait) else None)
            m.waiters, m.unload_waiters = [], []


class _StateWait(asyncio.Future):   # type: ignore[type-arg]
    """A `LoraWait`'s answer: the state name once the load is over (not a `ControlResult`)."""
