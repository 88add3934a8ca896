"""The runtime's hooks for the tools that drive it from outside the actors (`RuntimeHooks`, a
base of `Runtime`): the set-up a recording starts with (`setup`), re-execution's take-over of
the off-loop work (`take_over`), and the profiler's look at the step being started
(`step_seqs`). Each is set or read outside any turn, or inside the very turn it concerns."""

from __future__ import annotations

import dataclasses
from typing import Any


def fields_of(obj: Any) -> dict[str, Any]:
    """A parameters / message dataclass as a plain dict (shallow)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


class RuntimeHooks:
    # set by Runtime
    scheduler: Any
    pool_schedulers: dict[str, Any]
    control_actor: Any
    responses_capacity: int
    max_queue_time: float | None
    watchdog_config: dict[str, float] | None

    def setup(self) -> dict[str, Any]:
        """What re-execution needs to rebuild this runtime around model stand-ins: read off the
        actors as built, before `begin` spawns them (configuration, not state)."""
        def sched(s: Any) -> dict[str, Any]:
            return {"engine": fields_of(s.engine.info), "batch": fields_of(s.policy.config),
                    "batch_wait_s": s.batch_wait_s, "prefix_cache": s.bm.enable_prefix_cache}
        return {"generation": sched(self.scheduler),
                "pooling": {key: sched(s) for key, s in self.pool_schedulers.items()},
                "responses_store": self.responses_capacity,
                "max_queue_time_s": self.max_queue_time,
                "weight_version": self.scheduler.weight_version,
                "lora": None if self.scheduler.lora_slots is None else {
                    "max_loaded": self.scheduler.lora_slots.max_loaded,
                    "max_rank": self.scheduler.lora_slots.max_rank},
                "watchdog": self.watchdog_config}

    def take_over(self, *, steps: Any = None, policy: Any = None, loads: Any = None,
                  lora_reads: Any = None, weight_reads: Any = None) -> None:
        """Re-execution's hooks (`replay.reexec`), set before `begin`: who runs each model step
        (``steps(ref, fn, batch, wrap=...)``, every scheduler), the generation scheduler's batch
        policy, who runs a weight load at the step barrier, an adapter's read, a weight update's
        read. Each runner gets the ref of the actor to tell the outcome."""
        scheds = [self.scheduler, *self.pool_schedulers.values()]
        if steps is not None:
            for s in scheds:
                s.runner = steps
        if policy is not None:
            self.scheduler.policy = policy
        if loads is not None:
            self.scheduler.load_runner = loads
        if lora_reads is not None:
            self.scheduler.lora_runner = lora_reads
        if weight_reads is not None:
            self.control_actor.weights_reader = weight_reads

    def step_seqs(self) -> Any:
        """rid -> the generation scheduler's sequence of the step it is starting (the profiler
        reads it inside that turn, through the recorder's step event)."""
        sched = self.scheduler
        return lambda rid: sched.inflight.get(rid) or sched.seqs.get(rid)
