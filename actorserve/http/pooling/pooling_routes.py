"""Pooling routes: `/v1/embeddings`, `/encode`, `/v1/score` (SGLang's body; the route itself,
which takes vLLM's too, is `score_routes`), `/v1/rerank` (`/rerank`). `/v1/classify` is
`classify_routes`, vLLM's `/pooling` and `/invocations` are `vllm_routes`.

Every input becomes one pooling request (`PoolGroup`), routed by what is loaded:

* embeddings -> the ``embed`` encoder (mean pooled, L2-normalised, ``dimensions`` truncates
  and renormalises); the names ``default-embedding`` and the real one are accepted;
* score -> the generation model, zero new tokens: probabilities of ``label_token_ids`` at the
  next position after ``query + item`` (``item + query`` with ``item_first``);
* rerank -> the ``rerank`` cross-encoder when ``--rerank-model`` is loaded, else decoder-only:
  a judging prompt through the chat template, score ``p_yes / (p_yes + p_no)`` from the
  next-token distribution of the generation model;
* classify (`classify_routes`) -> the ``classify`` sequence classifier when ``--classify-model``
  is loaded, else a classifier from label tokens on the generation model (`next_token`).

`embed_vectors` and `rerank_documents` do the work; the Cohere v2 routes (`cohere_routes`) and
vLLM's `/pooling` call them too, so every API gives the same vectors and the same scores. The
inputs (token ids, ``add_special_tokens``, ``truncate_prompt_tokens``) are `pooling_inputs`'.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import Field, StrictBool, StrictInt, StrictStr

from ...engine.scheduling.params import PoolingParams
from ..edge.errors import APIError
from ..edge.generation import check_accepting, check_model, check_token_ids
from .pooling import (
    DEFAULT_EMBEDDING_ALIAS, PoolGroup, PoolModel, check_ids, loaded, pack_base64, require,
    softmax, word_token_ids,
)
from .pooling_inputs import MAX_INPUTS, PoolInput, encoder_ids, split_inputs, where
from ..edge.schemas import INT32_MAX, TokenIds, TruncatePrompt, _Body, read_json
from ..edge.state import CTX, ServerContext

JUDGE_SYSTEM = ('Judge whether the Document answers the Query. Note that the answer can only be '
                '"yes" or "no".')
MAX_LABELS = 1024          # label_token_ids, label words

TextOrIds = StrictStr | TokenIds
Texts = Annotated[list[StrictStr], Field(max_length=MAX_INPUTS)]
IdsList = Annotated[list[TokenIds], Field(max_length=MAX_INPUTS)]


class EmbeddingRequest(_Body):
    input: StrictStr | Texts | TokenIds | IdsList
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    user: StrictStr | None = None
    add_special_tokens: StrictBool = True               # vLLM's: of a text input
    truncate_prompt_tokens: TruncatePrompt | None = None  # vLLM's: keep the last k tokens


class EncodeRequest(_Body):
    text: StrictStr | Texts | None = None
    input_ids: TokenIds | IdsList | None = None


class ScoreRequest(_Body):
    query: TextOrIds
    items: TextOrIds | Annotated[list[TextOrIds], Field(max_length=MAX_INPUTS)]
    label_token_ids: Annotated[TokenIds, Field(min_length=1, max_length=MAX_LABELS)]
    apply_softmax: StrictBool = False
    item_first: StrictBool = False
    model: StrictStr | None = None


class RerankRequest(_Body):
    query: StrictStr
    documents: Annotated[list[StrictStr | dict[str, Any]], Field(max_length=MAX_INPUTS)]
    top_n: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)    # 0 (vLLM's default): all
    return_documents: StrictBool = True
    model: StrictStr | None = None


def usage(n: int) -> dict[str, int]:
    """A pooling request's usage: vLLM's and SGLang's ``UsageInfo`` (``completion_tokens`` 0)."""
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


def _count(inputs: list[Any], param: str) -> None:
    if not inputs:
        raise APIError(400, "the input is empty", param=param)
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}", param=param)


# -- embeddings --------------------------------------------------------------------------------
def check_embedding_model(ctx: ServerContext, model: str | None, what: str) -> PoolModel:
    """The loaded embedding model, which ``model`` (if given) must name: 404 otherwise."""
    pm = require(ctx, "embed", what)
    if model not in (None, "", pm.name, DEFAULT_EMBEDDING_ALIAS):
        raise APIError(404, f"the model {model!r} does not exist; embeddings are served by "
                            f"{pm.name!r} (also {DEFAULT_EMBEDDING_ALIAS!r})", code="model_not_found",
                       param="model")
    return pm


