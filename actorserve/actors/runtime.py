"""`Runtime`: the one entry every request shares before it forks by kind.

It wires an `ActorSystem` with a scheduler actor, a control actor and a flight recorder,
and turns a client's call into the right kind of actor:

* `generate(...)` spawns a `GenerationActor` (a probe when `is_probe`, on the priority lane);
* `pool(...)` spawns a `PoolingActor`;
* `control(...)` hands a control request to the control actor, which applies it at once.

The HTTP layer talks only to this class.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..config import SchedulerConfig
from ..engine.base import Engine
from ..engine.params import PoolingParams, SamplingParams
from ..engine.sequence import Sequence
from ..messages import Abort, ControlResult, ServerEvent, Submit
from ..statemachines import LIFECYCLES, ServerState
from .actor import Actor
from .clock import Clock
from .control import ControlActor
from .request import GenerationActor, OutputStream, PoolingActor, RequestActor
from .scheduler import SchedulerActor, SchedulerStats
from .system import ActorSystem


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
                 clock: Clock | None = None, recorder: Any = None) -> None:
        cfg = config or SchedulerConfig()
        self.engine = engine
        self.recorder = recorder
        self.system = ActorSystem(clock=clock, recorder=recorder)
        self.scheduler = SchedulerActor(engine, batch=cfg.batch, step_in_thread=cfg.step_in_thread)
        self.control_actor = ControlActor(self.scheduler)
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
        self.scheduler.tell(Submit(actor.rid, seq, actor))
        return RequestHandle(actor.rid, actor)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None, *,
                 rid: str | None = None, detokenizer: Any = None, is_probe: bool = False) -> RequestHandle:
        rid = self._rid(rid)
        sp = sampling or SamplingParams()
        seq = Sequence(rid, prompt_ids, sampling=sp, is_probe=is_probe, arrival=self.clock.now())
        actor = GenerationActor(rid, scheduler=self.scheduler, prompt_tokens=len(prompt_ids),
                                detokenizer=detokenizer, logprobs=sp.logprobs, is_probe=is_probe)
        return self._submit(actor, seq)

    def pool(self, prompt_ids: list[int], pooling: PoolingParams | None = None, *,
             rid: str | None = None, head: Callable[[Any], Any] | None = None,
             is_probe: bool = False) -> RequestHandle:
        rid = self._rid(rid)
        seq = Sequence(rid, prompt_ids, pooling=pooling or PoolingParams(), is_probe=is_probe,
                       arrival=self.clock.now())
        actor = PoolingActor(rid, scheduler=self.scheduler, prompt_tokens=len(prompt_ids),
                             head=head, is_probe=is_probe)
        return self._submit(actor, seq)

    def abort(self, rid: str, reason: str = "abort") -> None:
        """Abort one request now (e.g. its client disconnected); no-op if it already ended."""
        if self.scheduler.alive:
            self.scheduler.tell(Abort(rid, reason=reason))

    async def control(self, message: Any) -> ControlResult:
        return await self.control_actor.ask(message)

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

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
        await self.system.quiesce()
        await self.system.shutdown()
        if self.recorder is not None and hasattr(self.recorder, "close"):
            self.recorder.close()
