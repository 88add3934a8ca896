"""Server-sent events: open a stream, write ``data: <json>\\n\\n`` events, end with ``[DONE]``."""

from __future__ import annotations

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


async def send(resp: web.StreamResponse, payload: Any) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    await resp.write(f"data: {data}\n\n".encode())


async def done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
