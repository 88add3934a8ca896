"""The responses store: `/v1/responses` objects kept for ``GET``, ``DELETE`` and chaining.

One `ResponseStoreActor` owns every stored response; each `StoredResponse` is the model of the
RESPONSE lifecycle (``in_progress -> completed | incomplete | failed | cancelled``, then
``deleted`` or ``evicted``), its transitions recorded like every other lifecycle's. Its inputs
(`ResponseBegin`, `ResponseEnd`, `ResponseDelete`) reach it through `Runtime.session`, so they
are recorded inputs too and re-execution reproduces the store.

A response's *record* is what a continuation (``previous_response_id``) is composed from: its
conversation as chat messages (input and output), its input items, and where its tokens live,
the session it ran in, its rid there and its prompt + output token ids. The HTTP layer
(`http.responses_routes`) makes and reads these records; the store only keeps them.

The store is bounded (``capacity``, ``--responses-store``): past it, the response that ended
longest ago is evicted (responses in progress are never evicted). When the last stored response
of a session goes (deleted or evicted), the session is closed, so its token tree is freed
(closing waits for a request of it that still runs).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..messages import CloseSession, ControlResult, ResponseBegin, ResponseDelete, ResponseEnd
from ..statemachines import RESPONSE, ResponseState
from .actor import Actor, handles

#: the event that ends a response's generation, by the status it ends with
END_EVENTS = {"completed": "complete", "incomplete": "run_out", "failed": "fail", "cancelled": "cancel"}
CONTINUABLE = (ResponseState.completed, ResponseState.incomplete)


class StoredResponse:
    """The RESPONSE lifecycle's model; `state` is written only by `RESPONSE.fire`."""

    __slots__ = ("rid", "response_id", "state", "body", "record")

    def __init__(self, response_id: str, body: Any) -> None:
        self.rid = f"response:{response_id}"
        self.response_id = response_id
        self.state = RESPONSE.initial
        self.body = body
        self.record: dict[str, Any] | None = None

    @property
    def session_id(self) -> str | None:
        return (self.record or {}).get("session")


def _reject(message: str, code: str = "invalid_request") -> ControlResult:
    return ControlResult(False, message, {"code": code})


class ResponseStoreActor(Actor):
    def __init__(self, sessions: Actor | None = None, *, capacity: int = 1000,
                 name: str = "responses") -> None:
        super().__init__(name)
        if capacity < 0:
            raise ValueError(f"the responses store's capacity must be >= 0, got {capacity}")
        self.sessions = sessions
        self.capacity = capacity
        self.entries: dict[str, StoredResponse] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()     # ended responses, oldest first
        self.deleted = 0
        self.evicted = 0

    @property
    def _rec(self) -> Any:
        return self.system.recorder if self.system is not None else None

    def _fire(self, r: StoredResponse, event: str) -> None:
        RESPONSE.fire(r, event, observer=self._rec)

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
        r = StoredResponse(msg.response_id, msg.body)
        self.entries[msg.response_id] = r
        if self._rec is not None:
            self._rec.created(RESPONSE, r, {"previous": msg.previous_id})
        return ControlResult(True, "ok", {"previous": previous})

    @handles(ResponseEnd)
    def _end(self, msg: ResponseEnd) -> None:
        r = self.entries.get(msg.response_id)
        if r is None or r.state is not ResponseState.in_progress:
            return
        r.body = msg.body
        r.record = dict(msg.record) if msg.record else None
        self._fire(r, END_EVENTS[msg.status])
        self.ended[r.response_id] = None
        while len(self.ended) > self.capacity:
            oldest = next(iter(self.ended))
            self._drop(self.entries[oldest], "evict")
            self.evicted += 1

    @handles(ResponseDelete)
    def _delete(self, msg: ResponseDelete) -> ControlResult:
        r = self.entries.get(msg.response_id)
        if r is None:
            return _reject(f"response {msg.response_id!r} not found", "response_not_found")
        if r.state is ResponseState.in_progress:
            return _reject(f"response {msg.response_id!r} is still in progress")
        self._drop(r, "delete")
        self.deleted += 1
        return ControlResult(True, "deleted", {"id": msg.response_id})

    def _drop(self, r: StoredResponse, event: str) -> None:
        self._fire(r, event)
        del self.entries[r.response_id]
        self.ended.pop(r.response_id, None)
        sid = r.session_id
        if sid is not None and self.sessions is not None and self.sessions.alive \
                and not any(o.session_id == sid for o in self.entries.values()):
            self.sessions.tell(CloseSession(sid))
