"""Logprobs on the wire: the shapes OpenAI, vLLM and SGLang clients read.

The engine gives each output token as ``(token_id, logprob, top, ids)`` on
`RequestOutput.logprobs` (`top`: the k most likely ``(id, lp)``; `ids`: the requested ids'
``(id, lp)``, SGLang's ``token_ids_logprob``) and, with a request's first output, its prompt's
`engine.scheduling.base.PromptLogprobs` (the first reported token unscored: None). From them:

* OpenAI chat: ``choices[].logprobs.content[]`` (token, logprob, bytes, top_logprobs);
* OpenAI completions: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``. Each
  ``top_logprobs`` entry holds the chosen token and the k most likely (so at most k + 1, as
  OpenAI and vLLM: ``logprobs: 0`` gives the chosen token alone). With ``echo`` the prompt's
  tokens come first, the first of them with None (`prompt_completion_logprobs`);
* vLLM's ``prompt_logprobs``: ``[None, {token_id: {logprob, rank, decoded_token}}, ...]``, the
  prompt token first at each position, then the top k (`vllm_prompt_logprobs`);
* SGLang's ``meta_info``: ``input_token_logprobs`` / ``output_token_logprobs`` as
  ``[logprob, token_id, text | None]``, ``input_top_logprobs`` / ``output_top_logprobs`` and
  ``input_token_ids_logprobs`` / ``output_token_ids_logprobs`` as a list of those per position
  (None where nothing was scored), cumulative in a stream as SGLang sends them (`SGLangLogprobs`).

A logprob of ``-inf`` is sent as -9999.0 (JSON has no infinity; vLLM does the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import FieldError
from .state import ServerContext

FLOOR = -9999.0


def _lp(v: float | None) -> float | None:
    return None if v is None else max(v, FLOOR)


def _token_str(ctx: ServerContext, tid: int) -> str:
    return ctx.tokenizer.decode([tid], skip_special_tokens=False)


def chat_logprobs(ctx: ServerContext, lps: list[Any] | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for tid, lp, top, *_ in lps:
        s = _token_str(ctx, tid)
        content.append({"token": s, "logprob": _lp(lp), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": _token_str(ctx, t), "logprob": _lp(v),
                                          "bytes": list(_token_str(ctx, t).encode())}
                                         for t, v in (top or [])]})
    return {"content": content}


class TextOffsets:
    """OpenAI's ``text_offset`` for one choice: where each generated token's text begins in
    the choice's whole text, the echoed prompt included (``start``). The ids are decoded in
    context, as the choice's text was, so the offsets index that text even where a token
    decoded alone differs (SentencePiece drops a leading space, a character spread over
    byte tokens); a stream keeps one per choice, so each chunk goes on where the last ended."""

    def __init__(self, ctx: ServerContext, start: int, skip_special_tokens: bool) -> None:
        self._detok = ctx.tokenizer.new_detokenizer(skip_special_tokens=skip_special_tokens)
        self.at = start

    def take(self, tid: int) -> int:
        """The offset of token `tid`, the next one of the choice."""
        at = self.at
        self.at += len(self._detok.add([tid]))
        return at


def _top_dict(ctx: ServerContext, tid: int, lp: float | None, top: Any) -> dict[str, float | None]:
    """The chosen token first, then the k most likely (OpenAI: up to logprobs + 1 entries)."""
    out = {_token_str(ctx, tid): _lp(lp)}
    for t, v in top or ():
        out.setdefault(_token_str(ctx, t), _lp(v))
    return out


def completion_logprobs(ctx: ServerContext, lps: list[Any] | None, offsets_of: TextOffsets,
                        prompt: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A completion choice's logprobs; `prompt` (from `prompt_completion_logprobs`) goes first."""
    if lps is None:
        return prompt
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp, top, *_ in lps:
        offsets.append(offsets_of.take(tid))
        tokens.append(_token_str(ctx, tid))
        token_lps.append(_lp(lp))
        tops.append(_top_dict(ctx, tid, lp, top))
    out = {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
    if prompt is not None:
        out = {k: prompt[k] + v for k, v in out.items()}
    return out


def prompt_completion_logprobs(ctx: ServerContext, pl: Any, k: int,
                               skip_special_tokens: bool = True) -> dict[str, Any] | None:
    """The echoed prompt's part of a completion's logprobs: its tokens with their offsets in the
    echoed text (decoded as the echo is: a token-id prompt with its special tokens, so
    ``skip_special_tokens`` False), the first token's logprob and top None (vLLM's)."""
    if pl is None:
        return None
    offsets_of = TextOffsets(ctx, 0, skip_special_tokens)
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for j, tid in enumerate(pl.token_ids):
        out["text_offset"].append(offsets_of.take(tid))
        out["tokens"].append(_token_str(ctx, tid))
        out["token_logprobs"].append(_lp(pl.logprobs[j]))
        top = pl.top[j][:k] if pl.top is not None and pl.top[j] else None
        out["top_logprobs"].append(None if pl.logprobs[j] is None else _top_dict(ctx, tid, pl.logprobs[j], top))
    return out


def vllm_prompt_logprobs(ctx: ServerContext, pl: Any) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token_id: {logprob,
    rank, decoded_token}}``, the prompt's own token first, then the top k by rank."""
    if pl is None:
        return None
    out: list[dict[str, Any] | None] = []
    for j, tid in enumerate(pl.token_ids):
        if pl.logprobs[j] is None:
            out.append(None)
            continue
        d = {str(tid): {"logprob": _lp(pl.logprobs[j]), "rank": pl.ranks[j],
                        "decoded_token": _token_str(ctx, tid)}}
        for rank, (t, v) in enumerate(pl.top[j] if pl.top is not None else (), start=1):
            d.setdefault(str(t), {"logprob": _lp(v), "rank": rank, "decoded_token": _token_str(ctx, t)})
        out.append(d)
    return out


