"""Background responses (``POST /v1/responses`` with ``background: true``): the create answers at
once, the generation runs on in the server.

The generation is an ordinary request of the runtime: a `GenerationActor` submitted like every
other (admission, priority, deadlines, the metrics' request counts, `/abort_request`), which tells
the responses store `ResponseStarted` when the scheduler takes it (``queued -> in_progress``).
What is left to the HTTP layer is the reader of its outputs, the part a connected client plays
for a synchronous response: it turns the outputs into the final response object (and, with
``stream: true``, into the Responses events) and tells the store `ResponseEnd`. That reader is
one task per background response, held in `BackgroundRuns` (never detached): it ends exactly when
the request's output stream ends, which every request's does (its one terminal state: done,
aborted, failed; the server's shutdown aborts what is left), and the app's cleanup awaits every
reader after the runtime has shut down. Leaving the reader for any reason aborts the request
(`RequestGroup`), and the store always hears the response's end (``failed`` when the reader
itself failed).

``POST /v1/responses/{id}/cancel`` reaches the store (`ResponseCancel`), which aborts the request
through the control actor; the abort ends the output stream, the reader stores the response
``cancelled``, and the cancel is answered with it.

**Streams.** With ``stream: true`` the events go to an `EventLog` (every event, in
``sequence_number`` order) rather than to one connection: the creating client follows the log,
and so does ``GET /v1/responses/{id}?stream=true&starting_after=N``, which sends the events after
sequence number N and then follows the log to its end (OpenAI's resumable background stream).
A client that leaves only stops reading: the response runs on. The logs of ended responses are
kept as long as the store could still hold them (its capacity, oldest dropped first; a deleted
response's at once).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, AsyncIterator, Coroutine

from aiohttp import web

from ..edge import sse
from ..edge.generation import Job, RequestGroup
from .responses_items import response_object
from .responses_stream import EventStream

log = logging.getLogger(__name__)


class EventLog:
    """A background stream's events (``events[i]`` has sequence number ``i``), for any number of
    readers; `done` once its last event is in."""

    __slots__ = ("events", "done", "_waiters")

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.done = False
        self._waiters: list[asyncio.Future[None]] = []

    def append(self, event: dict[str, Any]) -> None:
        assert not self.done and event["sequence_number"] == len(self.events)
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def follow(self, after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """The events after sequence number `after`, then each new one, until the last."""
        at = max(after + 1, 0)
        while True:
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.done:
                return
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut


class BackgroundRuns:
    """The readers of the background responses' requests, and their streams' logs."""

    def __init__(self, keep: int = 1000) -> None:
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.logs: OrderedDict[str, EventLog] = OrderedDict()
        self.keep = keep                  # ended logs kept at most (the store's capacity)
        self.started = 0

    def start(self, response_id: str, reader: Coroutine[Any, Any, None], events: EventLog | None) -> None:
        task = asyncio.ensure_future(reader)
        self.tasks[response_id] = task
        self.started += 1
        task.add_done_callback(lambda _t: self._ended(response_id))
        if events is not None:
            self.logs[response_id] = events

    def _ended(self, response_id: str) -> None:
        self.tasks.pop(response_id, None)
        ended = [rid for rid, lg in self.logs.items() if lg.done]
        for rid in ended[:max(0, len(ended) - self.keep)]:
            del self.logs[rid]

    def log(self, response_id: str) -> EventLog | None:
        return self.logs.get(response_id)

    def forget(self, response_id: str) -> None:
        """The response was deleted: its events go too."""
        lg = self.logs.get(response_id)
        if lg is not None and lg.done:
            del self.logs[response_id]

    def describe(self) -> dict[str, Any]:
        return {"running": len(self.tasks), "started": self.started, "streams_kept": len(self.logs)}

    async def close(self, cancel: bool = False) -> None:
        """Await every reader: after the runtime's shutdown each one's stream has ended, so each
        ends too. ``cancel``: the runtime is not ours to stop: leave (each request is aborted)."""
        tasks = list(self.tasks.values())
        if cancel:
            for t in tasks:
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- the reader ----------------------------------------------------------------------------------
def start(ctx: Any, run: Any, group: RequestGroup, job: Job) -> EventLog | None:
    """Hand a submitted background response to its reader; its event log when it streams."""
    events = EventLog() if run.body.stream else None
    ctx.background.start(run.rid, _read(run, group, job, events), events)
    return events


async def _read(run: Any, group: RequestGroup, job: Job, events: EventLog | None) -> None:
    try:
        async with group:
            if events is None:
                run.finish(await group.collect(job), None)
            else:
                await _relay(run, group, job, events)
    except Exception as exc:        # the reader failed (not the request): the response failed
        log.exception("background response %s: its reader failed", run.rid)
        _failed(run, exc, events)
    finally:
        run.end_store()
        if events is not None:
            events.close()


async def _relay(run: Any, group: RequestGroup, job: Job, events: EventLog) -> None:
    stream = EventStream(None, run.plan, run.want_logprobs, run.token_logprobs, run.rplan.splitter(),
                         sink=events.append)
    await stream.begin(_skeleton(run, "queued"))
    final = None
    started = False
    async for piece in group.outputs(job):
        if not started and (piece.token_ids or not piece.finished):
            started = True
            await stream.progress(_skeleton(run, "in_progress"))
        await stream.feed(piece)
        if piece.finished:
            final = piece
    assert final is not None
    await stream.conclude(run.rid, final, run.finish)


def _skeleton(run: Any, status: str) -> dict[str, Any]:
    return response_object(run.rid, run.body, run.model, status=status, created=run.created)


def _failed(run: Any, exc: BaseException, events: EventLog | None) -> None:
    obj = response_object(run.rid, run.body, run.model, status="failed", created=run.created,
                          error={"code": "server_error", "message": f"{type(exc).__name__}: {exc}"})
    run.result = ("failed", obj, {"session": run.session, "rid": run.rid, "kv_text": "",
                                  "conversation": [], "input_items": run.items})
    if events is not None and not events.done:
        events.append({"type": "response.failed", "sequence_number": len(events.events), "response": obj})


# -- readers of a log: the creating client, GET ?stream=true --------------------------------------
async def follow(request: web.Request, events: EventLog, after: int = -1) -> web.StreamResponse:
    """Send a background stream's events after sequence number `after`, to its end. A client
    that leaves stops reading only."""
    resp = await sse.open_sse(request)
    async for event in events.follow(after):
        await sse.send(resp, event, event=event["type"])
    await sse.close(resp)
    return resp
