"""`/v1/classify` and `/classify`: vLLM's classification request and answer.

The input is vLLM's: a text, a list of texts, a token-id list or a list of them, with
``add_special_tokens`` (default true) and ``truncate_prompt_tokens`` (`pooling_inputs`). An
empty input (``""``, ``[]``, an empty token list) is a 400 naming it. Each input is classified
by the ``classify`` sequence classifier when ``--classify-model`` is loaded (token ids are then
that model's), else by the generation model's label-token classifier: the text (token ids are
the generation model's, decoded) goes into a chat-template prompt asking for one of the label
words (``labels``, default negative/positive), and the probabilities are those of the label
words' tokens at the next position, renormalised. The chat template adds the generation
model's special tokens there, so ``add_special_tokens`` applies to the classifier model only.

The answer is vLLM's ``{id: "classify-...", object: "list", created, model, data: [{index,
label, probs, num_classes}], usage}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from aiohttp import web
from pydantic import Field, StrictBool, StrictStr

from ...engine.scheduling.params import PoolingParams
from ..edge.errors import APIError
from ..edge.generation import check_accepting, check_model
from .pooling import PoolGroup, PoolModel, loaded, softmax, word_token_ids
from .pooling_inputs import encoder_ids, generation_text, split_inputs, where
from .pooling_routes import MAX_LABELS, IdsList, Texts, next_token, usage
from ..edge.schemas import TokenIds, TruncatePrompt, _Body, read_json
from ..edge.state import CTX, ServerContext

DEFAULT_LABELS = ("negative", "positive")


class ClassifyRequest(_Body):
    input: StrictStr | Texts | TokenIds | IdsList
    model: StrictStr | None = None
    user: StrictStr | None = None
    add_special_tokens: StrictBool = True                 # vLLM's: of a text input (the classifier model)
    truncate_prompt_tokens: TruncatePrompt | None = None  # vLLM's: keep the last k tokens
    # label words for the label-token classifier
    labels: Annotated[list[StrictStr], Field(max_length=MAX_LABELS)] | None = None


async def classifier_probs(ctx: ServerContext, ids: list[list[int]], kind: str = "classify") -> list[list[float]]:
    """The ``classify`` model's class probabilities for each token-id input."""
    check_accepting(ctx)
    async with PoolGroup(ctx, kind) as group:
        for one in ids:
            group.submit(one, PoolingParams(task="classify"), target="classify")
        return await group.results()


def classifier_ids(clf: PoolModel, inputs: list, single: bool, special: bool,
                   truncate: int | None) -> list[list[int]]:
    return [encoder_ids(clf, x, special=special, truncate=truncate, param=where("input", i, len(inputs), single))
            for i, x in enumerate(inputs)]


def _classify_prompt(ctx: ServerContext, text: str, labels: list[str]) -> list[int]:
    return ctx.tokenizer.apply_chat_template([
        {"role": "system", "content": "You classify texts. Answer with one word: "
                                      + " or ".join(labels) + "."},
        {"role": "user", "content": f"Text: {text}\nIs the sentiment of this text "
                                    + " or ".join(labels) + "?"}])


async def _label_token_probs(ctx: ServerContext, texts: list[str],
                             labels: list[str]) -> tuple[list[list[float]], int]:
    if len(labels) < 2:
        raise APIError(400, "labels needs at least two label words", param="labels")
    groups = [word_token_ids(ctx, [w]) for w in labels]
    flat = [t for g in groups for t in g]
    if any(not g for g in groups) or len(flat) != len(set(flat)):
        raise APIError(400, "each label word must have its own single-token spelling in the "
                            "generation model's vocabulary; or load --classify-model PATH",
                       param="labels")
    prompts = [_classify_prompt(ctx, t, labels) for t in texts]
    rows = await next_token(ctx, prompts, groups, "classify")
    return [softmax(r) for r in rows], sum(len(p) for p in prompts)


async def classify(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = ClassifyRequest.model_validate(await read_json(request))
    check_model(ctx, body.model)
    inputs, single = split_inputs(body.input)
    clf = loaded(ctx, "classify")
    if clf is not None and body.labels is None:
        ids = classifier_ids(clf, inputs, single, body.add_special_tokens, body.truncate_prompt_tokens)
        probs = await classifier_probs(ctx, ids)
        labels, name, tokens = list(clf.engine.labels), clf.name, sum(len(x) for x in ids)
    else:
        labels = list(body.labels or DEFAULT_LABELS)
        texts = [generation_text(ctx, x, body.truncate_prompt_tokens, where("input", i, len(inputs), single))
                 for i, x in enumerate(inputs)]
        probs, tokens = await _label_token_probs(ctx, texts, labels)
        name = ctx.served_name
    data = []
    for i, p in enumerate(probs):
        best = max(range(len(p)), key=lambda k: p[k])
        data.append({"index": i, "label": labels[best] if best < len(labels) else str(best),
                     "probs": p, "num_classes": len(p)})
    return web.json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                              "created": int(time.time()), "model": body.model or name,
                              "data": data, "usage": usage(tokens)})


ROUTES = [
    web.post("/v1/classify", classify),
    web.post("/classify", classify),
]
