"""The runtime's read side (`RuntimeReads`, a base of `Runtime`): stats, snapshots and plain-data
views of the actors for the HTTP layer and tests (`stats()`, `snapshot()`, `server_info()`,
`request_info(rid)`, the LoRA adapters, the weights' version, the stored responses).

Every read comes from what an actor published after its last turn (`ActorSystem.published`:
the schedulers' `SchedulerView`, the control actor's regions, the sessions and the responses
store) or from the request registry (a request's state, published on each transition); a read
that must wait for an actor's answer is an ask (`lora_wait`). None reads an actor's fields, so
none can see one half-way through a turn. Each returns data, never an actor."""

from __future__ import annotations

import asyncio
from typing import Any

from ..messages import LoraWait
from ..statemachines import LIFECYCLES
from .actor import ActorRef
from .scheduler_stats import SchedulerStats, SchedulerView
from .surface import ServerSnapshot


class PublishedScheduler:
    """A scheduler's `idle` and `steps_done` as it last published them (what `RestTrimmer` reads)."""
    __slots__ = ("_system", "_name")

    def __init__(self, system: Any, name: str) -> None:
        self._system, self._name = system, name

    @property
    def idle(self) -> bool:
        return self._system.published(self._name).idle

    @property
    def steps_done(self) -> int:
        return self._system.published(self._name).steps_done


class RuntimeReads:
    # set by Runtime
    sched_ref: ActorRef
    pool_refs: dict[str, ActorRef]
    control_ref: ActorRef
    sessions_ref: ActorRef
    responses_ref: ActorRef
    engine: Any
    watchdog_config: dict[str, float] | None
    system: Any
    recorder: Any
    shed: int

    # -- introspection: snapshots, never actors ------------------------------------------------
    def _view(self, ref: ActorRef) -> SchedulerView | None:
        """What the scheduler published after its last turn (None: the runtime is not started)."""
        return self.system.published(ref.name)

    def stats(self) -> SchedulerStats:
        return self._view(self.sched_ref).stats

    def pool_stats(self) -> dict[str, SchedulerStats]:
        """Stats of each pooling engine's scheduler, by target name."""
        return {key: self._view(r).stats for key, r in self.pool_refs.items()}

    def scheduler_probe(self) -> PublishedScheduler:
        """The generation scheduler's idleness and progress, as published (`RestTrimmer`)."""
        return PublishedScheduler(self.system, self.sched_ref.name)

    def call_on_step_thread(self, fn: Any) -> "asyncio.Future[Any]":
        """Run `fn()` on the thread the model steps run on, between two steps."""
        return self.system.call_on_step_thread(fn)

    @property
    def engine_info(self) -> Any:
        """The generation engine's geometry (`EngineInfo`: a frozen dataclass)."""
        return self.engine.info

    def _control(self) -> dict[str, Any]:
        return self.system.published(self.control_ref.name)

    def snapshot(self) -> ServerSnapshot:
        return ServerSnapshot(**self._control()["server"], shed=self.shed)

    @property
    def memory_out(self) -> bool:
        """Some memory tag is released (vLLM's ``is_sleeping``)."""
        return self._control()["memory_out"]

    def loras(self) -> list[dict[str, Any]]:
        """The live LoRA adapters (loading, ready, unloading) as plain data, load order."""
        view = self._view(self.sched_ref)
        return [] if view is None else [dict(d) for d in view.loras]     # None: not started yet

    def lora_state(self, name: str) -> str | None:
        """The state of adapter `name` (``loading``, ``ready``, ``unloading``), None: not loaded."""
        return next((d["state"] for d in self.loras() if d["name"] == name), None)

    @property
    def lora_enabled(self) -> bool:
        """Whether the generation engine has adapter slots at all."""
        view = self._view(self.sched_ref)
        n = None if view is None else view.lora_max_loaded
        return n is not None and n > 0

    def lora_wait(self, name: str) -> "asyncio.Future[str | None]":
        """Resolves with the adapter's state once it is no longer loading (None: unknown)."""
        return self.sched_ref.ask(LoraWait(name))

    @property
    def weight_version(self) -> str:
        """The version of the weights serving now (`--weight-version`, then each update's)."""
        return self._control()["weight_version"]

    @property
    def server_state(self) -> str:
        return self._control()["server"]["state"]

    def response(self, response_id: str) -> Any:
        """A stored response as the store published it (`StoredView`: its id, state, body,
        record), or None: never stored, deleted or evicted."""
        pub = self.system.published(self.responses_ref.name)
        return None if pub is None else pub["entries"].get(response_id)

    def responses_info(self) -> dict[str, Any]:
        pub = self.system.published(self.responses_ref.name)
        by_state: dict[str, int] = {}
        for v in pub["entries"].values():
            by_state[v.state.name] = by_state.get(v.state.name, 0) + 1
        return {"stored": len(pub["entries"]), "capacity": pub["capacity"], "by_state": by_state,
                "deleted": pub["deleted"], "evicted": pub["evicted"]}

    def server_info(self) -> dict[str, Any]:
        """What `/server_info` shows of the runtime, as plain data."""
        snap = self.snapshot()
        return {"server_state": snap.state, "server_reason": snap.reason,
                "pause_mode": snap.pause_mode, "health": snap.health,
                "health_reason": snap.health_reason,
                "watchdog": None if self.watchdog_config is None else {
                    "timeout_s": self.watchdog_config["timeout"], "interval_s": self.watchdog_config["interval"],
                    "stalled": snap.health == "unhealthy", "stalls": snap.stalls, "reason": snap.health_reason},
                "sessions": self.system.published(self.sessions_ref.name),
                "responses": self.responses_info(),
                "actors": len(self.system.actors),       # live actors: requests and the fixed ones
                "recorder": None if self.recorder is None else {
                    "events": len(self.recorder), "capacity": self.recorder.ring.capacity,
                    "ring_bytes": self.recorder.ring.memory()},
                "recent_controls": list(self._control()["recent_controls"])}

    def request_info(self, rid: str) -> dict[str, Any] | None:
        """A live request's kind and current state (as it published it on its last transition),
        or None when it is not running."""
        return self.system.requests.info(rid)

    def definitions(self) -> dict[str, Any]:
        return {name: lc.describe() for name, lc in LIFECYCLES.items()}

