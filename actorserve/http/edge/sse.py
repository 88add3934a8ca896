"""Server-sent events: open a stream, write ``data: <json>\\n\\n`` events, end with ``[DONE]``.

A client that stops reading must not hold its request (and its KV) forever: a write that
cannot be handed to the connection within `WRITE_STALL_S` (the transport's buffer full because
nothing is read at the other end) raises `ConnectionResetError`, the same as a client that went
away, so the handler leaves and its request group aborts the request at once. What a stream
buffers is thereby bounded too: at most the deltas produced while one write waits.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from .errors import SSE_KEY


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    request[SSE_KEY] = resp     # lets the error middleware end a broken stream properly
    return resp


WRITE_STALL_S = 30.0     # a reader that takes none of a stream's bytes for this long is cut off


async def send(resp: web.StreamResponse, payload: Any, *, stall_s: float | None = None,
               event: str | None = None) -> None:
    """One event (``event:`` names its type, as the Responses API's streams do)."""
    stall_s = WRITE_STALL_S if stall_s is None else stall_s
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    try:
        # a deadline on this task, not `wait_for`'s task per write: a write that the transport
        # takes at once (nearly all) costs no extra task and no extra turns of the loop
        async with asyncio.timeout(stall_s):
            await resp.write(f"{head}data: {data}\n\n".encode())
    except TimeoutError:
        raise ConnectionResetError(f"the client read nothing for {stall_s:g}s") from None


async def done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def close(resp: web.StreamResponse) -> None:
    """End a stream that has no ``[DONE]`` sentinel (the Responses API's)."""
    await resp.write_eof()
