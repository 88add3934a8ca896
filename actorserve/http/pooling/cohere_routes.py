"""Cohere's v2 API: `/v2/rerank` and `/v2/embed`, what ``cohere.ClientV2`` (and LiteLLM's
Cohere provider) post.

Both are the pooling routes in Cohere's wire shapes: `/v2/rerank` scores with
`pooling_routes.rerank_documents` (the same scores as `/v1/rerank`), `/v2/embed` embeds with
`pooling_routes.embed_vectors` (the same vectors as `/v1/embeddings`), then answers each
requested ``embedding_types`` from the one float vector:

* ``float``: the L2-normalised vector; ``base64``: its float32 little-endian bytes, base64;
* ``uint8``: scalar quantization over the range [-1, 1] that every component of a unit vector
  lies in, 256 equal buckets (Sentence Transformers' ``uint8`` with fixed ranges):
  ``floor((x + 1) * 127.5)``; ``int8`` is that minus 128. Cohere's own models are trained to
  emit int8; a model served here is not, so the buckets are fixed, never fitted to a batch;
* ``ubinary``: one bit per dimension, 1 where ``x > 0``, packed eight to a byte, the first
  dimension in the high bit (numpy's ``packbits``; a last partial byte is zero-padded);
  ``binary`` is that minus 128 (Sentence Transformers' and Cohere's signed packing).

``truncate`` (``END`` by default) and ``max_tokens`` act on the text's own tokens; the
model's special tokens are always kept. ``NONE`` makes an over-long text a 400.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, Callable

from aiohttp import web

from .cohere_schemas import CohereEmbedRequest, CohereRerankRequest
from ..edge.errors import APIError
from ..edge.generation import check_model
from .pooling import PoolModel, pack_base64
from .pooling_routes import check_embedding_model, doc_text, embed_vectors, rerank_documents
from ..edge.schemas import read_json
from ..edge.state import CTX

API_VERSION = {"version": "2"}
DOCS_PER_SEARCH_UNIT = 100       # Cohere bills a query over up to 100 documents as one search unit


# -- embedding types -----------------------------------------------------------------------------
def to_uint8(vec: list[float]) -> list[int]:
    return [min(255, max(0, math.floor((x + 1.0) * 127.5))) for x in vec]


def to_int8(vec: list[float]) -> list[int]:
    return [u - 128 for u in to_uint8(vec)]


def to_ubinary(vec: list[float]) -> list[int]:
    out = []
    for start in range(0, len(vec), 8):
        byte = 0
        for bit, x in enumerate(vec[start:start + 8]):
            if x > 0:
                byte |= 0x80 >> bit
        out.append(byte)
    return out


def to_binary(vec: list[float]) -> list[int]:
    return [b - 128 for b in to_ubinary(vec)]


def _as_float(vec: list[float]) -> list[float]:
    return vec


ENCODINGS: dict[str, Callable[[list[float]], Any]] = {
    "float": _as_float, "int8": to_int8, "uint8": to_uint8,
    "binary": to_binary, "ubinary": to_ubinary, "base64": pack_base64,
}


# -- /v2/embed -------------------------------------------------------------------------------------
def _no_priority(priority: int | None) -> None:
    if priority:
        raise APIError(400, "priority is not supported: requests are served in arrival order; "
                            "send 0 (the default) or leave it out", param="priority")


def _texts(body: CohereEmbedRequest) -> tuple[list[str], str]:
    """The texts to embed and the field they came from (``texts`` or ``inputs``)."""
    if body.images:
        raise APIError(400, "image embeddings are not supported; send texts", param="images")
    if body.texts is not None and body.inputs is not None:
        raise APIError(400, "send texts or inputs, not both", param="inputs")
    if body.inputs is None:
        if body.texts is None:
            raise APIError(400, "texts (or inputs) is required", param="texts")
        texts, param = list(body.texts), "texts"
    else:
        texts, param = [], "inputs"
        for i, one in enumerate(body.inputs):
            parts = []
            for j, part in enumerate(one.content):
                where = f"inputs.{i}.content.{j}"
                if part.type != "text" or part.image_url is not None:
                    raise APIError(400, "image content is not supported; send text parts", param=where)
                if part.text is None:
                    raise APIError(400, "a text part needs its text", param=f"{where}.text")
                parts.append(part.text)
            texts.append("\n".join(parts))
    for i, text in enumerate(texts):
        if not text:
            raise APIError(400, "an input is an empty string", param=f"{param}.{i}")
    return texts, param


def _split(full: list[int], text_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """``full`` (with special tokens) as (prefix, the text's own tokens, suffix)."""
    n = len(text_ids)
    for k in range(len(full) - n + 1):
        if full[k:k + n] == text_ids:
            return full[:k], text_ids, full[k + n:]
    return [], full, []          # the specials change the text's tokens: cut the whole


def encode_truncated(pm: PoolModel, text: str, max_tokens: int | None, truncate: str,
                     where: str) -> list[int]:
    """Token ids of `text` with the model's special tokens, the text's own tokens cut to what
    fits (the model's limit, ``max_tokens``): from the start (``START``) or the end (``END``)."""
    tok = pm.tokenizer
    prefix, ids, suffix = _split(list(tok(text, verbose=False)["input_ids"]),
                                 list(tok(text, add_special_tokens=False, verbose=False)["input_ids"]))
    room = max(1, pm.max_tokens - len(prefix) - len(suffix))
    if max_tokens is not None:
        room = min(room, max_tokens)
    if len(ids) > room:
        if truncate == "NONE":
            limit = "max_tokens" if max_tokens is not None and max_tokens == room else "the model's limit"
            raise APIError(400, f"the input has {len(ids)} tokens, over {limit} of {room}, and "
                                "truncate is NONE", param=where, code="context_length_exceeded")
        ids = ids[len(ids) - room:] if truncate == "START" else ids[:room]
    return prefix + ids + suffix


async def embed_v2(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = CohereEmbedRequest.model_validate(await read_json(request))
    pm = check_embedding_model(ctx, body.model, "/v2/embed")
    _no_priority(body.priority)
    if body.input_type == "image":
        raise APIError(400, "input_type image is not supported (no image model is served)",
                       param="input_type")
    texts, param = _texts(body)
    types = list(dict.fromkeys(body.embedding_types or ["float"]))
    truncate = body.truncate or "END"
    ids = [encode_truncated(pm, t, body.max_tokens, truncate, f"{param}.{i}")
           for i, t in enumerate(texts)]
    vecs, tokens, _ = await embed_vectors(ctx, ids, body.output_dimension, "/v2/embed", param, False)
    embeddings = {kind: [ENCODINGS[kind](v) for v in vecs] for kind in types}
    return web.json_response({"id": str(uuid.uuid4()), "embeddings": embeddings, "texts": texts,
                              "meta": {"api_version": API_VERSION,
                                       "billed_units": {"input_tokens": tokens}},
                              "response_type": "embeddings_by_type"})


# -- /v2/rerank ------------------------------------------------------------------------------------
async def rerank_v2(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = CohereRerankRequest.model_validate(await read_json(request))
    check_model(ctx, body.model)
    _no_priority(body.priority)
    if body.relevant_spans is not None and body.relevant_spans.mode == "enabled":
        raise APIError(400, "relevant spans are not supported; leave relevant_spans out",
                       param="relevant_spans.mode")
    if body.rank_fields not in (None, [], ["text"]):
        raise APIError(400, "only the documents' text is ranked: rank_fields may name 'text' only",
                       param="rank_fields")
    if not body.query:
        raise APIError(400, "the query is empty", param="query")
    docs = [doc_text(d, i) for i, d in enumerate(body.documents)]
    ranking = await rerank_documents(ctx, body.query, docs, body.max_tokens_per_doc)
    results = []
    for i in ranking.order(body.top_n):
        r: dict[str, Any] = {"index": i, "relevance_score": ranking.scores[i]}
        if body.return_documents:
            r["document"] = {"text": docs[i]}
        results.append(r)
    meta = {"api_version": API_VERSION,
            "billed_units": {"search_units": math.ceil(len(docs) / DOCS_PER_SEARCH_UNIT)},
            "tokens": {"input_tokens": ranking.tokens, "output_tokens": 0}}
    return web.json_response({"id": str(uuid.uuid4()), "results": results, "meta": meta})


ROUTES = [
    web.post("/v2/rerank", rerank_v2),
    web.post("/v2/embed", embed_v2),
]
