"""The control actor: applies control requests at once, each through its own lifecycle.

Control requests are not generation requests with an odd route. Each one becomes a
`ControlRecord` walking the CONTROL lifecycle, whose states are what the operation is doing:
``received`` (refused or applied at once), ``asking`` (it asked its actors and waits for their
answers: one per scheduler for an abort, each but the last ``answered``), ``waiting_idle`` (a
scheduler answered busy, or a drain: it waits for their idle answer and asks again with
``retry``), ``working`` (a weight update's read, a trainer group's join, off the loop) and
``probing`` (a /health_generate probe), then ``applied | rejected`` (``time_out``: a flush's
timeout ran out). What an answer means is per operation, in two tables (`_on_answer`,
`_on_idle`: op -> handler), never a switch on the op's name. Every abort goes through here
(`/abort_request`, a client that left, a health probe that timed out): each one is a recorded
control request with its reason.

The served weights are the WEIGHTS lifecycle (`weights_control`, `weights_distributed`); memory
release and resume per tag the MEMORY lifecycle (`memory_control`). The control actor also owns
the server's two orthogonal regions: the SERVER lifecycle
(``starting -> serving -> draining -> stopped``) and the HEALTH lifecycle (``healthy <->
unhealthy``, moved by the watchdog's `HealthVerdict`). Whether generation is paused is not a
state here: pause lives in one machine, the generation scheduler's (``paused_<mode>``), and
`pause_mode` reads it there, so a server ``draining`` while its scheduler is
``paused_in_place`` says it is paused. A paused scheduler whose server stalls is paused and
``unhealthy`` at once; nothing is re-fired when it recovers.

The control actor never waits inside a handler: it asks a scheduler and the answer comes back
as a `ControlDone` (or `SchedulerIdle`) message, where the record's final transition fires and
the caller's future resolves. Open records are kept by rid until they end.

It holds refs only (the schedulers', the session actor's) and publishes its regions after each
turn (`publish`): the runtime's `snapshot()`, `server_info()` and weight version read that.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import Any

from ..messages import (
    AbortRequest, Aborted, CloseSession, Continue, ContinueGeneration, ControlDone, ControlResult,
    Drain, Flush, FlushCache, FlushTimeout, HealthCheck, HealthDone, HealthVerdict, OpenSession,
    Pause, PauseGeneration, SchedulerIdle, ServerEvent, WhenIdle,
)
from ..statemachines import (
    CONTROL, HEALTH, SERVER, WEIGHTS, ControlState, HealthState, IllegalTransition, ServerState,
)
from .actor import ActorRef, handles
from .memory_control import MEMORY_OPS, MemoryControl, memory_models
from .weights_control import WEIGHT_OPS, WeightsModel
from .lora_control import LoraControl

S = ServerState
C = ControlState
_ASK = {C.received: "ask", C.working: "ask", C.waiting_idle: "retry"}   # the event of asking, by state
_AWAIT_IDLE = {C.received: "wait_idle", C.asking: "busy"}            # the event of waiting for idle


class ControlRecord:
    __slots__ = ("rid", "op", "state", "result", "reply", "expected", "matched", "msg", "data")

    def __init__(self, rid: str, op: str, reply: asyncio.Future[ControlResult] | None) -> None:
        self.rid = rid
        self.op = op
        self.state = CONTROL.initial
        self.result: ControlResult | None = None
        self.reply = reply          # the caller's future (None: the answer is the handler's return)
        self.expected = 0           # answers still expected (asking, waiting_idle): one per actor asked
        self.matched: list[str] = []   # abort: rids the schedulers matched so far
        self.msg: Any = None        # the request (abort, flush, weights, memory)
        self.data: Any = None       # a weight update: the checked tensors until they are applied


class ServerModel:
    """The server's run phase (SERVER) — `mode` is read off the state, never stored."""
    __slots__ = ("rid", "state", "reason")

    def __init__(self) -> None:
        self.rid = "server"
        self.state = SERVER.initial
        self.reason = ""


class HealthModel:
    __slots__ = ("rid", "state", "reason", "stalls")

    def __init__(self) -> None:
        self.rid = "health"
        self.state = HEALTH.initial
        self.reason = ""
        self.stalls = 0


