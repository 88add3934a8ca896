"""vLLM's control routes, mapped onto the same control actor and lifecycles as SGLang's:
`/pause`, `/resume`, `/reset_prefix_cache` (`/is_paused` is `control_routes`', whose answer
carries vLLM's ``is_paused`` besides ``mode`` and ``server_state``).

* ``POST /pause?mode=abort|wait|keep&clear_cache=true``: ``abort`` is the pause ``abort`` (every
  request in flight ends ``abort`` with its partial output); ``keep`` is ``in_place`` (the
  requests keep their KV and go on after ``/resume``); ``wait`` drains: no queued request is
  admitted any more, the running ones finish, then the server pauses (as ``retract``, with
  nothing left to retract; the queue runs after ``/resume``), and the answer waits for that.
  vLLM's deprecated ``wait_for_inflight_requests=true`` means ``mode=wait``. ``clear_cache``
  (default true, ignored for ``keep``) flushes the prefix cache once paused. Answers vLLM's
  ``{"status": "paused"}``; pausing a paused server answers it again, changing nothing.
* ``POST /resume``: continue; ``{"status": "resumed"}``.
* ``POST /reset_prefix_cache``: the flush; 200 with an empty body, as vLLM answers. Unlike vLLM
  (which answers 200 and resets nothing while requests run) a flush refused because requests
  hold KV is a 400 saying so. vLLM's ``reset_running_requests`` and ``reset_external`` are
  accepted at their default (false) only.
"""

from __future__ import annotations

from aiohttp import web

from ...messages import ContinueGeneration, FlushCache, PauseGeneration
from ..edge.errors import APIError
from ..edge.state import CTX

MODES = {"abort": "abort", "keep": "in_place", "wait": "wait"}


def _flag(request: web.Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise APIError(400, f"{name} must be a boolean (true or false), got {raw!r}", param=name)


async def pause(request: web.Request) -> web.Response:
    mode = request.query.get("mode", "abort")
    if mode not in MODES:
        raise APIError(400, f"invalid pause mode {mode!r}; use one of {sorted(MODES)}", param="mode")
    if _flag(request, "wait_for_inflight_requests", False):
        mode = "wait"
    clear = _flag(request, "clear_cache", True)
    runtime = request.app[CTX].runtime
    if runtime.snapshot().paused:
        return web.json_response({"status": "paused"})
    res = await runtime.control(PauseGeneration(mode=MODES[mode]))
    if not res.ok:
        raise APIError(400, res.message or "rejected", code="rejected", param="mode")
    if clear and mode != "keep":
        flushed = await runtime.control(FlushCache(timeout_s=None))
        if not flushed.ok:
            raise APIError(400, f"paused, but the prefix cache was not cleared: {flushed.message}",
                           code="rejected", param="clear_cache")
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    res = await request.app[CTX].runtime.control(ContinueGeneration())
    if not res.ok:
        raise APIError(400, res.message or "rejected", code="rejected")
    return web.json_response({"status": "resumed"})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    for name in ("reset_running_requests", "reset_external"):
        if _flag(request, name, False):
            raise APIError(400, f"{name}=true is not supported: pause with mode=abort first "
                                "(there is no external prefix cache)", param=name)
    res = await request.app[CTX].runtime.control(FlushCache(timeout_s=None))
    if not res.ok:
        raise APIError(400, res.message or "rejected", code="rejected")
    return web.Response(status=200)


ROUTES = [
    web.post("/pause", pause),
    web.post("/resume", resume),
    web.post("/reset_prefix_cache", reset_prefix_cache),
]
