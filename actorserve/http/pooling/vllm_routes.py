"""vLLM's `/pooling` (also `/v1/pooling`) and SageMaker's `/invocations`.

`/pooling` pools each input with one of the loaded pooling models and answers vLLM's
``PoolingResponse``: ``{id: "pool-...", object: "list", created, model, data: [{index, object:
"pooling", data}], usage}``. ``task`` picks the model: ``embed`` (the embedding model: its
vector, L2-normalised unless ``use_activation`` is false) or ``classify`` (the
``--classify-model``: its class probabilities). Without ``task``, ``embed`` when an embedding
model is loaded, else ``classify``. vLLM's per-token tasks (``token_embed``,
``token_classify``), ``score`` and ``plugin`` are 400s naming ``task``: the encoder engine
computes one pooled value per input. ``dimensions`` is vLLM's 400 ("not supported" on this
route). The inputs, ``add_special_tokens`` and ``truncate_prompt_tokens`` are `pooling_inputs`'.
vLLM serves the route as `/pooling` only; `/v1/pooling` is the same route.

`/invocations` (SageMaker, as vLLM serves it) takes any of those bodies and hands it to the
route whose request it is, trying them in vLLM's order: chat completion (``messages``),
completion (``prompt``), embeddings (``input``, when an embedding model is loaded),
classification (``input``), rerank (``query`` + ``documents``), vLLM's pair score
(``text_1`` / ``text_2`` and its other spellings), pooling (``input``, when a pooling model is
loaded). The first request model that validates the body wins (here every body model refuses
unknown fields, so a field only one route takes picks that route). A body none of them takes
is vLLM's 400: "Cannot find suitable handler for request. Expected one of: [...]". `/ping`
(SageMaker's health check) is `native_routes`'.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal, Union

from aiohttp import web
from pydantic import BaseModel, RootModel, StrictBool, StrictInt, StrictStr, ValidationError

from . import classify_routes, pooling_routes, score_routes
from ..openai import openai_routes
from .classify_routes import ClassifyRequest, classifier_ids, classifier_probs
from ..edge.errors import APIError
from .pooling import loaded, pack_base64, require
from .pooling_inputs import split_inputs
from .pooling_routes import (
    EmbeddingRequest, IdsList, RerankRequest, Texts, check_embedding_model, embed_vectors, usage,
)
from ..edge.schemas import ChatCompletionRequest, CompletionRequest, TokenIds, TruncatePrompt, _Body, read_json
from .score_routes import VLLM_FIELDS, PairScoreRequest
from ..edge.state import CTX, ServerContext

TASKS = ("embed", "classify")          # what /pooling computes here


class PoolingRequest(_Body):
    input: StrictStr | Texts | TokenIds | IdsList
    model: StrictStr | None = None
    user: StrictStr | None = None
    task: Literal["embed", "classify", "token_embed", "token_classify", "score", "plugin"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None                  # vLLM: a 400 on this route
    use_activation: StrictBool | None = None             # embed: normalise (default true)
    add_special_tokens: StrictBool = True
    truncate_prompt_tokens: TruncatePrompt | None = None


def _default_task(ctx: ServerContext) -> str:
    return "classify" if loaded(ctx, "embed") is None and loaded(ctx, "classify") is not None else "embed"


async def pooling(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = PoolingRequest.model_validate(await read_json(request))
    task = body.task or _default_task(ctx)
    if task not in TASKS:
        raise APIError(400, f"task {task!r} is not served here: /pooling pools with 'embed' (the "
                            "embedding model) or 'classify' (the --classify-model), one value per input",
                       param="task")
    if body.dimensions is not None:
        raise APIError(400, "dimensions is currently not supported", param="dimensions")
    inputs, single = split_inputs(body.input)
    if task == "embed":
        check_embedding_model(ctx, body.model, "/pooling")
        vecs, tokens, name = await embed_vectors(
            ctx, inputs, None, "/pooling", "input", single, special=body.add_special_tokens,
            truncate=body.truncate_prompt_tokens, normalize=body.use_activation is not False, kind="pooling")
    else:
        clf = require(ctx, "classify", "/pooling with task 'classify'")
        if body.model not in (None, "", clf.name):
            raise APIError(404, f"the model {body.model!r} does not exist; task 'classify' is served "
                                f"by {clf.name!r}", code="model_not_found", param="model")
        if body.use_activation is False:
            raise APIError(400, "use_activation false (raw logits) is not offered: the classifier "
                                "answers probabilities", param="use_activation")
        ids = classifier_ids(clf, inputs, single, body.add_special_tokens, body.truncate_prompt_tokens)
        vecs = await classifier_probs(ctx, ids, kind="pooling")
        tokens, name = sum(len(x) for x in ids), clf.name
    data = [{"index": i, "object": "pooling",
             "data": pack_base64(v) if body.encoding_format == "base64" else v} for i, v in enumerate(vecs)]
    return web.json_response({"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": body.model or name, "data": data, "usage": usage(tokens)})


# -- /invocations ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Invocation:
    """One route `/invocations` may hand a body to."""
    model: type[BaseModel]
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    served: Callable[[ServerContext], bool]
    takes: Callable[[dict[str, Any]], bool] = lambda body: True   # beyond validating


def _generates(ctx: ServerContext) -> bool:
    return ctx.runtime.engine_info.kind == "generate"


INVOCATIONS = (       # vLLM's order: the first whose request validates the body wins
    Invocation(ChatCompletionRequest, openai_routes.chat_completions, _generates),
    Invocation(CompletionRequest, openai_routes.completions, _generates),
    Invocation(EmbeddingRequest, pooling_routes.embeddings, lambda ctx: loaded(ctx, "embed") is not None),
    Invocation(ClassifyRequest, classify_routes.classify,
               lambda ctx: _generates(ctx) or loaded(ctx, "classify") is not None),
    Invocation(RerankRequest, pooling_routes.rerank,
               lambda ctx: _generates(ctx) or loaded(ctx, "rerank") is not None),
    Invocation(PairScoreRequest, score_routes.score,
               lambda ctx: _generates(ctx) or loaded(ctx, "rerank") is not None,
               lambda body: not VLLM_FIELDS.isdisjoint(body)),
    Invocation(PoolingRequest, pooling,
               lambda ctx: loaded(ctx, "embed") is not None or loaded(ctx, "classify") is not None),
)


class InvocationsBody(RootModel[Union[ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                      ClassifyRequest, RerankRequest, PairScoreRequest, PoolingRequest]]):
    """What `/invocations` takes: the body of any route it hands requests to (the document's
    schema; the handler tries them in vLLM's order)."""


def _takes(inv: Invocation, body: dict[str, Any]) -> bool:
    if not inv.takes(body):
        return False
    try:
        inv.model.model_validate(body)
    except (ValidationError, ValueError, APIError):
        return False
    return True


async def invocations(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    body = await read_json(request)                  # the route handed to reads it again (cached)
    served = [inv for inv in INVOCATIONS if inv.served(ctx)]
    for inv in served:
        if _takes(inv, body):
            return await inv.handler(request)
    names = [inv.model.__name__ for inv in served]
    raise APIError(400, f"Cannot find suitable handler for request. Expected one of: {names}")


ROUTES = [
    web.post("/pooling", pooling),
    web.post("/v1/pooling", pooling),
    web.post("/invocations", invocations),
]
