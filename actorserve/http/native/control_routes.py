"""Control routes: `/abort_request`, `/pause_generation`, `/continue_generation`, `/is_paused`,
`/flush_cache`, `/open_session`, `/close_session`; `/health_generate` lives in `health_routes`
and the debug diagrams (`/debug/diagram/{kind}`) in `debug_routes`.

`/open_session` answers the session id as a JSON string, as SGLang does. `/pause_generation`
and `/continue_generation` answer SGLang's ``"status": "ok"`` besides ``success`` and ``message``.

Each control body becomes a control message for the runtime's control actor; a rejected
request (e.g. flush while busy) is a 400 with the actor's reason.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ...messages import (
    AbortRequest, CloseSession, ContinueGeneration, ControlResult, FlushCache, OpenSession, PauseGeneration,
)
from ..edge.errors import APIError
from . import health_routes
from .native_schemas import AbortBody, CloseSessionBody, FlushBody, OpenSessionBody, PauseBody
from ..edge.schemas import read_json
from ..edge.state import CTX


async def _optional_json(request: web.Request) -> Any:
    return await read_json(request, optional=True)     # no body reads as {}


def _answer(res: ControlResult, **extra: Any) -> web.Response:
    if not res.ok:
        raise APIError(400, res.message or "rejected", code="rejected")
    return web.json_response({"success": True, "message": res.message, **extra, **res.detail})


async def abort_request(request: web.Request) -> web.Response:
    body = AbortBody.model_validate(await read_json(request))
    res = await request.app[CTX].runtime.control(
        AbortRequest(rid=body.rid, prefix=body.prefix, abort_all=body.abort_all))
    return _answer(res)


async def pause_generation(request: web.Request) -> web.Response:
    body = PauseBody.model_validate(await _optional_json(request))
    return _answer(await request.app[CTX].runtime.control(PauseGeneration(mode=body.mode)), status="ok")


async def continue_generation(request: web.Request) -> web.Response:
    await _optional_json(request)
    return _answer(await request.app[CTX].runtime.control(ContinueGeneration()), status="ok")


async def is_paused(request: web.Request) -> web.Response:
    snap = request.app[CTX].runtime.snapshot()
    return web.json_response({"is_paused": snap.paused, "mode": snap.pause_mode,
                              "server_state": snap.state})


async def flush_cache(request: web.Request) -> web.Response:
    body = FlushBody.model_validate(await _optional_json(request))
    timeout = None if body.timeout_s is None else float(body.timeout_s)
    return _answer(await request.app[CTX].runtime.control(FlushCache(timeout_s=timeout)))


async def open_session(request: web.Request) -> web.Response:
    body = OpenSessionBody.model_validate(await _optional_json(request))
    res = await request.app[CTX].runtime.control(OpenSession(
        body.session_id, body.capacity_of_str_len, None if body.timeout is None else float(body.timeout)))
    if not res.ok:
        raise APIError(400, res.message or "rejected", code="rejected")
    return web.json_response(res.detail["session_id"])


async def close_session(request: web.Request) -> web.Response:
    body = CloseSessionBody.model_validate(await read_json(request))
    return _answer(await request.app[CTX].runtime.control(CloseSession(body.session_id)))


ROUTES = [
    web.post("/abort_request", abort_request),
    web.post("/pause_generation", pause_generation),
    web.post("/continue_generation", continue_generation),
    web.get("/is_paused", is_paused),
    web.post("/flush_cache", flush_cache),
    web.post("/open_session", open_session),
    web.post("/close_session", close_session),
] + health_routes.ROUTES