# -- SGLang ------------------------------------------------------------------------------------------


def item_value(value: Any, i: int, n_items: int, field: str, *, nested: bool = False) -> Any:
    """SGLang's per-input logprob fields take one value for all inputs or a list, one per input
    (`nested`: the value itself is a list, so only a list of lists is per input)."""
    per_input = isinstance(value, list) and (not nested or (bool(value) and isinstance(value[0], list)))
    if not per_input:
        return value
    if len(value) != n_items:
        raise FieldError(field, f"{field} has {len(value)} entries for {n_items} inputs")
    return value[i]


@dataclass(frozen=True, slots=True)
class NativeLogprobs:
    """One /generate input's logprob request (SGLang's fields, resolved for input ``i``)."""
    want: bool                  # return_logprob
    start: int                  # logprob_start_len: -1 (output only) or a prompt position
    top: int                    # top_logprobs_num, for input and output positions
    ids: list[int] | None       # token_ids_logprob

    @classmethod
    def of(cls, body: Any, i: int, n_items: int, prompt_len: int | None) -> "NativeLogprobs":
        """``prompt_len`` None: not known yet (a session's turn: see `check`)."""
        want = bool(item_value(body.return_logprob, i, n_items, "return_logprob"))
        start = item_value(body.logprob_start_len, i, n_items, "logprob_start_len")
        top = item_value(body.top_logprobs_num, i, n_items, "top_logprobs_num")
        ids = item_value(body.token_ids_logprob, i, n_items, "token_ids_logprob", nested=True)
        made = cls(want, start, top, list(ids) if ids else None)
        if prompt_len is not None:
            made.check(prompt_len)
        return made

    def check(self, prompt_len: int) -> None:
        """``logprob_start_len`` is a position in the whole prompt the request runs with (a
        session's turn: the session's prompt + the new input, as SGLang counts it)."""
        if self.want and self.start >= prompt_len:
            raise FieldError("logprob_start_len", f"logprob_start_len ({self.start}) must be less than "
                                                  f"the prompt's {prompt_len} tokens (or -1)")

    def sampling(self) -> dict[str, Any]:
        """The `SamplingParams` fields it sets: prompt logprobs only from a start position."""
        if not self.want:
            return {}
        return {"logprobs": True, "top_logprobs": self.top, "token_ids_logprob": tuple(self.ids or ()),
                "prompt_logprobs": self.top if self.start >= 0 else None,
                "logprob_start_len": max(self.start, 0)}

    def collector(self, ctx: ServerContext, prompt: list[int], with_text: bool) -> "SGLangLogprobs | None":
        return SGLangLogprobs(ctx, prompt, self.start, self.top, self.ids, with_text) if self.want else None


class SGLangLogprobs:
    """SGLang's logprob fields of one request's ``meta_info``, grown as its outputs come.

    ``start`` is ``logprob_start_len`` (-1: the output only; the input lists then hold just the
    prompt's last token, unscored, as SGLang's do)."""

    def __init__(self, ctx: ServerContext, prompt: list[int], start: int, top: int,
                 ids: list[int] | None, with_text: bool) -> None:
        self.ctx, self.top, self.ids, self.with_text = ctx, top, ids, with_text
        self.fields: dict[str, list[Any]] = {"input_token_logprobs": [], "output_token_logprobs": []}
        if top > 0:
            self.fields |= {"input_top_logprobs": [], "output_top_logprobs": []}
        if ids is not None:
            self.fields |= {"input_token_ids_logprobs": [], "output_token_ids_logprobs": []}
        if start < 0:
            self._input([prompt[-1]], [None], None, None)

    def _one(self, lp: float | None, tid: int) -> list[Any]:
        return [_lp(lp), tid, _token_str(self.ctx, tid) if self.with_text else None]

    def _many(self, pairs: Any) -> list[list[Any]] | None:
        return [self._one(v, t) for t, v in pairs] if pairs else None

    def _input(self, tids: list[int], lps: list[float | None], tops: Any, ids: Any) -> None:
        f = self.fields
        f["input_token_logprobs"].extend(self._one(lp, t) for t, lp in zip(tids, lps))
        if self.top > 0:
            f["input_top_logprobs"].extend(self._many(t) for t in (tops or [None] * len(tids)))
        if self.ids is not None:
            f["input_token_ids_logprobs"].extend(self._many(t) for t in (ids or [None] * len(tids)))

    def add(self, out: Any) -> None:
        """Take one output (a delta, or a whole merged one)."""
        pl = out.prompt_logprobs
        if pl is not None:
            self._input(pl.token_ids, pl.logprobs, pl.top, pl.ids)
        f = self.fields
        for tid, lp, top, ids in out.logprobs or ():
            f["output_token_logprobs"].append(self._one(lp, tid))
            if self.top > 0:
                f["output_top_logprobs"].append(self._many(top))
            if self.ids is not None:
                f["output_token_ids_logprobs"].append(self._many(ids))

    def meta(self) -> dict[str, list[Any]]:
        """The fields so far (copies: a stream sends each event's state)."""
        return {k: list(v) for k, v in self.fields.items()}
