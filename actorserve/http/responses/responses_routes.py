"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``.

**Background** (``background: true``, with ``store``): the create answers at once with the
response ``queued`` (with ``stream``, its events, from a log any client can resume with
``GET /v1/responses/{id}?stream=true&starting_after=N``); the request runs on in the runtime
and the store follows it ``queued -> in_progress -> completed | incomplete | failed |
cancelled`` (`responses_background`). **Cancel** (``POST /v1/responses/{id}/cancel``) aborts a
background response still queued or in progress and answers it ``cancelled``; an ended one is
answered unchanged (cancelling is idempotent); a synchronous one is a 400 (``Cannot cancel a
synchronous response.``, OpenAI's and vLLM's words), an unknown id a 404. A synchronous response
in progress is ended by its own client leaving (or ``/abort_request`` with its rid).

A response is one generation request, built from ``instructions`` (a system message) and
``input`` (`responses_items`), through the chat template, with ``text.format`` and ``tools``
as the chat route has them (grammar-constrained JSON, tool calls parsed into
``function_call`` items).

**Stored responses are sessions.** With ``store`` (the default) the response is kept by the
runtime's responses store (`actors.responses`, its RESPONSE lifecycle recorded) and its
generation runs in an actorserve session. A response made with ``previous_response_id``
continues its parent's conversation: when the chat template's rendering of the whole
conversation (the parent's input and output, then the new input) extends exactly the text
of the parent's tokens, the new request joins the parent's session as the parent's child: its
prompt is the parent's prompt + output tokens + the new turn's tokens, so its prefill starts
after the parent's KV (``usage.input_tokens_details.cached_tokens``). Two responses chained to
the same parent are two branches of that session. When the rendering does not extend the
parent's tokens (new ``instructions``, a template that rewrites history, tool calls
re-rendered), the response starts a session of its own from the whole rendered conversation
(the prefix cache may still hit).

