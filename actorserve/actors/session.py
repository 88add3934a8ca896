"""Sessions: chains of generation requests that reuse each other's KV through the prefix cache.

One `SessionActor` owns every open session; each `Session` is the model of the SESSION
lifecycle (``open -> closing -> closed``; ``expire`` for idle ones), its transitions recorded.
A session is a tree of request nodes (rid -> prompt ids, output ids, parent). A request that
joins a session (`SessionBegin`) gets its prompt composed at the token level::

    prompt = parent.prompt + parent.output + new input          (the default)
    prompt = parent.prompt + new input                          (drop_previous_output)
    prompt = (parent.prompt + parent.output)[:offset] + new input   (offset; < 0 counts from
                                                                     the end, as SGLang's -1)

and since the parent's blocks were committed to the prefix cache, the new request's prefill
starts after them (``cached_tokens`` grows turn by turn). The semantics follow SGLang's
session controller:

* ``rid`` names the parent; without it the session's latest finished request is the parent
  (SGLang starts a fresh prompt instead; continuing the chain is what a client that omits the
  rid wants in practice). The parent must have finished: extending a running request is a 400.
* ``replace`` with a ``rid`` prunes that request's other continuations (their rids become
  unknown, so they can no longer be extended) and extends it; ``replace`` without a rid clears
  the session and starts fresh from the new input alone.
* a BOS at the start of the new input is dropped when it extends a parent.
* ``capacity_of_str_len`` (when given) bounds the composed prompt, in tokens.

``close`` while a request of the session runs is deferred (``defer_close``; the session is
``closing`` and refuses new requests) and completes when the last one ends. A session with a
``timeout`` expires after that many idle seconds (no request running), on the runtime's clock.
Unknown, closing and closed sessions refuse requests with a reason (the HTTP layer's 400).
"""

from __future__ import annotations

import uuid
from typing import Any

from ..messages import CloseSession, ControlResult, OpenSession, SessionBegin, SessionEnd, SessionReap
from ..statemachines import SESSION, SessionState
from .actor import Actor, handles
from .clock import Timer


class Node:
    __slots__ = ("rid", "prompt_ids", "output_ids", "parent", "children", "done")

    def __init__(self, rid: str, prompt_ids: list[int], parent: "Node | None") -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.parent = parent
        self.children: list[Node] = []
        self.done = False


class Session:
    """The SESSION lifecycle's model; `state` is written only by `SESSION.fire`."""

    __slots__ = ("rid", "session_id", "state", "capacity", "timeout", "nodes", "order", "running",
                 "last_active", "timer")

    def __init__(self, session_id: str, capacity: int | None, timeout: float | None, now: float) -> None:
        self.rid = f"session:{session_id}"
        self.session_id = session_id
        self.state = SESSION.initial
        self.capacity = capacity
        self.timeout = timeout
        self.nodes: dict[str, Node] = {}
        self.order: list[str] = []        # finished rids, oldest first (the tip is the last)
        self.running: set[str] = set()
        self.last_active = now
        self.timer: Timer | None = None

    def prune(self, node: Node) -> None:
        """Forget every descendant of `node`."""
        stack = list(node.children)
        node.children.clear()
        while stack:
            n = stack.pop()
            stack.extend(n.children)
            self.nodes.pop(n.rid, None)
            self.running.discard(n.rid)
            if n.rid in self.order:
                self.order.remove(n.rid)

    def describe(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "state": self.state.name, "requests": len(self.nodes),
                "running": len(self.running), "timeout": self.timeout}


def _reject(message: str) -> ControlResult:
    return ControlResult(False, message)


