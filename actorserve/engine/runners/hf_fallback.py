"""`HFFallbackRunner`: any causal LM through its plain HF forward and HF's own KV cache.

The families the paged runner does not drive (`engine.runners.families`: GPT-2, GPT-NeoX, Gemma3,
...) run here, one sequence at a time. Each sequence keeps a `transformers.DynamicCache`
across steps (``_caches``, dropped on `release`) together with the token ids whose K/V it
holds; a step feeds the model only the member's new tokens ``[held, num_computed + n)``, so a
decode is a one-token forward. The cache is dropped and rebuilt from position 0 whenever it
is not the scheduler's view of the sequence: it holds a different count than
``num_computed`` (a retraction and recompute, a prefix-cache hit of the paged block
manager, a first step) or other tokens than the sequence's. A prefill chunk that stops short
of the end is fed too (it extends the cache; nothing is sampled). A model whose forward
takes no cache argument is recomputed over the whole context each time it must produce
something (the former behaviour).

Prompt logprobs: every prompt row a step feeds from ``prompt_logprob_from`` on is scored
(the head runs on all fed rows then, ``logits_to_keep=0``), so a chunked prefill scores its
chunks and a rebuild rescores by position (`engine.sampling.prompt_logprobs`). The block tables are
accepted and ignored. Same interface and outputs as the paged runner.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sampling import prompt_logprobs as prompt_lp
from ..scheduling.base import SeqOutput, engine_info
from .sampling_runner import Sampler, _SamplingRunner
from ..scheduling.sequence import Sequence


@dataclass(slots=True)
class _Held:
    cache: Any
    ids: list[int] = field(default_factory=list)    # the tokens whose K/V the cache holds


class HFFallbackRunner(_SamplingRunner):
    """Any causal LM through its plain HF forward with a per-sequence HF KV cache."""

    lora = None                 # no LoRA adapters here (`engine.weights.lora` needs the paged runner)

    def __init__(self, model: Any, *, num_blocks: int = 1024, block_size: int = 16,
                 sampler: Sampler | None = None, threads: int | None = None, tokenizer: Any = None,
                 model_name: str | None = None, max_model_len: int | None = None) -> None:
        if threads:
            torch.set_num_threads(int(threads))
        self.model = model.eval()
        self.info = engine_info(model, num_blocks=num_blocks, block_size=block_size, tokenizer=tokenizer,
                                model_name=model_name, max_model_len=max_model_len)
        self._sampler = sampler
        self._grammar_for(tokenizer)
        params = inspect.signature(model.forward).parameters
        # transformers 5 names the argument ``cache``; older and remote-code models ``past_key_values``
        self._cache_kw = next((k for k in ("cache", "past_key_values") if k in params), None)
        self._keep_kw = "logits_to_keep" in params
        self._caches: dict[Sequence, _Held] = {}
        self.rebuilds = 0           # caches started from position 0 (first steps and recomputes)

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's KV cache."""
        self._caches.pop(seq, None)

    def _new_cache(self) -> Any:
        from transformers import DynamicCache
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:           # a transformers without the config argument
            return DynamicCache()

    def _held(self, seq: Sequence) -> _Held | None:
        """The sequence's cache if it holds exactly its first ``num_computed`` tokens, else a
        fresh one (counted in `rebuilds`); None for a model that takes no cache."""
        if self._cache_kw is None:
            return None
        held = self._caches.pop(seq, None)      # back in only after a forward that succeeded
        if held is None or len(held.ids) != seq.num_computed \
                or seq.token_slice(0, len(held.ids)) != held.ids:
            self.rebuilds += 1
            held = _Held(self._new_cache())
        return held

    def _forward(self, ids: list[int], held: _Held | None, all_rows: bool, want_hidden: bool) -> Any:
        kw: dict[str, Any] = {"output_hidden_states": want_hidden}
        if held is not None:
            kw[self._cache_kw] = held.cache
            kw["use_cache"] = True
        else:
            kw["use_cache"] = False
        if self._keep_kw:
            kw["logits_to_keep"] = 0 if all_rows else 1
        return self.model(input_ids=torch.tensor([ids], dtype=torch.long), **kw)

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]]) -> list[SeqOutput]:
        outputs = [SeqOutput(seq) for seq, _ in batch]
        members: list[int] = []
        rows: list[torch.Tensor | None] = []
        logits: list[torch.Tensor] = []
        for i, (seq, n) in enumerate(batch):
            if seq.lora is not None:
                raise ValueError(f"{seq!r}: LoRA adapter {seq.lora.name!r} on an engine without adapters")
            if n <= 0:
                continue
            end = seq.num_computed + n
            if end > seq.num_tokens:
                raise ValueError(f"{seq!r}: asked to compute {n} tokens, only {seq.num_uncomputed} known")
            finishing = end == seq.num_tokens
            held = self._held(seq)
            first = len(held.ids) if held is not None else 0
            start = seq.prompt_logprob_from        # it owes prompt logprobs: score the fed prompt rows
            lo, hi = (max(first, start), min(end, len(seq.prompt_ids) - 1)) if start is not None else (0, 0)
            scored = lo < hi
            if held is None and not (finishing or scored):
                continue                           # no cache to extend: nothing to do before the end
            ids = seq.token_slice(first, end)
            embed = finishing and seq.pooling is not None and seq.pooling.task == "embed"
            out = self._forward(ids, held, scored, embed)
            if held is not None:
                held.ids.extend(ids)
                self._caches[seq] = held
            if scored:
                prompt_lp.score_rows([(seq, lo, hi, lo - first)], lambda a, b, o=out: o.logits[0, a:b])
            if finishing:
                members.append(i)
                logits.append(out.logits[0, -1])
                rows.append(out.hidden_states[-1][0, -1] if embed else None)
        if members:
            all_logits = torch.stack(logits)
            some = next((r for r in rows if r is not None), None)      # rows are read for embed members only
            hidden = all_logits if some is None else torch.stack([some.new_zeros(some.shape) if r is None else r
                                                                  for r in rows])
            self._finish(outputs, [batch[i][0] for i in members], members, hidden, lambda idx: all_logits[idx])
        return outputs
