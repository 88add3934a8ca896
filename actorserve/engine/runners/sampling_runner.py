"""What both model runners share (`runner.PagedLlamaRunner`, `hf_fallback.HFFallbackRunner`):
the sampler (``engine.sampling.sampling.sample`` unless one is injected, made on first use), the grammar
backend of constrained requests, and `_finish`, which turns a step's final rows into outputs:
a sampled token (with its logprobs, prompt logprobs and the grammar's verdict) or a pooled value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..sampling import prompt_logprobs as prompt_lp
from ..scheduling.base import SeqOutput
from ..scheduling.sequence import Sequence


Sampler = Callable[[torch.Tensor, list[Sequence]], list[tuple[int, float, list[tuple[int, float]] | None]]]


def _default_sampler() -> Sampler:
    from ..sampling.sampling import sample   # another module; imported on first use
    return sample


class _SamplingRunner:
    """What both runners share: the sampler (the default one made on first use) and the
    grammar backend of constrained requests (`engine.sampling.grammar`; None without a tokenizer)."""

    _sampler: Sampler | None
    grammar: Any = None

    def _grammar_for(self, tokenizer: Any) -> None:
        if tokenizer is not None:
            from ..sampling.grammar import GrammarBackend
            self.grammar = GrammarBackend(tokenizer, vocab_size=self.info.vocab_size,
                                          stop_token_ids=self.info.eos_token_ids)

    def _finish(self, outputs: list[SeqOutput], seqs: list[Sequence], where: list[int],
                hidden: torch.Tensor, logits_of: Callable[[list[int]], torch.Tensor]) -> None:
        _finish(outputs, seqs, where, hidden, logits_of, self.sampler, self.grammar)

    @property
    def sampler(self) -> Sampler:
        if self._sampler is None:
            self._sampler = _default_sampler()
        return self._sampler


def _finish(outputs: list[SeqOutput], seqs: list[Sequence], where: list[int], hidden: torch.Tensor,
            logits_of: Callable[[list[int]], torch.Tensor], sampler: Sampler, grammar: Any = None) -> None:
    """Fill ``outputs[where[i]]`` for each finishing member ``seqs[i]``: sample a token, or
    pool. `hidden` holds their final-normed last rows; ``logits_of(idx)`` gives the logits
    of the members ``idx``, computed only for those that need them. A constrained member's
    matcher is made before its first draw and advanced by each drawn token (`engine.sampling.grammar`)."""
    gen = [i for i, s in enumerate(seqs) if s.pooling is None]
    head = [i for i, s in enumerate(seqs) if s.pooling is not None and s.pooling.task != "embed"]
    logits = logits_of(gen + head).float() if gen or head else None
    if gen:
        gen_seqs = [seqs[i] for i in gen]
        constrained = [s for s in gen_seqs if s.sampling.grammar is not None]
        if constrained:
            if grammar is None:
                raise RuntimeError("a constrained request reached an engine without a grammar backend")
            grammar.ensure(constrained)
        picked = sampler(logits[:len(gen)], gen_seqs)
        ids = prompt_lp.ids_logprobs(logits[:len(gen)], gen_seqs) \
            if any(s.sampling.token_ids_logprob for s in gen_seqs) else [None] * len(gen)
        for i, (tok, lp, top), ids_lp in zip(gen, picked, ids):
            out = outputs[where[i]]
            out.token_id = int(tok)
            if seqs[i].sampling.logprobs:
                out.logprob, out.top_logprobs = (None if lp is None else float(lp)), top
                out.ids_logprobs = ids_lp
            if seqs[i].prompt_logprob_from is not None:      # its first token: hand them over
                out.prompt_logprobs = prompt_lp.assemble(seqs[i])
            if seqs[i].grammar is not None:
                from ..sampling.grammar import accept
                verdict = accept(seqs[i], out.token_id)
                out.stop = verdict == "stop"
                out.error = verdict if verdict not in (None, "stop") else None
    for j, i in enumerate(head):
        outputs[where[i]].pooled = torch.log_softmax(logits[len(gen) + j], dim=-1).clone()
    for i, s in enumerate(seqs):
        if s.pooling is not None and s.pooling.task == "embed":
            vec = hidden[i].float()
            if s.pooling.dimensions:
                vec = vec[:s.pooling.dimensions]
            if s.pooling.normalize:
                vec = F.normalize(vec, dim=-1)
            outputs[where[i]].pooled = vec.clone()
