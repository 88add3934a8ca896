"""The control actor: applies control requests at once, each through its own lifecycle.

Control requests are not generation requests with an odd route. Each one becomes a
`ControlRecord` walking the control lifecycle ``received -> applied | rejected`` (a flush
with a timeout passes through ``waiting``), and reaches the scheduler as a message that
becomes transitions of the request machines. The control actor also owns the server
lifecycle (``starting -> serving <-> paused(mode) -> draining -> stopped``, ``unhealthy``).

The control actor never waits inside a handler: it asks the scheduler and the answer comes
back as a `ControlDone` message, where the record's final transition fires and the HTTP
caller's future resolves.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ..messages import (
    Abort, AbortRequest, CloseSession, Continue, ContinueGeneration, ControlDone, ControlResult,
    Flush, FlushCache, FlushTimeout, HealthCheck, HealthDone, OpenSession, Pause, PauseGeneration,
    ServerEvent,
)
from ..statemachines import CONTROL, SERVER, ControlState, IllegalTransition, ServerState
from .actor import Actor, handles


class ControlRecord:
    __slots__ = ("rid", "op", "state", "result")

    def __init__(self, rid: str, op: str) -> None:
        self.rid = rid
        self.op = op
        self.state = CONTROL.initial
        self.result: ControlResult | None = None


class ServerModel:
    __slots__ = ("rid", "state", "pause_mode", "reason")

    def __init__(self) -> None:
        self.rid = "server"
        self.state = SERVER.initial
        self.pause_mode: str | None = None
        self.reason = ""

    @property
    def label(self) -> str:
        if self.state is ServerState.paused and self.pause_mode:
            return f"paused({self.pause_mode})"
        return self.state.name


class ControlActor(Actor):
    def __init__(self, scheduler: Actor, *, name: str = "control") -> None:
        super().__init__(name)
        self.scheduler = scheduler
        self.sessions: Actor | None = None      # the session actor (open/close_session go there)
        self.server = ServerModel()
        self._ids = itertools.count(1)
        self.history: list[ControlRecord] = []   # the last few, for /server_info
        self._probing: dict[str, ControlRecord] = {}   # health checks waiting for their probe

    # -- helpers -------------------------------------------------------------------------------
    @property
    def _rec(self) -> Any:
        return self.system.recorder if self.system is not None else None

    def _new(self, op: str) -> ControlRecord:
        rec = ControlRecord(f"ctl-{next(self._ids)}", op)
        if self._rec is not None:
            self._rec.created(CONTROL, rec, {"op": op})
        self.history.append(rec)
        del self.history[:-32]
        return rec

    def _end(self, rec: ControlRecord, result: ControlResult) -> ControlResult:
        CONTROL.fire(rec, "apply" if result.ok else "reject", observer=self._rec)
        rec.result = result
        return result

    def _server_fire(self, event: str) -> None:
        SERVER.fire(self.server, event, observer=self._rec)

    def _forward(self, rec: ControlRecord, message: Any,
                 target: Actor | None = None) -> asyncio.Future[ControlResult]:
        """Ask the scheduler (or `target`); its answer comes back to us as `ControlDone`."""
        assert self.system is not None
        reply: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self.system.pipe((target or self.scheduler).ask(message), self,
                         wrap=lambda res, err: ControlDone(rec.rid, (rec, res), err, reply))
        return reply

    # -- control requests ----------------------------------------------------------------------
    @handles(AbortRequest)
    def _abort(self, msg: AbortRequest) -> Any:
        rec = self._new("abort_request")
        if not msg.abort_all and not msg.rid:
            return self._end(rec, ControlResult(False, "abort_request needs a non-empty rid or abort_all: true"))
        return self._forward(rec, Abort(msg.rid, msg.prefix, msg.abort_all))

    @handles(PauseGeneration)
    def _pause(self, msg: PauseGeneration) -> Any:
        rec = self._new("pause_generation")
        if self.server.state is not ServerState.serving:
            return self._end(rec, ControlResult(False, f"cannot pause while the server is {self.server.label}"))
        return self._forward(rec, Pause(msg.mode))

    @handles(ContinueGeneration)
    def _continue(self, msg: ContinueGeneration) -> Any:
        rec = self._new("continue_generation")
        return self._forward(rec, Continue())

    @handles(FlushCache)
    def _flush(self, msg: FlushCache) -> Any:
        rec = self._new("flush_cache")
        wait = bool(msg.timeout_s and msg.timeout_s > 0)
        if self.server.state is ServerState.paused and self.server.pause_mode == "in_place":
            return self._end(rec, ControlResult(False, "cannot flush while paused in_place: the KV is kept"))
        reply = self._forward(rec, Flush(wait=wait))
        if wait:
            CONTROL.fire(rec, "wait", observer=self._rec)
            assert self.system is not None
            sched = self.scheduler
            self.system.call_later(msg.timeout_s or 0.0,
                                   lambda: sched.tell(FlushTimeout()) if sched.alive else None,
                                   f"{rec.rid}:flush_timeout")
        return reply

    @handles(OpenSession, CloseSession)
    def _session(self, msg: Any) -> Any:
        rec = self._new("open_session" if isinstance(msg, OpenSession) else "close_session")
        if self.sessions is None or not self.sessions.alive:
            return self._end(rec, ControlResult(False, "sessions are not available"))
        if isinstance(msg, OpenSession) and self.server.state in (ServerState.draining, ServerState.stopped):
            return self._end(rec, ControlResult(False, f"cannot open a session while the server is {self.server.label}"))
        return self._forward(rec, msg, self.sessions)

    @handles(HealthCheck)
    def _health(self, msg: HealthCheck) -> ControlResult:
        """Open the record of a /health_generate; the HTTP layer runs the probe and reports
        `HealthDone`. Only a serving server is probed; paused is healthy without a probe."""
        rec = self._new("health_generate")
        state = self.server.state
        if state is ServerState.paused:
            return self._end(rec, ControlResult(True, "paused", {"probe": False, "record": rec.rid}))
        if state is not ServerState.serving:
            why = self.server.reason if state is ServerState.unhealthy and self.server.reason else ""
            return self._end(rec, ControlResult(False, why or f"server is {self.server.label}",
                                                {"record": rec.rid}))
        CONTROL.fire(rec, "wait", observer=self._rec)
        self._probing[rec.rid] = rec
        return ControlResult(True, "probing", {"probe": True, "record": rec.rid})

    @handles(HealthDone)
    def _health_done(self, msg: HealthDone) -> None:
        rec = self._probing.pop(msg.record, None)
        if rec is not None and rec.state is ControlState.waiting:
            self._end(rec, ControlResult(msg.ok, msg.reason))

    @handles(ControlDone)
    def _done(self, msg: ControlDone) -> None:
        """Replies arrive in the order the scheduler applied them (a pause that waits for the
        step boundary is the only late one, and nothing else may change the pause meanwhile)."""
        try:
            if msg.error is None:
                rec, res = msg.result
            else:
                rec = next((r for r in self.history if r.rid == msg.rid), None)
                res = ControlResult(False, f"scheduler error: {msg.error}")
            if isinstance(res, int):  # abort answers with the number of requests it matched
                res = ControlResult(True, f"aborted {res} request(s)", {"aborted": res})
            if res.ok and rec is not None:
                self._mirror(rec.op, res)
            if rec is not None:
                self._end(rec, res)
        finally:
            if not msg.reply.done():
                self._reply(msg.reply, res if "res" in locals() else ControlResult(False, "internal error"))

    def _mirror(self, op: str, res: ControlResult) -> None:
        """Keep the server lifecycle in step with what the scheduler applied."""
        state = self.server.state
        if op == "pause_generation" and state is ServerState.serving:
            self._server_fire("pause")
            self.server.pause_mode = res.detail.get("mode")
        elif op == "pause_generation" and state is ServerState.unhealthy:
            # a pause that waited at a stalled step: the scheduler is paused now; the server
            # shows it when it recovers (see `_server_event`)
            self.server.pause_mode = res.detail.get("mode")
        elif op == "continue_generation" and state is ServerState.paused:
            self._server_fire("resume")
            self.server.pause_mode = None
        elif op == "continue_generation":
            self.server.pause_mode = None

    # -- server lifecycle ----------------------------------------------------------------------
    @handles(ServerEvent)
    def _server_event(self, msg: ServerEvent) -> ControlResult:
        try:
            self._server_fire(msg.event)
        except IllegalTransition as exc:
            return ControlResult(False, str(exc))
        self.server.reason = msg.reason
        if msg.event == "recover" and self.server.pause_mode:
            self._server_fire("pause")        # recovered into the pause the scheduler holds
        elif msg.event in ("resume", "recover", "ready", "drain", "stop"):
            self.server.pause_mode = None     # none of these lands in `paused`
        return ControlResult(True, self.server.label)
