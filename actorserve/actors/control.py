"""The control actor: applies control requests at once, each through its own lifecycle.

Control requests are not generation requests with an odd route. Each one becomes a
`ControlRecord` walking the control lifecycle ``received -> applied | rejected`` (a flush
with a timeout, a health probe and an abort that reaches several schedulers pass through
``waiting``), and reaches the schedulers as messages that become transitions of the request
machines. Every abort goes through here — the `/abort_request` route, a client that
disconnected, a health probe that timed out, a pooling request's caller that left — so each
one is a recorded control request with its reason.

The served weights are the WEIGHTS lifecycle, handled by the `WeightsControl` base
(`weights_control`; a trainer's process group by `WeightsGroupControl`, `weights_distributed`); memory release and resume per tag the MEMORY lifecycle (`memory_control`). The control actor also owns the server's two orthogonal regions: the SERVER lifecycle
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


class ControlRecord:
    __slots__ = ("rid", "op", "state", "result", "reply", "parts", "matched", "idle_left", "msg", "data")

    def __init__(self, rid: str, op: str, reply: asyncio.Future[ControlResult] | None) -> None:
        self.rid = rid
        self.op = op
        self.state = CONTROL.initial
        self.result: ControlResult | None = None
        self.reply = reply          # the caller's future (None: the answer is the handler's return)
        self.parts = 0              # answers still expected (abort: one per scheduler)
        self.matched: list[str] = []   # abort: rids the schedulers matched so far
        self.msg: Any = None        # abort: the request
        self.idle_left = 0          # drain: schedulers not idle yet
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

    def _end(self, rec: ControlRecord, result: ControlResult) -> Any:
        """The record's final transition; answers its caller. Returns what a handler returns."""
        CONTROL.fire(rec, "apply" if result.ok else "reject", observer=self._rec)
        rec.result = result
        self.open.pop(rec.rid, None)
        self.history.append(rec)
        if rec.reply is None:
            return result
        if not rec.reply.done():
            self._reply(rec.reply, result)
        return rec.reply

    def _wait(self, rec: ControlRecord) -> None:
        if CONTROL.can(rec.state, "wait"):
            CONTROL.fire(rec, "wait", observer=self._rec)

    def _ask(self, rec: ControlRecord, target: ActorRef, message: Any) -> None:
        """Ask `target`; its answer comes back to us as `ControlDone` for this record."""
        assert self.system is not None
        rec.parts += 1
        rid = rec.rid
        self.system.pipe(target.ask(message), self, wrap=lambda res, err: ControlDone(rid, res, err))

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
        if len(targets) > 1:
            self._wait(rec)
        for sched in targets:
            self._ask(rec, sched, msg)
        return rec.reply

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
            if any(r.op == "flush_cache" and r.state is ControlState.waiting for r in self.open.values()):
                return self._end(rec, ControlResult(False, "another flush is already waiting for idle"))
            self._wait(rec)
            assert self.system is not None
            rid = rec.rid
            self.system.call_later(msg.timeout_s, lambda: self.tell(FlushTimeout(rid)) if self.alive else None,
                                   f"{rid}:flush_timeout")
        self._ask(rec, self.scheduler, Flush())
        return rec.reply

    @handles(FlushTimeout)
    def _flush_timeout(self, msg: FlushTimeout) -> None:
        rec = self.open.get(msg.rid)
        if rec is not None:
            self._end(rec, ControlResult(False, "timed out waiting for the engine to become idle"))

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
        self._wait(rec)
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
        rec.parts -= 1
        if rec.op in WEIGHT_OPS:
            self._weights_done(rec, msg.result, msg.error)
            return
        if rec.op in MEMORY_OPS:
            self._memory_done(rec, msg.result, msg.error)
            return
        if msg.error is not None:
            self._end(rec, ControlResult(False, f"{rec.op} failed: {type(msg.error).__name__}: {msg.error}"))
            return
        res = msg.result
        if rec.op == "abort_request":
            rec.matched.extend(res)
            if rec.parts == 0:
                self._end(rec, self._aborted(rec))
            return
        if rec.op == "flush_cache" and not res.ok and rec.state is ControlState.waiting \
                and "busy" in res.detail:
            self._ask_idle(rec, self.scheduler)      # busy: flush again once it is idle
            return
        self._end(rec, res)

    def _ask_idle(self, rec: ControlRecord, sched: ActorRef) -> None:
        assert self.system is not None
        rid, name = rec.rid, sched.name
        self.system.pipe(sched.ask(WhenIdle()), self, wrap=lambda res, err: SchedulerIdle(rid, name, err))

    @handles(SchedulerIdle)
    def _idle(self, msg: SchedulerIdle) -> None:
        rec = self.open.get(msg.rid)
        if rec is None:
            return
        if rec.op == "flush_cache":
            self._ask(rec, self.scheduler, Flush())
        elif rec.op in WEIGHT_OPS:
            self._weights_idle(rec)
        elif rec.op == "drain":
            rec.idle_left -= 1
            if rec.idle_left == 0:
                self._end(rec, ControlResult(True, "drained: no request left"))

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
        self._wait(rec)
        rec.idle_left = len(targets)
        for sched in targets:
            self._ask_idle(rec, sched)
        return rec.reply

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

