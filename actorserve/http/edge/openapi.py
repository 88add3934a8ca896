"""`GET /openapi.json`: an OpenAPI 3.1 description of the app, generated, not written.

The paths come from walking the app's router, so every method and path the app registers is in
the document (the debug routes too when they are on, each implicit ``HEAD`` of a ``GET``). What
an operation takes comes from `OPERATIONS`, keyed by handler: the pydantic model its body is
validated with (pydantic's JSON schema of it lands in ``components.schemas``; the body models
are the ones the handlers call ``model_validate`` on, so the two cannot drift apart), whether
the body may be left out, a pydantic model of its query string and of its path, whether it can
answer an SSE stream. A handler the table does not know still gets its path parameters and,
for a ``POST``, an optional JSON object body.

Every error response refers to one schema, ``ErrorResponse``: the OpenAI shape
``{"error": {"message", "type", "code", "param"}}`` that `errors.error_middleware` answers
with. With an API key, every operation but those on the open paths (`app.OPEN_PATHS`) needs
bearer auth, and says so (``security``, and a 401); `auth.open_paths` adds `/metrics` with
``--metrics-auth open``. The document is built once per app, on its first request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

from aiohttp import web
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from ... import __version__
from ...statemachines import LIFECYCLES
from ..pooling import cohere_routes, pooling_routes
from ..native import (
    control_routes, health_routes, native_routes, lora_routes, profile_routes, vllm_control_routes, weights_dist_routes, weights_routes,
)
from . import debug_routes
from ..openai import openai_routes
from ..responses import responses_routes
from .auth import open_paths
from ..pooling.cohere_schemas import CohereEmbedRequest, CohereRerankRequest
from ..responses.responses_schemas import InputItemsQuery, ResponsePath, ResponsesRequest, RetrieveQuery
from .metrics import metrics_handler
from ..pooling.classify_routes import ClassifyRequest
from ..pooling.pooling_routes import EmbeddingRequest, EncodeRequest, RerankRequest
from ..native.native_schemas import AbortBody, CloseSessionBody, FlushBody, GenerateRequest, OpenSessionBody, PauseBody
from .schemas import ChatCompletionRequest, CompletionRequest
from .state import CTX
from ..pooling import classify_routes, score_routes, vllm_routes
from ..native import reasoning_routes, tokenize_routes
from ..native.reasoning_routes import SeparateReasoningRequest
from ..native.weights_dist_routes import DestroyGroupBody, InitGroupBody, UpdateDistributedBody
from ..native.lora_routes import LoadLoraBody, UnloadLoraBody
from ..native.weights_routes import UpdateFromDiskBody, UpdateFromTensorBody, UpdateVersionBody, WeightsByNameBody
from ..native import memory_routes
from ..native.memory_routes import MemoryTagsBody, SleepQuery, WakeUpQuery
from ..native.tokenize_routes import DetokenizeRequest, TokenizeRequest

OPENAPI_VERSION = "3.1.0"
_CACHE = "openapi"          # ctx.extra key: the built document
_SECURITY = "apiKey"
_PARAM = re.compile(r"\{(\w+)")


# -- schemas that only the document needs -------------------------------------------------------


class ErrorDetail(BaseModel):
    """What went wrong; ``type`` is e.g. invalid_request_error, server_error."""
    message: str
    type: str
    code: str | int | None
    param: str | None


class ErrorResponse(BaseModel):
    """Every error this server answers, in the OpenAI shape."""
    error: ErrorDetail


class Unavailable(BaseModel):
    """A health check that failed: the server is starting, draining, stopped or unhealthy."""
    status: Literal["unavailable"]
    server_state: str
    reason: str | None = None
    health: str | None = None


class HealthGenerateQuery(BaseModel):
    timeout: float = Field(health_routes.DEFAULT_TIMEOUT_S, gt=0, le=health_routes.MAX_TIMEOUT_S,
                           description="seconds the probe may take")


class ModelPath(BaseModel):
    model: str = Field(description="a served model name (or its alias)")


class RidPath(BaseModel):
    rid: str = Field(description="a request id")


class DiagramPath(BaseModel):
    kind: str = Field(description="a lifecycle", json_schema_extra={"enum": sorted(LIFECYCLES)})


class DiagramQuery(BaseModel):
    format: Literal["mermaid", "svg"] = "mermaid"
    rid: str | None = Field(None, description="highlight this request's path")


class VllmPauseQuery(BaseModel):
    mode: Literal["abort", "wait", "keep"] = Field("abort", description="abort: end what runs; keep: park it "
                                                   "(in_place); wait: let it finish, admit nothing, then pause")
    wait_for_inflight_requests: bool = Field(False, description="vLLM's deprecated spelling of mode=wait")
    clear_cache: bool = Field(True, description="flush the prefix cache once paused (not with keep)")


class ResetPrefixCacheQuery(BaseModel):
    reset_running_requests: Literal[False] = Field(False, description="only false: pause with mode=abort first")
    reset_external: Literal[False] = Field(False, description="only false: there is no external cache")


class EventsQuery(BaseModel):
    rid: str | None = Field(None, description="only this request's events")
    kind: str | None = Field(None, description="only this lifecycle's events")


# -- what each handler takes -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Op:
    """How one handler is described (every route of that handler alike)."""
    summary: str
    body: type[BaseModel] | None = None      # the model the handler validates its body with
    body_required: bool = True               # False: an empty body is the model's defaults
    query: type[BaseModel] | None = None
    path: type[BaseModel] | None = None
    stream: bool = False                     # may answer text/event-stream
    work: bool = False                       # 503 when the server does not accept work
    health: bool = False                     # 503 is an `Unavailable` status, not an error
    media: str = "application/json"          # what a 200 is


OPERATIONS: dict[Callable[..., Any], Op] = {
    openai_routes.chat_completions: Op("Chat completion (OpenAI)", ChatCompletionRequest,
                                       stream=True, work=True),
    openai_routes.completions: Op("Text completion (OpenAI)", CompletionRequest, stream=True, work=True),
    openai_routes.list_models: Op("The served models"),
    openai_routes.get_model: Op("One served model", path=ModelPath),
    native_routes.generate: Op("Generate (SGLang); a list of inputs is a batch", GenerateRequest,
                               stream=True, work=True),
    tokenize_routes.tokenize: Op("Token ids of a text, texts or chat", TokenizeRequest),
    tokenize_routes.detokenize: Op("Text of token ids (or of lists of them)", DetokenizeRequest),
    reasoning_routes.separate_reasoning: Op("Split a text's <think> reasoning off (SGLang)",
                                            SeparateReasoningRequest),
    native_routes.model_info: Op("The model's geometry"),
    native_routes.server_info: Op("Server state, scheduler and pooling statistics, config"),
    native_routes.get_load: Op("Load per rank, as SGLang's (what sglang-router probes)"),
    native_routes.health: Op("Shallow health: serving and healthy", health=True),
    native_routes.ping: Op("Liveness (SageMaker-style): as /health", health=True),
    native_routes.version: Op("The server's version"),
    control_routes.abort_request: Op("Abort a request, a prefix of ids, or all", AbortBody),
    control_routes.pause_generation: Op("Pause generation", PauseBody, body_required=False),
    control_routes.continue_generation: Op("Continue after a pause"),
    control_routes.is_paused: Op("Whether generation is paused"),
    control_routes.flush_cache: Op("Flush the prefix cache", FlushBody, body_required=False),
    control_routes.open_session: Op("Open a session; answers its id", OpenSessionBody,
                                    body_required=False),
    control_routes.close_session: Op("Close a session", CloseSessionBody),
    vllm_control_routes.pause: Op("Pause generation (vLLM): abort, keep or wait (drain)", query=VllmPauseQuery),
    vllm_control_routes.resume: Op("Resume generation (vLLM)"),
    vllm_control_routes.reset_prefix_cache: Op("Flush the prefix cache (vLLM): an empty 200",
                                               query=ResetPrefixCacheQuery),
    weights_routes.update_weights_from_disk: Op("Load new weights from a model folder in place (SGLang)",
                                                UpdateFromDiskBody),
    weights_routes.update_weights_from_tensor: Op("Update some or all weights from safetensors bytes, or "
                                                  "SGLang's shared-memory forms from this host", UpdateFromTensorBody),
    weights_dist_routes.init_weights_update_group: Op("Join a trainer's torch.distributed group (gloo) as rank "
                                                      "rank_offset (SGLang)", InitGroupBody),
    weights_dist_routes.update_weights_from_distributed: Op("Receive named tensors broadcast by the trainer, "
                                                            "then load them at a step barrier (SGLang)",
                                                            UpdateDistributedBody),
    weights_dist_routes.destroy_weights_update_group: Op("Leave and free the weight update group (SGLang)",
                                                         DestroyGroupBody),
    lora_routes.sglang_load: Op("Load a LoRA adapter (SGLang); shared with a load of it in flight", LoadLoraBody),
    lora_routes.sglang_unload: Op("Unload a LoRA adapter once no request holds it (SGLang)", UnloadLoraBody),
    lora_routes.vllm_load: Op("Load a LoRA adapter (vLLM): a plain-text answer", LoadLoraBody, media="text/plain"),
    lora_routes.vllm_unload: Op("Unload a LoRA adapter (vLLM): a plain-text answer", UnloadLoraBody,
                                media="text/plain"),
    weights_routes.update_weight_version: Op("Relabel the served weights' version (SGLang)", UpdateVersionBody),
    weights_routes.get_weight_version: Op("The served weights' version"),
    weights_routes.get_weights_by_name: Op("One parameter's values, first dimension truncated (SGLang)",
                                           WeightsByNameBody),
    memory_routes.release_memory_occupation: Op("Give the KV cache's and/or the weights' memory back to "
                                                "the OS (SGLang); no tags: all", MemoryTagsBody, body_required=False),
    memory_routes.resume_memory_occupation: Op("Bring released memory back (SGLang); no tags: all",
                                               MemoryTagsBody, body_required=False),
    memory_routes.sleep: Op("Pause and release all memory (vLLM): an empty 200", query=SleepQuery),
    memory_routes.wake_up: Op("Resume released memory, continue once all is back (vLLM): an empty 200",
                              query=WakeUpQuery),
    memory_routes.is_sleeping: Op("Whether any memory is released (vLLM)"),
    health_routes.health_generate: Op("Deep health: a 1-token probe on the priority lane",
                                      query=HealthGenerateQuery, health=True),
    pooling_routes.embeddings: Op("Embeddings (OpenAI)", EmbeddingRequest, work=True),
    pooling_routes.encode: Op("Embeddings (SGLang)", EncodeRequest, work=True),
    score_routes.score: Op("Score: label-token probabilities (SGLang) or text pairs (vLLM)",
                           score_routes.ScoreBody, work=True),
    pooling_routes.rerank: Op("Rerank documents for a query", RerankRequest, work=True),
    classify_routes.classify: Op("Classify texts or token ids (vLLM)", ClassifyRequest, work=True),
    vllm_routes.pooling: Op("Pool inputs with the embedding or classifier model (vLLM)",
                            vllm_routes.PoolingRequest, work=True),
    vllm_routes.invocations: Op("SageMaker: the route whose request the body is (vLLM's dispatch)",
                                vllm_routes.InvocationsBody, stream=True, work=True),
    cohere_routes.rerank_v2: Op("Rerank documents for a query (Cohere v2)", CohereRerankRequest, work=True),
    cohere_routes.embed_v2: Op("Embeddings by type (Cohere v2)", CohereEmbedRequest, work=True),
    responses_routes.create_response: Op("Create a response (OpenAI Responses API); stored ones "
                                         "chain through sessions", ResponsesRequest, stream=True, work=True),
    responses_routes.get_response: Op("A stored response; stream=true: a background stream's events "
                                      "after starting_after, to its end", path=ResponsePath,
                                      query=RetrieveQuery, stream=True),
    responses_routes.delete_response: Op("Delete a stored response", path=ResponsePath),
    responses_routes.input_items: Op("A stored response's input items", path=ResponsePath,
                                     query=InputItemsQuery),
    responses_routes.cancel_response: Op("Cancel a background response (answered when it has ended; "
                                         "400 for a synchronous one, 404 for an unknown id)", path=ResponsePath,
                                         body_required=False),
    profile_routes.start_profile: Op("Start torch's profiler on the model-step thread and the "
                                     "lifecycle tracks (SGLang)", profile_routes.ProfileBody,
                                     body_required=False, media="text/plain"),
    profile_routes.stop_profile: Op("Stop profiling; writes one Perfetto trace (SGLang)",
                                    body_required=False, media="text/plain"),
    metrics_handler: Op("Prometheus metrics", media="text/plain"),
    debug_routes.request_info: Op("A request's state and recorded history", path=RidPath),
    debug_routes.events: Op("Lifecycle events as they are recorded", query=EventsQuery, stream=True),
    debug_routes.diagram: Op("A lifecycle diagram, a request's path on it", path=DiagramPath,
                             query=DiagramQuery, media="text/plain"),
}


# -- the document ----------------------------------------------------------------------------------


def _ref(name: str, kind: str = "schemas") -> dict[str, str]:
    return {"$ref": f"#/components/{kind}/{name}"}


# pydantic writes a constraint it cannot push into the members of a union (``Annotated[int |
# float, Field(ge=0)]``) under its own name; JSON Schema's name makes clients and fuzzers see it.
_KEYWORDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum",
             "multiple_of": "multipleOf"}
_DATA = frozenset({"default", "const", "enum", "examples"})     # values, not schemas


def _standard(node: Any) -> Any:
    """`node` (a JSON schema) with pydantic's numeric constraint names as JSON Schema's."""
    if isinstance(node, list):
        return [_standard(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _KEYWORDS and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[_KEYWORDS[key]] = value
        elif key in _DATA:
            out[key] = value
        else:
            out[key] = _standard(value)
    return out


def _models(ops: Iterable[Op]) -> list[type[BaseModel]]:
    found: dict[type[BaseModel], None] = {ErrorResponse: None, Unavailable: None}
    for op in ops:
        for m in (op.body, op.query, op.path):
            if m is not None:
                found[m] = None
    return list(found)


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema without the ``null`` of an optional field (a query value is text)."""
    some = [s for s in schema.get("anyOf", ()) if s.get("type") != "null"]
    if len(some) == 1:
        schema = {**{k: v for k, v in schema.items() if k not in ("anyOf", "default")}, **some[0]}
    return schema


