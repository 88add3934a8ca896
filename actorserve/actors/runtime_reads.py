"""The runtime's read side (`RuntimeReads`, a base of `Runtime`): stats, snapshots and plain-data
views of the actors for the HTTP layer and tests (`stats()`, `snapshot()`, `server_info()`,
`request_info(rid)`, the LoRA adapters, the weights' version). Each returns data, never an
actor, so a caller cannot reach into one; ``live_actors`` is for tests."""

from __future__ import annotations

import asyncio
from typing import Any

from ..messages import LoraWait
from ..statemachines import LIFECYCLES
from .actor import Actor
from .request import RequestActor
from .scheduler import SchedulerStats
from .surface import ServerSnapshot


class RuntimeReads:
    # set by Runtime
    scheduler: Any
    pool_schedulers: dict[str, Any]
    engine: Any
    control_actor: Any
    watchdog: Any
    sessions: Any
    responses: Any
    system: Any
    recorder: Any
    shed: int

    # -- introspection: snapshots, never actors ------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def pool_stats(self) -> dict[str, SchedulerStats]:
        """Stats of each pooling engine's scheduler, by target name."""
        return {key: s.stats() for key, s in self.pool_schedulers.items()}

    @property
    def engine_info(self) -> Any:
        """The generation engine's geometry (`EngineInfo`: a frozen dataclass)."""
        return self.engine.info

    def snapshot(self) -> ServerSnapshot:
        return ServerSnapshot(**self.control_actor.snapshot(), shed=self.shed)

    def loras(self) -> list[dict[str, Any]]:
        """The live LoRA adapters (loading, ready, unloading) as plain data, load order."""
        return self.scheduler.describe_loras()

    def lora_state(self, name: str) -> str | None:
        """The state of adapter `name` (``loading``, ``ready``, ``unloading``), None: not loaded."""
        m = self.scheduler.loras.get(name)
        return None if m is None else m.state.name

    @property
    def lora_enabled(self) -> bool:
        """Whether the generation engine has adapter slots at all."""
        return self.scheduler.lora_slots is not None and self.scheduler.lora_slots.max_loaded > 0

    def lora_wait(self, name: str) -> "asyncio.Future[str | None]":
        """Resolves with the adapter's state once it is no longer loading (None: unknown)."""
        return self.scheduler.ask(LoraWait(name))

    @property
    def weight_version(self) -> str:
        """The version of the weights serving now (`--weight-version`, then each update's)."""
        return self.control_actor.weights.version

    @property
    def server_state(self) -> str:
        return self.control_actor.server.state.name

    def server_info(self) -> dict[str, Any]:
        """What `/server_info` shows of the runtime, as plain data."""
        snap = self.snapshot()
        return {"server_state": snap.state, "server_reason": snap.reason,
                "pause_mode": snap.pause_mode, "health": snap.health,
                "health_reason": snap.health_reason,
                "watchdog": None if self.watchdog is None else {
                    **self.watchdog.status(), "stalled": snap.health == "unhealthy",
                    "stalls": snap.stalls, "reason": snap.health_reason},
                "sessions": self.sessions.describe(),
                "responses": self.responses.describe(),
                "actors": len(self.system.actors),       # live actors: requests and the fixed ones
                "recorder": None if self.recorder is None else {
                    "events": len(self.recorder), "capacity": self.recorder.ring.maxlen},
                "recent_controls": [{"rid": r.rid, "op": r.op, "state": r.state.name,
                                     "message": r.result.message if r.result else ""}
                                    for r in self.control_actor.history]}

    def request_info(self, rid: str) -> dict[str, Any] | None:
        """A live request's kind and current state, or None when it is not running."""
        actor = self.system.get(f"req:{rid}")
        if not isinstance(actor, RequestActor):
            return None
        return {"rid": rid, "kind": actor.lifecycle.name, "state": actor.state.name,
                "probe": actor.is_probe, "live": actor.alive}

    def live_actors(self) -> list[Actor]:
        return [a for a in self.system.actors.values() if isinstance(a, RequestActor)]

    def definitions(self) -> dict[str, Any]:
        return {name: lc.describe() for name, lc in LIFECYCLES.items()}