``store: false`` responses are not kept; one may still continue a stored parent. On a server
with a replica id (``--replica-id``; a fleet's ``r<i>``) a response's id names the replica
(``resp_r1_<hex>``, `responses_items.response_id`), so a fleet's front sends a continuation,
``GET`` and ``DELETE`` to the replica that stores it.
Streaming sends the Responses event types (``response.created`` ... ``response.completed``),
each with its ``sequence_number``; a client that leaves cancels the response.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any

from aiohttp import web

from ...messages import OpenSession, RequestOutput, ResponseBegin, ResponseCancel, ResponseDelete, ResponseEnd
from ...statemachines import ResponseState
from . import responses_background
from ..edge import sse
from ..edge.constraints import pick_constraint
from ..edge.errors import APIError, FieldError
from ..edge.generation import RequestGroup, fail_if_error, session_prompt
from ..edge.logprobs import chat_logprobs
from ..edge.prepare import prepare
from ..openai.reasoning_plan import ReasoningPlan, plan_reasoning
from .responses_items import (
    call_item, chat_tool_choice, chat_tools, message_item, read_input, response_id, response_object,
    reasoning_item, responses_param, to_messages, usage,
)
from .responses_schemas import InputItemsQuery, ResponsesRequest, RetrieveQuery
from .responses_stream import STATUS_OF, EventStream
from ..edge.schemas import SessionParams
from ..edge.state import CTX, ServerContext
from ..tools.tools import ToolPlan, plan_tools


def _previous(ctx: ServerContext, body: ResponsesRequest) -> dict[str, Any] | None:
    if body.previous_response_id is None:
        return None
    entry = ctx.runtime.response(body.previous_response_id)
    if entry is None:
        raise APIError(400, f"previous response {body.previous_response_id!r} not found: it was never "
                            "stored (store: false), or it was deleted or evicted",
                       code="previous_response_not_found", param="previous_response_id")
    if entry.state not in (ResponseState.completed, ResponseState.incomplete) or entry.record is None:
        raise APIError(400, f"previous response {body.previous_response_id!r} is {entry.state.name}; "
                            "only a completed or incomplete response can be continued",
                       param="previous_response_id")
    return entry.record


def _plan(ctx: ServerContext, body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ToolPlan:
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = system + conversation
    view = SimpleNamespace(messages=messages, tools=chat_tools(body.tools),
                           tool_choice=chat_tool_choice(body.tool_choice),
                           parallel_tool_calls=body.parallel_tool_calls)
    try:
        return plan_tools(view, ctx.tokenizer, ctx.config.tool_call_parser)
    except FieldError as exc:
        raise FieldError(responses_param(exc.param), str(exc)) from None


def _constraint(body: ResponsesRequest, plan: ToolPlan) -> tuple[tuple[str, str], str] | None:
    fmt = (body.text.format if body.text is not None else None)
    own = None
    if fmt is not None:
        # the Responses API spells json_schema flat: {type, name, schema, strict}
        flat = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        rf = fmt if fmt.get("type") != "json_schema" else {"type": "json_schema", "json_schema": flat}
        try:
            own = pick_constraint(SimpleNamespace(response_format=rf))
        except FieldError as exc:
            message = str(exc).replace("response_format", "text.format")
            raise FieldError(_format_param(exc.param), message) from None
        if own is not None:
            own = (own[0], _format_param(own[1]))
    if plan.grammar is not None:
        if own is not None:
            raise FieldError("text.format", f"text.format cannot be combined with tools (tool_choice "
                                            f"{plan.mode}); use tool_choice none")
        return plan.grammar, "tools"
    return own


def _format_param(param: str) -> str:
    return (param.replace("response_format.json_schema", "text.format")
            .replace("response_format", "text.format"))


def _render(ctx: ServerContext, plan: ToolPlan) -> str:
    try:
        return ctx.tokenizer.render_chat(plan.messages, **plan.template_kwargs)
    except ValueError as exc:
        raise FieldError("input", str(exc)) from None


def _fit(ctx: ServerContext, body: ResponsesRequest,
         conversation: list[dict[str, Any]]) -> tuple[ToolPlan, str, list[int]]:
    """The plan, rendered text and ids; ``truncation: auto`` drops the oldest items until the
    prompt leaves room to generate (``disabled``: too long is a 400)."""
    while True:
        plan = _plan(ctx, body, conversation)
        text = _render(ctx, plan)
        ids = ctx.tokenizer.encode(text, add_special_tokens=False)
        if body.truncation == "disabled" or len(ids) < ctx.capacity or len(conversation) <= 1:
            return plan, text, ids
        conversation = conversation[1:]


def _outcome(plan: ToolPlan, rplan: ReasoningPlan, out: RequestOutput,
             logprobs: list[Any] | None) -> tuple[str, list[dict[str, Any]]]:
    status = STATUS_OF.get(out.finish_reason or "error", "failed")
    item_status = "incomplete" if status == "incomplete" else "completed"
    message, _finish = rplan.message(plan, out.text, out.finish_reason)
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content") is not None:      # a reasoning model's thinking first
        items.append(reasoning_item(message["reasoning_content"], item_status))
    content = message.get("content")
    if content or not message.get("tool_calls"):
        items.append(message_item(content or "", item_status, logprobs))
    for call in message.get("tool_calls") or ():
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return status, items


async def _open_session(ctx: ServerContext, sid: str) -> None:
    res = await ctx.runtime.control(OpenSession(session_id=sid))
    if not res.ok:
        raise APIError(500, f"could not open the response's session: {res.message}", type="server_error")


async def create_response(request: web.Request) -> web.StreamResponse:
    p = await prepare(request, ResponsesRequest, "responses")
    ctx, body, model, group = p.ctx, p.body, p.model, p.group
    assert model is not None
    items = read_input(body.input)
    parent = _previous(ctx, body)
    conversation = list(parent["conversation"]) if parent else []
    plan, text, ids = _fit(ctx, body, conversation + to_messages(items))
    constraint = _constraint(body, plan)
    rplan = plan_reasoning(ctx, body, ids)
    p.check_prompts([(ids, "input")])
    sp = rplan.sampling(body.sampling(group.default_max(ids), constraint[0] if constraint else None))
    await p.ready([(sp, body.logit_bias, "")], [constraint] if constraint else [])
    # with a replica id (--replica-id, a fleet's r<i>) the id names this replica (`response_id`)
    rid, created = response_id(ctx.config.recorder.replica_id), time.time()
    rt = ctx.runtime
    if body.store:
        skeleton = response_object(rid, body, model, status="queued", created=created)
        res = await rt.session(ResponseBegin(rid, body.previous_response_id, skeleton, body.background))
        if not res.ok:
            raise APIError(400, res.message, code=res.detail.get("code"), param="previous_response_id"
                           if body.previous_response_id else "store")
    run = _Run(ctx, body, model, rid, created, plan, items, conversation + to_messages(items))
    run.rplan = rplan
    background = False
    try:
        await run.join_session(parent, text, ids)
        grammar = constraint[0] if constraint else None
        sampling = rplan.sampling(body.sampling(group.default_max(run.prompt_ids), grammar))
        if body.background:      # the request runs on; its reader ends the stored response
            job = group.submit(run.prompt_ids, sampling, rid=rid, session=run.session, response=rid)
            background = True
            events = responses_background.start(ctx, run, group, job)
            if events is None:
                return web.json_response(response_object(rid, body, model, status="queued", created=created))
            return await responses_background.follow(request, events)
        async with group:
            job = group.submit(run.prompt_ids, sampling, rid=rid, session=run.session,
                               response=rid if body.store else None)
            if not body.stream:
                out = await group.collect(job)
                obj = run.finish(out, None)
                fail_if_error([out])
                return web.json_response(obj)
            return await _stream(request, run, group)
    finally:
        if not background:
            run.end_store()


async def _stream(request: web.Request, run: "_Run", group: RequestGroup) -> web.StreamResponse:
    resp = await sse.open_sse(request)
    stream = EventStream(resp, run.plan, run.want_logprobs, run.token_logprobs, run.rplan.splitter())
    await stream.begin(response_object(run.rid, run.body, run.model, status="in_progress",
                                       created=run.created))
    final: RequestOutput | None = None
    async with contextlib.aclosing(group.iterate()) as outputs:
        async for _job, piece in outputs:
            await stream.feed(piece)
            if piece.finished:
                final = piece
    assert final is not None
    await stream.conclude(run.rid, final, run.finish)
    await sse.close(resp)
    return resp


class _Run:
    """One create: where its tokens go (session), what it stores when it ends."""

    def __init__(self, ctx: ServerContext, body: ResponsesRequest, model: str, rid: str, created: float,
                 plan: ToolPlan, items: list[dict[str, Any]], conversation: list[dict[str, Any]]) -> None:
        self.ctx, self.body, self.model, self.rid, self.created = ctx, body, model, rid, created
        self.plan, self.items, self.conversation = plan, items, conversation
        self.want_logprobs = body.want_logprobs
        self.rplan = ReasoningPlan()              # the create's (`reasoning_plan`)
        self.session: str | None = None
        self.text = ""                            # the rendered prompt text
        self.prompt_ids: list[int] = []
        self.result: tuple[str, dict[str, Any], dict[str, Any] | None] | None = None

    async def join_session(self, parent: dict[str, Any] | None, text: str, ids: list[int]) -> None:
        ctx = self.ctx
        self.text = text
        if parent is not None and parent.get("session") is not None:
            kv_text = parent["kv_text"]
            if text.startswith(kv_text) and len(text) > len(kv_text):
                new = ctx.tokenizer.encode(text[len(kv_text):], add_special_tokens=False)
                try:
                    self.prompt_ids = await session_prompt(
                        ctx, SessionParams(id=parent["session"], rid=parent["rid"]), new, self.rid)
                    self.session = parent["session"]
                    return
                except APIError:
                    pass       # the parent's session is closing or gone: a session of our own
        self.prompt_ids = ids
        if self.body.store:
            self.session = self.rid
            await _open_session(ctx, self.session)
            self.prompt_ids = await session_prompt(ctx, SessionParams(id=self.session), ids, self.rid)

    def token_logprobs(self, lps: list[Any]) -> list[dict[str, Any]]:
        return chat_logprobs(self.ctx, lps)["content"]

    def finish(self, out: RequestOutput, items: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The final response object (``items``: the streamed output items, else from the text)."""
        lps = self.token_logprobs(out.logprobs) if self.want_logprobs and out.logprobs is not None else None
        status, parsed = _outcome(self.plan, self.rplan, out, lps)
        output = parsed if items is None else items
        thought = next((i["content"][0]["text"] for i in output if i["type"] == "reasoning"), None)
        error = None
        if status == "failed":
            error = {"code": "server_error", "message": out.error or out.finish_reason or "failed"}
        obj = response_object(self.rid, self.body, self.model, status=status, created=self.created,
                              output=output, use=usage(out.prompt_tokens or len(self.prompt_ids),
                                                       out.completion_tokens, out.cached_tokens,
                                                       self.rplan.tokens(out.token_ids, thought,
                                                                         self.ctx.tokenizer)),
                              error=error,
                              incomplete="max_output_tokens" if status == "incomplete" else None)
        self.result = (status, obj, {"session": self.session, "rid": self.rid,
                                     "kv_text": self._kv_text(out),
                                     "conversation": self.conversation + to_messages(output),
                                     "input_items": self.items})
        return obj

    def _kv_text(self, out: RequestOutput) -> str:
        """The text this response's tokens (prompt + output) stand for, as the chat template
        renders a conversation: the rendered prompt, the output text, and the stop token that
        ended it (EOS is a token of the KV but not of the text)."""
        tok = self.ctx.tokenizer
        end = ""
        last = out.token_ids[-1] if out.token_ids else None
        if last is not None and (last in tok.special_ids or out.matched_stop == last):
            end = tok.decode([last], skip_special_tokens=False)
        return self.text + out.text + end

    def end_store(self) -> None:
        if not self.body.store:
            return
        if self.result is None:     # refused, failed or left before an outcome: cancelled
            obj = response_object(self.rid, self.body, self.model, status="cancelled", created=self.created)
            self.result = ("cancelled", obj, {"session": self.session, "rid": self.rid, "kv_text": "",
                                              "conversation": [], "input_items": self.items})
        status, obj, record = self.result
        self.ctx.runtime.session(ResponseEnd(self.rid, status, obj, record))


# -- reads ---------------------------------------------------------------------------------------
def _stored(request: web.Request) -> Any:
    ctx = request.app[CTX]
    rid = request.match_info["response_id"]
    entry = ctx.runtime.response(rid)
    if entry is None:
        raise APIError(404, f"response {rid!r} not found", code="response_not_found", param="response_id")
    return entry


async def get_response(request: web.Request) -> web.StreamResponse:
    """The stored response; ``stream=true``: a background stream's events after
    ``starting_after``, then on to its end."""
    entry = _stored(request)
    q = RetrieveQuery.model_validate(dict(request.query))
    q.check()
    if not q.stream:
        return web.json_response(entry.body)
    events = request.app[CTX].background.log(entry.response_id)
    if events is None:
        raise APIError(400, f"response {entry.response_id!r} has no stream to resume: only a response "
                            "created with background: true and stream: true keeps its events",
                       param="stream")
    after = -1 if q.starting_after is None else q.starting_after
    return await responses_background.follow(request, events, after)


async def delete_response(request: web.Request) -> web.Response:
    entry = _stored(request)
    ctx = request.app[CTX]
    res = await ctx.runtime.session(ResponseDelete(entry.response_id))
    if not res.ok:
        raise APIError(404 if res.detail.get("code") == "response_not_found" else 400, res.message,
                       param="response_id")
    ctx.background.forget(entry.response_id)
    return web.json_response({"id": entry.response_id, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    """OpenAI's cancel (see the module doc): answered when the response has ended."""
    rid = request.match_info["response_id"]
    res = await request.app[CTX].runtime.session(ResponseCancel(rid))
    if not res.ok:
        code = res.detail.get("code")
        if code == "response_not_found":
            raise APIError(404, res.message, code=code, param="response_id")
        if code == "shutting_down":
            raise APIError(503, res.message, code="server_unavailable")
        raise APIError(400, res.message)
    return web.json_response(res.detail["body"])


async def input_items(request: web.Request) -> web.Response:
    entry = _stored(request)
    q = InputItemsQuery.model_validate(dict(request.query))
    items = list((entry.record or {}).get("input_items") or [])
    if q.order == "desc":
        items.reverse()
    if q.after is not None:
        at = next((i for i, it in enumerate(items) if it["id"] == q.after), None)
        if at is None:
            raise APIError(400, f"no input item {q.after!r} in this response", param="after")
        items = items[at + 1:]
    page = items[:q.limit]
    return web.json_response({"object": "list", "data": page,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None,
                              "has_more": len(items) > len(page)})


ROUTES = [
    web.post("/v1/responses", create_response),
    web.get("/v1/responses/{response_id}", get_response),
    web.delete("/v1/responses/{response_id}", delete_response),
    web.get("/v1/responses/{response_id}/input_items", input_items),
    web.post("/v1/responses/{response_id}/cancel", cancel_response),
]
