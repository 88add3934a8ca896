"""`/health_generate`: a deep health check that is healthy only when its own probe completes.

The probe is a 1-token generation request submitted with ``is_probe=True``: it walks the
generation lifecycle like any request but waits on the scheduler's priority lane, so a long
chunked prefill cannot starve it (SGLang's false negative), and it is healthy only when *this*
probe produces its token (SGLang accepts any output, a false positive). It is not business
traffic: it has no metrics timer, and the scheduler leaves it out of its token counters. On an
embedding-only engine the probe is a pooling request (the pooling lifecycle) instead.

Each check is also a control record (``health_generate``): the control actor opens it
(`HealthCheck`: ``received -> waiting``, or ``rejected`` at once when the server is not serving)
and the probe's outcome closes it (`HealthDone`: ``applied`` healthy, ``rejected`` with the
reason), so health checks are on the flight recorder beside their probes.

Answers:

* 200 ``{"status": "ok", "latency_s"}`` when the probe completes within the timeout
  (``?timeout=`` seconds, default 20 as in SGLang);
* 503 while the server is starting, draining, stopped or unhealthy (watchdog; the reason is in
  the body), and when the probe does not complete in time — then the probe is aborted, so a
  stalled engine does not collect probes;
* 200 ``{"status": "paused"}`` while generation is paused: the pause is intended, a probe could
  not run (no batch is formed while paused), and `/is_paused` tells the rest.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from ...engine.scheduling.params import SamplingParams
from ...messages import HealthCheck
from ..edge.errors import APIError
from ..edge.state import CTX, ServerContext

DEFAULT_TIMEOUT_S = 20.0
MAX_TIMEOUT_S = 300.0
_BACKGROUND: set[asyncio.Task[None]] = set()


def _unavailable(state: str, reason: str, **extra: object) -> web.Response:
    return web.json_response({"status": "unavailable", "server_state": state, "reason": reason, **extra},
                             status=503)


async def probe(ctx: ServerContext, timeout: float) -> tuple[bool, str, float]:
    """Run one probe; return (healthy, why, seconds). A generation engine gets a 1-token
    generation probe; an embedding-only engine a pooling probe (the pooling lifecycle)."""
    rt = ctx.runtime
    info = rt.engine_info
    rid = f"health-probe-{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    if info.kind == "generate":
        sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        handle = rt.generate([1 % info.vocab_size], sp, rid=rid, is_probe=True)
    else:
        handle = rt.pool([1 % info.vocab_size], rid=rid, is_probe=True)
    try:
        out = await asyncio.wait_for(asyncio.shield(_final(handle)), timeout)
    except asyncio.TimeoutError:
        await rt.abort(handle.rid, reason="health probe timed out")
        return False, f"the probe did not complete within {timeout:g}s", time.perf_counter() - t0
    except asyncio.CancelledError:
        rt.abort(handle.rid, reason="health check cancelled")
        raise
    dt = time.perf_counter() - t0
    if out.finish_reason in ("stop", "length") and (len(out.token_ids) == 1 or out.pooled is not None):
        return True, "ok", dt
    return False, f"the probe ended with {out.finish_reason}: {out.error or ''}".rstrip(": "), dt


def _final(handle: Any) -> "asyncio.Future[Any]":
    """The probe's final output, read in a task that outlives a timeout (so the stream is
    drained whatever happens and the actor's last item is consumed)."""
    task = asyncio.ensure_future(handle.stream.final())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


async def health_generate(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    rt = ctx.runtime
    try:
        timeout = float(request.query.get("timeout", DEFAULT_TIMEOUT_S))
    except ValueError:
        raise APIError(400, "timeout must be a number of seconds", param="timeout") from None
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise APIError(400, f"timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds", param="timeout")
    check = await rt.control(HealthCheck())          # the control record of this health check
    if not check.ok:
        return _unavailable(rt.server_state, check.message)
    if not check.detail.get("probe"):
        return web.json_response({"status": "paused", "server_state": rt.server_state})
    record = check.detail["record"]
    ok, why, dt = False, "health check cancelled", 0.0
    try:
        ok, why, dt = await probe(ctx, timeout)
        snap = rt.snapshot()
        state = snap.state
        if ok and snap.health == "unhealthy":             # the watchdog saw a stall meanwhile
            ok, why = False, snap.health_reason or "server is unhealthy"
        elif ok and state != "serving":                 # draining meanwhile (a pause leaves it serving)
            ok, why = False, snap.reason or f"server is {state}"
    finally:
        rt.health_done(record, ok, why)
    if not ok:
        return _unavailable(state, why, latency_s=round(dt, 6))
    return web.json_response({"status": "ok", "server_state": state, "latency_s": round(dt, 6)})


ROUTES = [web.get("/health_generate", health_generate), web.post("/health_generate", health_generate)]
