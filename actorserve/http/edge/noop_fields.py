"""Fields the peers' clients send at a value that changes nothing, accepted on every route.

A body of ours refuses a field it would not honour (`schemas._Body`: ``extra="forbid"``), so a
client that serialises its whole request type gets a 400 for fields it never meant to use.
Three kinds of sender do that:

* **sglang-router** (0.3) parses a client's body into its own typed request and serialises
  that again, so every field of its type that has a default comes along (chat:
  ``separate_reasoning: true``, ``return_hidden_states: false``; ``/generate``:
  ``log_metrics: true``, ``background: false``; rerank: ``rid: null``, ...; seen on the wire,
  docs/fleet.md);
* **SGLang's own clients** (``sglang.bench_serving``, ``sglang.Engine``-shaped payloads) send
  `GenerateReqInput` fields at their defaults: ``lora_path: null``,
  ``return_routed_experts: false``, ``custom_logit_processor: null``, ...;
* **vLLM's and OpenAI's clients** (langchain, litellm, ``vllm bench serve``) send vLLM's
  extensions and OpenAI's newer fields at theirs: ``use_beam_search: false``,
  ``length_penalty: 1.0``, ``cache_salt: null``, ``modalities: ["text"]``, ...

Each field in `NOOP_VALUES` is dropped before validation **only when its value is null or the
one listed** (the value under which the server behaves exactly as if it were absent) and only
where the body does not declare the field itself; any other value is still the 400 it was: a
body that cannot honour ``lora_path: "my-adapter"`` must not pretend to (``/generate`` declares
``lora_path``, and serves it: `lora_routes`).

`drop_noop_fields` is called by every body model before validation.
"""

from __future__ import annotations

from typing import Any, Iterable

# field -> the value that changes nothing (besides null, which always means "not set")
NOOP_VALUES: dict[str, object] = {
    # sglang-router 0.3.2's serialised defaults
    "model": None, "rid": None, "user": None,
    "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
    "return_hidden_states": False, "skip_special_tokens": True, "no_stop_trim": False,
    "ignore_eos": False, "echo": False, "logprobs": False, "stream": False,
    "return_text_in_logprobs": False, "log_metrics": True, "background": False,
    "no_logs": False, "return_bytes": False, "return_entropy": False,
    # SGLang's GenerateReqInput / sampling_params (what its own clients send unasked)
    "lora_path": None, "lora_id": None, "return_routed_experts": False,
    "custom_logit_processor": None, "custom_params": None, "image_data": None,
    "video_data": None, "audio_data": None, "input_embeds": None, "bootstrap_host": None,
    "bootstrap_port": None, "bootstrap_room": None, "data_parallel_rank": None,
    "routed_dp_rank": None, "external_trace_header": None, "extra_key": None,
    "routing_key": None, "require_reasoning": False, "spaces_between_special_tokens": True,
    "sampling_seed": None, "return_prompt_token_ids": False,
    # vLLM's extensions at their defaults
    "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
    "include_reasoning": True, "documents": None, "chat_template": None,
    "mm_processor_kwargs": None, "media_io_kwargs": None, "guided_decoding_backend": None,
    "guided_whitespace_pattern": None, "logits_processors": None,
    "return_tokens_as_token_ids": False, "return_token_ids": False, "cache_salt": None,
    "kv_transfer_params": None, "vllm_xargs": None, "allowed_token_ids": None,
    "bad_words": [], "prompt_embeds": None, "request_id": None, "repetition_detection": None,
    "truncation_side": "left",        # where truncate_prompt_tokens cuts: the only side we cut
    # OpenAI's fields that only a feature this server does not have would read
    "modalities": ["text"], "audio": None, "prediction": None, "web_search_options": None,
    "function_call": None, "functions": None,
}


def drop_noop_fields(data: Any, declared: Iterable[str]) -> Any:
    """`data` without the no-op fields that the body (whose fields are `declared`) does not
    declare; a value other than the no-op one stays, to be refused as before."""
    if not isinstance(data, dict) or NOOP_VALUES.keys().isdisjoint(data):
        return data
    names = set(declared)
    return {k: v for k, v in data.items()
            if k in names or k not in NOOP_VALUES or not (v is None or _same(v, NOOP_VALUES[k]))}


def _same(value: object, default: object) -> bool:
    if default is None:
        return False
    if isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) == default
    return type(value) is type(default) and value == default
