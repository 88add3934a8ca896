"""`SchedulerStats`: what a scheduler actor shows of itself, as plain data (metrics, /server_info)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..statemachines import SchedulerState

K = SchedulerState


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


def stats_of(sched: Any) -> SchedulerStats:
    """A snapshot of a scheduler actor (plain data, read at one moment)."""
    kv = sched.bm.stats()
    return SchedulerStats(
        state=sched.state.name, waiting=len(sched.lane) + len(sched.probe_lane), running=len(sched.running),
        paused_mode=sched.paused_mode, step_in_flight=sched.state in (K.stepping, K.pausing),
        steps=sched.step_id, live_requests=len(sched.seqs), kv_used_blocks=kv.used_blocks,
        kv_free_blocks=kv.free_blocks, kv_cached_blocks=kv.cached_free_blocks,
        kv_usage=kv.usage, prefix_hit_rate=kv.hit_rate,
        generated_tokens=sched.generated_tokens, prompt_tokens=sched.prompt_tokens,
        isolations=sched.isolations, isolated_failures=sched.isolated_failures,
        preemptions=getattr(sched.policy, "preemptions", 0), pause_retractions=sched.pause_retractions,
        prefix_queries=kv.prefix_queries_total, prefix_hits=kv.prefix_hits_total)
