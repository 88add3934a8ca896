"""`Sequence`: what the scheduler and the runner share about one request's tokens.

The scheduler owns the lists and the block table (through the `BlockManager`); the runner
reads them and writes KV into the slots they name. ``num_computed`` counts tokens whose KV
is in the cache; a step that is given ``(seq, n)`` computes tokens
``token_ids[num_computed : num_computed + n]`` and the scheduler advances ``num_computed``
after the step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .params import PoolingParams, SamplingParams


class LoraRef(NamedTuple):
    """A sequence's LoRA adapter (`engine.weights.lora`): its name, the slot it sits in, the load it
    is (``uid``, new for every load) and the digest of its weights (``key``, the prefix
    cache's salt: `BlockManager` chains its block hashes from it)."""

    name: str
    slot: int
    uid: int
    key: bytes


class Sequence:
    __slots__ = (
        "rid", "kind", "prompt_ids", "output_ids", "num_computed", "num_cached",
        "block_table", "block_hashes", "sampling", "pooling", "is_probe", "engine_state", "arrival",
        "grammar", "prompt_lp", "prompt_hashes", "prompt_hash_key",
        "penalty_state", "draft", "spec_index", "table_epoch", "priority", "order", "admitted",
        "min_stop_ids", "thinking", "think_gate", "lora",
    )

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        *,
        sampling: SamplingParams | None = None,
        pooling: PoolingParams | None = None,
        is_probe: bool = False,
        arrival: float = 0.0,
        priority: int = 0,
        lora: LoraRef | None = None,
    ) -> None:
        self.rid = rid
        self.kind = "pool" if pooling is not None else "generate"
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.num_computed = 0          # tokens whose KV is in the cache
        self.num_cached = 0            # of those, how many came from the prefix cache
        self.block_table: list[int] = []
        self.table_epoch = 0           # bumped each time the BlockManager clears the block table
        self.block_hashes: list[bytes] = []  # chain hashes of the full blocks registered so far
        # Chain hashes of the prompt's full blocks, computed once and kept (by the BlockManager:
        # a sequence waiting for memory retries its match every step, a retracted one is matched
        # again), with what they were computed for: (block size, the prompt list, its length,
        # the chain's root: b"" or the adapter's key).
        self.prompt_hashes: list[bytes] = []
        self.prompt_hash_key: tuple[int, list[int], int, bytes] | None = None
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.pooling = pooling
        self.is_probe = is_probe
        self.engine_state: Any = None  # opaque per-sequence state of the runner (e.g. a torch.Generator)
        self.arrival = arrival
        # Scheduling priority (``--scheduling-policy priority``, `engine.scheduling.priority`), and the
        # scheduler's arrival ordinal: ties between equal priorities go first come first served.
        self.priority = priority
        self.order = 0
        self.admitted = False          # the scheduler admitted it once (a queue deadline is over)
        # The grammar matcher of a constrained request (`engine.sampling.grammar`): made on the first
        # sampled token, advanced by every one after, kept across pause and retract.
        self.grammar: Any = None
        # Prompt logprobs computed so far, by position (`engine.sampling.prompt_logprobs`; the runner's).
        self.prompt_lp: dict[int, Any] | None = None
        # The sampler's incremental view of the tokens the penalties read (`engine.sampling.penalties.
        # PenaltyState`), made on the first penalised step; it follows appends to output_ids.
        self.penalty_state: Any = None
        # Speculative decoding (`engine.scheduling.speculative`): the drafts this step verifies after the
        # last token (set by the batch policy, cleared by the scheduler when the step is over),
        # and the n-gram index they are proposed from.
        self.draft: list[int] = []
        self.spec_index: Any = None
        # The thinking budget's count of reasoning tokens (`engine.sampling.thinking.ThinkCounter`),
        # made on the first budgeted step; it follows appends to output_ids.
        self.thinking: Any = None
        # Where a reasoning model's grammar stands (`engine.sampling.thinking.GrammarGate`): made on the
        # first constrained step of a ``grammar_after_think`` request; follows output_ids.
        self.think_gate: Any = None
        # The token ids that would end it (stop_token_ids, and EOS unless ignored), masked by
        # the sampler while fewer than `sampling.min_tokens` are out (set by whoever knows the
        # model's EOS: the runtime at submission).
        self.min_stop_ids: tuple[int, ...] = ()
        # The LoRA adapter it runs under (None: the base model), held from submission to its
        # end (`engine.weights.lora.LoraSlots.acquire`); its rows get the adapter's deltas and its KV
        # is cached apart from the base's and every other adapter's.
        self.lora = lora

    def stop_ids_masked(self) -> tuple[int, ...]:
        """The ids the sampler must not draw at this step (`min_stop_ids` until min_tokens)."""
        return self.min_stop_ids if len(self.output_ids) < self.sampling.min_tokens else ()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def prefill_complete(self) -> bool:
        """True once every prompt token has KV (the next step decodes)."""
        return self.num_computed >= len(self.prompt_ids)

    @property
    def prompt_logprob_from(self) -> int | None:
        """The first prompt position whose logits row feeds a prompt logprob while they are still
        owed, else None. Row ``r`` scores token ``r + 1``, so KV is reused (prefix cache) only
        below it. Once the first token is out they have been delivered: a recompute after a
        retraction owes none (a rule on the scheduler's own state, so re-execution follows it)."""
        sp = self.sampling
        if sp.prompt_logprobs is None or self.output_ids:
            return None
        return min(sp.logprob_start_len, len(self.prompt_ids) - 1)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids()[start:end]`` (``0 <= start``, ``0 <= end``) without building the whole
        list: only the range is copied, from the prompt, the output, or both."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    def __repr__(self) -> str:
        return (f"Sequence({self.rid!r}, {self.kind}, prompt={len(self.prompt_ids)}, "
                f"out={len(self.output_ids)}, computed={self.num_computed}, blocks={len(self.block_table)})")
