"""Submitting pooling requests and reading their results, shared by the pooling routes.

A `PoolGroup` is the set of pooling requests one HTTP request makes (one per input, per
document, per item). Each is a `PoolingActor` walking ``queued -> forward -> pool -> done``
on the scheduler of its ``target`` (a pooling engine such as ``"embed"``, or None = the
generation engine, for score / decoder-only rerank / classify-from-label-tokens). Like the
generation `RequestGroup`, leaving the group before a result was read (client disconnect,
cancellation, an error) aborts what is still running at once.

Also here: which pooling capability is loaded (`loaded`, with the 400 that names the option
that loads it), the label-token helpers of the decoder-only paths, and base64 packing.
"""

from __future__ import annotations

import asyncio
import base64
import math
import sys
from array import array
from dataclasses import dataclass
from typing import Any

from ...engine.scheduling.params import PoolingParams
from ...messages import RequestOutput
from ..edge.errors import APIError
from ..edge.state import ServerContext

POOL_KEY = "pooling"            # ctx.extra[POOL_KEY]: dict target -> PoolModel
DEFAULT_EMBEDDING_ALIAS = "default-embedding"
OPTION = {"embed": "--embedding-model PATH (default: the embedded all-MiniLM-L6-v2; not 'none')",
          "rerank": "--rerank-model PATH (a local *ForSequenceClassification cross-encoder)",
          "classify": "--classify-model PATH (a local *ForSequenceClassification model)"}


@dataclass(slots=True)
class PoolModel:
    """A loaded pooling engine as the routes see it: name, HF tokenizer, engine."""
    target: str
    name: str
    tokenizer: Any
    engine: Any

    @property
    def max_tokens(self) -> int:
        return int(getattr(self.engine, "max_input_tokens", self.engine.info.max_model_len - 1))

    def encode(self, text: str, pair: str | None = None) -> list[int]:
        """Token ids with the model's special tokens, truncated to what it accepts."""
        enc = self.tokenizer(text, pair, truncation=True, max_length=self.max_tokens)
        return list(enc["input_ids"])


def pool_models(ctx: ServerContext) -> dict[str, PoolModel]:
    return ctx.extra.get(POOL_KEY) or {}


def loaded(ctx: ServerContext, target: str) -> PoolModel | None:
    return pool_models(ctx).get(target)


def require(ctx: ServerContext, target: str, what: str) -> PoolModel:
    model = loaded(ctx, target)
    if model is None:
        raise APIError(400, f"{what} needs a model this server has not loaded; start it with "
                            f"{OPTION[target]}", code="model_not_loaded")
    return model


def check_ids(ids: list[int], vocab: int, limit: int) -> None:
    if not ids:
        raise APIError(400, "an input is empty")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range [0, {vocab})")
    if len(ids) > limit:
        raise APIError(400, f"an input has {len(ids)} tokens; this model accepts at most {limit}",
                       code="context_length_exceeded")


def pack_base64(values: list[float]) -> str:
    """Little-endian float32, base64 (what the OpenAI client decodes)."""
    arr = array("f", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


# -- decoder-only heads ------------------------------------------------------------------------
def word_token_ids(ctx: ServerContext, words: list[str]) -> list[int]:
    """Ids of the single-token spellings of `words` ("yes", "Yes", " yes", ...), deduplicated."""
    found: list[int] = []
    for w in words:
        for form in (w, w.capitalize(), " " + w, " " + w.capitalize(), w.upper()):
            ids = ctx.tokenizer.encode(form, add_special_tokens=False)
            if len(ids) == 1 and ids[0] not in found:
                found.append(ids[0])
    return found


def softmax(logps: list[float]) -> list[float]:
    top = max(logps)
    ex = [math.exp(v - top) for v in logps]
    total = sum(ex)
    return [e / total for e in ex]


# -- the group -------------------------------------------------------------------------------
class PoolGroup:
    def __init__(self, ctx: ServerContext, kind: str = "pooling") -> None:
        self.ctx = ctx
        self.kind = kind                   # metrics label: embeddings, score, rerank, classify
        self.handles: list[Any] = []
        self.timers: dict[str, Any] = {}
        self.finished: set[str] = set()

    def submit(self, ids: list[int], params: PoolingParams, *, target: str | None) -> None:
        """One pooling request; its head (`params.head`) runs inside the runtime."""
        handle = self.ctx.runtime.pool(ids, params, target=target)
        self.handles.append(handle)
        if self.ctx.metrics is not None:
            model = loaded(self.ctx, target) if target is not None else None
            self.timers[handle.rid] = self.ctx.metrics.timer(
                self.kind, model=model.name if model is not None else None, generates=False)

    async def _final(self, handle: Any) -> RequestOutput:
        out = await handle.stream.final()
        self.finished.add(handle.rid)
        timer = self.timers.get(handle.rid)
        if timer is not None:
            timer.observe(out)         # e2e latency, prompt tokens, requests{kind, finish_reason}
        return out

    async def results(self) -> list[Any]:
        """Every request's pooled value, in submission order; an abort or failure is an error."""
        outs = await asyncio.gather(*(self._final(h) for h in self.handles))
        for out in outs:
            if out.finish_reason == "timeout":
                raise APIError(504, f"request {out.rid} exceeded its deadline", code="request_timeout")
            if out.finish_reason == "abort":   # a pooling request has no partial result to return
                raise APIError(503, f"request {out.rid} was aborted"
                               + (f": {out.error}" if out.error else ""), code="request_aborted")
            if out.finish_reason != "stop" or out.pooled is None:
                raise APIError(500, f"request {out.rid} failed: {out.error}", type="server_error")
        return [o.pooled for o in outs]

    async def __aenter__(self) -> "PoolGroup":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for h in self.handles:
            if h.rid not in self.finished and not h.stream.closed:
                self.ctx.runtime.abort(h.rid, "client went away")


# -- loading -----------------------------------------------------------------------------------
def load_pool_models(model_config: Any, dtype: Any = None) -> dict[str, PoolModel]:
    """The pooling engines a `ModelConfig` asks for: ``embedding_model`` (default: the embedded
    all-MiniLM-L6-v2, skipped with a warning when its package is missing; None/"none" = off),
    ``rerank_model`` and ``classify_model`` (local folders; a bad one is an error)."""
    import logging

    from ...engine.pooling.encoder import load_encoder
    from ...engine.weights.models import ModelNotFound

    out: dict[str, PoolModel] = {}
    wanted = (("embed", getattr(model_config, "embedding_model", None)),
              ("rerank", getattr(model_config, "rerank_model", None)),
              ("classify", getattr(model_config, "classify_model", None)))
    for target, spec in wanted:
        if spec is None or str(spec).lower() in ("", "none", "off"):
            continue
        try:
            kw = {} if dtype is None else {"dtype": dtype}
            engine, tok, _ = load_encoder(spec, threads=model_config.threads, **kw)
        except ModelNotFound as exc:
            if target == "embed" and spec == "embed":
                logging.getLogger("actorserve.http").warning("no embedding model: %s", exc)
                continue
            raise
        if target == "embed" and engine.is_classifier:
            raise ValueError(f"{spec} is a sequence classifier, not an embedding model; "
                             f"load it with --classify-model or --rerank-model")
        if target != "embed" and not engine.is_classifier:
            raise ValueError(f"{spec} is not a *ForSequenceClassification model ({OPTION[target]})")
        out[target] = PoolModel(target, engine.info.model_name, tok, engine)
    return out
