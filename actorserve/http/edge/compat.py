"""SGLang's and vLLM's extras on the OpenAI routes and ``/server_info``, in one place (see
``docs/compat.md``).

* `stop_fields`: what ended a choice. SGLang puts ``matched_stop`` on every choice: the stop
  token id (EOS included) or the stop string that ended it, null for any other finish. vLLM
  puts ``stop_reason``: the same, except that an EOS token (one the request did not list in
  ``stop_token_ids``) is null. Both are on a non-streamed choice and on a streamed choice's
  last chunk.
* `truncate_prompt`: vLLM's ``truncate_prompt_tokens``: keep the last k tokens of the prompt
  (``-1``: as many as the context holds); more than the context is a 400.
* `best_of`: OpenAI's ``best_of`` on ``/v1/completions``: ``best_of`` candidates are generated
  per prompt and the ``n`` with the highest log probability per token are answered (OpenAI's
  rule), in that order; usage counts every candidate's tokens (all were generated). At least
  ``n``; more than ``n`` cannot be streamed (which candidates win is known only at the end).
* `ChunkUsage`: vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every
  streamed chunk carries the usage so far of its choice; the final usage chunk still comes.
* `model_cards`: ``/v1/models`` entries in vLLM's shape (``root``, ``parent``,
  ``max_model_len``), also what ``GET /v1/models/{id}`` answers.
* `sglang_server_fields`: the ``/get_server_info`` fields SGLang's clients read (its tests,
  ``bench_serving``: ``max_total_num_tokens``, ``version``, ``internal_states[0]``, ...), each
  answered from this server's own configuration; none is made up.
"""

from __future__ import annotations

from typing import Any

from .errors import APIError
from .state import ServerContext


def stop_fields(out: Any, finish: str | None, stop_token_ids: Any,
                eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """``matched_stop`` (SGLang) and ``stop_reason`` (vLLM) of a choice that ended with `finish`
    (the finish reason as answered: a tool call's ``tool_calls`` matched nothing)."""
    matched = out.matched_stop if finish == "stop" else None
    reason = matched
    if isinstance(matched, int) and matched in eos_ids and matched not in (stop_token_ids or ()):
        reason = None
    return {"matched_stop": matched, "stop_reason": reason}


def truncate_prompt(ids: list[int], k: int | None, cap: int) -> list[int]:
    """The prompt's last `k` tokens (vLLM's ``truncate_prompt_tokens``; -1 = the context)."""
    if k is None:
        return ids
    if k == -1:
        k = cap
    if k > cap:
        raise APIError(400, f"truncate_prompt_tokens value ({k}) is greater than the model's "
                            f"context length ({cap}); select a smaller truncation size",
                       param="truncate_prompt_tokens")
    return ids[len(ids) - k:] if k < len(ids) else ids


class BestOf:
    """A completions request's ``best_of`` (`best_of`): ``candidates`` engine requests per
    prompt, of which `pick` keeps the best ``n``."""

    __slots__ = ("n", "candidates")

    def __init__(self, n: int, candidates: int) -> None:
        self.n, self.candidates = n, candidates

    @property
    def extra(self) -> bool:
        return self.candidates > self.n

    def pick(self, outs: list[Any]) -> list[Any]:
        """Per prompt (consecutive runs of ``candidates`` outputs) the ``n`` best, best first."""
        kept: list[Any] = []
        for at in range(0, len(outs), self.candidates):
            group = outs[at:at + self.candidates]
            kept += sorted(group, key=_mean_logprob, reverse=True)[:self.n]
        return kept


def _mean_logprob(out: Any) -> float:
    lps = [lp for _, lp, *_ in (out.logprobs or ()) if lp is not None]
    return sum(lps) / len(lps) if lps else float("-inf")


def best_of(body: Any, n: int) -> BestOf:
    """Check ``best_of`` against ``n`` and ``stream`` (OpenAI's rules)."""
    k = body.best_of
    if k is None or k == n:
        return BestOf(n, n)
    if k < n:
        raise APIError(400, f"best_of must be greater than or equal to n; got best_of={k}, n={n}",
                       param="best_of")
    if body.stream:
        raise APIError(400, "best_of > n cannot be streamed: the best choices are known only when "
                            "every candidate has finished", param="best_of")
    return BestOf(n, k)


class ChunkUsage:
    """The usage of each streamed choice so far (``continuous_usage_stats``)."""

    __slots__ = ("enabled", "_prompt", "_done")

    def __init__(self, enabled: bool, prompt_tokens: dict[int, int]) -> None:
        self.enabled = enabled
        self._prompt = prompt_tokens          # choice index -> its prompt's tokens
        self._done: dict[int, int] = {}

    def add(self, index: int, out: Any) -> None:
        if self.enabled:
            self._done[index] = self._done.get(index, 0) + len(out.token_ids)

    def usage(self, index: int) -> dict[str, int] | None:
        if not self.enabled:
            return None
        p, c = self._prompt[index], self._done.get(index, 0)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def model_cards(ctx: ServerContext) -> list[dict[str, Any]]:
    """Every served model: the generation model (and its alias), then the pooling models."""
    info = ctx.runtime.engine_info
    data = [{"id": name, "object": "model", "created": ctx.created, "owned_by": "actorserve",
             "root": ctx.served_name, "parent": None, "max_model_len": info.max_model_len}
            for name in ctx.model_names()]
    for pm in (ctx.extra.get("pooling") or {}).values():     # pooling models (embed, rerank, classify)
        data.append({"id": pm.name, "object": "model", "created": ctx.created, "owned_by": "actorserve",
                     "root": pm.name, "parent": None, "max_model_len": pm.max_tokens, "task": pm.target})
    from ..native.lora_routes import adapter_cards
    return data + adapter_cards(ctx)        # LoRA adapters, parent = the base model (vLLM's)


def sglang_server_fields(ctx: ServerContext) -> dict[str, Any]:
    """SGLang's names for this server's geometry and limits (``/get_server_info``)."""
    from ... import __version__
    rt = ctx.runtime
    info = rt.engine_info
    batch = rt.setup()["generation"]["batch"]
    return {
        "model_path": ctx.extra.get("model_path", ctx.served_name),
        "max_total_num_tokens": info.num_blocks * info.block_size,   # the KV cache, in tokens
        "max_running_requests": batch["max_num_seqs"],
        "max_prefill_tokens": batch["max_batch_tokens"],             # tokens of one step
        "chunked_prefill_size": batch["max_prefill_chunk"],
        "page_size": info.block_size,
        "context_length": ctx.capacity,
        "max_req_input_len": ctx.capacity - 1,                       # room for one new token
        "attention_backend": "torch_native",                         # torch SDPA over paged KV
        "speculative_algorithm": batch.get("speculative") and str(batch["speculative"]).upper(),
        "speculative_num_draft_tokens": batch.get("speculative_tokens") if batch.get("speculative") else None,
        "is_embedding": info.kind != "generate",
        "version": __version__,
        # SGLang: one dict per data-parallel rank; bench_serving reads [0].get("avg_spec_accept_length")
        "internal_states": [{"scheduler": "generation", **_plain(rt.stats()),     # None: not speculating
                             "avg_spec_accept_length": rt.stats().avg_spec_accept_length
                             if batch.get("speculative") else None}],
    }


def _plain(stats: Any) -> dict[str, Any]:
    return {name: getattr(stats, name) for name in getattr(stats, "__dataclass_fields__", {})}
