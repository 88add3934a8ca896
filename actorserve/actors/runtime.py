"""`Runtime`: the one entry every request shares before it forks by kind.

It wires an `ActorSystem` with a scheduler actor, a control actor and a flight recorder,
and turns a client's call into the right kind of actor:

* `generate(...)` spawns a `GenerationActor` (a probe when `is_probe`, on the priority lane);
* `pool(...)` spawns a `PoolingActor`;
* `control(...)` hands a control request to the control actor, which applies it at once.

Pooling engines (``pooling_engines={"embed": EncoderEngine, "rerank": ..., "classify": ...}``)
each get their own scheduler actor beside the generation one, so one server hosts a
generation model and pooling models and routes by kind: ``pool(..., target="embed")`` goes to
that engine's scheduler, ``target=None`` to the generation engine (score, decoder-only rerank,
classify-from-label-tokens: a forward with zero new tokens). Abort (`abort`, and the
``AbortRequest`` control) reaches requests on every scheduler. Pause, continue and flush stay
generation-only: they exist for the generation model's KV and weights, and an encoder has
neither, so embeddings keep flowing while generation is paused.

The HTTP layer talks only to this class, and every call that reaches an actor is synchronous up
to the point where its message is in a mailbox (the awaitable it returns only waits for the
answer). With a recorder, each call is noted as an ``input`` event with what it carried (the
prompt ids, the parameters, the rid chosen), so `actorserve replay --reexecute` can feed the
same inputs through the same actors at the same points; `begin` notes the set-up (engines'
geometry, batch limits) first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..config import SchedulerConfig
from ..engine.base import Engine
from ..engine.params import PoolingParams, SamplingParams
from ..engine.sequence import Sequence
from ..messages import (
    Abort, AbortRequest, ControlResult, HealthDone, OpenSession, ServerEvent, SessionEnd, Submit,
)
from ..statemachines import LIFECYCLES, ServerState
from .actor import Actor
from .clock import Clock
from .control import ControlActor
from .request import GenerationActor, OutputStream, PoolingActor, RequestActor
from .scheduler import SchedulerActor, SchedulerStats
from .session import SessionActor
from .system import ActorSystem
from .watchdog import WatchdogActor


def _pool_scheduler(key: str, engine: Engine, cfg: SchedulerConfig) -> SchedulerActor:
    """A scheduler for a pooling engine: batch limits from the engine when it has them
    (an encoder runs each input whole), no prefix cache (an encoder has no KV to reuse)."""
    from ..engine.block_manager import BlockManager
    limits = getattr(engine, "batch_config", None)
    batch = limits() if callable(limits) else cfg.batch
    info = engine.info
    bm = BlockManager(info.num_blocks, info.block_size, enable_prefix_cache=False)
    return SchedulerActor(engine, batch=batch, block_manager=bm, step_in_thread=cfg.step_in_thread,
                          name=f"scheduler:{key}", batch_wait_s=cfg.pool_batch_wait_s)


def fields_of(obj: Any) -> dict[str, Any]:
    """A parameters / message dataclass as a plain dict (shallow)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


_DEFAULTS: dict[type, tuple[tuple[str, Any], ...]] = {}


def changed_fields(obj: Any) -> dict[str, Any]:
    """Only the fields that differ from their defaults: what a recording needs to rebuild `obj`,
    in a few bytes instead of a dict of every field (the common request sets two or three)."""
    spec = _DEFAULTS.get(type(obj))
    if spec is None:
        spec = _DEFAULTS[type(obj)] = tuple(
            (f.name, f.default) for f in dataclasses.fields(obj))
    return {name: v for name, d in spec if (v := getattr(obj, name)) is not d and v != d}


class DuplicateRequestId(ValueError):
    """A live request already has this rid."""


@dataclass(slots=True)
class RequestHandle:
    rid: str
    actor: RequestActor

    @property
    def stream(self) -> OutputStream:
        return self.actor.stream


