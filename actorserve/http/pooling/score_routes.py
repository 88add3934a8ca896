"""`/v1/score` and `/score`: SGLang's label-token scoring and vLLM's pair scoring on one path.

A body with SGLang's fields (``query``, ``items``, ``label_token_ids``) is SGLang's request and
goes to `pooling_routes.score`. A body with vLLM's pairs is vLLM's: ``text_1`` / ``text_2``
(also spelled ``data_1`` / ``data_2``, or ``queries`` / ``documents``), each a string or a list
of strings, paired 1:1, 1:N (one first text against every second text) or N:N (element by
element). Each pair is scored as `/v1/rerank` scores a (query, document): the cross-encoder
when ``--rerank-model`` is loaded, else the generation model's yes/no judgement, in [0, 1].
The answer is vLLM's::

    {id, object: "list", created, model, data: [{index, object: "score", score}], usage}
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any, Union

from aiohttp import web
from pydantic import Field, RootModel, StrictStr

from . import pooling_routes
from ..edge.errors import APIError
from ..edge.generation import check_model
from .pooling_routes import MAX_INPUTS, ScoreRequest, rerank_documents
from ..edge.schemas import _Body, read_json
from ..edge.state import CTX

Texts = Union[StrictStr, Annotated[list[StrictStr], Field(max_length=MAX_INPUTS)]]
_PAIRS = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"))
VLLM_FIELDS = frozenset(f for pair in _PAIRS for f in pair)


class PairScoreRequest(_Body):
    """vLLM's score request: one of the three spellings of its two sides."""
    model: StrictStr | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None

    def sides(self) -> tuple[list[str], list[str], str]:
        """(first texts, second texts, the first side's field name)."""
        given = [(a, b) for a, b in _PAIRS if getattr(self, a) is not None or getattr(self, b) is not None]
        if len(given) != 1:
            raise APIError(400, "give exactly one pair of text_1 / text_2 (or data_1 / data_2, or "
                                "queries / documents)", param=given[1][0] if given else "text_1")
        a, b = given[0]
        one, two = getattr(self, a), getattr(self, b)
        if one is None or two is None:
            raise APIError(400, f"{a} and {b} are both required", param=b if two is None else a)
        one, two = ([one] if isinstance(one, str) else list(one)), ([two] if isinstance(two, str) else list(two))
        if not one:
            raise APIError(400, "At least one text element must be given", param=a)
        if not two:
            raise APIError(400, "At least one text_pair element must be given", param=b)
        if len(one) > 1 and len(one) != len(two):
            raise APIError(400, f"Input lengths must be either 1:1, 1:N or N:N (got {len(one)}:{len(two)})",
                           param=b)
        return one, two, a


class ScoreBody(RootModel[Union[ScoreRequest, PairScoreRequest]]):
    """What `/v1/score` takes: SGLang's request or vLLM's (the document's schema; the handler
    picks the model by the fields the body has)."""


async def _pair_scores(ctx: Any, first: list[str], second: list[str]) -> tuple[list[float], str, int]:
    if len(first) == 1:        # 1:N is one ranking of every second text against the first
        r = await rerank_documents(ctx, first[0], second)
        return r.scores, r.name, r.tokens
    rankings = await asyncio.gather(*(rerank_documents(ctx, q, [d]) for q, d in zip(first, second)))
    return ([r.scores[0] for r in rankings], rankings[0].name if rankings else ctx.served_name,
            sum(r.tokens for r in rankings))


async def score(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    raw = await read_json(request)
    if VLLM_FIELDS.isdisjoint(raw):
        return await pooling_routes.score(request)     # SGLang's (the body is read once, cached)
    body = PairScoreRequest.model_validate(raw)
    check_model(ctx, body.model)
    first, second, _ = body.sides()
    scores, name, tokens = await _pair_scores(ctx, first, second)
    return web.json_response({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": body.model or name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})


ROUTES = [
    web.post("/v1/score", score),
    web.post("/score", score),
]
