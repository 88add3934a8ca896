"""The responses store: `/v1/responses` objects kept for ``GET``, ``DELETE`` and chaining.

One `ResponseStoreActor` owns every stored response; each `StoredResponse` is the model of the
RESPONSE lifecycle (``queued -> in_progress -> completed | incomplete | failed | cancelled``,
then ``deleted`` or ``evicted``), its transitions recorded like every other lifecycle's. Its
inputs (`ResponseBegin`, `ResponseEnd`, `ResponseDelete`, `ResponseCancel`) reach it through
`Runtime.session`, so they are recorded inputs too and re-execution reproduces the store;
`ResponseStarted` comes from the response's request actor when the scheduler first takes it.
A response's ``status`` in its stored body follows its state while it is queued / in progress.

**Cancel** (background responses only): the store tells the control actor `AbortRequest` for
the response's request (its rid is the response id), like every abort, and answers the cancel
when the response has ended (its `ResponseEnd`, ``cancelled`` unless it ended first): a deferred
reply, so the answer is the stored response as it ended. An ended response's cancel is answered
with it unchanged (OpenAI: cancelling is idempotent); a synchronous response's is refused.

A response's *record* is what a continuation (``previous_response_id``) is composed from: its
conversation as chat messages (input and output), its input items, and where its tokens live,
the session it ran in, its rid there and its prompt + output token ids. The HTTP layer
(`http.responses.responses_routes`) makes and reads these records; the store only keeps them.

The store is bounded (``capacity``, ``--responses-store``): past it, the response that ended
longest ago is evicted (responses in progress are never evicted). When the last stored response
of a session goes (deleted or evicted), the session is closed, so its token tree is freed
(closing waits for a request of it that still runs).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..messages import (
    AbortRequest, CloseSession, ControlResult, ResponseBegin, ResponseCancel, ResponseDelete, ResponseEnd,
    ResponseStarted,
)
from ..statemachines import RESPONSE, ResponseState
from .actor import Actor, ActorRef, handles

#: the event that ends a response's generation, by the status it ends with
END_EVENTS = {"completed": "complete", "incomplete": "run_out", "failed": "fail", "cancelled": "cancel"}
CONTINUABLE = (ResponseState.completed, ResponseState.incomplete)
LIVE = (ResponseState.queued, ResponseState.in_progress)
#: why a cancelled background response's request was aborted (its recorded abort reason)
CANCELLED = "cancelled: POST /v1/responses/{id}/cancel"


@dataclass(frozen=True, slots=True)
class StoredView:
    """What the store publishes of one response (the HTTP layer reads these, never the model)."""
    response_id: str
    state: ResponseState
    body: Any
    record: dict[str, Any] | None
    background: bool


class StoredResponse:
    """The RESPONSE lifecycle's model; `state` is written only by `RESPONSE.fire`."""

    __slots__ = ("rid", "response_id", "state", "body", "record", "background", "waiters")

    def __init__(self, response_id: str, body: Any, background: bool = False) -> None:
        self.rid = f"response:{response_id}"
        self.response_id = response_id
        self.state = RESPONSE.initial
        self.body = body
        self.record: dict[str, Any] | None = None
        self.background = background
        self.waiters: list[asyncio.Future[Any]] = []    # cancels waiting for the end

    @property
    def session_id(self) -> str | None:
        return (self.record or {}).get("session")


def _reject(message: str, code: str = "invalid_request") -> ControlResult:
    return ControlResult(False, message, {"code": code})


