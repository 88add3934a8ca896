"""The inputs of the pooling routes as vLLM takes them: one text, a list of texts, one token-id
list or a list of them; vLLM's ``add_special_tokens`` (default true) and ``truncate_prompt_tokens``
(keep the last k tokens; -1 = as many as the model takes; more than that is a 400).

* `split_inputs`: the raw ``input`` as a list of inputs, and whether it was a single one (errors
  then name the field itself, else ``input.<i>``); an empty list, an empty string or an empty
  token list is a 400 naming it.
* `encoder_ids`: one input as an encoder's token ids. A text is tokenized by the model's own
  tokenizer; cut to its last k tokens, it keeps the model's special tokens ([CLS] ... [SEP]),
  which count in k, as vLLM's left truncation of a text does. A token-id input is taken as
  given (no special tokens are added) and cut to its last k ids.
* `generation_text`: one input of the label-token classifier on the generation model (token ids
  are the generation model's, decoded), cut to its last k tokens before the prompt wraps it.
"""

from __future__ import annotations

from typing import Any

from ..edge.compat import truncate_prompt
from ..edge.errors import APIError
from ..edge.generation import check_token_ids
from .pooling import PoolModel, check_ids
from ..edge.state import ServerContext

MAX_INPUTS = 2048          # inputs of one request (OpenAI's embeddings bound)

PoolInput = str | list[int]


def where(param: str, i: int, n: int, single: bool) -> str:
    """The ``param`` of input ``i`` of ``n``: the field itself for a lone input."""
    return param if single and n == 1 else f"{param}.{i}"


def split_inputs(raw: Any, param: str = "input") -> tuple[list[PoolInput], bool]:
    """``(inputs, single)`` of a validated ``str | list[str] | list[int] | list[list[int]]``."""
    if isinstance(raw, str):
        inputs, single = [raw], True
    elif raw and all(isinstance(x, int) for x in raw):
        inputs, single = [list(raw)], True
    else:
        inputs, single = [x if isinstance(x, str) else list(x) for x in raw], False
    if not inputs:
        raise APIError(400, "the input is empty", param=param)
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}", param=param)
    for i, x in enumerate(inputs):
        if not x:
            raise APIError(400, "an input is empty (an empty string or list)",
                           param=where(param, i, len(inputs), single))
    return inputs, single


def _truncation(k: int | None, cap: int) -> int | None:
    """``truncate_prompt_tokens`` as a count (-1: `cap`); more than `cap` is a 400."""
    if k is None:
        return None
    truncate_prompt([], k, cap)                 # the 400 past the model's length, vLLM's wording
    return cap if k == -1 else k


def _wrapped(tokenizer: Any, text: str, special: bool) -> tuple[list[int], list[int], list[int]]:
    """A text's tokens as (the special tokens before, the text's own, the special tokens after)."""
    body = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not special:
        return [], body, []
    full = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    n = len(body)
    at = next((p for p in range(len(full) - n + 1) if full[p:p + n] == body), None)
    if at is None:          # the specials are not around the text: cut the whole sequence
        return [], full, []
    return full[:at], body, full[at + n:]


def encoder_ids(pm: PoolModel, x: PoolInput, *, special: bool = True, truncate: int | None = None,
                param: str = "input") -> list[int]:
    """Token ids of one input for the encoder `pm` (see the module doc), checked against its
    vocabulary and its length; ``param`` names the input in errors."""
    cap = pm.max_tokens
    k = _truncation(truncate, cap)
    vocab = pm.engine.info.vocab_size
    if not isinstance(x, str):
        check_token_ids(x, vocab, param)
        ids = x if k is None else (x[len(x) - k:] if k < len(x) else x)
    elif k is None:        # no truncation asked: what the model takes (as before; specials kept)
        ids = list(pm.tokenizer(x, add_special_tokens=special, truncation=True, max_length=cap)["input_ids"])
    else:
        prefix, body, suffix = _wrapped(pm.tokenizer, x, special)
        keep = k - len(prefix) - len(suffix)
        if keep <= 0:
            raise APIError(400, f"truncate_prompt_tokens ({k}) leaves no room for the input beside the "
                                f"model's {len(prefix) + len(suffix)} special tokens",
                           param="truncate_prompt_tokens")
        ids = prefix + (body[len(body) - keep:] if keep < len(body) else body) + suffix
    if not ids:
        raise APIError(400, "an input is empty after truncation", param=param)
    check_ids(ids, vocab, cap)
    return ids


def generation_text(ctx: ServerContext, x: PoolInput, truncate: int | None, param: str) -> str:
    """One input of the generation model's label-token classifier as text (see the module doc)."""
    tok = ctx.tokenizer
    if not isinstance(x, str):
        check_token_ids(x, ctx.runtime.engine_info.vocab_size, param)
    if truncate is None:
        return x if isinstance(x, str) else tok.decode(x)
    ids = tok.encode(x, add_special_tokens=False) if isinstance(x, str) else list(x)
    ids = truncate_prompt(ids, truncate, ctx.capacity)
    if not ids:
        raise APIError(400, "an input is empty after truncation", param=param)
    return tok.decode(ids)
