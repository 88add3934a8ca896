"""Live inspection routes, registered only with ``ServerConfig.debug_routes`` (``serve --debug-routes``).

* ``GET /debug/requests/{rid}`` — ``{rid, kind, state, live, history}``: the request's current
  state (from its live actor while it runs, else its last recorded transition) and every event
  the flight recorder still holds for it (``Event.to_dict()`` each). 404 when the recorder has
  nothing for that rid.
* ``GET /debug/events?rid=X&kind=Y`` — an SSE stream of lifecycle events as they are recorded
  (one JSON `Event` per ``data:`` line; both filters optional). It starts with new events (a
  ``: subscribed`` comment tells the client it is listening), sends a ``: keepalive`` comment
  when idle, reports ``{"dropped": n}`` if a slow client made its bounded queue overflow, and
  ends when the client disconnects or the server shuts down (``data: [DONE]``).
* ``GET /debug/diagram/{kind}?format=mermaid|svg&rid=X`` — the lifecycle diagram; with ``rid``
  the request's visited states (with counts), path, current state and refused edge are drawn on
  it (`replay.render.highlight_for`).

Without the flag none of these exist (404); with an API key they need it like every route.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web

from ...replay.recorder import Event
from ...replay.render import highlight_for
from ...statemachines import LIFECYCLES
from ...statemachines.diagram import to_mermaid, to_svg
from .errors import APIError
from .sse import open_sse
from .state import CTX

QUEUE_MAX = 10_000          # events buffered per stream before a slow client loses some
KEEPALIVE_S = 10.0          # idle time before a ``: keepalive`` comment
_STREAMS = "debug_streams"  # ctx.extra key: the open `_Stream`s, ended on shutdown


def _recorder(request: web.Request) -> Any:
    rec = request.app[CTX].runtime.recorder
    if rec is None:
        raise APIError(404, "this server runs without a flight recorder", code="not_found")
    return rec


def _lifecycle_kind(history: list[Event]) -> str | None:
    kinds = [e.kind for e in history if e.kind in LIFECYCLES]
    created = [e.kind for e in history if e.kind in LIFECYCLES and e.event == "create"]
    return (created or kinds or [None])[0]


async def request_info(request: web.Request) -> web.Response:
    rid = request.match_info["rid"]
    history = _recorder(request).events(rid=rid)
    if not history:
        raise APIError(404, f"no recorded events for request {rid!r}", code="not_found", param="rid")
    kind = _lifecycle_kind(history)
    info = request.app[CTX].runtime.request_info(rid)
    live = info is not None
    if info is not None:
        state = info["state"]
    else:
        state = None
        for e in reversed(history):
            if e.kind == kind and e.ok and e.dst is not None:
                state = e.dst
                break
    return web.json_response({"rid": rid, "kind": kind, "state": state, "live": live,
                              "history": [e.to_dict() for e in history]}, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, default=str)


class _Stream:
    """One SSE client: a bounded queue fed by the recorder's subscriber callback."""

    __slots__ = ("rid", "kind", "queue", "dropped", "loop", "thread")

    def __init__(self, rid: str | None, kind: str | None) -> None:
        self.rid, self.kind = rid, kind
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize=QUEUE_MAX)
        self.dropped = 0
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()

    def on_event(self, ev: Event) -> None:
        if (self.rid is not None and ev.rid != self.rid) or (self.kind is not None and ev.kind != self.kind):
            return
        if threading.get_ident() != self.thread:        # recorded off the loop: hop onto it
            self.loop.call_soon_threadsafe(self._put, ev)
        else:
            self._put(ev)

    def _put(self, ev: Event | None) -> None:
        try:
            self.queue.put_nowait(ev)
        except asyncio.QueueFull:
            self.dropped += 1

    def close(self) -> None:
        while self.queue.full():          # make room for the end marker
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(None)


async def events(request: web.Request) -> web.StreamResponse:
    rec = _recorder(request)
    kind = request.query.get("kind") or None
    stream = _Stream(request.query.get("rid") or None, kind)
    streams: set[_Stream] = request.app[CTX].extra.setdefault(_STREAMS, set())
    unsubscribe = rec.subscribe(stream.on_event)     # before the headers go out: nothing is missed
    streams.add(stream)
    try:
        resp = await open_sse(request)
        await resp.write(b": subscribed\n\n")
        while True:
            try:
                ev = await asyncio.wait_for(stream.queue.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                await resp.write(b": keepalive\n\n")
                continue
            if stream.dropped:
                await resp.write(f"data: {_dumps({'dropped': stream.dropped})}\n\n".encode())
                stream.dropped = 0
            if ev is None:
                break
            await resp.write(f"data: {_dumps(ev.to_dict())}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    finally:
        unsubscribe()
        streams.discard(stream)


async def _end_streams(app: web.Application) -> None:
    for stream in list(app[CTX].extra.get(_STREAMS, ())):
        stream.close()


async def diagram(request: web.Request) -> web.Response:
    kind = request.match_info["kind"]
    lc = LIFECYCLES.get(kind)
    if lc is None:
        raise APIError(404, f"unknown lifecycle {kind!r}; known: {', '.join(LIFECYCLES)}", code="not_found")
    fmt = request.query.get("format", "mermaid")
    if fmt not in ("mermaid", "svg"):
        raise APIError(400, f"format must be mermaid or svg, got {fmt!r}", param="format")
    highlight = None
    rid = request.query.get("rid")
    if rid:
        found = highlight_for(_recorder(request).events(rid=rid), rid)
        if found is None:
            raise APIError(404, f"no recorded lifecycle for request {rid!r}", code="not_found", param="rid")
        rkind, highlight = found
        if rkind != kind:
            raise APIError(400, f"request {rid!r} follows the {rkind!r} lifecycle, not {kind!r}",
                           param="rid")
    if fmt == "mermaid":
        return web.Response(text=to_mermaid(lc, highlight), content_type="text/plain")
    return web.Response(text=to_svg(lc, highlight), content_type="image/svg+xml")


ROUTES = [
    web.get("/debug/requests/{rid}", request_info),
    web.get("/debug/events", events),
    web.get("/debug/diagram/{kind}", diagram),
]


def setup(app: web.Application) -> None:
    """Register the debug routes and end open event streams when the server shuts down."""
    app.router.add_routes(ROUTES)
    app.on_shutdown.append(_end_streams)
