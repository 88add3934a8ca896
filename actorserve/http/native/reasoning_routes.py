"""SGLang's ``POST /separate_reasoning``: split a text with a named reasoning parser.

``{text, reasoning_parser}`` -> ``{reasoning_text, text}`` (the reasoning without its tags,
"" when there is none; the rest). The parser is named by the request (``qwen3``,
``deepseek-r1`` and their other spellings), not the server's ``--reasoning-parser``: the text
is taken as a whole output, so ``deepseek-r1`` reads text before ``</think>`` as reasoning and
``qwen3`` only what follows a leading ``<think>``.
"""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import Field, StrictStr

from ..edge.errors import FieldError
from ..openai.reasoning import get_format, split_text
from ..edge.schemas import _Body, read_json


class SeparateReasoningRequest(_Body):
    text: Annotated[StrictStr, Field(max_length=1 << 22)]
    reasoning_parser: StrictStr


async def separate_reasoning(request: web.Request) -> web.Response:
    body = SeparateReasoningRequest.model_validate(await read_json(request))
    try:
        fmt = get_format(body.reasoning_parser)
    except ValueError as exc:
        raise FieldError("reasoning_parser", str(exc)) from None
    reasoning, text = split_text(fmt, body.text, opened=fmt.always)
    return web.json_response({"reasoning_text": reasoning or "", "text": text})


ROUTES = [web.post("/separate_reasoning", separate_reasoning)]
