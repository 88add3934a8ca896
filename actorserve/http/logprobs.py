"""Logprobs on the wire: the OpenAI shapes of a request's token logprobs.

Chat (``choices[].logprobs.content[]``: token, logprob, bytes, top_logprobs) and completions
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), from the engine's
``(token_id, logprob, top)`` triples on `RequestOutput.logprobs`.
"""

from __future__ import annotations

from typing import Any

from .state import ServerContext


def _token_str(ctx: ServerContext, tid: int) -> str:
    return ctx.tokenizer.decode([tid], skip_special_tokens=False)


def chat_logprobs(ctx: ServerContext, lps: list[Any] | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for tid, lp, top in lps:
        s = _token_str(ctx, tid)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": _token_str(ctx, t), "logprob": v,
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


def completion_logprobs(ctx: ServerContext, lps: list[Any] | None,
                        offsets_of: TextOffsets) -> dict[str, Any] | None:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp, top in lps:
        s = _token_str(ctx, tid)
        offsets.append(offsets_of.take(tid))
        tokens.append(s)
        token_lps.append(lp)
        tops.append({_token_str(ctx, t): v for t, v in (top or [])} if top else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
