"""The engine interface the scheduler drives; the real runner and the fake engine both fill it.

`execute` is synchronous and is called from a worker thread, one step at a time. The
scheduler chooses each step's members: a sequence left out is paused, an aborted one has
its blocks released and never appears again. Before the step the scheduler has already
allocated blocks so that ``seq.block_table`` covers ``num_computed + n``.

For a member whose step reaches the end of its known tokens the engine returns a
`SeqOutput`: a sampled ``token_id`` for a generation sequence, ``pooled`` values for a
pooling sequence. A prefill chunk that stops short of the end returns an output with
neither (``token_id is None and pooled is None``).

An engine may carry ``preempt`` (a `PreemptFlag`, or any object with a `threading.Event`'s
``set``/``clear``/``is_set``): the scheduler sets it when a request
that outranks the step in flight arrives (`actors.step_preempt`), and the engine checks it between
layers; set, it gives the step up by raising `StepPreempted` -- no member advances (the KV it
wrote past ``num_computed`` is written again by the step that recomputes those tokens). The
scheduler clears it before each step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .sequence import Sequence


class StepPreempted(Exception):
    """The step was given up at a layer boundary because ``engine.preempt`` was set."""


class PreemptFlag:
    """The scheduler's ask to give the step in flight up, as one C int: `set`, `clear` and
    `is_set` as a `threading.Event`'s (nothing waits on it), and `address`, where a step that
    runs its layers in C (`engine.kernels.fused_step`) reads it at each layer boundary. The
    scheduler writes it on the event loop's thread while the step thread reads it."""

    __slots__ = ("_cell",)

    def __init__(self) -> None:
        self._cell = ctypes.c_int32(0)

    def set(self) -> None:
        self._cell.value = 1

    def clear(self) -> None:
        self._cell.value = 0

    def is_set(self) -> bool:
        return self._cell.value != 0

    @property
    def address(self) -> int:
        return ctypes.addressof(self._cell)


@dataclass(slots=True)
class SeqOutput:
    seq: Sequence
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    pooled: Any = None
    # The engine's own verdict on a generated token: its grammar has ended (``stop``), or the
    # request cannot go on (``error``, e.g. its grammar refused the token): that request only.
    stop: bool = False
    error: str | None = None
    # Logprobs of the requested ids (`SamplingParams.token_ids_logprob`) at this token: [(id, lp)].
    ids_logprobs: list[tuple[int, float]] | None = None
    # With the first token of a request that asked for them: its prompt's logprobs.
    prompt_logprobs: "PromptLogprobs | None" = None
    # A speculating member (``seq.draft`` non-empty) with ``a`` drafts accepted yields ``a + 1``
    # tokens: `token_id` (the model's token after the last known one), then `extra`, the ``a``
    # further ones in order, each its own output with its logprobs (the model's tokens after
    # each accepted draft; the first ``a`` tokens are the accepted drafts themselves). Empty:
    # a shared empty tuple, so a plain token's output makes no list.
    extra: "list[SeqOutput] | tuple[SeqOutput, ...]" = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """What the engine says of a prompt's tokens from position `start` on (entry ``j`` is prompt
    token ``start + j``): the log-probability of each given the tokens before it, its rank
    in that distribution (1 = the most likely), the ``k`` most likely tokens there (`top`,
    when ``SamplingParams.prompt_logprobs`` > 0) and the logprobs of the requested ids (`ids`).
    The first entry is never scored (None everywhere), as in SGLang and vLLM. Plain data."""

    start: int
    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[list[tuple[int, float]] | None] | None = None
    ids: list[list[tuple[int, float]] | None] | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_name: str
    block_size: int
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    kind: str = "generate"          # generate | embed
    dtype: str = "float32"          # the weights' and the KV cache's (sampling is always fp32)
    attention: str = ""             # how decode attention runs, and why (`engine.kernels.decode_kernel`)

    @property
    def capacity(self) -> int:
        """Tokens one sequence may hold (prompt + output): `context_capacity` of this engine."""
        return context_capacity(self.max_model_len, self.num_blocks, self.block_size)


def context_capacity(max_model_len: int | None, num_blocks: int, block_size: int) -> int:
    """Tokens one sequence may hold (prompt + output): the model's context length, at most
    what the KV cache holds (``num_blocks * block_size``); None: the KV cache alone."""
    kv = num_blocks * block_size
    return kv if max_model_len is None else min(int(max_model_len), kv)


@runtime_checkable
class Engine(Protocol):
    info: EngineInfo

    def execute(self, batch: list[tuple[Sequence, int]]) -> list[SeqOutput]:
        """Run one model step over `batch` = [(sequence, n_tokens_to_compute)]."""
        ...

    def release(self, seq: Sequence) -> None:
        """Forget per-sequence engine state (called once when the sequence leaves)."""
        ...


def _eos_ids(model: Any, tokenizer: Any = None) -> tuple[int, ...]:
    found: list[int] = []
    sources = [getattr(getattr(model, "generation_config", None), "eos_token_id", None),
               getattr(model.config, "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None]
    for value in sources:
        for tok in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(tok, int) and tok >= 0 and tok not in found:
                found.append(tok)
    return tuple(found)


def engine_info(model: Any, *, num_blocks: int, block_size: int, tokenizer: Any = None,
                model_name: str | None = None, max_model_len: int | None = None) -> EngineInfo:
    """EngineInfo from the model's config. ``max_model_len`` is capped by the position
    table, by a sliding window (attention here is full, so stay inside the window) and by
    what the KV cache can hold."""
    cfg = model.config
    limit = getattr(cfg, "max_position_embeddings", None) or 2048
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        limit = min(limit, int(window))
    limit = context_capacity(limit, num_blocks, block_size)
    if max_model_len:
        limit = min(limit, int(max_model_len))
    name = (model_name or getattr(model, "actorserve_name", None)
            or Path(str(getattr(cfg, "_name_or_path", "") or "model")).name or "model")
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None \
        else int(cfg.vocab_size)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return EngineInfo(model_name=name, block_size=block_size, num_blocks=num_blocks, max_model_len=limit,
                      eos_token_ids=_eos_ids(model, tokenizer), vocab_size=int(vocab), dtype=dtype)
