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
    Abort, AbortRequest, Continue, ContinueGeneration, ControlDone, ControlResult, Flush,
    FlushCache, FlushTimeout, Pause, PauseGeneration, ServerEvent,
)
from ..statemachines import CONTROL, SERVER, IllegalTransition, ServerState
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
        self.server = ServerModel()
        self._ids = itertools.count(1)
        self.history: list[ControlRecord] = []   # the last few, for /server_info

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

    def _forward(self, rec: ControlRecord, message: Any) -> asyncio.Future[ControlResult]:
        """Ask the scheduler; its answer comes back to us as `ControlDone`."""
        assert self.system is not None
        reply: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self.system.pipe(self.scheduler.ask(message), self,
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
            self.system.clock.call_later(
                msg.timeout_s or 0.0, lambda: sched.tell(FlushTimeout()) if sched.alive else None)
        return reply

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
                msg.reply.set_result(res if "res" in locals() else ControlResult(False, "internal error"))

    def _mirror(self, op: str, res: ControlResult) -> None:
        """Keep the server lifecycle in step with what the scheduler applied."""
        state = self.server.state
        if op == "pause_generation" and state is ServerState.serving:
            self._server_fire("pause")
            self.server.pause_mode = res.detail.get("mode")
        elif op == "continue_generation" and state is ServerState.paused:
            self._server_fire("resume")
            self.server.pause_mode = None

    # -- server lifecycle ----------------------------------------------------------------------
    @handles(ServerEvent)
    def _server_event(self, msg: ServerEvent) -> ControlResult:
        try:
            self._server_fire(msg.event)
        except IllegalTransition as exc:
            return ControlResult(False, str(exc))
        self.server.reason = msg.reason
        if msg.event in ("resume", "recover", "ready", "drain", "stop"):
            self.server.pause_mode = None if self.server.state is not ServerState.paused else self.server.pause_mode
        return ControlResult(True, self.server.label)
