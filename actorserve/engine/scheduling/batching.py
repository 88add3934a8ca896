"""Batching policy: which sequences run in the next step, and how many tokens each.

Pure code over `Sequence` and `BlockManager`; the scheduler actor owns the queues and asks
`plan()` once per step. The policy is continuous batching with chunked prefill under a token
budget, first come first served:

1. Running sequences first, oldest first: a decode costs one token, an unfinished prefill a
   chunk of what is left of the budget. When the KV cache cannot grow for one of them, the
   youngest running sequence is *retracted* (its blocks freed; it is recomputed later) until
   the older one fits — a full cache slows requests down, it never crashes the server.
2. Then waiting sequences, probes' lane first: each is matched against the prefix cache,
   then given a chunk of the remaining budget if its blocks can be allocated. The first one
   that does not fit stops admission (no overtaking, so no starvation).

3. Speculative decoding (``BatchConfig.speculative``, `engine.scheduling.speculative`): while at most
   ``speculative_max_batch`` sequences run, an eligible decode gets n-gram drafts in
   ``seq.draft`` and computes ``1 + len(draft)`` tokens, if their blocks are free without
   retracting anyone (else it decodes one token, as without speculation).

`plan()` never touches a sequence's token lists; it only allocates or frees blocks, sets the
drafts, and returns the decision.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .base import context_capacity
from .block_manager import BlockManager
from .lane import Lane
from .sequence import Sequence
from .speculative import SpecConfig, eligible, propose


SCHEDULING_POLICIES = ("fcfs", "priority")
KV_PRESSURE = "kv_pressure"       # a retraction's cause: a running request could not grow


@dataclass(frozen=True, slots=True)
class BatchConfig:
    max_num_seqs: int = 64            # sequences in one step
    # Tokens computed in one step (prefill chunks + decodes), and the largest prefill chunk of
    # one sequence in one step: no cap beyond the budget, so the oldest waiting prompt takes
    # what it needs and reaches its first token first (vLLM's and SGLang's order). Long
    # prompts, 8 at a time (benchmarks/peers.py --long 8:16:830:32, 2-core AMD EPYC): TTFT p50
    # 6.4 s with (2048, 512), where four prompts shared every step and all finished together;
    # 4.5 s with (2048, 2048); 2.5 s with (1024, 1024), whose shorter steps also keep the
    # running streams' decodes closer together; 3.0 s with (512, 512).
    max_batch_tokens: int = 1024
    max_prefill_chunk: int = 1024
    # Speculative decoding (`engine.scheduling.speculative`; flat fields, so a recording's set-up rebuilds
    # them): None = off, "ngram" = prompt-lookup drafts of up to `speculative_tokens` a step,
    # while at most `speculative_max_batch` sequences decode.
    speculative: str | None = None
    speculative_tokens: int = 4
    speculative_max_batch: int = 8
    speculative_min_ngram: int = 1
    speculative_max_ngram: int = 3
    # Which waiting request goes first (`engine.scheduling.priority`): "fcfs" (arrival order) or
    # "priority" (by the request's `priority`, then arrival; a higher-priority arrival may
    # retract a lower-priority running request); `priority_low_first`: a lower value is served
    # first (vLLM's order; SGLang's default is the other way, see serve --enable-priority-scheduling).
    scheduling_policy: str = "fcfs"
    priority_low_first: bool = True
    # Distinct LoRA adapters in one step (``--max-loras``; None: any number): a waiting request
    # under an adapter no running request has waits, at the head of its queue, while as many
    # adapters run already (the base model is not an adapter).
    max_loras: int | None = None

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_batch_tokens, self.max_prefill_chunk) < 1:
            raise ValueError("batch limits must be >= 1")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        self.spec_config()          # validates the speculative fields

    def spec_config(self) -> SpecConfig:
        return SpecConfig(self.speculative, self.speculative_tokens, self.speculative_max_ngram,
                          self.speculative_min_ngram, self.speculative_max_batch)


@dataclass(slots=True)
class Plan:
    batch: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, cached tokens)
    retracted: list[Sequence] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)   # why each of `retracted` was (same order)


class BatchPolicy:
    def __init__(self, config: BatchConfig | None = None) -> None:
        self.config = config or BatchConfig()
        self.spec = self.config.spec_config()
        self.max_len: int | None = None   # the engine's context limit (the scheduler sets it)
        self.preemptions = 0          # sequences retracted for want of KV blocks (a counter)
        self.preempted: dict[int, int] = {}   # the same, by the retracted request's priority

    def new_lane(self) -> Lane:
        """The waiting queue this policy serves from (FIFO here; `engine.scheduling.priority` orders it)."""
        return Lane()

    def preempts(self, seq: Sequence, members: Iterable[Sequence]) -> bool:
        """Whether `seq`'s arrival is worth giving up the step in flight of `members` for
        (the priority policy's question; first come, first served never does)."""
        return False

    def _retract(self, out: Plan, victim: Sequence, cause: str) -> None:
        out.retracted.append(victim)
        out.causes.append(cause)
        self.preemptions += 1
        self.preempted[victim.priority] = self.preempted.get(victim.priority, 0) + 1

    def plan(self, running: list[Sequence], lanes: list[Lane], bm: BlockManager) -> Plan:
        """Choose the next step. `running` is oldest-first and may shrink (retraction);
        admitted sequences are popped from the front of `lanes` (highest priority first)."""
        cfg = self.config
        out = Plan()
        budget = cfg.max_batch_tokens
        budget -= self._before(out, running, lanes, bm)
        spec = self.spec.enabled and len(running) <= self.spec.max_batch
        kv_short = False
        i = 0
        while i < len(running) and budget > 0 and len(out.batch) < cfg.max_num_seqs:
            seq = running[i]
            n = min(seq.num_uncomputed, budget, cfg.max_prefill_chunk)
            if n <= 0:
                i += 1
                continue
            if spec and n == 1 and seq.prefill_complete and self._speculate(seq, budget, bm):
                out.batch.append((seq, 1 + len(seq.draft)))
                budget -= 1 + len(seq.draft)
                i += 1
                continue
            if not bm.allocate(seq, n):
                victim = running[-1]
                running.pop()
                bm.free(victim)
                self._retract(out, victim, KV_PRESSURE)
                kv_short = True
                if victim is seq:
                    break
                continue
            out.batch.append((seq, n))
            budget -= n
            i += 1
        if kv_short:
            return out  # memory is short: admit nothing new this step
        adapters = {s.lora.uid for s in running if s.lora is not None} if cfg.max_loras else None
        for lane in lanes:
            while lane and budget > 0 and len(out.batch) < cfg.max_num_seqs:
                seq = lane.peek()
                if adapters is not None and seq.lora is not None and seq.lora.uid not in adapters:
                    if len(adapters) >= cfg.max_loras:      # type: ignore[operator]
                        break          # --max-loras: it waits (no overtaking) for an adapter to leave
                    adapters.add(seq.lora.uid)
                cached = bm.match_prefix(seq)
                n = min(seq.num_uncomputed, budget, cfg.max_prefill_chunk)
                if not bm.allocate(seq, n):
                    freed = self._make_room(out, seq, n, running, bm)
                    if freed is None:
                        bm.abort_match(seq)     # stays queued; its query is counted on admission
                        return out
                    budget += freed
                lane.popleft()
                running.append(seq)
                out.admitted.append((seq, cached))
                out.batch.append((seq, n))
                budget -= n
        return out

    # -- hooks of a policy that orders by priority (`engine.scheduling.priority`); FCFS has none --------------
    def _before(self, out: Plan, running: list[Sequence], lanes: list[Lane], bm: BlockManager) -> int:
        """Called before the running sequences are planned; returns budget it used (none)."""
        return 0

    def _make_room(self, out: Plan, seq: Sequence, n: int, running: list[Sequence],
                   bm: BlockManager) -> int | None:
        """Waiting `seq` does not fit: free room for it by retracting others and allocate its
        `n` tokens, returning the step budget given back; None: it waits (FCFS never overtakes)."""
        return None

    def _speculate(self, seq: Sequence, budget: int, bm: BlockManager) -> bool:
        """Give a decoding `seq` drafts (`seq.draft`) when it is eligible, some are proposed and
        their blocks can be had without retracting anyone; False: it decodes plainly."""
        if not eligible(seq):
            return False
        sp = seq.sampling
        limit = context_capacity(self.max_len, bm.num_blocks, bm.block_size)
        room = min(sp.max_new_tokens - len(seq.output_ids), limit - seq.num_tokens)
        k = min(self.spec.num_tokens, budget - 1, room - 1)
        draft = propose(seq, self.spec, k) if k > 0 else []
        if not draft or not bm.allocate(seq, 1 + len(draft)):
            return False
        seq.draft = draft
        return True


def step_stage(members: Iterable[tuple[int, int, bool]]) -> str:
    """A step's stage (SGLang's forward-mode split, what the profiler's ``merge_profiles``
    separates) from its members' ``(tokens this step, output tokens so far, pooling)``:
    ``prefill`` when any member computes more than one token, has no output yet or pools."""
    return "prefill" if any(n > 1 or out == 0 or pool for n, out, pool in members) else "decode"
