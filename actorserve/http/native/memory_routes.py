"""Memory release routes: SGLang's `/release_memory_occupation` and `/resume_memory_occupation`,
vLLM's `/sleep`, `/wake_up` and `/is_sleeping`, on the control actor's MEMORY lifecycle
(`actors.memory_control`; the freeing itself is `engine.weights.memory_release`).

* ``POST|GET /release_memory_occupation`` with SGLang's body ``{"tags": [...]}``: tags
  ``kv_cache`` and ``weights`` (``cuda_graph`` accepted, nothing to do); no body, ``{}``,
  ``{"tags": null}`` or ``[]`` release all. As in SGLang it is for an idle server: while a
  request holds KV it is a 400 saying to pause first (``/pause_generation`` with ``abort`` or
  ``retract``); requests that only wait in the queue stay queued. Answers ``{success, message,
  tags: {tag: {ok, bytes, error}}, memory: {tag: state}}``; releasing a released tag changes
  nothing and answers success.
* ``POST|GET /resume_memory_occupation`` ``{"tags": [...]}`` (none: every released tag): the
  same answer. While a tag is released no model step runs: requests sent meanwhile wait in the
  queue and are served after the resume.
* ``POST /sleep?level=1|2&mode=abort|wait`` (vLLM's): pauses a serving server first with
  `mode` (default ``abort``, as vLLM's; ``keep`` is a 400: its requests would hold KV), then
  releases both tags. Level 1 keeps the weights (spilled to a private file, read back at the
  wake); level 2 discards them and the wake reloads them from the model folder last loaded in
  full (the one the server started with, or the last ``/update_weights_from_disk``'s, as
  ``/model_info``'s ``model_path`` says): weights updated from tensors since are lost, as vLLM's
  level 2 forgets them. 200 with an empty body, as vLLM answers.
* ``POST /wake_up`` (optional repeated ``tags=kv_cache|weights``; none: all): resumes them; once
  no tag is left released, a server that ``/sleep`` paused is continued. 200, empty body.
* ``GET /is_sleeping``: ``{"is_sleeping": bool}`` -- true while any tag is not resident.
"""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, Field

from ...messages import ContinueGeneration, ControlResult, PauseGeneration
from ...messages_memory import ReleaseMemory, ResumeMemory
from ..edge.errors import APIError, error_body
from ..edge.schemas import _Body, read_json
from ..edge.state import CTX

Tag = Literal["kv_cache", "weights", "cuda_graph"]
SLEEP_MODES = {"abort": "abort", "wait": "wait"}
SLEEP_PAUSED = "sleep_paused"          # ctx.extra: /sleep paused the server, /wake_up continues it


class MemoryTagsBody(_Body):
    tags: list[Tag] | None = Field(default=None, max_length=8)


class SleepQuery(BaseModel):
    """`/sleep`'s query (the handler reads it by hand, as vLLM's does; this documents it)."""
    level: Literal[1, 2] = Field(1, description="1: weights kept (spilled, read back at the wake); "
                                 "2: weights discarded, reloaded from the model folder at the wake")
    mode: Literal["abort", "wait"] = Field("abort", description="how a serving server is paused first")


class WakeUpQuery(BaseModel):
    tags: list[Literal["kv_cache", "weights"]] | None = Field(None, description="repeated; none: all")


async def _tags(request: web.Request) -> tuple[str, ...] | None:
    raw = await read_json(request, optional=True) if request.method == "POST" else {}
    body = MemoryTagsBody.model_validate(raw)
    return tuple(body.tags) if body.tags else None


def _answer(res: ControlResult) -> web.Response:
    answer: dict[str, Any] = {"success": res.ok, "message": res.message,
                              "tags": res.detail.get("tags", {}), "memory": res.detail.get("memory", {})}
    if res.ok:
        return web.json_response(answer)
    answer.update(error_body(400, res.message or "rejected", code="rejected", param="tags"))
    return web.json_response(answer, status=400)


async def release_memory_occupation(request: web.Request) -> web.Response:
    tags = await _tags(request)
    return _answer(await request.app[CTX].runtime.control(ReleaseMemory(tags)))


async def resume_memory_occupation(request: web.Request) -> web.Response:
    tags = await _tags(request)
    ctx = request.app[CTX]
    return _answer(await ctx.runtime.control(ResumeMemory(tags, ctx.extra.get("model_path"))))


async def sleep(request: web.Request) -> web.Response:
    raw = request.query.get("level", "1")
    if raw not in ("1", "2"):
        raise APIError(400, f"level must be 1 or 2, got {raw!r}", param="level")
    mode = request.query.get("mode", "abort")
    if mode not in SLEEP_MODES:
        raise APIError(400, f"mode {mode!r} cannot sleep: use abort or wait (keep would leave requests "
                            "holding the KV cache that sleep frees)", param="mode")
    ctx = request.app[CTX]
    runtime = ctx.runtime
    paused = False
    if runtime.snapshot().state == "serving" and not ctx.extra.get(SLEEP_PAUSED):
        res = await runtime.control(PauseGeneration(mode=SLEEP_MODES[mode]))
        if not res.ok:
            raise APIError(400, res.message or "rejected", code="rejected", param="mode")
        paused = True
    res = await runtime.control(ReleaseMemory(None, int(raw)))
    if not res.ok:
        if paused:
            await runtime.control(ContinueGeneration())
        raise APIError(400, res.message or "rejected", code="rejected", param="level")
    if paused:
        ctx.extra[SLEEP_PAUSED] = True
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    tags = request.query.getall("tags", [])
    bad = [t for t in tags if t not in ("kv_cache", "weights")]
    if bad:
        raise APIError(400, f"unknown tag(s) {bad}: use kv_cache or weights", param="tags")
    ctx = request.app[CTX]
    runtime = ctx.runtime
    res = await runtime.control(ResumeMemory(tuple(tags) or None, ctx.extra.get("model_path")))
    if not res.ok:
        raise APIError(400, res.message or "rejected", code="rejected", param="tags")
    if not runtime.memory_out and ctx.extra.pop(SLEEP_PAUSED, False):
        cont = await runtime.control(ContinueGeneration())
        if not cont.ok:
            raise APIError(400, f"awake, but not continued: {cont.message}", code="rejected")
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[CTX].runtime.memory_out})


ROUTES = [
    web.post("/release_memory_occupation", release_memory_occupation),
    web.get("/release_memory_occupation", release_memory_occupation),
    web.post("/resume_memory_occupation", resume_memory_occupation),
    web.get("/resume_memory_occupation", resume_memory_occupation),
    web.post("/sleep", sleep),
    web.post("/wake_up", wake_up),
    web.get("/is_sleeping", is_sleeping),
]
