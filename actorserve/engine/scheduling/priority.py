"""Priority scheduling (``--scheduling-policy priority``): the waiting queue ordered by each
request's `priority`, and preemption of lower-priority running requests.

A request's rank is its `priority` (``BatchConfig.priority_low_first``: a lower value goes
first, vLLM's order; otherwise a higher one, SGLang's default), then its arrival ordinal
(`Sequence.order`, given by the scheduler at submission): equal priorities stay first come first
served, and a retracted request goes back to its own place, ahead of later arrivals of its
priority. Health probes keep their own lane, served before any of this (and rank above every
business request here: a probe may retract one, never the other way round).

`PriorityPolicy` is `BatchPolicy` (continuous batching, chunked prefill, speculation) with
three differences:

1. Running sequences are planned best rank first, so when the cache cannot grow the one
   retracted is the lowest-priority, latest-arrived running request (cause ``kv_pressure``).
2. A waiting request whose blocks cannot be allocated retracts running requests of strictly
   lower priority, lowest first, until it fits (cause ``priority:<its rid>``); with none left
   it waits, and nothing overtakes it (no starvation among equals).
3. When the batch is full by count (``max_num_seqs``), the best waiting request takes the slot
   of the worst running one if that one has strictly lower priority (same cause).

`PriorityLane` is the waiting queue: a heap with lazy deletion, O(log n) append and pop, O(1)
removal from anywhere (an abort, a queue deadline), and the `Lane` surface the scheduler uses.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import Any

from .batching import BatchConfig, BatchPolicy, Plan
from .block_manager import BlockManager
from .lane import _tokens
from .sequence import Sequence

PROBE_RANK = float("-inf")


def rank_of(seq: Any, low_first: bool = True) -> tuple[float, int]:
    """Smaller is served first: (signed priority, arrival ordinal); probes before everything."""
    if getattr(seq, "is_probe", False):
        return (PROBE_RANK, seq.order)
    p = seq.priority
    return (p if low_first else -p, seq.order)


class PriorityLane:
    """Waiting sequences by rank (`rank_of`); the surface of `Lane`."""

    __slots__ = ("_heap", "_live", "tokens", "low_first")

    def __init__(self, items: Iterable[Any] = (), *, low_first: bool = True) -> None:
        self._heap: list[tuple[tuple[float, int], int, Any]] = []
        self._live: dict[int, Any] = {}
        self.tokens = 0
        self.low_first = low_first
        for seq in items:
            self.append(seq)

    def append(self, seq: Any) -> None:
        key = id(seq)
        if key in self._live:
            raise ValueError(f"{seq!r} is already in the lane")
        self._live[key] = seq
        self.tokens += _tokens(seq)
        heapq.heappush(self._heap, (rank_of(seq, self.low_first), key, seq))

    # A retracted request goes back to its rank's place, which is ahead of later arrivals.
    appendleft = append

    def extendleft(self, seqs: Iterable[Any]) -> None:
        for seq in seqs:
            self.append(seq)

    def _settle(self) -> None:
        """Drop removed entries from the top of the heap."""
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][1]) is not heap[0][2]:
            heapq.heappop(heap)

    def peek(self) -> Any:
        self._settle()
        if not self._heap:
            raise IndexError("peek from an empty lane")
        return self._heap[0][2]

    def popleft(self) -> Any:
        self._settle()
        if not self._heap:
            raise IndexError("pop from an empty lane")
        _, key, seq = heapq.heappop(self._heap)
        del self._live[key]
        self.tokens -= _tokens(seq)
        return seq

    def discard(self, seq: Any) -> bool:
        gone = self._live.pop(id(seq), None)
        if gone is None:
            return False
        self.tokens -= _tokens(gone)
        if len(self._heap) > 2 * len(self._live) + 64:     # bound the stale entries
            self._heap = [e for e in self._heap if self._live.get(e[1]) is e[2]]
            heapq.heapify(self._heap)
        return True

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()
        self.tokens = 0

    def __contains__(self, seq: object) -> bool:
        return self._live.get(id(seq)) is seq

    def __iter__(self) -> Iterator[Any]:
        """In service order."""
        return iter(sorted(self._live.values(), key=lambda s: rank_of(s, self.low_first)))

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __repr__(self) -> str:
        return f"PriorityLane({list(self)!r})"


class PriorityPolicy(BatchPolicy):
    def __init__(self, config: BatchConfig | None = None) -> None:
        super().__init__(config)
        self.low_first = self.config.priority_low_first

    def rank(self, seq: Sequence) -> tuple[float, int]:
        return rank_of(seq, self.low_first)

    def _outranks(self, a: Sequence, b: Sequence) -> bool:
        """`a` has strictly higher priority than `b` (arrival order does not count)."""
        return self.rank(a)[0] < self.rank(b)[0]

    def preempts(self, seq: Sequence, members: Iterable[Sequence]) -> bool:
        """A business request that no member of the step in flight outranks and that outranks
        some: its class's own members lose that step's work too, but the next step is the
        best class's alone (`plan`), so they get their token about when they would have, and
        the arrival its first one a whole wide step earlier. A probe neither asks (it is no
        one's latency) nor is a probe's step given up."""
        members = list(members)
        return (not getattr(seq, "is_probe", False) and any(self._outranks(seq, m) for m in members)
                and not any(self._outranks(m, seq) for m in members))

    def plan(self, running: list[Sequence], lanes: list[Any], bm: BlockManager) -> Plan:
        """`BatchPolicy.plan`, then a step of its own for a request's first token: when a
        member of the best priority in the batch is still prefilling, the members of lower
        priority sit this step out (still running, their blocks kept; drafts dropped). When
        that step ends a best-class prompt (its first token is sampled in it), the best class's
        own decoding members sit it out too: the prompt's step is as narrow as it can be, as
        SGLang runs a prefill batch apart from the decode batch. They lose one step's turn per
        such prompt, never more: the chunks of a longer prompt before its last keep them."""
        out = super().plan(running, lanes, bm)
        if len(out.batch) < 2:
            return out
        best = min(self.rank(s)[0] for s, _ in out.batch)
        first = [(s, n) for s, n in out.batch
                 if self.rank(s)[0] == best and not s.is_probe and not s.prefill_complete]
        if not first:
            return out
        ends = any(s.num_computed + n >= len(s.prompt_ids) for s, n in first)
        keep = [(s, n) for s, n in out.batch
                if self.rank(s)[0] == best and not (ends and s.prefill_complete)]
        if len(keep) < len(out.batch):
            kept = {id(s) for s, _ in keep}
            for s, _ in out.batch:
                if id(s) not in kept:
                    s.draft = []
            out.batch[:] = keep
        return out

    def new_lane(self) -> PriorityLane:
        return PriorityLane(low_first=self.low_first)

    def _before(self, out: Plan, running: list[Sequence], lanes: list[Any], bm: BlockManager) -> int:
        running.sort(key=self.rank)          # best first: the worst is retracted first
        cap = self.config.max_num_seqs
        while len(running) >= cap:
            best = next((lane.peek() for lane in lanes if lane), None)
            if best is None or not self._outranks(best, running[-1]):
                break
            victim = running.pop()
            bm.free(victim)
            self._retract(out, victim, f"priority:{best.rid}")
        return 0

    def _make_room(self, out: Plan, seq: Sequence, n: int, running: list[Sequence],
                   bm: BlockManager) -> int | None:
        freed = 0
        fresh = {id(s) for s, _ in out.admitted}     # admitted this step: not retracted in it
        while True:
            worst = max((r for r in running if id(r) not in fresh), key=self.rank, default=None)
            if worst is None or not self._outranks(seq, worst):
                return None          # what was retracted stays retracted: it freed blocks
            running.remove(worst)
            for j, (member, tokens) in enumerate(out.batch):
                if member is worst:          # planned for this step already: give its room back
                    del out.batch[j]
                    freed += tokens
                    break
            worst.draft = []
            bm.free(worst)
            self._retract(out, worst, f"priority:{seq.rid}")
            if bm.allocate(seq, n):
                return freed


def make_policy(config: BatchConfig | None) -> BatchPolicy:
    """The batch policy `config.scheduling_policy` names."""
    if config is not None and config.scheduling_policy == "priority":
        return PriorityPolicy(config)
    return BatchPolicy(config)
