"""Tokenizer routes: `/tokenize`, `/detokenize` (SGLang) and `/v1/tokenize`, `/v1/detokenize`
(vLLM's paths), one handler each for both servers' request shapes.

``/tokenize`` takes one of

* ``text`` or ``prompt``: a string, or a list of strings (SGLang's batch: the answer's
  ``tokens`` is then a list of lists and ``count`` a list), with ``add_special_tokens``
  (default true);
* ``messages`` (vLLM's chat form): rendered by the chat template with
  ``add_generation_prompt`` (default true) or ``continue_final_message`` (the last message
  left open; not both), ``chat_template_kwargs``; ``add_special_tokens`` (default false here,
  as vLLM: the template has them) adds the tokenizer's own on top; ``tools`` (vLLM) are shown to
  the model exactly as a chat request with those tools shows them (`tools.plan_tools`), so the
  count is the prompt that request would have;

and answers ``{tokens, count, max_model_len, token_strs}``; ``token_strs`` (the tokenizer's
pieces of each id) is filled when ``return_token_strs`` is set, else null, as vLLM.

``/detokenize`` takes ``tokens`` (or ``input_ids``): a list of ids or, as SGLang, a list of
lists, and answers ``{text, prompt}`` (SGLang reads ``text``, vLLM ``prompt``; a batch has a
list in each). An id outside the vocabulary is a 400 naming it (``tokens.3``, ``tokens.1.0``).
``skip_special_tokens`` defaults to false (vLLM's behaviour; SGLang's default is true).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from aiohttp import web
from pydantic import Field, StrictBool, StrictStr

from ..edge.errors import APIError
from ..edge.generation import check_model, check_token_ids
from ..edge.schemas import MAX_BATCH, Messages, StrBatch, TokenIds, Tools, _Body, read_json
from ..edge.state import CTX
from ..tools.tools import plan_tools

TemplateKwargs = Annotated[dict[StrictStr, Any], Field(max_length=64)]


class TokenizeRequest(_Body):
    model: StrictStr | None = None
    text: StrictStr | StrBatch | None = None
    prompt: StrictStr | StrBatch | None = None
    messages: Messages | None = None
    add_special_tokens: StrictBool | None = None      # default: true for text, false for messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: TemplateKwargs | None = None
    tools: Tools | None = None
    return_token_strs: StrictBool = False

    # what `plan_tools` reads of a chat request besides the tools: every tool shown, as "auto"
    tool_choice: ClassVar[None] = None
    parallel_tool_calls: ClassVar[bool] = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: TokenIds | Annotated[list[TokenIds], Field(max_length=MAX_BATCH)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(max_length=MAX_BATCH)] | None = None
    skip_special_tokens: StrictBool = False


def _chat_ids(ctx: Any, body: TokenizeRequest) -> list[int]:
    if body.add_generation_prompt and body.continue_final_message and "add_generation_prompt" in body.model_fields_set:
        raise APIError(400, "cannot set both continue_final_message and add_generation_prompt to true",
                       param="continue_final_message")
    plan = plan_tools(body, ctx.tokenizer, ctx.config.tool_call_parser)
    kwargs = {**(body.chat_template_kwargs or {}), **plan.template_kwargs}
    if body.continue_final_message:
        kwargs["continue_final_message"] = True
    gen = body.add_generation_prompt and not body.continue_final_message
    text = ctx.tokenizer.render_chat(plan.messages, gen, **kwargs)
    return ctx.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


async def tokenize(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = TokenizeRequest.model_validate(await read_json(request))
    check_model(ctx, body.model)
    given = [f for f in ("text", "prompt", "messages") if getattr(body, f) is not None]
    if len(given) != 1:
        raise APIError(400, "exactly one of text, prompt or messages is required",
                       param=given[1] if given else "text")
    hf = ctx.tokenizer.hf
    if body.messages is not None:
        ids_list, batch = [_chat_ids(ctx, body)], False
    else:
        raw = body.text if body.text is not None else body.prompt
        batch = isinstance(raw, list)
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids_list = [ctx.tokenizer.encode(t, add_special_tokens=special) for t in (raw if batch else [raw])]
    strs = [list(hf.convert_ids_to_tokens(ids)) for ids in ids_list] if body.return_token_strs else None
    if batch:
        return web.json_response({"tokens": ids_list, "count": [len(x) for x in ids_list],
                                  "max_model_len": ctx.capacity, "token_strs": strs})
    return web.json_response({"tokens": ids_list[0], "count": len(ids_list[0]), "max_model_len": ctx.capacity,
                              "token_strs": strs[0] if strs is not None else None})


async def detokenize(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = DetokenizeRequest.model_validate(await read_json(request))
    check_model(ctx, body.model)
    param = "tokens" if body.tokens is not None else "input_ids"
    ids = body.tokens if body.tokens is not None else body.input_ids
    if ids is None:
        raise APIError(400, "tokens (or input_ids) is required", param="tokens")
    batch = bool(ids) and isinstance(ids[0], list)
    vocab = ctx.tokenizer.vocab_size
    for i, one in enumerate(ids if batch else [ids]):
        check_token_ids(one, vocab, f"{param}.{i}" if batch else param)
    texts = [ctx.tokenizer.decode(one, skip_special_tokens=body.skip_special_tokens)
             for one in (ids if batch else [ids])]
    text: str | list[str] = texts if batch else texts[0]
    return web.json_response({"text": text, "prompt": text})


ROUTES = [
    web.post("/tokenize", tokenize),
    web.post("/detokenize", detokenize),
    web.post("/v1/tokenize", tokenize),          # vLLM's paths for the same two
    web.post("/v1/detokenize", detokenize),
]
