"""The scheduler's requests and their KV: one of the parts a scheduler is built from.

`Queues` holds every request a scheduler has (`seqs`, with the actor to tell), where each one
is (the probe lane, served first; the normal lane, FIFO or by priority; `running`, holding
KV), the members of the step in flight (`inflight`), and the `BlockManager`. It knows nothing
of the scheduler's lifecycle or of messages: the scheduler decides, the queues keep count.

Leaving is `remove`: a request in the step in flight keeps its blocks until the step is back
(`step_over`), since the worker thread may still read its block table; any other's blocks are
freed at once. `release` (handed in) is what else a leaving sequence gives back (the engine's
per-sequence state, its adapter's hold).
"""

from __future__ import annotations

from typing import Any, Callable

from ..engine.scheduling.lane import Lane
from ..messages import AbortRequest


class Queues:
    __slots__ = ("bm", "probe_lane", "lane", "running", "seqs", "actors", "inflight", "free_after_step",
                 "arrivals", "release")

    def __init__(self, bm: Any, lane: Any, release: Callable[[Any], None]) -> None:
        self.bm = bm
        self.probe_lane = Lane()             # waiting probes (served first), then the rest:
        self.lane = lane                     # FIFO or by priority, O(1) removal (an abort)
        self.running: list[Any] = []
        self.seqs: dict[str, Any] = {}
        self.actors: dict[str, Any] = {}
        self.inflight: dict[str, Any] = {}   # rid -> seq of the step being computed
        self.free_after_step: list[Any] = []
        self.arrivals = 0                    # submissions so far: each one's order (ties by it)
        self.release = release

    def add(self, seq: Any, actor: Any) -> None:
        """A new request (not queued yet: `enqueue`, or held by its adapter's load)."""
        self.seqs[seq.rid] = seq
        self.actors[seq.rid] = actor
        self.arrivals += 1
        seq.order = self.arrivals

    def enqueue(self, seq: Any) -> None:
        (self.probe_lane if seq.is_probe else self.lane).append(seq)

    def requeue(self, seqs: Any) -> None:
        """Put retracted requests back at the front of their own lane (a probe in the probe
        lane), in order: the first of `seqs` ends up first."""
        seqs = list(seqs)
        self.lane.extendleft(reversed([s for s in seqs if not s.is_probe]))
        self.probe_lane.extendleft(reversed([s for s in seqs if s.is_probe]))

    def live(self, seq: Any) -> bool:
        return self.seqs.get(seq.rid) is seq

    def remove(self, rid: str) -> tuple[Any, Any] | None:
        """Forget a request: (its sequence, its actor), or None if it is not here."""
        seq = self.seqs.pop(rid, None)
        actor = self.actors.pop(rid, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        elif not self.lane.discard(seq):
            self.probe_lane.discard(seq)
        if rid in self.inflight:
            self.free_after_step.append(seq)
        else:
            self.bm.free(seq)
            self.release(seq)
        return seq, actor

    def start(self, batch: list[tuple[Any, int]]) -> None:
        self.inflight.clear()
        self.inflight.update((seq.rid, seq) for seq, _ in batch)

    def step_over(self, batch: list[tuple[Any, int]]) -> None:
        """No step is in flight any more: drafts cleared, the blocks that waited for it freed."""
        for seq, _ in batch:
            seq.draft = []
        self.inflight.clear()
        for seq in self.free_after_step:
            self.bm.free(seq)
            self.release(seq)
        self.free_after_step.clear()

    def matches(self, msg: AbortRequest) -> list[str]:
        """The rids an `AbortRequest` names."""
        if msg.abort_all:
            return list(self.seqs)
        if msg.lora is not None:       # the requests holding an adapter (an unload that aborts)
            return [rid for rid, seq in self.seqs.items() if seq.lora is not None and seq.lora.name == msg.lora]
        if not msg.rid:  # an empty rid never matches everything
            return []
        if msg.prefix:
            return [rid for rid in self.seqs if rid.startswith(msg.rid)]
        return [msg.rid] if msg.rid in self.seqs else []