class ControlActor(MemoryControl, LoraControl):
    def __init__(self, scheduler: ActorRef, *, pool_schedulers: dict[str, ActorRef] | None = None,
                 name: str = "control", weight_version: str = "default", engine: Any = None) -> None:
        super().__init__(name)
        self.scheduler = scheduler
        self.engine = engine                    # the generation engine (a weight update reads against it)
        self.pool_schedulers = dict(pool_schedulers or {})
        self.sessions: ActorRef | None = None   # the session actor (open/close_session go there)
        self.server = ServerModel()
        self.health = HealthModel()
        self.weights = WeightsModel(weight_version)    # the WEIGHTS lifecycle (weights_control)
        self._init_weights_group()                     # a trainer's process group (weights_distributed)
        self.memory = memory_models()                  # a MEMORY lifecycle per tag (memory_control)
        self._ids = itertools.count(1)
        self.open: dict[str, ControlRecord] = {}           # records not ended yet, by rid
        self.history: deque[ControlRecord] = deque(maxlen=32)   # the last ended, for /server_info
        # what an answer means, per operation (the default: it is the record's result)
        self._on_answer = {"abort_request": self._abort_answered, "flush_cache": self._flush_answered,
                           **dict.fromkeys(WEIGHT_OPS, self._weights_done),
                           **dict.fromkeys(MEMORY_OPS, self._memory_done)}
        # what a scheduler's idle answer (`SchedulerIdle`) means, per operation
        self._on_idle = {"flush_cache": self._flush_again, "drain": self._drain_idle,
                         **dict.fromkeys(WEIGHT_OPS, self._weights_idle)}

    # -- helpers -------------------------------------------------------------------------------
    @property
    def _rec(self) -> Any:
        return self.system.recorder if self.system is not None else None

    @property
    def pause_mode(self) -> str | None:
        """The generation scheduler's pause mode (None: not paused): its machine's state, as it
        published it after its last turn."""
        view = self.system.published(self.scheduler.name) if self.system is not None else None
        return None if view is None else view.stats.paused_mode

    def _schedulers(self) -> list[ActorRef]:
        return [s for s in (self.scheduler, *self.pool_schedulers.values()) if s.alive]

    def _new(self, op: str, *, deferred: bool = True) -> ControlRecord:
        reply = asyncio.get_running_loop().create_future() if deferred else None
        rec = ControlRecord(f"ctl-{next(self._ids)}", op, reply)
        if self._rec is not None:
            self._rec.created(CONTROL, rec, {"op": op})
        self.open[rec.rid] = rec
        return rec

    def _end(self, rec: ControlRecord, result: ControlResult, event: str | None = None) -> Any:
        """The record's final transition (``apply``, ``reject``, or `event`); answers its caller.
        Returns what a handler returns."""
        CONTROL.fire(rec, event or ("apply" if result.ok else "reject"), observer=self._rec)
        rec.result = result
        self.open.pop(rec.rid, None)
        self.history.append(rec)
        if rec.reply is None:
            return result
        if not rec.reply.done():
            self._reply(rec.reply, result)
        return rec.reply

    def _fire(self, rec: ControlRecord, event: str) -> None:
        CONTROL.fire(rec, event, observer=self._rec)

    def _ask(self, rec: ControlRecord, target: ActorRef, message: Any) -> None:
        self._ask_all(rec, (target,), message)

    def _ask_all(self, rec: ControlRecord, targets: Any, message: Any) -> None:
        """``-> asking`` (``retry`` from waiting_idle): ask each target; each answer comes back
        to us as a `ControlDone` for this record."""
        assert self.system is not None
        self._fire(rec, _ASK[rec.state])
        rid = rec.rid
        for target in targets:
            rec.expected += 1
            self.system.pipe(target.ask(message), self, wrap=lambda res, err: ControlDone(rid, res, err))

    def _await_idle(self, rec: ControlRecord, scheds: Any) -> None:
        """``-> waiting_idle`` (``busy`` from asking, ``wait_idle`` from received): ask each
        scheduler `WhenIdle`; each answer comes back as a `SchedulerIdle` for this record."""
        assert self.system is not None
        self._fire(rec, _AWAIT_IDLE[rec.state])
        rid = rec.rid
        for sched in scheds:
            rec.expected += 1
            self.system.pipe(sched.ask(WhenIdle()), self,
                             wrap=lambda res, err, name=sched.name: SchedulerIdle(rid, name, err))

    def _more_answers(self, rec: ControlRecord) -> bool:
        """One answer is in: with more to come, ``answered`` (the record stays where it is)."""
        if rec.expected > 0:
            self._fire(rec, "answered")
            return True
        return False

    def _server_fire(self, event: str) -> None:
        SERVER.fire(self.server, event, observer=self._rec)

    # -- control requests ----------------------------------------------------------------------
    @handles(AbortRequest)
    def _abort(self, msg: AbortRequest) -> Any:
        """Reaches every scheduler (generation and pooling); answered with the total matched."""
        rec = self._new("abort_request")
        if not msg.abort_all and not msg.rid and msg.lora is None:
            return self._end(rec, ControlResult(False, "abort_request needs a non-empty rid or abort_all: true"))
        rec.msg = msg
        targets = self._schedulers()
        if not targets:
            return self._end(rec, self._aborted(rec))
        self._ask_all(rec, targets, msg)
        return rec.reply

    def _abort_answered(self, rec: ControlRecord, res: Any, error: BaseException | None) -> None:
        """A scheduler's rids; the last one's answer ends the record with them all."""
        if error is not None:
            self._failed(rec, error)
            return
        rec.matched.extend(res)
        if not self._more_answers(rec):
            self._end(rec, self._aborted(rec))

    def _aborted(self, rec: ControlRecord) -> ControlResult:
        """Every scheduler answered. A request whose result is known but not yet taken by its
        client (``detok``, ``pool``) is in no scheduler: it is told `Aborted` here. The request
        registry lists those (`registry.py`): by rid in O(1), never a scan of every live request."""
        msg: AbortRequest = rec.msg
        matched = set(rec.matched)
        assert self.system is not None
        if msg.lora is None:         # one in detok holds no adapter any more
            for rid, ref in self.system.requests.delivering_matches(msg.rid, msg.prefix, msg.abort_all):
                if rid not in matched and ref.tell_if_alive(Aborted(rid, msg.reason)):
                    matched.add(rid)
        n = len(matched)
        return ControlResult(True, f"aborted {n} request(s)", {"aborted": n})

    @handles(PauseGeneration)
    def _pause(self, msg: PauseGeneration) -> Any:
        rec = self._new("pause_generation")
        if self.server.state is not S.serving:
            return self._end(rec, ControlResult(False, f"cannot pause while the server is {self.server.state.name}"))
        self._ask(rec, self.scheduler, Pause(msg.mode))
        return rec.reply

    @handles(ContinueGeneration)
    def _continue(self, msg: ContinueGeneration) -> Any:
        rec = self._new("continue_generation")
        self._ask(rec, self.scheduler, Continue())
        return rec.reply

    @handles(FlushCache)
    def _flush(self, msg: FlushCache) -> Any:
        """Flush now if the engine is idle; with a timeout, the record waits for idle (asked of
        the scheduler with `WhenIdle`) and flushes then, until `FlushTimeout`."""
        rec = self._new("flush_cache")
        if self.pause_mode == "in_place":
            return self._end(rec, ControlResult(False, "cannot flush while paused in_place: the KV is kept"))
        if msg.timeout_s and msg.timeout_s > 0:
            if any(r.op == "flush_cache" and r.msg.timeout_s for r in self.open.values() if r is not rec):
                return self._end(rec, ControlResult(False, "another flush is already waiting for idle"))
            assert self.system is not None
            rid = rec.rid
            self.system.call_later(msg.timeout_s, lambda: self.tell(FlushTimeout(rid)) if self.alive else None,
                                   f"{rid}:flush_timeout")
        rec.msg = msg
        self._ask(rec, self.scheduler, Flush())
        return rec.reply

    def _flush_answered(self, rec: ControlRecord, res: Any, error: BaseException | None) -> None:
        """Busy, with a timeout: wait for idle and flush again then; else the answer is the result."""
        if error is None and not res.ok and "busy" in res.detail and rec.msg.timeout_s:
            self._await_idle(rec, (self.scheduler,))
        else:
            self._answered(rec, res, error)

    def _flush_again(self, rec: ControlRecord) -> None:
        self._ask(rec, self.scheduler, Flush())

    @handles(FlushTimeout)
    def _flush_timeout(self, msg: FlushTimeout) -> None:
        rec = self.open.get(msg.rid)
        if rec is not None:
            self._end(rec, ControlResult(False, "timed out waiting for the engine to become idle"), "time_out")

    @handles(OpenSession, CloseSession)
    def _session(self, msg: Any) -> Any:
        rec = self._new("open_session" if isinstance(msg, OpenSession) else "close_session")
        if self.sessions is None or not self.sessions.alive:
            return self._end(rec, ControlResult(False, "sessions are not available"))
        if isinstance(msg, OpenSession) and self.server.state in (S.draining, S.stopped):
            return self._end(rec, ControlResult(False, f"cannot open a session while the server is "
                                                       f"{self.server.state.name}"))
        self._ask(rec, self.sessions, msg)
        return rec.reply

    @handles(HealthCheck)
    def _health(self, msg: HealthCheck) -> ControlResult:
        """Open the record of a /health_generate; the HTTP layer runs the probe and reports
        `HealthDone`. Only a serving, healthy server is probed; paused is healthy without one."""
        rec = self._new("health_generate", deferred=False)
        state, paused = self.server.state, self.pause_mode is not None
        if self.health.state is HealthState.unhealthy:
            return self._end(rec, ControlResult(False, self.health.reason or "server is unhealthy",
                                                {"record": rec.rid}))
        if state is S.serving and (paused or self.memory_out):   # nothing would step
            return self._end(rec, ControlResult(True, "paused" if paused else "memory released",
                                                {"probe": False, "record": rec.rid}))
        if state is not S.serving:
            return self._end(rec, ControlResult(False, f"server is {state.name}", {"record": rec.rid}))
        self._fire(rec, "probe")
        return ControlResult(True, "probing", {"probe": True, "record": rec.rid})

    @handles(HealthDone)
    def _health_done(self, msg: HealthDone) -> None:
        rec = self.open.get(msg.record)
        if rec is not None and rec.op == "health_generate":
            self._end(rec, ControlResult(msg.ok, msg.reason))

    @handles(ControlDone)
    def _done(self, msg: ControlDone) -> None:
        rec = self.open.get(msg.rid)
        if rec is None:
            return                  # ended meanwhile (a flush that timed out)
        rec.expected -= 1
        self._on_answer.get(rec.op, self._answered)(rec, msg.result, msg.error)

    def _answered(self, rec: ControlRecord, res: Any, error: BaseException | None) -> None:
        """The one answer is the record's result (pause, continue, a flush, sessions, LoRA, ...)."""
        if error is not None:
            self._failed(rec, error)
        else:
            self._end(rec, res)

    def _failed(self, rec: ControlRecord, error: BaseException) -> None:
        self._end(rec, ControlResult(False, f"{rec.op} failed: {type(error).__name__}: {error}"))

    @handles(SchedulerIdle)
    def _idle(self, msg: SchedulerIdle) -> None:
        rec = self.open.get(msg.rid)
        if rec is not None:
            rec.expected -= 1
            self._on_idle[rec.op](rec)

    # -- server lifecycle ----------------------------------------------------------------------
    @handles(ServerEvent)
    def _server_event(self, msg: ServerEvent) -> ControlResult:
        try:
            self._server_fire(msg.event)
        except IllegalTransition as exc:
            return ControlResult(False, str(exc))
        self.server.reason = msg.reason
        return ControlResult(True, self.server.state.name)

    @handles(Drain)
    def _drain(self, msg: Drain) -> Any:
        """``-> draining`` (new requests are refused); answered when no scheduler has a
        request left, each telling us with its `WhenIdle` answer."""
        rec = self._new("drain")
        if self.server.state is not S.draining:
            try:
                self._server_fire("drain")
            except IllegalTransition as exc:
                return self._end(rec, ControlResult(False, str(exc)))
            self.server.reason = msg.reason
        targets = self._schedulers()
        if not targets:
            return self._end(rec, ControlResult(True, "drained: no request left"))
        self._await_idle(rec, targets)
        return rec.reply

    def _drain_idle(self, rec: ControlRecord) -> None:
        if not self._more_answers(rec):
            self._end(rec, ControlResult(True, "drained: no request left"))

    @handles(HealthVerdict)
    def _verdict(self, msg: HealthVerdict) -> None:
        h = self.health
        if msg.ok and HEALTH.can(h.state, "recover"):
            HEALTH.fire(h, "recover", observer=self._rec)
            h.reason = ""
        elif not msg.ok and HEALTH.can(h.state, "stall"):
            HEALTH.fire(h, "stall", observer=self._rec)
            h.reason = msg.reason
            h.stalls += 1

    def on_start(self) -> None:
        if self._rec is not None:
            self._rec.created(SERVER, self.server)
            self._rec.created(HEALTH, self.health)
            self._rec.created(WEIGHTS, self.weights, {"version": self.weights.version})
        self._memory_start()

    def on_stop(self) -> None:
        self._close_weights_group()
        for rec in list(self.open.values()):
            if rec.reply is not None and not rec.reply.done():
                self._reply(rec.reply, ControlResult(False, "server shutting down"))

    def snapshot(self) -> dict[str, Any]:
        """Plain data about the server's regions (the runtime's `ServerSnapshot` is built from it)."""
        return {"state": self.server.state.name, "pause_mode": self.pause_mode,
                "reason": self.server.reason, "health": self.health.state.name,
                "health_reason": self.health.reason, "stalls": self.health.stalls}

    def publish(self) -> dict[str, Any]:
        """What the runtime reads of the control plane, taken after each turn."""
        return {"server": self.snapshot(), "weight_version": self.weights.version,
                "memory_out": self.memory_out,
                "recent_controls": [{"rid": r.rid, "op": r.op, "state": r.state.name,
                                     "message": r.result.message if r.result else ""}
                                    for r in self.history]}

