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

The HTTP layer talks only to this class.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..config import SchedulerConfig
from ..engine.base import Engine
from ..engine.params import PoolingParams, SamplingParams
from ..engine.sequence import Sequence
from ..messages import Abort, AbortRequest, ControlResult, ServerEvent, SessionEnd, Submit
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

    async def start(self) -> None:
        """Spawn the long-lived actors; the server lifecycle goes `starting -> serving`."""
        if self._started:
            return
        self.system.spawn(self.scheduler)
        self.system.spawn(self.control_actor)
        self.system.spawn(self.sessions)
        if self.watchdog is not None:
            self.system.spawn(self.watchdog)
        for sched in self.pool_schedulers.values():
            self.system.spawn(sched)
        self._started = True
        await self.control_actor.ask(ServerEvent("ready"))

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
        actor = GenerationActor(rid, scheduler=self.scheduler, prompt_tokens=len(prompt_ids),
                                detokenizer=detokenizer, logprobs=sp.logprobs, is_probe=is_probe,
                                session=None if session is None else (self.sessions, session))
        return self._submit(actor, seq)

    async def session(self, message: Any) -> ControlResult:
        """Ask the session actor directly (`SessionBegin` when a request joins a session);
        `SessionEnd(submitted=False)` is told, for a begun request that was never submitted."""
        if isinstance(message, SessionEnd):
            if self.sessions.alive:
                self.sessions.tell(message)
            return ControlResult(True)
        return await self.sessions.ask(message)

    def pool(self, prompt_ids: list[int], pooling: PoolingParams | None = None, *,
             rid: str | None = None, head: Callable[[Any], Any] | None = None,
             is_probe: bool = False, target: str | None = None) -> RequestHandle:
        """A pooling request; ``target`` names a pooling engine, None = the generation engine."""
        if target is not None and target not in self.pool_schedulers:
            raise KeyError(f"no pooling engine {target!r} is loaded")
        sched = self.scheduler if target is None else self.pool_schedulers[target]
        rid = self._rid(rid)
        seq = Sequence(rid, prompt_ids, pooling=pooling or PoolingParams(), is_probe=is_probe,
                       arrival=self.clock.now())
        actor = PoolingActor(rid, scheduler=sched, prompt_tokens=len(prompt_ids),
                             head=head, is_probe=is_probe)
        return self._submit(actor, seq)

    def abort(self, rid: str, reason: str = "abort") -> None:
        """Abort one request now (e.g. its client disconnected); no-op if it already ended."""
        if self.scheduler.alive:
            self.scheduler.tell(Abort(rid, reason=reason))
        for sched in self.pool_schedulers.values():
            if sched.alive:
                sched.tell(Abort(rid, reason=reason))

    async def control(self, message: Any) -> ControlResult:
        if isinstance(message, AbortRequest) and self.pool_schedulers and (message.rid or message.abort_all):
            # Pooling schedulers apply the abort first; the control actor's record counts the
            # generation side, the answer counts both.
            msg = Abort(message.rid, message.prefix, message.abort_all)
            pooled = sum([n for n in await asyncio.gather(
                *(s.ask(msg) for s in self.pool_schedulers.values() if s.alive)) if isinstance(n, int)])
            res = await self.control_actor.ask(message)
            if res.ok and pooled:
                n = int(res.detail.get("aborted", 0)) + pooled
                res = ControlResult(True, f"aborted {n} request(s)", {**res.detail, "aborted": n})
            return res
        return await self.control_actor.ask(message)

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