class ResponseStoreActor(Actor):
    def __init__(self, sessions: ActorRef | None = None, *, capacity: int = 1000,
                 name: str = "responses", control: ActorRef | None = None) -> None:
        super().__init__(name)
        if capacity < 0:
            raise ValueError(f"the responses store's capacity must be >= 0, got {capacity}")
        self.sessions = sessions
        self.control = control          # where a cancel's abort goes (the control actor)
        self.capacity = capacity
        self.entries: dict[str, StoredResponse] = {}
        self.views: dict[str, StoredView] = {}     # what is published: one view per live entry
        self.ended: OrderedDict[str, None] = OrderedDict()     # ended responses, oldest first
        self.deleted = 0
        self.evicted = 0

    @property
    def _rec(self) -> Any:
        return self.system.recorder if self.system is not None else None

    def _fire(self, r: StoredResponse, event: str) -> None:
        RESPONSE.fire(r, event, observer=self._rec)
        if r.state in LIVE and isinstance(r.body, dict):
            r.body = {**r.body, "status": r.state.name}
        self._view(r)

    def _view(self, r: StoredResponse) -> None:
        self.views[r.response_id] = StoredView(r.response_id, r.state, r.body, r.record, r.background)

    def publish(self) -> dict[str, Any]:
        """The entries' views (a read-only map, replaced entry by entry inside turns) and counts."""
        return {"entries": MappingProxyType(self.views), "capacity": self.capacity,
                "deleted": self.deleted, "evicted": self.evicted}

    # -- reads (plain data, from the loop) -----------------------------------------------------
    def get(self, response_id: str) -> StoredResponse | None:
        r = self.entries.get(response_id)
        gone = (ResponseState.deleted, ResponseState.evicted)
        return r if r is not None and r.state not in gone else None

    def describe(self) -> dict[str, Any]:
        by_state: dict[str, int] = {}
        for r in self.entries.values():
            by_state[r.state.name] = by_state.get(r.state.name, 0) + 1
        return {"stored": len(self.entries), "capacity": self.capacity, "by_state": by_state,
                "deleted": self.deleted, "evicted": self.evicted}

    # -- inputs --------------------------------------------------------------------------------
    @handles(ResponseBegin)
    def _begin(self, msg: ResponseBegin) -> ControlResult:
        if self.capacity == 0:
            return _reject("this server stores no responses (--responses-store 0); send store: false",
                           "store_disabled")
        if msg.response_id in self.entries:
            return _reject(f"response {msg.response_id!r} already exists")
        previous: dict[str, Any] | None = None
        if msg.previous_id is not None:
            p = self.entries.get(msg.previous_id)
            if p is None:
                return _reject(f"previous response {msg.previous_id!r} not found: it was never stored "
                               "(store: false), or it was deleted or evicted",
                               "previous_response_not_found")
            if p.state not in CONTINUABLE:
                return _reject(f"previous response {msg.previous_id!r} is {p.state.name}; only a "
                               "completed or incomplete response can be continued",
                               "previous_response_not_continuable")
            previous = p.record
        r = StoredResponse(msg.response_id, msg.body, msg.background)
        self.entries[msg.response_id] = r
        self._view(r)
        if self._rec is not None:
            self._rec.created(RESPONSE, r, {"previous": msg.previous_id})
        return ControlResult(True, "ok", {"previous": previous})

    @handles(ResponseStarted)
    def _started(self, msg: ResponseStarted) -> None:
        r = self.entries.get(msg.response_id)
        if r is not None and r.state is ResponseState.queued:
            self._fire(r, "start")

    @handles(ResponseEnd)
    def _end(self, msg: ResponseEnd) -> None:
        r = self.entries.get(msg.response_id)
        if r is None or r.state not in LIVE:
            return
        event = END_EVENTS[msg.status]
        if r.state is ResponseState.queued and event not in RESPONSE.allowed(r.state):
            self._fire(r, "start")      # it ran: its start is on the way (never seen in practice)
        r.body = msg.body
        r.record = dict(msg.record) if msg.record else None
        self._fire(r, event)
        self.ended[r.response_id] = None
        waiters, r.waiters = r.waiters, []
        for fut in waiters:
            self._reply(fut, ControlResult(True, r.state.name, {"body": r.body}))
        while len(self.ended) > self.capacity:
            oldest = next(iter(self.ended))
            self._drop(self.entries[oldest], "evict")
            self.evicted += 1

    @handles(ResponseDelete)
    def _delete(self, msg: ResponseDelete) -> ControlResult:
        r = self.entries.get(msg.response_id)
        if r is None:
            return _reject(f"response {msg.response_id!r} not found", "response_not_found")
        if r.state in LIVE:
            return _reject(f"response {msg.response_id!r} is still {r.state.name}")
        self._drop(r, "delete")
        self.deleted += 1
        return ControlResult(True, "deleted", {"id": msg.response_id})

    @handles(ResponseCancel)
    def _cancel(self, msg: ResponseCancel) -> Any:
        r = self.get(msg.response_id)
        if r is None:
            return _reject(f"response {msg.response_id!r} not found", "response_not_found")
        if not r.background:
            return _reject("Cannot cancel a synchronous response.", "not_background")
        if r.state not in LIVE:                     # ended: answered as it is (idempotent)
            return ControlResult(True, r.state.name, {"body": r.body})
        fut = asyncio.get_running_loop().create_future()
        if not r.waiters and self.control is not None and self.control.alive:
            self.control.tell(AbortRequest(r.response_id, reason=CANCELLED))
        r.waiters.append(fut)
        return fut

    def on_stop(self) -> None:
        for r in self.entries.values():
            waiters, r.waiters = r.waiters, []
            for fut in waiters:
                self._reply(fut, ControlResult(False, "the server is shutting down",
                                               {"code": "shutting_down"}))

    def _drop(self, r: StoredResponse, event: str) -> None:
        self._fire(r, event)
        del self.entries[r.response_id]
        self.views.pop(r.response_id, None)
        self.ended.pop(r.response_id, None)
        sid = r.session_id
        if sid is not None and self.sessions is not None and self.sessions.alive \
                and not any(o.session_id == sid for o in self.entries.values()):
            self.sessions.tell(CloseSession(sid))
