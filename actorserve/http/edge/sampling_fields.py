"""The one mapping from a request body's sampling fields to `SamplingParams`.

Every generation body (OpenAI's chat and completions, SGLang's ``sampling_params``, the
Responses API) names what its client sent in `SamplingParams`' own field names (`to_sampling`'s
``sent``; None: not sent, the default) and hands it here. What the spellings share is done
once: ``max_new_tokens`` falls back to the route's default, ``min_tokens`` may not exceed it
(vLLM's rule and words), ``stop`` is a string or a list, ``stop_regex`` patterns must compile
and must not match the empty text, ``logit_bias`` keys become token ids. Errors name the field
as the client spelled it (``names``). `SamplingParams` then checks the ranges it owns.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...engine.scheduling.params import SamplingParams
from .errors import FieldError


def check_min_tokens(min_tokens: int, max_tokens: int | None, param: str) -> None:
    """vLLM's rule and words: at least as many tokens as asked for cannot exceed the most."""
    if max_tokens is not None and min_tokens > max_tokens:
        raise FieldError(param, f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                                f"got {min_tokens}.")


def stop_patterns(value: str | list[str] | None, param: str = "stop_regex") -> tuple[str, ...]:
    """SGLang's ``stop_regex`` as patterns the detokenizer can search: each must compile and
    must not match the empty text (it would stop every request before its first token)."""
    import regex      # transformers' own dependency; `regex` can report a partial match

    pats = [value] if isinstance(value, str) else list(value or ())
    for i, pat in enumerate(pats):
        where = param if isinstance(value, str) else f"{param}.{i}"
        try:
            compiled = regex.compile(pat)
        except regex.error as exc:
            raise FieldError(where, f"{where} is not a valid regular expression: {exc}") from None
        if compiled.search("") is not None:
            raise FieldError(where, f"{where} matches the empty text, so it would stop every request at once")
    return tuple(pats)


def bias_pairs(bias: dict[str, Any] | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` ({"token id": bias}; keys checked against the vocabulary in `generation`)."""
    return tuple((int(k), float(v)) for k, v in (bias or {}).items() if k.isascii() and k.isdigit())


def to_sampling(sent: Mapping[str, Any], default_max: int, *, grammar: tuple[str, str] | None = None,
                names: Mapping[str, str] | None = None) -> SamplingParams:
    """`SamplingParams` from ``sent`` (its field names -> the client's values, None for a field
    not sent), ``default_max`` when no ``max_new_tokens`` was sent, and the request's output
    constraint. ``names``: the client's spelling of a field, for the error's ``param``."""
    names = names or {}
    kw = {k: v for k, v in sent.items() if v is not None}
    most = kw.get("max_new_tokens")
    check_min_tokens(kw.get("min_tokens", 0), most, names.get("min_tokens", "min_tokens"))
    kw["max_new_tokens"] = default_max if most is None else most
    if "stop" in kw:
        kw["stop"] = (kw["stop"],) if isinstance(kw["stop"], str) else tuple(kw["stop"])
    if "stop_regex" in kw:
        kw["stop_regex"] = stop_patterns(kw["stop_regex"], names.get("stop_regex", "stop_regex"))
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    if "logit_bias" in kw:
        kw["logit_bias"] = bias_pairs(kw["logit_bias"])
    return SamplingParams(**kw, grammar=grammar)