def _parameters(model: type[BaseModel] | None, where: str, names: Iterable[str]) -> list[dict[str, Any]]:
    own = _standard(model.model_json_schema()) if model is not None else {}
    props, required = own.get("properties", {}), set(own.get("required", ()))
    out = []
    for name in names:
        schema = _not_null(dict(props.get(name, {"type": "string"})))
        schema.pop("title", None)
        p = {"name": name, "in": where, "required": where == "path" or name in required, "schema": schema}
        if "description" in schema:
            p["description"] = schema.pop("description")
        out.append(p)
    return out


def _responses(op: Op, *, has_input: bool, has_body: bool, guarded: bool,
               names_things: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {op.media: {"schema": {}}}
    if op.stream:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    out: dict[str, Any] = {"200": {"description": "the answer", "content": ok}}
    if has_input:
        out["400"] = _ref("Error", "responses")
    if guarded:
        out["401"] = _ref("Error", "responses")
    if names_things:       # a path parameter or a model that may not exist
        out["404"] = _ref("Error", "responses")
    if has_body:
        out["413"] = _ref("Error", "responses")
    if op.health:
        out["503"] = {"description": "unavailable",
                      "content": {"application/json": {"schema": _ref("Unavailable")}}}
    elif op.work:
        out["503"] = _ref("Error", "responses")
    out["default"] = _ref("Error", "responses")
    return out


def _operation(method: str, path: str, handler: Any, refs: dict[type[BaseModel], Any],
               guarded: bool, key_set: bool) -> dict[str, Any]:
    op = OPERATIONS.get(handler) or Op(getattr(handler, "__name__", "undescribed"))
    params = _parameters(op.path, "path", _PARAM.findall(path))
    if op.query is not None:
        params += _parameters(op.query, "query", op.query.model_fields)
    module = getattr(handler, "__module__", "").rsplit(".", 1)[-1]
    doc: dict[str, Any] = {
        "operationId": re.sub(r"[^A-Za-z0-9]+", "_", f"{method.lower()}{path}").strip("_"),
        "summary": op.summary, "tags": [module.removesuffix("_routes")],
    }
    if params:
        doc["parameters"] = params
    has_body = method == "POST"
    if has_body:
        schema = refs[op.body] if op.body is not None else {"type": "object"}
        doc["requestBody"] = {"required": op.body is not None and op.body_required,
                              "content": {"application/json": {"schema": schema}}}
    names_things = "{" in path or (op.body is not None and "model" in op.body.model_fields)
    doc["responses"] = _responses(op, has_input=bool(params) or has_body, has_body=has_body,
                                  guarded=guarded, names_things=names_things)
    if key_set and not guarded:
        doc["security"] = []           # an open path: no key needed
    return doc


def build_openapi(app: web.Application, open_paths: Iterable[str]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app`'s routes (walks its router)."""
    ctx = app[CTX]
    key_set = bool(ctx.config.api_key)
    open_paths = frozenset(open_paths)
    refs, defs = models_json_schema([(m, "validation") for m in _models(OPERATIONS.values())],
                                    ref_template="#/components/schemas/{model}")
    by_model = {m: ref for (m, _mode), ref in refs.items()}
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        method = route.method.upper()
        if not path or method == "*":
            continue
        guarded = key_set and path not in open_paths
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, route.handler, by_model,
                                                                guarded, key_set)
    components: dict[str, Any] = {
        "schemas": _standard(defs.get("$defs", {})),
        "responses": {"Error": {"description": "an error, in the OpenAI shape",
                                "content": {"application/json": {"schema": _ref("ErrorResponse")}}}},
    }
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "actorserve", "version": __version__,
                 "description": f"Serving {ctx.served_name!r}: OpenAI-compatible, native (SGLang) "
                                "and control routes. Generated from the router and the request models."},
        "paths": {p: dict(sorted(ops.items())) for p, ops in sorted(paths.items())},
        "components": components,
    }
    if key_set:
        components["securitySchemes"] = {_SECURITY: {"type": "http", "scheme": "bearer",
                                                     "description": "the server's --api-key"}}
        doc["security"] = [{_SECURITY: []}]
    return doc


async def openapi_handler(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    extra = ctx.extra
    if _CACHE not in extra:
        extra[_CACHE] = build_openapi(request.app, open_paths(ctx.config))
    return web.json_response(extra[_CACHE])


OPERATIONS[openapi_handler] = Op("This document (OpenAPI 3.1)")