class Runtime:
    def __init__(self, engine: Engine, *, config: SchedulerConfig | None = None,
                 clock: Clock | None = None, recorder: Any = None,
                 pooling_engines: dict[str, Engine] | None = None) -> None:
        cfg = config or SchedulerConfig()
        self.engine = engine
        self.recorder = recorder
        self.system = ActorSystem(clock=clock, recorder=recorder)
        self.scheduler = SchedulerActor(engine, batch=cfg.batch, step_in_thread=cfg.step_in_thread)
        self.control_actor = ControlActor(self.scheduler)
        self.sessions = SessionActor()                  # open/close_session via the control actor
        self.control_actor.sessions = self.sessions
        self.watchdog: WatchdogActor | None = None      # --watchdog-timeout: stall -> unhealthy
        if cfg.watchdog_timeout_s:
            self.watchdog = WatchdogActor(self.scheduler, self.control_actor, timeout=cfg.watchdog_timeout_s)
        self.pooling_engines: dict[str, Engine] = dict(pooling_engines or {})
        self.pool_schedulers: dict[str, SchedulerActor] = {
            key: _pool_scheduler(key, eng, cfg) for key, eng in self.pooling_engines.items()}
        self._seq = itertools.count(1)
        self._started = False

    @property
    def clock(self) -> Clock:
        return self.system.clock

    def begin(self) -> "asyncio.Future[Any]":
        """Spawn the long-lived actors; the returned future resolves when the server lifecycle
        has gone `starting -> serving`."""
        if self._started:
            done = asyncio.get_running_loop().create_future()
            done.set_result(ControlResult(True, self.server_state))
            return done
        if self.recorder is not None:
            self.recorder.input("runtime", data=self.setup())
        self.system.spawn(self.scheduler)
        self.system.spawn(self.control_actor)
        self.system.spawn(self.sessions)
        if self.watchdog is not None:
            self.system.spawn(self.watchdog)
        for sched in self.pool_schedulers.values():
            self.system.spawn(sched)
        self._started = True
        return self.control_actor.ask(ServerEvent("ready"))

    async def start(self) -> None:
        await self.begin()

    def setup(self) -> dict[str, Any]:
        """What re-execution needs to rebuild this runtime around model stand-ins."""
        def sched(s: SchedulerActor) -> dict[str, Any]:
            return {"engine": fields_of(s.engine.info), "batch": fields_of(s.policy.config),
                    "batch_wait_s": s.batch_wait_s, "prefix_cache": s.bm.enable_prefix_cache}
        return {"generation": sched(self.scheduler),
                "pooling": {key: sched(s) for key, s in self.pool_schedulers.items()},
                "watchdog": None if self.watchdog is None else {
                    "timeout": self.watchdog.timeout, "interval": self.watchdog.interval}}

    def _request_input(self, event: str, seq: Sequence, params: Any, xkey: str, extra: Any) -> None:
        """Note a request's arrival in one small dict: the parameters that differ from their
        defaults, its prompt (the sequence's own list, never changed: the note holds no copy),
        and the probe flag, session or target when there is one."""
        data = changed_fields(params)
        data["prompt"] = seq.prompt_ids
        if seq.is_probe:
            data["probe"] = True
        if extra is not None:
            data[xkey] = extra
        self.recorder.input(event, rid=seq.rid, data=data)

    def _input(self, event: str, rid: str | None = None, **data: Any) -> None:
        if self.recorder is not None:
            self.recorder.input(event, rid=rid, data=data)

    # -- requests ------------------------------------------------------------------------------
    def _rid(self, rid: str | None) -> str:
        if rid is None or rid == "":
            return uuid.uuid4().hex
        if self.system.get(f"req:{rid}") is not None:
            raise DuplicateRequestId(f"a request with rid {rid!r} is already running")
        return rid

    def _submit(self, actor: RequestActor, seq: Sequence) -> RequestHandle:
        self.system.spawn(actor, supervisor=None)
        actor.scheduler.tell(Submit(actor.rid, seq, actor))
        return RequestHandle(actor.rid, actor)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None, *,
                 rid: str | None = None, detokenizer: Any = None, is_probe: bool = False,
                 session: str | None = None) -> RequestHandle:
        """``session``: the id of a session whose `SessionBegin` composed `prompt_ids` and
        reserved `rid`; the request reports its output to the session when it ends."""
        rid = self._rid(rid)
        sp = sampling or SamplingParams()
        seq = Sequence(rid, prompt_ids, sampling=sp, is_probe=is_probe, arrival=self.clock.now())
        if self.recorder is not None:
            self._request_input("generate", seq, sp, "session", session)
        actor = GenerationActor(rid, scheduler=self.scheduler, prompt_tokens=len(prompt_ids),
                                detokenizer=detokenizer, logprobs=sp.logprobs, is_probe=is_probe,
                                session=None if session is None else (self.sessions, session))
        return self._submit(actor, seq)

    def session(self, message: Any) -> "asyncio.Future[ControlResult]":
        """Ask the session actor directly (`SessionBegin` when a request joins a session);
        `SessionEnd(submitted=False)` is told, for a begun request that was never submitted."""
        self._input("session", op=type(message).__name__, args=fields_of(message))
        if isinstance(message, SessionEnd):
            if self.sessions.alive:
                self.sessions.tell(message)
            done = asyncio.get_running_loop().create_future()
            done.set_result(ControlResult(True))
            return done
        return self.sessions.ask(message)

    def pool(self, prompt_ids: list[int], pooling: PoolingParams | None = None, *,
             rid: str | None = None, head: Callable[[Any], Any] | None = None,
             is_probe: bool = False, target: str | None = None) -> RequestHandle:
        """A pooling request; ``target`` names a pooling engine, None = the generation engine."""
        if target is not None and target not in self.pool_schedulers:
            raise KeyError(f"no pooling engine {target!r} is loaded")
        sched = self.scheduler if target is None else self.pool_schedulers[target]
        rid = self._rid(rid)
        pooling = pooling or PoolingParams()
        seq = Sequence(rid, prompt_ids, pooling=pooling, is_probe=is_probe, arrival=self.clock.now())
        if self.recorder is not None:
            self._request_input("pool", seq, pooling, "target", target)
        actor = PoolingActor(rid, scheduler=sched, prompt_tokens=len(prompt_ids),
                             head=head, is_probe=is_probe)
        return self._submit(actor, seq)

    def abort(self, rid: str, reason: str = "abort") -> None:
        """Abort one request now (e.g. its client disconnected); no-op if it already ended."""
        self._input("abort", rid, reason=reason)
        if self.scheduler.alive:
            self.scheduler.tell(Abort(rid, reason=reason))
        for sched in self.pool_schedulers.values():
            if sched.alive:
                sched.tell(Abort(rid, reason=reason))

    def control(self, message: Any) -> Awaitable[ControlResult]:
        """Hand a control request to the control actor; await the result."""
        if isinstance(message, OpenSession) and not message.session_id:
            message = dataclasses.replace(message, session_id=uuid.uuid4().hex)   # recorded below
        self._input("control", op=type(message).__name__, args=fields_of(message))
        if isinstance(message, AbortRequest) and self.pool_schedulers and (message.rid or message.abort_all):
            # Every scheduler gets the abort now; the control actor's record counts the
            # generation side, the answer counts both.
            msg = Abort(message.rid, message.prefix, message.abort_all)
            pooled = [s.ask(msg) for s in self.pool_schedulers.values() if s.alive]
            return asyncio.ensure_future(self._merge_abort(self.control_actor.ask(message), pooled))
        return self.control_actor.ask(message)

    @staticmethod
    async def _merge_abort(main: "asyncio.Future[ControlResult]",
                           pooled: list["asyncio.Future[Any]"]) -> ControlResult:
        n_pooled = sum(n for n in await asyncio.gather(*pooled) if isinstance(n, int))
        res = await main
        if res.ok and n_pooled:
            n = int(res.detail.get("aborted", 0)) + n_pooled
            res = ControlResult(True, f"aborted {n} request(s)", {**res.detail, "aborted": n})
        return res

    def health_done(self, record: str, ok: bool, reason: str) -> None:
        """A /health_generate's probe is over: close its control record."""
        self._input("health_done", record=record, ok=ok, reason=reason)
        if self.control_actor.alive:
            self.control_actor.tell(HealthDone(record, ok, reason))

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def pool_stats(self) -> dict[str, SchedulerStats]:
        """Stats of each pooling engine's scheduler, by target name."""
        return {key: s.stats() for key, s in self.pool_schedulers.items()}

    @property
    def server_state(self) -> str:
        return self.control_actor.server.label

    def live_actors(self) -> list[Actor]:
        return [a for a in self.system.actors.values() if isinstance(a, RequestActor)]

    def definitions(self) -> dict[str, Any]:
        return {name: lc.describe() for name, lc in LIFECYCLES.items()}

    async def quiesce(self) -> None:
        await self.system.quiesce()

    async def shutdown(self) -> None:
        """Drain is the server's job; this stops everything at once (pending replies fail)."""
        self._input("shutdown")
        if self.control_actor.alive:
            if self.control_actor.server.state is not ServerState.draining:
                await self.control_actor.ask(ServerEvent("drain", "shutdown"))
            await self.control_actor.ask(ServerEvent("stop", "shutdown"))
        self.scheduler.stop()          # aborts what is left, telling each request actor
        for sched in self.pool_schedulers.values():
            if sched.alive:
                sched.stop()
        await self.system.quiesce()
        await self.system.shutdown()
        if self.recorder is not None and hasattr(self.recorder, "close"):
            self.recorder.close()
