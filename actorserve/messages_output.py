"""What a request actor hands its client: `RequestOutput` (a delta, or the final item), and the
one merge of a request's deltas into its whole output (`merge_outputs`, for a non-streaming
client and for a request group). Re-exported by `messages`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# -- request actor -> client ----------------------------------------------------------------------


@dataclass(slots=True)
class RequestOutput:
    """One item of a request's output stream (a delta), the last one with `finished`."""
    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # per token (token_id, logprob, top [(id, lp)] | None, requested ids [(id, lp)] | None)
    logprobs: list[Any] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    pooled: Any = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # finish_reason stop: the stop token id (EOS, stop_token_ids, a grammar's end) or the stop
    # string that ended it (SGLang's matched_stop); None otherwise
    matched_stop: int | str | None = None
    aborted_in: str | None = None        # finish_reason abort / timeout: the state it was caught in
    # On the finished output of a request that got its result (not aborted or failed): seconds
    # it spent in each lifecycle state until then ("queued", "prefill", "decode", "paused";
    # pooling: "queued", "forward"), from its state machine's transitions on the runtime clock.
    timings: dict[str, float] | None = None
    prompt_logprobs: Any = None          # engine.base.PromptLogprobs, on the first token's output
    # On the finished output of a request that speculated: (verify steps, drafts verified,
    # drafts accepted); None if it never did.
    spec: tuple[int, int, int] | None = None
    # The output tokens so far per weight version, in order: ((version, start, end), ...), end
    # exclusive, over the request's generated tokens (a request that spans a weight update has
    # several); on every item (cumulative) and on the finished one.
    weight_versions: tuple[tuple[str, int, int], ...] = ()


FINAL_FIELDS = ("finished", "finish_reason", "error", "pooled", "prompt_tokens", "completion_tokens",
                "cached_tokens", "matched_stop", "aborted_in", "spec", "weight_versions", "timings")


def delta_output(rid: str, d: tuple) -> RequestOutput:  # type: ignore[type-arg]
    """A token delta kept as a tuple (`OutputStream.put_token`: text, token id, logprob entry,
    prompt logprobs, closed weight spans, open span's version, start, end) as an output."""
    text, tok, lp, plp, vdone, vcur, vstart, vend = d
    versions = vdone if vcur is None else vdone + ((vcur, vstart, vend),)
    return RequestOutput(rid, text=text, token_ids=[tok], logprobs=None if lp is None else [lp],
                         prompt_logprobs=plp, weight_versions=versions)


def merge_outputs(items: list[Any], rid: str = "") -> RequestOutput:
    """A request's output items (deltas, in order; `RequestOutput`s or token tuples, see
    `delta_output`) as one output: the texts, token ids and logprobs joined, the prompt logprobs
    where they came, the rest (`FINAL_FIELDS`) the last item's. One item is returned as it is."""
    if not items:
        raise ValueError("no output items to merge")
    last = items[-1]
    if len(items) == 1:
        return delta_output(rid, last) if type(last) is tuple else last
    texts: list[str] = []
    ids: list[int] = []
    lps: list[Any] = []
    plp = None
    for it in items:
        if type(it) is tuple:
            texts.append(it[0])
            ids.append(it[1])
            if it[2] is not None:
                lps.append(it[2])
            if it[3] is not None:
                plp = it[3]
        else:
            texts.append(it.text)
            ids.extend(it.token_ids)
            if it.logprobs:
                lps.extend(it.logprobs)
            if it.prompt_logprobs is not None:
                plp = it.prompt_logprobs
    first = items[0]
    had_lps = (first[2] is not None) if type(first) is tuple else first.logprobs is not None
    merged = RequestOutput(rid if type(first) is tuple else first.rid,
                           text="".join(texts), token_ids=ids)
    merged.logprobs = lps if lps or had_lps else None
    merged.prompt_logprobs = plp
    if type(last) is tuple:
        last = delta_output(rid, last)
    for f in FINAL_FIELDS:
        setattr(merged, f, getattr(last, f))
    return merged
