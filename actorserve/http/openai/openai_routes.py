"""OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Chat prompts go through the tokenizer's chat template; ``n > 1`` becomes n engine requests.
Completions take a string, a list of strings or token ids (one list or a list of lists).
Streaming is SSE: the role delta first, content deltas, ``finish_reason`` on each choice's last
chunk, a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``. A client that
goes away mid-stream aborts its requests at once (`RequestGroup` does it on exit). SGLang's
and vLLM's extras (``matched_stop`` / ``stop_reason``, ``continuous_usage_stats``,
``truncate_prompt_tokens``, the model cards) come from `compat`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from typing import Any

from aiohttp import web

from ...messages import RequestOutput
from ..edge import sse
from ..edge.compat import ChunkUsage, best_of, model_cards, stop_fields, truncate_prompt
from ..edge.constraints import pick_constraint
from ..edge.errors import APIError, FieldError
from ..edge.generation import RequestGroup, fail_if_error, session_prompt, session_rid
from ..edge.prepare import prepare
from .reasoning_plan import ChoiceStream, ReasoningPlan, plan_reasoning, template_kwargs
from ..edge.logprobs import (
    TextOffsets, chat_logprobs, completion_logprobs, prompt_completion_logprobs, vllm_prompt_logprobs,
)
from ..edge.schemas import SessionParams
from ..edge.schemas import ChatCompletionRequest, CompletionRequest
from ..edge.state import CTX, ServerContext
from ..tools.tools import ToolPlan, plan_tools
from ..edge.weight_versions import response_metadata


def _usage(outs: list[RequestOutput], prompt_tokens: int) -> dict[str, Any]:
    completion = sum(o.completion_tokens for o in outs)
    cached = max((o.cached_tokens for o in outs), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _grammar(body: Any, plan: ToolPlan | None = None) -> tuple[tuple[str, str], str] | None:
    """The request's one output constraint: its own, or the tool calls' (not both)."""
    own = pick_constraint(body)
    if plan is not None and plan.grammar is not None:
        if own is not None:
            raise FieldError(own[1], f"{own[1]} cannot be combined with tools (tool_choice "
                                     f"{plan.mode}); use tool_choice none")
        return plan.grammar, "tools"
    return own


def _no_stream_prompt_logprobs(body: Any) -> None:
    if body.stream and body.prompt_logprobs is not None:       # vLLM refuses them too
        raise FieldError("prompt_logprobs", "prompt_logprobs are not available with stream: true")


# -- chat ------------------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    p = await prepare(request, ChatCompletionRequest, "chat")
    ctx, body, model, group = p.ctx, p.body, p.model, p.group
    plan = plan_tools(body, ctx.tokenizer, ctx.config.tool_call_parser)
    ids = ctx.tokenizer.apply_chat_template(plan.messages, **template_kwargs(body, plan),
                                            **body.generation_prompt_kwargs())
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, ctx.capacity)
    rplan = plan_reasoning(ctx, body, ids)
    sess = body.session_params or (SessionParams(id=body.session_id) if body.session_id else None)
    if sess is not None and body.n != 1:
        raise APIError(400, "a session request takes n = 1", param="n")
    constraint = _grammar(body, plan)
    grammar = constraint[0] if constraint else None
    sp = rplan.sampling(body.sampling(group.default_max(ids), grammar))   # validates before a session is joined
    _no_stream_prompt_logprobs(body)
    p.check_prompts([(ids, "messages")])
    await p.ready([(sp, body.logit_bias, "")], [constraint] if constraint else [])
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    async with group:
        if sess is not None:   # the new messages' template extends the session's chain
            rid = session_rid(body.rid)
            ids = await session_prompt(ctx, sess, ids, rid)
            group.submit(ids, rplan.sampling(body.sampling(group.default_max(ids), grammar)), rid=rid,
                         session=sess.id)
        else:
            group.submit_n(ids, sp, rid=body.rid)
        if not body.stream:
            outs = await group.collect_all()
            fail_if_error(outs)
            choices, thought = [], 0
            for i, o in enumerate(outs):
                message, finish = rplan.message(plan, o.text, o.finish_reason)
                thought += rplan.tokens(o.token_ids, message.get("reasoning_content"), ctx.tokenizer)
                choices.append({"index": i, "message": message,
                                "logprobs": chat_logprobs(ctx, o.logprobs), "finish_reason": finish,
                                **stop_fields(o, finish, body.stop_token_ids, ctx.runtime.engine_info.eos_token_ids)})
            answer = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                      "choices": choices, "usage": rplan.add_usage(_usage(outs, len(ids)), thought),
                      "metadata": response_metadata(outs, ctx.runtime.weight_version)}     # SGLang's
            if sp.prompt_logprobs is not None:      # vLLM's, for the one prompt of every choice
                answer["prompt_logprobs"] = vllm_prompt_logprobs(ctx, outs[0].prompt_logprobs)
            return web.json_response(answer)
        return await _stream_chat(request, ctx, group, body, plan, rplan, cid, created, model, len(ids))


async def _stream_chat(request: web.Request, ctx: ServerContext, group: RequestGroup,
                       body: ChatCompletionRequest, plan: ToolPlan, rplan: ReasoningPlan, cid: str,
                       created: int, model: str, n_prompt: int) -> web.StreamResponse:
    include_usage = body.include_usage
    resp = await sse.open_sse(request)
    usage = ChunkUsage(body.continuous_usage, {job.index: n_prompt for job in group.jobs})
    eos = ctx.runtime.engine_info.eos_token_ids

    def chunk(choices: list[dict[str, Any]], out: RequestOutput | None = None) -> dict[str, Any]:
        c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
        for ch in choices:         # a choice's last chunk says what stopped it
            if out is not None and ch["finish_reason"] is not None:
                ch.update(stop_fields(out, ch["finish_reason"], body.stop_token_ids, eos))
        if include_usage:
            c["usage"] = usage.usage(choices[0]["index"])
        return c

    finals: list[RequestOutput] = []
    streams = {job.index: ChoiceStream(plan, rplan) for job in group.jobs}
    # a choice's role chunk goes out with its first output, as vLLM's and SGLang's do: sent at
    # acceptance, it was what clients that time the first chunk (`vllm bench serve`) took for
    # the first token (a median TTFT of 23 ms for 256-token prompts)
    unannounced = {job.index for job in group.jobs}
    async with contextlib.aclosing(group.iterate()) as outputs:
        async for job, out in outputs:
            if job.index in unannounced:
                unannounced.discard(job.index)
                await sse.send(resp, chunk([{"index": job.index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]))
            ds = streams[job.index]
            usage.add(job.index, out)
            deltas = ds.feed(out.text, out.token_ids, out.finished)
            logprobs = chat_logprobs(ctx, out.logprobs)
            if logprobs and not deltas:
                deltas = [{"content": ""}]     # the token's text is held back (a possible tool call)
            last = len(deltas) - 1
            for k, delta in enumerate(deltas):
                final = out.finished and k == last
                await sse.send(resp, chunk([{"index": job.index, "delta": delta,
                                             "logprobs": logprobs if k == 0 else None,
                                             "finish_reason": ds.finish_reason(out.finish_reason) if final else None}],
                                           out))
            if out.finished:
                if not deltas:
                    await sse.send(resp, chunk([{"index": job.index, "delta": {}, "logprobs": None,
                                                 "finish_reason": ds.finish_reason(out.finish_reason)}], out))
                finals.append(out)
    if include_usage:
        await sse.send(resp, {"id": cid, "object": "chat.completion.chunk", "created": created,
                              "model": model, "choices": [], "usage": rplan.add_usage(
                                  _usage(finals, n_prompt),
                                  sum(s.reasoning_tokens(ctx.tokenizer) for s in streams.values()))})
    await sse.done(resp)
    return resp


# -- completions -----------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    p = await prepare(request, CompletionRequest, "completion")
    ctx, body, model, group = p.ctx, p.body, p.model, p.group
    if body.suffix:
        raise FieldError("suffix", "suffix (fill-in-the-middle) is not supported")
    given = body.prompts()
    encoded = [ctx.tokenizer.encode(p) if isinstance(p, str) else p for p in given]
    prompts = [truncate_prompt(e, body.truncate_prompt_tokens, ctx.capacity) for e in encoded]
    constraint = _grammar(body)
    grammar = constraint[0] if constraint else None
    params = [body.sampling(group.default_max(ids), grammar) for ids in prompts]
    best = best_of(body, params[0].n)
    if best.extra:    # the candidates' own logprobs rank them; the answer shows them only if asked
        params = [dataclasses.replace(sp, n=best.candidates, logprobs=True) for sp in params]
    _no_stream_prompt_logprobs(body)
    one = isinstance(body.prompt, str) or len(prompts) == 1
    p.check_prompts((ids, "prompt" if one else f"prompt.{i}") for i, ids in enumerate(prompts))
    await p.ready([(params[0], body.logit_bias, "")], [constraint] if constraint else [],
                  (len(prompts) * params[0].n, "n"))
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    # vLLM's echo: a text prompt as sent, a token-id prompt decoded with its special tokens shown
    as_text = [isinstance(p, str) for p in given]
    echo = [("" if not body.echo else p if t and len(ids) == len(e)
             else ctx.tokenizer.decode(ids, skip_special_tokens=t))
            for p, e, ids, t in zip(given, encoded, prompts, as_text)]
    async with group:
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            rid = None if body.rid is None else (body.rid if len(prompts) == 1 else f"{body.rid}-{i}")
            group.submit_n(ids, sp, rid=rid)
        n = params[0].n       # engine requests per prompt (best_of's candidates included)
        n_prompt = sum(len(p) for p in prompts)
        eos = ctx.runtime.engine_info.eos_token_ids
        usage = ChunkUsage(body.continuous_usage, {i: len(prompts[i // n]) for i in range(len(group.jobs))})

        def offsets_for(i: int) -> TextOffsets:
            return TextOffsets(ctx, len(echo[i // n]), params[i // n].skip_special_tokens)

        def echoed(o: RequestOutput, i: int) -> dict[str, Any] | None:
            """The echoed prompt's logprobs (echo with logprobs), before the choice's own."""
            if not body.echo or body.logprobs is None:
                return None
            return prompt_completion_logprobs(ctx, o.prompt_logprobs, body.logprobs, as_text[i // n])

        if not body.stream:
            outs = await group.collect_all()
            fail_if_error(outs)
            used = _usage(outs, n_prompt)          # every candidate's tokens were spent
            if best.extra:
                outs = best.pick(outs)
                n = best.n
                if body.logprobs is None:
                    for o in outs:
                        o.logprobs = None
            choices = [{"index": i, "text": echo[i // n] + o.text,
                        "logprobs": completion_logprobs(ctx, o.logprobs, offsets_for(i), echoed(o, i)),
                        "finish_reason": o.finish_reason} for i, o in enumerate(outs)]
            if params[0].prompt_logprobs is not None:       # vLLM's, on each choice
                for c, o in zip(choices, outs):
                    c["prompt_logprobs"] = vllm_prompt_logprobs(ctx, o.prompt_logprobs)
            for c, o in zip(choices, outs):
                c.update(stop_fields(o, o.finish_reason, params[0].stop_token_ids, eos))
            return web.json_response({"id": cid, "object": "text_completion", "created": created,
                                      "model": model, "choices": choices, "usage": used,
                                      "metadata": response_metadata(outs, ctx.runtime.weight_version)})
        resp = await sse.open_sse(request)
        finals: list[RequestOutput] = []
        offsets: dict[int, TextOffsets] = {}      # per choice, from its first chunk on
        async with contextlib.aclosing(group.iterate()) as outputs:
            async for job, out in outputs:
                usage.add(job.index, out)
                text, first = out.text, None
                if job.index not in offsets:
                    offsets[job.index] = offsets_for(job.index)
                    text, first = echo[job.index // n] + text, echoed(out, job.index)
                if not text and not out.finished and not out.logprobs:
                    continue
                lps = completion_logprobs(ctx, out.logprobs, offsets[job.index], first)
                c = {"id": cid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": job.index, "text": text, "logprobs": lps,
                                  "finish_reason": out.finish_reason if out.finished else None}]}
                if out.finished:
                    c["choices"][0].update(stop_fields(out, out.finish_reason, params[0].stop_token_ids, eos))
                if body.include_usage:
                    c["usage"] = usage.usage(job.index)
                await sse.send(resp, c)
                if out.finished:
                    finals.append(out)
        if body.include_usage:
            await sse.send(resp, {"id": cid, "object": "text_completion", "created": created,
                                  "model": model, "choices": [], "usage": _usage(finals, n_prompt)})
        await sse.done(resp)
        return resp


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": model_cards(request.app[CTX])})


async def get_model(request: web.Request) -> web.Response:
    """One entry of `/v1/models` (the alias answers under its own id), else 404."""
    ctx = request.app[CTX]
    name = request.match_info["model"]
    card = next((c for c in model_cards(ctx) if c["id"] == name), None)
    if card is None:                          # unknown, or an adapter not ready (loading, unloading)
        raise APIError(404, f"The model `{name}` does not exist", type="invalid_request_error",
                       code="model_not_found", param="model")
    return web.json_response(card)


ROUTES = [
    web.post("/v1/chat/completions", chat_completions),
    web.post("/v1/completions", completions),
    web.get("/v1/models", list_models),
    web.get("/v1/models/{model}", get_model),
]