async def embed_vectors(ctx: ServerContext, inputs: list[PoolInput], dimensions: int | None,
                        what: str, param: str, single: bool, *, special: bool = True,
                        truncate: int | None = None, normalize: bool = True,
                        kind: str = "embeddings") -> tuple[list[list[float]], int, str]:
    """The embedding of each input (a text, with the model's special tokens unless ``special``
    is false, or token ids as given; ``truncate``: vLLM's ``truncate_prompt_tokens``), the tokens
    they took, and the model's name; ``param`` names the inputs' field in errors."""
    pm = require(ctx, "embed", what)
    _count(inputs, param)
    ids = []
    for i, x in enumerate(inputs):       # an empty string would embed [CLS] [SEP] alone
        at = where(param, i, len(inputs), single)
        if not x:
            raise APIError(400, "an input is empty (an empty string or list)", param=at)
        ids.append(encoder_ids(pm, x, special=special, truncate=truncate, param=at))
    params = PoolingParams(task="embed", normalize=normalize, dimensions=dimensions)
    check_accepting(ctx)
    async with PoolGroup(ctx, kind) as group:
        for one in ids:
            group.submit(one, params, target="embed")
        vecs = await group.results()
    return vecs, sum(len(x) for x in ids), pm.name


async def embeddings(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = EmbeddingRequest.model_validate(await read_json(request))
    check_embedding_model(ctx, body.model, "/v1/embeddings")
    inputs, single = split_inputs(body.input)
    vecs, n, name = await embed_vectors(ctx, inputs, body.dimensions, "/v1/embeddings", "input", single,
                                        special=body.add_special_tokens, truncate=body.truncate_prompt_tokens)
    data = [{"object": "embedding", "index": i,
             "embedding": pack_base64(v) if body.encoding_format == "base64" else v}
            for i, v in enumerate(vecs)]
    return web.json_response({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "data": data, "model": body.model or name, "usage": usage(n)})


async def encode(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = EncodeRequest.model_validate(await read_json(request))
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "exactly one of text or input_ids is required", param="text")
    raw = body.text if body.text is not None else body.input_ids
    batch = isinstance(raw, list) and not (raw and all(isinstance(x, int) for x in raw))
    inputs = list(raw) if batch else [raw if isinstance(raw, str) else list(raw)]
    vecs, _, _ = await embed_vectors(ctx, inputs, None, "/encode",
                                     "text" if body.text is not None else "input_ids", not batch)
    out = [{"embedding": v, "meta_info": {"prompt_tokens": None}} for v in vecs]
    return web.json_response(out if batch else out[0])


# -- score ---------------------------------------------------------------------------------------
def _gen_ids(ctx: ServerContext, x: str | list[int], special: bool) -> list[int]:
    return ctx.tokenizer.encode(x, add_special_tokens=special) if isinstance(x, str) else list(x)


async def next_token(ctx: ServerContext, prompts: list[list[int]], groups: list[list[int]],
                      task: str) -> list[list[float]]:
    """For each prompt, the log-probability of each group of next tokens (generation model)."""
    info = ctx.runtime.engine_info
    for ids in prompts:
        check_ids(ids, info.vocab_size, ctx.capacity - 1)
    params = PoolingParams(task=task, head="label_groups", label_groups=tuple(map(tuple, groups)))
    check_accepting(ctx)
    async with PoolGroup(ctx, task) as group:
        for ids in prompts:
            group.submit(ids, params, target=None)
        return await group.results()


async def score(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = ScoreRequest.model_validate(await read_json(request))
    check_model(ctx, body.model)
    items = body.items
    single = isinstance(items, str) or bool(items and all(isinstance(x, int) for x in items))
    if single:
        items = [items]
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} items per request, got {len(items)}", param="items")
    if not items and not isinstance(body.query, str):   # SGLang: no items is no scores, for a text query
        raise APIError(400, "Invalid combination of query/items types for score_request.", param="items")
    vocab = ctx.runtime.engine_info.vocab_size
    check_token_ids(body.label_token_ids, vocab, "label_token_ids")
    if not isinstance(body.query, str):
        check_token_ids(body.query, vocab, "query")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            check_token_ids(item, vocab, where("items", i, len(items), single))
    prompts = []
    for item in items:
        first, second = (item, body.query) if body.item_first else (body.query, item)
        prompts.append(_gen_ids(ctx, first, True) + _gen_ids(ctx, second, False))
    rows = await next_token(ctx, prompts, [[t] for t in body.label_token_ids], "score")
    scores = [softmax(r) if body.apply_softmax else [math.exp(v) for v in r] for r in rows]
    return web.json_response({"scores": scores, "model": ctx.served_name, "object": "scoring",
                              "usage": usage(sum(len(p) for p in prompts))})


# -- rerank ---------------------------------------------------------------------------------------
def doc_text(doc: str | dict[str, Any], i: int) -> str:
    """A document: a string, or an object with a string ``text``."""
    if isinstance(doc, str):
        return doc
    text = doc.get("text")
    if not isinstance(text, str):
        raise APIError(400, "each document must be a string or an object with a string 'text'",
                       param=f"documents.{i}")
    return text


def _first_tokens(hf_tokenizer: Any, text: str, n: int) -> str:
    """`text` cut after its first `n` tokens (no special tokens counted), at a token boundary."""
    try:
        enc = hf_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    except NotImplementedError:        # a slow tokenizer has no offsets: decode the kept tokens
        ids = hf_tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        return text if len(ids) <= n else hf_tokenizer.decode(ids[:n])
    offsets = enc["offset_mapping"]
    return text if len(offsets) <= n else text[:offsets[n - 1][1]]


@dataclass(frozen=True, slots=True)
class Ranking:
    """Each document's relevance to the query (in [0, 1] for the decoder-only judge), the model
    that scored them and the tokens scored."""
    scores: list[float]
    name: str
    tokens: int

    def order(self, top_n: int | None) -> list[int]:
        """Document indices, most relevant first, the first `top_n` of them."""
        order = sorted(range(len(self.scores)), key=lambda i: -self.scores[i])
        return order if top_n is None else order[:top_n]


async def rerank_documents(ctx: ServerContext, query: str, docs: list[str],
                           max_tokens_per_doc: int | None = None) -> Ranking:
    """Score each document against the query: the cross-encoder when one is loaded, else the
    generation model's yes/no judgement. ``max_tokens_per_doc`` cuts each document first."""
    _count(docs, "documents")
    cross = loaded(ctx, "rerank")
    if max_tokens_per_doc is not None:
        tok = cross.tokenizer if cross is not None else ctx.tokenizer.hf
        docs = [_first_tokens(tok, d, max_tokens_per_doc) for d in docs]
    if cross is not None:
        pairs = [cross.encode(query, d) for d in docs]
        check_accepting(ctx)
        async with PoolGroup(ctx, "rerank") as group:
            for ids in pairs:
                group.submit(ids, PoolingParams(task="rerank", head="last"), target="rerank")
            scores = await group.results()
        return Ranking(scores, cross.name, sum(len(p) for p in pairs))
    yes, no = word_token_ids(ctx, ["yes"]), word_token_ids(ctx, ["no"])
    if not yes or not no:
        raise APIError(400, "the generation model's vocabulary has no single 'yes'/'no' token; "
                            "load a cross-encoder with --rerank-model PATH")
    prompts = [ctx.tokenizer.apply_chat_template(
        [{"role": "system", "content": JUDGE_SYSTEM},
         {"role": "user", "content": f"<Query>: {query}\n<Document>: {d}\n"
                                     "Does the Document answer the Query? Answer yes or no."}])
        for d in docs]
    rows = await next_token(ctx, prompts, [yes, no], "rerank")
    return Ranking([softmax(r)[0] for r in rows], ctx.served_name, sum(len(p) for p in prompts))


async def rerank(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    raw = await read_json(request)
    # SGLang's own form (what sglang-router forwards: ``rid`` always there, ``top_k``, and the
    # model "unknown" when the client named none) is answered in SGLang's shape, the bare list
    # the router parses and re-wraps (docs/fleet.md).
    sglang = isinstance(raw, dict) and "rid" in raw
    if sglang:
        raw = {("top_n" if k == "top_k" else k): v for k, v in raw.items()
               if k not in ("rid", "user") and (k, v) != ("model", "unknown")}
    body = RerankRequest.model_validate(raw)
    check_model(ctx, body.model)
    docs = [doc_text(d, i) for i, d in enumerate(body.documents)]
    ranking = await rerank_documents(ctx, body.query, docs)
    if sglang:
        return web.json_response([
            {"score": ranking.scores[i], "index": i, "meta_info": {"prompt_tokens": ranking.tokens},
             **({"document": docs[i]} if body.return_documents else {})}
            for i in ranking.order(body.top_n or None)])
    results = []
    for i in ranking.order(body.top_n or None):
        r: dict[str, Any] = {"index": i, "relevance_score": ranking.scores[i]}
        if body.return_documents:
            r["document"] = {"text": docs[i]}
        results.append(r)
    tokens = ranking.tokens
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or ranking.name,
                              "results": results, "usage": {"total_tokens": tokens, "prompt_tokens": tokens}})


ROUTES = [
    web.post("/v1/embeddings", embeddings),
    web.post("/encode", encode),
    web.post("/v1/rerank", rerank),
    web.post("/rerank", rerank),
]
