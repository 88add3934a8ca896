"""Submitting generation requests and reading their outputs, shared by OpenAI and native routes.

A `RequestGroup` is the set of engine requests one HTTP request makes (``n`` choices, a batch).
It validates each prompt against the context size, submits it with its own detokenizer, times
it for the metrics, and reads the outputs either merged per request (`collect_all`) or
interleaved as they come (`iterate`). It is an async context manager: leaving it for any reason
(client disconnect, cancellation, an error) before a request's final output was read aborts
that request at once, so its KV blocks are freed.

The ``check_*`` helpers are the edge's checks that need the model (the vocabulary, the context
size): a route runs them on every input before it submits the first, so a request is refused
whole, with ``param`` naming the field, before any of it reaches the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, AsyncIterator

from ...actors.surface import RequestHandle
from ...engine.scheduling.params import SamplingParams
from ...messages import QUEUE_TIMEOUT, RequestOutput, SessionBegin, SessionEnd, merge_outputs
from ...messages_lora import is_lora_refusal
from .errors import APIError
from .state import ServerContext

MAX_N = 64                                      # choices per prompt
MAX_REQUESTS = 1024                             # engine requests of one HTTP request (inputs x n)
_BACKGROUND: set[asyncio.Task[None]] = set()   # drains of aborted streams (strong refs)


@dataclasses.dataclass(slots=True)
class Job:
    index: int
    handle: RequestHandle
    timer: Any
    finished: bool = False

    @property
    def rid(self) -> str:
        return self.handle.rid


def check_accepting(ctx: ServerContext) -> None:
    snap = ctx.runtime.snapshot()
    if not snap.accepting:
        raise APIError(503, f"server is {snap.state}; not accepting requests", code="server_unavailable")


def check_admission(ctx: ServerContext) -> None:
    """Refuse a generation request (503 + Retry-After) before any work is spent on it when the
    queue is full; the runtime checks again at submission."""
    ctx.runtime.admit()


def check_model(ctx: ServerContext, model: str | None) -> None:
    """A ``model`` field names something this server serves (any of its generation or pooling
    models, or an alias), else 404: a field that is accepted has its effect."""
    if model is None or model in ctx.model_names():
        return
    pooled = [pm.name for pm in (ctx.extra.get("pooling") or {}).values()]
    if model in pooled or model == "default-embedding":
        return
    raise APIError(404, f"The model `{model}` does not exist; served: {ctx.served_name!r}"
                        + (f" and {', '.join(map(repr, pooled))}" if pooled else ""),
                   type="invalid_request_error", code="model_not_found", param="model")


def check_token_ids(ids: Any, vocab: int, param: str) -> None:
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {ids[bad]} is out of range [0, {vocab})", param=f"{param}.{bad}")


def check_prompt(ctx: ServerContext, ids: list[int], param: str = "prompt") -> None:
    if not ids:
        raise APIError(400, "the prompt is empty", param=param)
    check_token_ids(ids, ctx.runtime.engine_info.vocab_size, param)
    cap = ctx.capacity
    if len(ids) >= cap:
        raise APIError(400, f"this model's maximum context length is {cap} tokens; the prompt has "
                            f"{len(ids)} tokens, leaving no room to generate",
                       code="context_length_exceeded", param=param)


def check_sampling(ctx: ServerContext, sp: SamplingParams, logit_bias: dict[str, Any] | None,
                   prefix: str = "") -> None:
    """What of the sampling parameters needs the vocabulary: stop token ids, token_ids_logprob,
    logit_bias keys (a token id as a decimal string; the values' range is the schema's)."""
    vocab = ctx.runtime.engine_info.vocab_size
    check_token_ids(sp.stop_token_ids, vocab, f"{prefix}stop_token_ids")
    check_token_ids(sp.token_ids_logprob, vocab, "token_ids_logprob")
    for key in logit_bias or ():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab):
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab}), got {key[:40]!r}",
                           param=f"{prefix}logit_bias")


def check_fanout(total: int, param: str = "n") -> None:
    """Bound the engine requests one HTTP request makes (inputs x n)."""
    if total > MAX_REQUESTS:
        raise APIError(400, f"this request would make {total} generations (inputs x n); at most "
                            f"{MAX_REQUESTS}", param=param)


async def session_prompt(ctx: ServerContext, params: Any, new_ids: list[int], rid: str) -> list[int]:
    """Join session ``params.id`` (a `SessionParams`): the composed prompt, or a 400 why not.
    The session now counts `rid` as running; `RequestGroup.submit(..., session=)` reports its end."""
    bos = getattr(getattr(ctx.tokenizer, "hf", None), "bos_token_id", None)
    try:
        res = await ctx.runtime.session(SessionBegin(
            params.id, rid, tuple(new_ids), params.rid, params.offset, params.replace,
            params.drop_previous_output, bos))
    except asyncio.CancelledError:   # the client left: undo a reservation that may have been made
        await asyncio.shield(ctx.runtime.session(SessionEnd(params.id, rid, submitted=False)))
        raise
    if not res.ok:
        raise APIError(400, res.message, code="invalid_session", param="session_params")
    return list(res.detail["prompt_ids"])


def session_rid(rid: str | None) -> str:
    return rid or uuid.uuid4().hex


def fail_if_error(outs: list[RequestOutput]) -> None:
    """A request that failed is the answer's error: a 404 when its adapter went away after the
    route checked it (the scheduler's refusal), else a 500."""
    for o in outs:
        if o.finish_reason == "error":
            if is_lora_refusal(o.error):
                raise APIError(404, o.error, code="model_not_found", param="model")
            raise APIError(500, f"generation failed: {o.error}", type="server_error")


def _queue_timed_out(out: RequestOutput) -> None:
    """``--max-queue-time`` ended the request while queued: SGLang's answer, a 503."""
    if out.finished and out.finish_reason == "abort" and out.error == QUEUE_TIMEOUT:
        raise APIError(503, QUEUE_TIMEOUT, code=503)


class RequestGroup:
    def __init__(self, ctx: ServerContext, kind: str, *, deadline_s: float | None = None,
                 priority: int | None = None) -> None:
        ctx.runtime.check_priority(priority)     # vLLM's 400 under FCFS, before anything runs
        self.ctx = ctx
        self.kind = kind
        self.deadline_s = deadline_s      # the request's own deadline (else the server's)
        self.priority = priority or 0     # its scheduling priority (--scheduling-policy priority)
        self.lora: str | None = None      # the LoRA adapter its requests run under (None: the base)
        self.jobs: list[Job] = []

    def default_max(self, ids: list[int]) -> int:
        return max(1, self.ctx.capacity - len(ids))

    def submit(self, ids: list[int], sp: SamplingParams, *, rid: str | None = None,
               session: str | None = None, response: str | None = None, lora: str | None = None) -> Job:
        """Submit one request (one choice); `sp.n` is ignored here (see `submit_n`).
        With ``session``, the request was begun by `session_prompt` under `rid`; ``response``:
        the stored response it makes (`Runtime.generate`); ``lora``: its adapter (else the group's)."""
        try:
            check_prompt(self.ctx, ids)
            metrics = self.ctx.metrics
            timer = metrics.timer(self.kind, priority=self.priority) if metrics is not None else None
            handle = self.ctx.runtime.generate(ids, sp, rid=rid, session=session,
                                               deadline_s=self.deadline_s, priority=self.priority,
                                               response=response, lora=lora or self.lora)
        except BaseException:
            if session is not None and rid is not None:
                task = asyncio.ensure_future(self.ctx.runtime.session(SessionEnd(session, rid, submitted=False)))
                _BACKGROUND.add(task)
                task.add_done_callback(_BACKGROUND.discard)
            raise
        job = Job(len(self.jobs), handle, timer)
        self.jobs.append(job)
        return job

    def submit_n(self, ids: list[int], sp: SamplingParams, *, rid: str | None = None,
                 lora: str | None = None) -> list[Job]:
        """`sp.n` independent requests for one prompt (seeded ones get seed, seed+1, ...)."""
        if sp.n > MAX_N:
            raise APIError(400, f"n must be <= {MAX_N}, got {sp.n}", param="n")
        out = []
        for i in range(sp.n):
            one = sp if sp.n == 1 else dataclasses.replace(
                sp, n=1, seed=None if sp.seed is None else sp.seed + i)
            r = rid if rid is None or sp.n == 1 else f"{rid}-{i}"
            out.append(self.submit(ids, one, rid=r, lora=lora))
        return out

    # -- reading -----------------------------------------------------------------------------------
    def _seen(self, job: Job, out: RequestOutput) -> None:
        if job.timer is not None:
            job.timer.observe(out)
        if out.finished:
            job.finished = True

    async def collect(self, job: Job) -> RequestOutput:
        items: list[RequestOutput] = []
        async for out in job.handle.stream:
            self._seen(job, out)
            items.append(out)
        return merge_outputs(items) if items else RequestOutput(job.rid)

    async def outputs(self, job: Job) -> AsyncIterator[RequestOutput]:
        """One job's outputs as they come, observed like every read (no in-band refusal)."""
        async for out in job.handle.stream:
            self._seen(job, out)
            yield out

    async def collect_all(self) -> list[RequestOutput]:
        outs = list(await asyncio.gather(*(self.collect(j) for j in self.jobs)))
        for out in outs:
            _queue_timed_out(out)
        return outs

    async def iterate(self) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """Outputs of all jobs, interleaved in arrival order, until every job has finished."""
        if len(self.jobs) == 1:
            job = self.jobs[0]
            async for out in job.handle.stream:
                self._seen(job, out)
                self._in_band(out)
                yield job, out
            return
        queue: asyncio.Queue[tuple[Job, RequestOutput]] = asyncio.Queue()

        async def pump(job: Job) -> None:
            async for out in job.handle.stream:
                queue.put_nowait((job, out))

        tasks = [asyncio.ensure_future(pump(j)) for j in self.jobs]
        try:
            remaining = len(self.jobs)
            while remaining:
                job, out = await queue.get()
                self._seen(job, out)
                self._in_band(out)
                if out.finished:
                    remaining -= 1
                yield job, out
        finally:
            for t in tasks:
                t.cancel()
            # Wait for the pumps to let go of their streams before anyone else reads them.
            await asyncio.gather(*tasks, return_exceptions=True)

    def _in_band(self, out: RequestOutput) -> None:
        """A stream that ends on the queue deadline: OpenAI routes end with SGLang's error event
        (503); /generate keeps its in-band ``finish_reason`` (abort, status_code 503)."""
        if self.kind != "generate":
            _queue_timed_out(out)

    # -- leaving -----------------------------------------------------------------------------------
    def abort_unfinished(self) -> None:
        """Abort every request whose final output was not read; read that output in the
        background so the metrics still count the request (as aborted)."""
        for job in self.jobs:
            if not job.finished:
                self.ctx.runtime.abort(job.rid, "client went away")
                job.finished = True
                task = asyncio.ensure_future(self._drain(job))
                _BACKGROUND.add(task)
                task.add_done_callback(_BACKGROUND.discard)

    async def _drain(self, job: Job) -> None:
        async for out in job.handle.stream:
            if job.timer is not None:
                job.timer.observe(out)

    async def __aenter__(self) -> "RequestGroup":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.abort_unfinished()