class SessionActor(Actor):
    def __init__(self, *, name: str = "sessions") -> None:
        super().__init__(name)
        self.sessions: dict[str, Session] = {}
        self.closed = 0

    @property
    def _rec(self) -> Any:
        return self.system.recorder if self.system is not None else None

    def _now(self) -> float:
        assert self.system is not None
        return self.system.clock.now()

    def _fire(self, s: Session, event: str) -> None:
        SESSION.fire(s, event, observer=self._rec)
        if s.state is SessionState.closed:
            if s.timer is not None:
                s.timer.cancel()
                s.timer = None
            self.sessions.pop(s.session_id, None)
            self.closed += 1

    # -- open / close --------------------------------------------------------------------------
    @handles(OpenSession)
    def _open(self, msg: OpenSession) -> ControlResult:
        sid = msg.session_id or uuid.uuid4().hex
        if sid in self.sessions:
            return _reject(f"session {sid!r} already exists")
        if msg.timeout is not None and msg.timeout <= 0:
            return _reject(f"timeout must be > 0 seconds, got {msg.timeout}")
        if msg.capacity_of_str_len is not None and msg.capacity_of_str_len < 1:
            return _reject(f"capacity_of_str_len must be >= 1, got {msg.capacity_of_str_len}")
        s = Session(sid, msg.capacity_of_str_len, msg.timeout, self._now())
        self.sessions[sid] = s
        if self._rec is not None:
            self._rec.created(SESSION, s, {"timeout": msg.timeout, "capacity": msg.capacity_of_str_len})
        if s.timeout is not None:
            self._arm(s, s.timeout)
        return ControlResult(True, "session opened", {"session_id": sid})

    @handles(CloseSession)
    def _close(self, msg: CloseSession) -> ControlResult:
        s = self.sessions.get(msg.session_id)
        if s is None:
            return _reject(f"unknown session {msg.session_id!r}")
        if s.state is SessionState.closing:
            return ControlResult(True, "session is already closing", {"state": "closing"})
        if s.running:
            self._fire(s, "defer_close")
            return ControlResult(True, f"close deferred until {len(s.running)} request(s) end",
                                 {"state": "closing", "running": sorted(s.running)})
        self._fire(s, "close")
        return ControlResult(True, "session closed", {"state": "closed"})

    # -- requests ------------------------------------------------------------------------------
    @handles(SessionBegin)
    def _begin(self, msg: SessionBegin) -> ControlResult:
        s = self.sessions.get(msg.session_id)
        if s is None:
            return _reject(f"unknown session {msg.session_id!r}")
        if s.state is not SessionState.open:
            return _reject(f"session {msg.session_id!r} is {s.state.name}; it accepts no new requests")
        if msg.rid in s.nodes:
            return _reject(f"request id {msg.rid!r} is already part of session {msg.session_id!r}")
        parent: Node | None = None
        if msg.replace and msg.parent is None:
            if s.running:
                return _reject("replace without a rid resets the session, but a request of it is running")
            s.nodes.clear()
            s.order.clear()
        elif msg.parent is not None:
            parent = s.nodes.get(msg.parent)
            if parent is None:
                return _reject(f"rid {msg.parent!r} is not a request of session {msg.session_id!r}")
        elif s.order:
            parent = s.nodes[s.order[-1]]
        if parent is not None and not parent.done:
            return _reject(f"request {parent.rid!r} of the session has not finished yet")
        if parent is not None and msg.replace:
            if any(n.rid in s.running for n in self._descendants(parent)):
                return _reject(f"a continuation of {parent.rid!r} is still running; cannot replace it")
            s.prune(parent)
        new = list(msg.new_ids)
        if parent is None:
            prompt = new
        else:
            if new and msg.bos_id is not None and new[0] == msg.bos_id:
                new = new[1:]
            base = parent.prompt_ids if msg.drop_previous_output else parent.prompt_ids + parent.output_ids
            if msg.offset:
                base = base[:msg.offset]
            prompt = base + new
        if not prompt:
            return _reject("the composed prompt is empty")
        if s.capacity is not None and len(prompt) > s.capacity:
            return _reject(f"the session's prompt would be {len(prompt)} tokens, over its "
                           f"capacity_of_str_len of {s.capacity}")
        node = Node(msg.rid, prompt, parent)
        s.nodes[msg.rid] = node
        if parent is not None:
            parent.children.append(node)
        s.running.add(msg.rid)
        s.last_active = self._now()
        return ControlResult(True, "ok", {"prompt_ids": prompt,
                                          "parent": parent.rid if parent is not None else None})

    @staticmethod
    def _descendants(node: Node) -> list[Node]:
        out, stack = [], list(node.children)
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children)
        return out

    @handles(SessionEnd)
    def _end(self, msg: SessionEnd) -> None:
        s = self.sessions.get(msg.session_id)
        if s is None:
            return
        node = s.nodes.get(msg.rid)
        if node is not None and node.done:
            return                    # a late "never submitted" for a rid that did run: ignore
        s.running.discard(msg.rid)
        s.last_active = self._now()
        if node is not None:
            if msg.submitted:
                node.output_ids = list(msg.output_ids)
                node.done = True
                s.order.append(msg.rid)
            else:
                s.nodes.pop(msg.rid, None)
                if node.parent is not None and node in node.parent.children:
                    node.parent.children.remove(node)
        if s.state is SessionState.closing and not s.running:
            self._fire(s, "close")

    # -- reaping -------------------------------------------------------------------------------
    def _arm(self, s: Session, delay: float) -> None:
        assert self.system is not None
        sid = s.session_id

        def due() -> None:
            if self.alive:
                self.tell(SessionReap(sid))

        s.timer = self.system.call_later(delay, due, f"session:{sid}:reap")

    @handles(SessionReap)
    def _reap(self, msg: SessionReap) -> None:
        s = self.sessions.get(msg.session_id)
        if s is None or s.state is not SessionState.open or s.timeout is None:
            return
        s.timer = None
        if s.running:
            self._arm(s, s.timeout)
            return
        left = s.last_active + s.timeout - self._now()
        if left > 1e-9:
            self._arm(s, left)
            return
        self._fire(s, "expire")

    def on_stop(self) -> None:
        for s in self.sessions.values():
            if s.timer is not None:
                s.timer.cancel()

    def describe(self) -> dict[str, Any]:
        return {"open": [s.describe() for s in self.sessions.values()], "closed": self.closed}

    def publish(self) -> dict[str, Any]:
        """What `/server_info` shows of the sessions, taken after each turn."""
        return self.describe()
