"""The runtime's hooks for the tools that drive it from outside the actors (`RuntimeHooks`, a
base of `Runtime`): the set-up a recording starts with (`setup`), re-execution's take-over of
the off-loop work (`take_over`). The set-up is the schedulers' configuration as the runtime
built them (never read off an actor); the take-over is set before `begin` spawns the actors. (The profiler reads a
step's stage from the recorder's ``step`` note.)"""

from __future__ import annotations

import dataclasses
from typing import Any


def fields_of(obj: Any) -> dict[str, Any]:
    """A parameters / message dataclass as a plain dict (shallow)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


_SCHED_KEYS = ("engine", "batch", "batch_wait_s", "prefix_cache")     # a scheduler's part of the set-up


class RuntimeHooks:
    # set by Runtime
    setups: dict[str, Any]
    _unspawned: dict[str, Any]       # the actors built and not yet spawned (until `begin`)
    responses_capacity: int
    max_queue_time: float | None
    watchdog_config: dict[str, float] | None

    def setup(self) -> dict[str, Any]:
        """What re-execution needs to rebuild this runtime around model stand-ins (configuration,
        not state): each scheduler's from what it was built with (`setups`, the same data it
        publishes in its view), never read off an actor; and the runtime's own."""
        gen = self.setups[""]
        return {"generation": {k: gen[k] for k in _SCHED_KEYS},
                "pooling": {key: {k: s[k] for k in _SCHED_KEYS} for key, s in self.setups.items() if key},
                "responses_store": self.responses_capacity,
                "max_queue_time_s": self.max_queue_time,
                "weight_version": gen["weight_version"],
                "lora": gen["lora"],
                "watchdog": self.watchdog_config}

    def take_over(self, *, steps: Any = None, policy: Any = None, loads: Any = None,
                  lora_reads: Any = None, weight_reads: Any = None) -> None:
        """Re-execution's hooks (`replay.reexec`), set before `begin`: who runs each model step
        (``steps(ref, fn, batch, wrap=...)``, every scheduler), the generation scheduler's batch
        policy, who runs a weight load at the step barrier, an adapter's read, a weight update's
        read. Each runner gets the ref of the actor to tell the outcome."""
        built = self._unspawned
        if not built:
            raise RuntimeError("take_over is set before the runtime begins")
        if steps is not None:
            for key, actor in built.items():
                if key == "scheduler" or key.startswith("pool:"):
                    actor.runner = steps
        sched = built["scheduler"]
        if policy is not None:
            sched.policy = policy
        if loads is not None:
            sched.load_runner = loads
        if lora_reads is not None:
            sched.lora_runner = lora_reads
        if weight_reads is not None:
            built["control"].weights_reader = weight_reads
