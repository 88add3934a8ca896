"""`SchedulerStats`: what a scheduler actor shows of itself, as plain data (metrics, /server_info)."""

from __future__ import annotations

import dataclasses
import logging

from dataclasses import dataclass
from typing import Any

from ..engine.scheduling.batching import BatchConfig
from ..statemachines import STEP_IN_FLIGHT



log = logging.getLogger("actorserve.scheduler")


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    state: str
    waiting: int
    running: int
    paused_mode: str | None
    step_in_flight: bool
    steps: int
    live_requests: int
    kv_used_blocks: int
    kv_free_blocks: int
    kv_cached_blocks: int
    kv_usage: float
    prefix_hit_rate: float
    generated_tokens: int
    prompt_tokens: int
    isolations: int
    isolated_failures: int
    preemptions: int = 0            # requests retracted for want of KV blocks (since start)
    pause_retractions: int = 0      # running requests retracted by pause_generation(retract)
    prefix_queries: int = 0         # tokens looked up in the prefix cache (since start)
    prefix_hits: int = 0            # of those, tokens found cached
    spec_steps: int = 0             # speculative verifications (a member's step with drafts)
    spec_draft_tokens: int = 0      # drafts checked in them
    spec_accepted_tokens: int = 0   # of those, accepted
    queue_timeouts: int = 0         # requests ended by --max-queue-time (still queued)
    preempted_by_priority: tuple[tuple[int, int], ...] = ()   # (priority, retracted), by priority
    lora_requests: tuple[tuple[str, int], ...] = ()   # (adapter, requests admitted under it), by name
    loras_loaded: int = 0                             # LoRA adapters ready now

    @property
    def avg_spec_accept_length(self) -> float:
        """Tokens a verify step yields on average (1 + accepted drafts); 0 without any."""
        return (self.spec_steps + self.spec_accepted_tokens) / self.spec_steps if self.spec_steps else 0.0


def stats_of(sched: Any) -> SchedulerStats:
    """A snapshot of a scheduler actor (plain data, read at one moment)."""
    kv = sched.bm.stats()
    return SchedulerStats(
        state=sched.state.name, waiting=len(sched.lane) + len(sched.probe_lane), running=len(sched.running),
        paused_mode=sched.paused_mode, step_in_flight=sched.state in STEP_IN_FLIGHT,
        steps=sched.step_id, live_requests=len(sched.seqs), kv_used_blocks=kv.used_blocks,
        kv_free_blocks=kv.free_blocks, kv_cached_blocks=kv.cached_free_blocks,
        kv_usage=kv.usage, prefix_hit_rate=kv.hit_rate,
        generated_tokens=sched.generated_tokens, prompt_tokens=sched.prompt_tokens,
        isolations=sched.isolator.isolations, isolated_failures=sched.isolator.isolated_failures,
        preemptions=getattr(sched.policy, "preemptions", 0), pause_retractions=sched.pause_retractions,
        prefix_queries=kv.prefix_queries_total, prefix_hits=kv.prefix_hits_total,
        spec_steps=getattr(sched, "spec_steps", 0), spec_draft_tokens=getattr(sched, "spec_draft_tokens", 0),
        spec_accepted_tokens=getattr(sched, "spec_accepted_tokens", 0),
        queue_timeouts=getattr(sched, "queue_timeouts", 0),
        preempted_by_priority=tuple(sorted(getattr(sched.policy, "preempted", {}).items())),
        lora_requests=tuple(sorted(getattr(sched, "lora_requests", {}).items())),
        loras_loaded=sum(1 for m in getattr(sched, "loras", {}).values() if m.state.name == "ready"))


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """What a scheduler publishes after each turn (`Actor.publish`): all the runtime reads of it."""
    stats: SchedulerStats
    queued: int                  # requests in its normal lane (admission control)
    queued_tokens: int           # their prompt tokens
    max_num_seqs: int
    scheduling_policy: str       # fcfs | priority
    idle: bool                   # no request and no step in flight
    steps_done: int
    loras: tuple[dict[str, Any], ...] = ()     # the live LoRA adapters, load order
    lora_max_loaded: int | None = None         # None: the engine has no adapter slots
    setup: Any = None            # its configuration as plain data (`setup_of`, made once at its start)


def view_of(sched: Any) -> SchedulerView:
    slots = sched.lora_slots
    return SchedulerView(stats_of(sched), len(sched.lane), sched.lane.tokens,
                         sched.policy.config.max_num_seqs, sched.policy.config.scheduling_policy, sched.idle, sched.steps_done,
                         tuple(sched.describe_loras()) if sched.loras else (),
                         None if slots is None else slots.max_loaded, sched.setup)


def setup_of(engine: Any, batch: Any, batch_wait_s: float, prefix_cache: bool,
             weight_version: str) -> dict[str, Any]:
    """A scheduler's configuration as plain data, what a recording starts with (`Runtime.setup`),
    from what it is built with: its engine's geometry, its batching as it runs (`batch_it_runs`),
    its batching window, the prefix cache, the weights' label, the engine's adapter slots."""
    slots = getattr(engine, "lora", None)
    return {"engine": _fields(engine.info), "batch": _fields(batch), "batch_wait_s": batch_wait_s,
            "prefix_cache": prefix_cache, "weight_version": weight_version,
            "lora": None if slots is None else {"max_loaded": slots.max_loaded, "max_rank": slots.max_rank}}


def batch_it_runs(engine: Any, batch: Any, name: str) -> Any:
    """The batching a scheduler over `engine` runs: `batch` (or the default), without
    speculation where the engine cannot verify drafts (what is recorded is what runs)."""
    batch = batch or BatchConfig()
    if batch.speculative and not getattr(engine, "verifies_drafts", False):
        log.warning("%s: the engine cannot verify drafts (%s): speculative decoding is off",
                    name, type(engine).__name__)
        batch = dataclasses.replace(batch, speculative=None)
    return batch


def _fields(obj: Any) -> dict[str, Any]:
    """A configuration dataclass as a plain dict (shallow)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
