"""Native (SGLang-style) routes: `/generate`, `/model_info`, `/server_info`, `/get_load`, `/health`;
`/version`, `/ping` (SageMaker-style liveness). The tokenizer routes live in `tokenize_routes`.

`/generate` takes ``text`` or ``input_ids``, one or a list (a list answers a list), with
``sampling_params`` (one for all, or one per input) and ``sampling_params.n`` copies per input.
Its answer is ``{text, output_ids, meta_info{id, finish_reason{type}, prompt_tokens,
completion_tokens, cached_tokens, e2e_latency}}``, with SGLang's logprob fields when
``return_logprob`` (`logprobs.SGLangLogprobs`); streamed, each SSE event carries the
*cumulative* text, ids and logprobs so far (as SGLang does), with ``index`` in a batch, then
``[DONE]``. ``max_new_tokens: 0`` runs the prompt only (SGLang's way to score a prompt: its
``input_token_logprobs``): the prefill's one sampled token is not answered, the finish is
``{type: length, length: 0}`` (`prompt_only`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from aiohttp import web

from ..edge import sse
from ..edge.constraints import pick_constraint
from ...messages import QUEUE_TIMEOUT, SessionEnd
from ..edge.errors import APIError, FieldError
from ..edge.generation import Job, session_prompt, session_rid
from ..edge.prepare import prepare
from ..edge.logprobs import NativeLogprobs
from .native_schemas import GenerateRequest
from .lora_routes import lora_for_paths
from ..edge.compat import sglang_server_fields
from ..edge.state import CTX
from ..edge.weight_versions import version_fields


def finish_reason(out: Any) -> dict[str, Any]:
    """SGLang's ``meta_info.finish_reason``: ``{type: stop, matched: <token id | string>}``,
    ``{type: length, length: <tokens generated>}``, ``{type: abort, message}`` (``Abort in
    waiting queue`` / ``Aborted``), and ``message`` with every error."""
    reason: dict[str, Any] = {"type": out.finish_reason}
    if out.finish_reason == "stop":
        reason["matched"] = out.matched_stop
    elif out.finish_reason == "length":
        reason["length"] = out.completion_tokens
    elif out.finish_reason == "abort" and not out.error:     # the abort route's: SGLang's words
        reason["message"] = "Abort in waiting queue" if out.aborted_in == "queued" else "Aborted"
    if out.error:
        reason["message"] = out.error
    if out.error == QUEUE_TIMEOUT:       # --max-queue-time: SGLang's waiting timeout
        reason["status_code"] = 503
    return reason


def _meta(job: Job, out: Any, finished: bool, weights: Any) -> dict[str, Any]:
    reason = finish_reason(out) if finished else None
    meta = {"id": job.rid, "finish_reason": reason, "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
            # SGLang's: which weights made its tokens (weight_version: the last one's; weight_versions: spans)
            **version_fields(out.weight_versions, out.completion_tokens, weights()),
            "e2e_latency": round(job.timer.elapsed, 6) if job.timer is not None else None}
    spec = getattr(out, "spec", None)
    if spec is not None:           # it speculated (--speculative): SGLang's spec_verify_ct and more
        steps, drafts, accepted = spec
        meta.update(spec_verify_ct=steps, spec_draft_tokens=drafts, spec_accepted_tokens=accepted,
                    spec_accept_rate=round(accepted / drafts, 6) if drafts else 0.0)
    return meta


def prompt_only(out: Any) -> Any:
    """The output of a ``max_new_tokens: 0`` request: the prefill ran (prompt logprobs, cached
    tokens), the token it sampled is not part of the answer."""
    return dataclasses.replace(out, text="", token_ids=[], logprobs=None, completion_tokens=0,
                               finish_reason="length" if out.finish_reason in ("stop", "length")
                               else out.finish_reason, matched_stop=None)


async def generate(request: web.Request) -> web.StreamResponse:
    p = await prepare(request, GenerateRequest, "generate", named=False)
    ctx, body, group = p.ctx, p.body, p.group
    items, batch = body.items()
    prompts = [ctx.tokenizer.encode(x) if isinstance(x, str) else x for x in items]
    params, constraints, logs, vetted = [], [], [], []
    zero: set[int] = set()           # inputs with max_new_tokens 0 (`prompt_only`)
    field = "text" if body.text is not None else "input_ids"
    p.check_prompts((ids, f"{field}.{i}" if batch else field) for i, ids in enumerate(prompts))
    for i, ids in enumerate(prompts):     # every input before the first is submitted
        ns = body.params_for(i, len(prompts))
        where = f"sampling_params.{i}." if isinstance(body.sampling_params, list) else "sampling_params."
        picked = pick_constraint(ns, where)
        if picked is not None:
            constraints.append(picked)
        logs.append(NativeLogprobs.of(body, i, len(prompts), None if body.session_params else len(ids)))
        params.append(dataclasses.replace(ns.to_params(128, grammar=picked[0] if picked else None),
                                          **logs[-1].sampling()))
        if params[-1].max_new_tokens == 0:      # the prefill samples one token: not answered
            params[-1] = dataclasses.replace(params[-1], max_new_tokens=1)
            zero.add(i)
        vetted.append((params[-1], ns.logit_bias, where))
    await p.ready(vetted, constraints, (sum(sp.n for sp in params), "sampling_params.n"))
    loras = await lora_for_paths(ctx, body.lora_path, len(prompts))
    batch = batch or any(sp.n > 1 for sp in params)
    sess = body.session_params
    if sess is not None and (batch or not isinstance(body.rid, (str, type(None)))):
        raise APIError(400, "session_params takes one input with n = 1", param="session_params")
    if sess is not None and zero:
        raise APIError(400, "a session request generates at least one token (max_new_tokens >= 1)",
                       param="sampling_params.max_new_tokens")
    zero_jobs: set[int] = set()      # job indices of those inputs
    prompt_len: dict[int, int] = {}  # job index -> its prompt's tokens (every streamed chunk says it)
    lp_of: dict[int, Any] = {}       # job index -> its SGLang logprob fields (return_logprob)
    weights = lambda: ctx.runtime.weight_version     # no token made yet: the version serving when answered
    with_text = body.return_text_in_logprobs
    async with group:
        if sess is not None:
            rid = session_rid(body.rid if isinstance(body.rid, str) else None)
            ids = await session_prompt(ctx, sess, prompts[0], rid)
            try:                     # its start is a position in the whole session prompt (SGLang's)
                logs[0].check(len(ids))
            except FieldError:
                await ctx.runtime.session(SessionEnd(sess.id, rid, submitted=False))
                raise
            job = group.submit(ids, params[0], rid=rid, session=sess.id, lora=loras[0])
            lp_of[job.index] = logs[0].collector(ctx, ids, with_text)
            prompt_len[job.index] = len(ids)
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            if sess is not None:
                break
            for job in group.submit_n(ids, sp, rid=body.rid_for(i, len(prompts), batch), lora=loras[i]):
                lp_of[job.index] = logs[i].collector(ctx, ids, with_text)
                prompt_len[job.index] = len(ids)
                if i in zero:
                    zero_jobs.add(job.index)
        if not body.stream:
            outs = await group.collect_all()
            results = []
            for job, out in zip(group.jobs, outs):
                if job.index in zero_jobs:
                    out = prompt_only(out)
                r = {"text": out.text, "output_ids": out.token_ids, "meta_info": _meta(job, out, True, weights)}
                if lp_of[job.index] is not None:
                    lp_of[job.index].add(out)
                    r["meta_info"].update(lp_of[job.index].meta())
                results.append(r)
            return web.json_response(results if batch else results[0])
        resp = await sse.open_sse(request)
        texts = {j.index: "" for j in group.jobs}
        ids_so_far: dict[int, list[int]] = {j.index: [] for j in group.jobs}
        async with contextlib.aclosing(group.iterate()) as outputs:
            async for job, out in outputs:
                if job.index in zero_jobs:
                    if not out.finished:
                        continue
                    out = prompt_only(out)
                texts[job.index] += out.text
                ids_so_far[job.index].extend(out.token_ids)
                lps = lp_of[job.index]
                if lps is not None:
                    lps.add(out)
                if not out.text and not out.token_ids and not out.finished:
                    continue
                cum = dataclasses.replace(out, completion_tokens=out.completion_tokens
                                          or len(ids_so_far[job.index]),
                                          prompt_tokens=out.prompt_tokens or prompt_len[job.index])
                event = {"text": texts[job.index], "output_ids": list(ids_so_far[job.index]),
                         "meta_info": _meta(job, cum, out.finished, weights)}
                if lps is not None:          # cumulative, like the text (SGLang's default)
                    event["meta_info"].update(lps.meta())
                if batch:
                    event["index"] = job.index
                await sse.send(resp, event)
        await sse.done(resp)
        return resp


async def model_info(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    info = ctx.runtime.engine_info
    return web.json_response({
        "model_path": ctx.extra.get("model_path", ctx.served_name), "served_model_name": ctx.served_name,
        "is_generation": info.kind == "generate", "max_model_len": info.max_model_len,
        "context_length": ctx.capacity, "vocab_size": info.vocab_size,
        "eos_token_ids": list(info.eos_token_ids), "block_size": info.block_size,
        "num_blocks": info.num_blocks, "dtype": info.dtype, "weight_version": ctx.runtime.weight_version})


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


async def server_info(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    cfg = _jsonable(ctx.config)
    if cfg.get("api_key"):
        cfg["api_key"] = "***"
    rt = ctx.runtime
    return web.json_response({
        **_jsonable(rt.server_info()), **sglang_server_fields(ctx), "served_model_name": ctx.served_name,
        "dtype": rt.engine_info.dtype, "dtype_reason": ctx.extra.get("dtype_reason"),
        "decode_attention": rt.engine_info.attention or None, "quantization": ctx.extra.get("quantization"),
        "engine_paths": ctx.extra.get("engine_paths"),
        "scheduler": _jsonable(ctx.runtime.stats()),
        "pooling": {key: _jsonable(st) for key, st in rt.pool_stats().items()}, "config": cfg,
        "uptime_s": round(time.time() - ctx.created, 3) if ctx.created else None})


async def get_load(request: web.Request) -> web.Response:
    """SGLang's ``/get_load``: one entry per data-parallel rank (one here), ``num_reqs`` running
    and waiting (pooling included), ``num_waiting_reqs``, ``num_tokens`` held in the KV cache;
    sglang-router's load is the sum of ``num_tokens`` (power_of_two balances on it)."""
    rt = request.app[CTX].runtime
    st, pools = rt.stats(), rt.pool_stats().values()
    waiting = st.waiting + sum(p.waiting for p in pools)
    running = st.running + sum(p.running for p in pools)
    return web.json_response([{
        "dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
        "num_tokens": st.kv_used_blocks * rt.engine_info.block_size, "num_running_reqs": running,
        "kv_cache_usage": round(st.kv_usage, 6)}])


async def health(request: web.Request) -> web.Response:
    snap = request.app[CTX].runtime.snapshot()
    ok = snap.state == "serving" and snap.health == "healthy"      # paused or not: the pause is the scheduler's
    return web.json_response({"status": "ok" if ok else "unavailable", "server_state": snap.state,
                              "health": snap.health}, status=200 if ok else 503)


async def version(request: web.Request) -> web.Response:
    from ... import __version__
    return web.json_response({"version": __version__})


async def ping(request: web.Request) -> web.Response:
    """SageMaker-style liveness (``GET``/``POST /ping``): the same verdict as ``/health``."""
    return await health(request)


ROUTES = [
    web.post("/generate", generate),
    web.get("/version", version),
    web.get("/ping", ping),
    web.post("/ping", ping),
    web.get("/model_info", model_info),
    web.get("/get_model_info", model_info),
    web.get("/server_info", server_info),
    web.get("/get_server_info", server_info),
    web.get("/get_load", get_load),
    web.get("/health", health),
]
