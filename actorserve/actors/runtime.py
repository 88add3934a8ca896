"""`Runtime`: the one entry every request shares before it forks by kind.

It wires an `ActorSystem` with a scheduler actor, a control actor and a flight recorder,
and turns a client's call into the right kind of actor:

* `generate(...)` spawns a `GenerationActor` (a probe when `is_probe`, on the priority lane);
* `pool(...)` spawns a `PoolingActor`;
* `control(...)` hands a control request to the control actor, which applies it at once;
* `abort(rid, reason)` is a control request too (a client that disconnected, a probe that timed
  out): every abort is on the record as one, with its reason;
* `drain()` moves the server to ``draining`` and resolves when no request is left (a message
  from each scheduler, not a poll).

Generation outputs pass through the output stage (`output.py`): the runtime tracks each
generation request there with its detokenizer (built from the request's `SamplingParams` by the
``detokenizer`` factory the runtime was given), and tells a request `Delivered` when its client
has taken the final output off the stream.

Pooling engines (``pooling_engines={"embed": EncoderEngine, "rerank": ..., "classify": ...}``)
each get their own scheduler actor beside the generation one, so one server hosts a
generation model and pooling models and routes by kind: ``pool(..., target="embed")`` goes to
that engine's scheduler, ``target=None`` to the generation engine (score, decoder-only rerank,
classify-from-label-tokens: a forward with zero new tokens). Abort (`abort`, and the
``AbortRequest`` control) reaches requests on every scheduler. Pause, continue and flush stay
generation-only: they exist for the generation model's KV and weights, and an encoder has
neither, so embeddings keep flowing while generation is paused.

The HTTP layer talks only to this class — calls with request ids and plain data in, a
`RequestHandle` (rid + output stream) and snapshots (`snapshot()`, `request_info(rid)`, `stats()`)
out, never an actor — and every call that reaches an actor is synchronous up to the point where
its message is in a mailbox (the awaitable it returns only waits for the answer). The runtime
itself builds the actors and then holds them only to spawn them: it sends through their refs,
finds a request by rid in the system's request registry, and reads what the actors published
after their last turn (`runtime_reads.py`), never an actor's fields. Shutdown stops the actors
with `Stop` messages (`ActorSystem.stop_all`); each one's teardown ends what it holds. With a recorder, each call is noted as an ``input`` event with what it carried (the
prompt ids, the parameters, the rid chosen), so `actorserve replay --reexecute` can feed the
same inputs through the same actors at the same points; `begin` notes the set-up (engines'
geometry, batch limits) first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import uuid
from typing import Any, Callable

from ..config import SchedulerConfig
from ..engine.scheduling.base import Engine
from ..engine.pooling.heads import apply_head
from ..engine.scheduling.params import ParamError, PoolingParams, SamplingParams
from ..engine.scheduling.sequence import Sequence
from ..messages import (
    DEADLINE_EXCEEDED, AbortRequest, ControlResult, Delivered, Drain, HealthDone, OpenSession,
    ResponseBegin, ResponseCancel, ResponseDelete, ResponseEnd, ResponseStarted, ServerEvent, SessionEnd,
    Submit, Track,
)
from ..statemachines import ServerState
from .actor import ActorRef
from .clock import Clock
from .control import ControlActor
from .output import OutputStage
from .arrival import Rids, changed_fields
from .request import GenerationActor, PoolingActor, RequestActor
from .scheduler import SchedulerActor
from .scheduler_stats import batch_it_runs, setup_of
from .responses import ResponseStoreActor
from .runtime_hooks import RuntimeHooks, fields_of
from .runtime_reads import RuntimeReads
from .session import SessionActor
from .surface import DuplicateRequestId, Overloaded, RequestHandle
from .system import ActorSystem
from .watchdog import WatchdogActor


def _pool_scheduler(key: str, engine: Engine, cfg: SchedulerConfig, stage: ActorRef,
                    setups: dict[str, Any]) -> SchedulerActor:
    """A scheduler for a pooling engine: batch limits from the engine when it has them
    (an encoder runs each input whole), no prefix cache (an encoder has no KV to reuse). Its
    configuration as plain data goes to `setups` (the recording's set-up)."""
    from ..engine.scheduling.block_manager import BlockManager
    limits = getattr(engine, "batch_config", None)
    name = f"scheduler:{key}"
    batch = batch_it_runs(engine, limits() if callable(limits) else cfg.batch, name)
    info = engine.info
    bm = BlockManager(info.num_blocks, info.block_size, enable_prefix_cache=False)
    setups[key] = setup_of(engine, batch, cfg.pool_batch_wait_s, False, "default")
    return SchedulerActor(engine, stage=stage, batch=batch, block_manager=bm,
                          step_in_thread=cfg.step_in_thread, name=name, batch_wait_s=cfg.pool_batch_wait_s)


RESPONSE_INPUTS = (ResponseBegin, ResponseEnd, ResponseDelete, ResponseCancel)


class Runtime(RuntimeReads, RuntimeHooks):
    def __init__(self, engine: Engine, *, config: SchedulerConfig | None = None,
                 clock: Clock | None = None, recorder: Any = None,
                 pooling_engines: dict[str, Engine] | None = None,
                 detokenizer: Callable[[SamplingParams], Any] | None = None,
                 weight_version: str = "default") -> None:
        cfg = config or SchedulerConfig()
        self.engine = engine
        self.recorder = recorder
        self.new_detokenizer = detokenizer      # SamplingParams -> detokenizer (None: no text)
        self.system = ActorSystem(clock=clock, recorder=recorder)
        stage = OutputStage()
        batch = batch_it_runs(engine, cfg.batch, "scheduler")
        # each scheduler's configuration as plain data, from what it is built with (`setup`)
        self.setups: dict[str, Any] = {"": setup_of(engine, batch, 0.0, True, weight_version)}
        sched = SchedulerActor(engine, stage=stage.ref, batch=batch,
                               step_in_thread=cfg.step_in_thread, weight_version=weight_version)
        self.pooling_engines: dict[str, Engine] = dict(pooling_engines or {})
        pools = {key: _pool_scheduler(key, eng, cfg, stage.ref, self.setups)
                 for key, eng in self.pooling_engines.items()}
        control = ControlActor(sched.ref, weight_version=weight_version, engine=engine,
                               pool_schedulers={k: s.ref for k, s in pools.items()})
        sessions = SessionActor()                       # open/close_session via the control actor
        control.sessions = sessions.ref
        responses = ResponseStoreActor(sessions.ref, capacity=cfg.responses_store, control=control.ref)
        self.responses_capacity = cfg.responses_store
        watchdog: WatchdogActor | None = None           # --watchdog-timeout: stall -> unhealthy
        self.watchdog_config: dict[str, float] | None = None
        if cfg.watchdog_timeout_s:
            watchdog = WatchdogActor(sched.ref, control.ref, timeout=cfg.watchdog_timeout_s)
            self.watchdog_config = {"timeout": watchdog.timeout, "interval": watchdog.interval}
        # The actors are built here and spawned by `begin` (in this order), which lets go of them:
        # from then on the runtime holds their refs and reads what they publish, nothing else.
        self._unspawned: dict[str, Any] = {
            "stage": stage, "scheduler": sched, "control": control, "sessions": sessions,
            "responses": responses, "watchdog": watchdog, **{f"pool:{k}": s for k, s in pools.items()}}
        self.sched_ref: ActorRef = sched.ref
        self.pool_refs: dict[str, ActorRef] = {k: s.ref for k, s in pools.items()}
        self.stage_ref: ActorRef = stage.ref
        self.control_ref: ActorRef = control.ref
        self.sessions_ref: ActorRef = sessions.ref
        self.responses_ref: ActorRef = responses.ref
        self.watchdog_ref: ActorRef | None = None if watchdog is None else watchdog.ref
        self._begun = False
        self.steps_in_thread = cfg.step_in_thread
        self._seq = itertools.count(1)
        self._on_final = self.delivered
        self._on_deadline = self._deadline_passed
        self.max_queued = cfg.max_queued_requests
        self.request_timeout = cfg.request_timeout_s
        self.max_queue_time = cfg.max_queue_time_s
        self.max_queued_tokens = cfg.max_queued_tokens
        self.shed = 0                    # requests refused by admission control
        self._rids = Rids()             # fresh request ids

    @property
    def clock(self) -> Clock:
        return self.system.clock

    def begin(self) -> "asyncio.Future[Any]":
        """Spawn the long-lived actors; the returned future resolves when the server lifecycle
        has gone `starting -> serving`. Once begun, it answers with the state at once."""
        if self._begun:
            done = asyncio.get_running_loop().create_future()
            done.set_result(ControlResult(True, self.server_state))
            return done
        self._begun = True
        if self.recorder is not None:
            self.recorder.input("runtime", data=self.setup())
        built, self._unspawned = self._unspawned, {}
        for actor in built.values():
            if actor is not None:
                self.system.spawn(actor)
        return self.control_ref.ask(ServerEvent("ready"))

    async def start(self) -> None:
        await self.begin()

    def _request_input(self, event: str, seq: Sequence, params: Any, xkey: str, extra: Any,
                       deadline: float | None = None, response: str | None = None,
                       lora: str | None = None) -> None:
        """Note a request's arrival in one small dict: the parameters that differ from their
        defaults, its prompt (the sequence's own list, never changed: the note holds no copy),
        and the probe flag, session or target, and deadline when there is one."""
        data = changed_fields(params)
        data["prompt"] = seq.prompt_ids
        if seq.is_probe:
            data["probe"] = True
        if seq.priority:
            data["priority"] = seq.priority
        if extra is not None:
            data[xkey] = extra
        if deadline is not None:
            data["deadline_s"] = deadline
        if response is not None:
            data["response"] = response
        if lora is not None:
            data["lora"] = lora
        self.recorder.input(event, rid=seq.rid, data=data)

    def _input(self, event: str, rid: str | None = None, **data: Any) -> None:
        if self.recorder is not None:
            self.recorder.input(event, rid=rid, data=data)

    # -- requests ------------------------------------------------------------------------------
    def _rid(self, rid: str | None) -> str:
        if rid is None or rid == "":
            return self._rids.new()          # uuid4().hex's form (32 hex digits), the OS's randomness
        if rid in self.system.requests:
            raise DuplicateRequestId(f"Duplicate request ID detected: {rid} (a request with this rid "
                                     f"is already running)")     # SGLang's words: clients match them
        return rid

    def _admit(self, sched: ActorRef, is_probe: bool, tokens: int = 0) -> None:
        """Admission control: refuse (raise `Overloaded`) when `max_queued` requests already
        wait for `sched` (its queue, and submissions still in its mailbox), or when a prompt of
        `tokens` would take the prompt tokens its queue holds past `max_queued_tokens` (an
        empty queue admits any). Probes always pass: health must answer under overload."""
        if is_probe or (self.max_queued is None and self.max_queued_tokens is None):
            return
        view = self.system.published(sched.name)      # as of its last turn, + what is in its mailbox
        queued = view.queued + sched.queued
        over = None
        if self.max_queued is not None and queued >= self.max_queued:
            over = (queued, self.max_queued, "")
        held = view.queued_tokens
        if over is None and self.max_queued_tokens is not None and held and held + tokens > self.max_queued_tokens:
            over = (held, self.max_queued_tokens, "tokens")
        if over is None:
            return
        self.shed += 1
        if self.recorder is not None:     # an input: it came from outside, and changed nothing
            data = {"sched": sched.name, "queued": over[0], "limit": over[1]}
            if over[2]:
                data["unit"] = over[2]
            self.recorder.input("shed", data=data)
        per_step = max(1, view.max_num_seqs)
        raise Overloaded(over[0], over[1], max(1, min(30, queued // per_step)), over[2])

    def check_priority(self, priority: int | None, target: str | None = None) -> None:
        """vLLM's answer to a priority the scheduler does not honour: a non-zero one under FCFS
        is a 400 (`ParamError` naming ``priority``); 0 and None are the default, always fine."""
        sched = self.sched_ref if target is None else self.pool_refs[target]
        if priority and self.system.published(sched.name).scheduling_policy != "priority":
            err = ParamError(f"Got priority {priority} but Priority scheduling is not enabled.")
            err.param = "priority"  # type: ignore[attr-defined]
            raise err

    def admit(self, target: str | None = None) -> None:
        """Admission control up front (raises `Overloaded`): the HTTP layer asks before it
        spends time on a request (chat template, tokenizing) that would be refused anyway."""
        self._admit(self.sched_ref if target is None else self.pool_refs[target], False)

    def _deadline(self, deadline_s: float | None, is_probe: bool) -> float | None:
        """A request may shorten the server's deadline (``request_timeout_s``), never lengthen it."""
        if deadline_s is not None:
            if not deadline_s > 0:
                raise ValueError(f"a request's deadline must be > 0 seconds, got {deadline_s}")
            cap = self.request_timeout
            return float(deadline_s) if cap is None or is_probe else min(float(deadline_s), cap)
        return None if is_probe else self.request_timeout

    def _deadline_passed(self, rid: str) -> None:
        """A request's deadline timer fired (an input): abort it like any abort, through the
        control actor (a message: the timer is what the recording replays)."""
        self.control_ref.tell_if_alive(AbortRequest(rid, reason=DEADLINE_EXCEEDED))

    def _submit(self, actor: RequestActor, seq: Sequence, deadline: float | None = None,
                lora: str | None = None) -> RequestHandle:
        if deadline is not None:
            actor.deadline = deadline
            actor.on_deadline = self._on_deadline
        if self.max_queue_time is not None and not seq.is_probe:
            actor.queue_deadline = self.max_queue_time
        self.system.spawn(actor, supervisor=None)
        rid = actor.rid
        stream = actor.stream
        stream.rid = rid
        stream.on_final = self._on_final     # one bound method for all: no closure each
        actor.scheduler.tell(Submit(rid, seq, actor.ref, lora))
        return RequestHandle(rid, stream)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None, *,
                 rid: str | None = None, is_probe: bool = False, session: str | None = None,
                 detokenizer: Any = None, deadline_s: float | None = None,
                 priority: int | None = None, response: str | None = None,
                 lora: str | None = None) -> RequestHandle:
        """``session``: the id of a session whose `SessionBegin` composed `prompt_ids` and
        reserved `rid`; the request reports its output to the session when it ends.
        The output stage detokenizes with the runtime's factory (``detokenizer`` replaces it
        for this request: tests and re-execution). ``deadline_s`` (else the runtime's
        ``request_timeout_s``) aborts the request that long after its arrival. Raises
        `Overloaded` when admission control refuses it. ``priority``: its scheduling priority
        (``--scheduling-policy priority``; a non-zero one under FCFS is a `ParamError`).
        ``response``: the id of the stored response this request makes; the request tells the
        responses store `ResponseStarted` when the scheduler first takes it. ``lora``: the name
        of the LoRA adapter it runs under (held from its admission to its end; one still loading
        is waited for; one not loaded or being unloaded fails the request)."""
        rid = self._rid(rid)
        self.check_priority(priority)
        self._admit(self.sched_ref, is_probe, len(prompt_ids))
        deadline = self._deadline(deadline_s, is_probe)
        sp = sampling or SamplingParams()
        seq = Sequence(rid, prompt_ids, sampling=sp, is_probe=is_probe, arrival=self.clock.now(),
                       priority=priority or 0)
        if sp.min_tokens:
            eos = () if sp.ignore_eos else tuple(self.engine_info.eos_token_ids)
            seq.min_stop_ids = tuple(dict.fromkeys((*sp.stop_token_ids, *eos)))
        if self.recorder is not None:
            self._request_input("generate", seq, sp, "session", session, deadline, response, lora)
        if detokenizer is None and self.new_detokenizer is not None:
            detokenizer = self.new_detokenizer(sp)
        actor = GenerationActor(rid, scheduler=self.sched_ref, prompt_tokens=len(prompt_ids),
                                logprobs=sp.logprobs, is_probe=is_probe,
                                session=None if session is None else (self.sessions_ref, session))
        actor.priority = seq.priority
        if response is not None:
            actor.on_scheduled = (self.responses_ref, ResponseStarted(response))
        self.stage_ref.tell(Track(rid, actor.ref, detokenizer))
        return self._submit(actor, seq, deadline, lora)

    async def compile_grammar(self, grammar: tuple[str, str]) -> float:
        """Compile a request's constraint (``SamplingParams.grammar``) on a worker thread, before
        the request is submitted, so its first step finds it compiled and a large schema never
        holds up the loop. Returns the seconds it took (0 when cached); noted as a ``grammar``
        input with its compile time. Raises `ParamError` (a 400) for a spec that does not
        compile, or when the engine has no grammar backend."""
        backend = getattr(self.engine, "grammar", None)
        if backend is None:
            raise ParamError("this engine does not support constrained decoding")
        loop = asyncio.get_running_loop()
        _, took, cached = await loop.run_in_executor(None, backend.compile, grammar)
        self._input("grammar", kind=grammar[0], chars=len(grammar[1]), cached=cached,
                    compile_ms=round(took * 1e3, 3))
        return took

    def delivered(self, rid: str) -> None:
        """The client took request `rid`'s final output off its stream: it is done."""
        self._input("delivered", rid)
        ref = self.system.requests.ref(rid)
        if ref is not None:
            ref.tell_if_alive(Delivered(rid))

    def session(self, message: Any) -> "asyncio.Future[ControlResult]":
        """Ask the session actor directly (`SessionBegin` when a request joins a session);
        `SessionEnd(submitted=False)` is told, for a begun request that was never submitted.
        The responses store's inputs (`ResponseBegin`, `ResponseEnd`: told, `ResponseDelete`,
        `ResponseCancel`) go to the store the same way."""
        self._input("session", op=type(message).__name__, args=fields_of(message))
        actor = self.responses_ref if isinstance(message, RESPONSE_INPUTS) else self.sessions_ref
        if isinstance(message, (SessionEnd, ResponseEnd)):
            actor.tell_if_alive(message)
            done = asyncio.get_running_loop().create_future()
            done.set_result(ControlResult(True))
            return done
        return actor.ask(message)

    def pool(self, prompt_ids: list[int], pooling: PoolingParams | None = None, *,
             rid: str | None = None, is_probe: bool = False, target: str | None = None,
             deadline_s: float | None = None) -> RequestHandle:
        """A pooling request; ``target`` names a pooling engine, None = the generation engine.
        Its result is what ``pooling.head`` makes of the pooled value (`engine.pooling.heads`)."""
        if target is not None and target not in self.pool_refs:
            raise KeyError(f"no pooling engine {target!r} is loaded")
        sched = self.sched_ref if target is None else self.pool_refs[target]
        rid = self._rid(rid)
        self._admit(sched, is_probe, len(prompt_ids))
        deadline = self._deadline(deadline_s, is_probe)
        pooling = pooling or PoolingParams()
        seq = Sequence(rid, prompt_ids, pooling=pooling, is_probe=is_probe, arrival=self.clock.now())
        if self.recorder is not None:
            self._request_input("pool", seq, pooling, "target", target, deadline)
        actor = PoolingActor(rid, scheduler=sched, prompt_tokens=len(prompt_ids),
                             head=functools.partial(apply_head, pooling), is_probe=is_probe)
        return self._submit(actor, seq, deadline)

    def abort(self, rid: str, reason: str = "abort") -> "asyncio.Future[ControlResult]":
        """Abort one request now (e.g. its client disconnected), through the control actor like
        every abort; matches nothing if it already ended."""
        return self.control(AbortRequest(rid, reason=reason))

    def control(self, message: Any) -> "asyncio.Future[ControlResult]":
        """Hand a control request to the control actor; await the result."""
        if isinstance(message, OpenSession) and not message.session_id:
            message = dataclasses.replace(message, session_id=uuid.uuid4().hex)   # recorded below
        recorded = getattr(message, "recorded", None)      # a message too big to record whole
        self._input("control", op=type(message).__name__, args=recorded() if recorded else fields_of(message))
        return self.control_ref.ask(message)

    def drain(self, reason: str = "drain") -> "asyncio.Future[ControlResult]":
        """``-> draining``: new requests are refused; resolves when no request is left."""
        return self.control(Drain(reason))

    def health_done(self, record: str, ok: bool, reason: str) -> None:
        """A /health_generate's probe is over: close its control record."""
        self._input("health_done", record=record, ok=ok, reason=reason)
        self.control_ref.tell_if_alive(HealthDone(record, ok, reason))

    async def quiesce(self) -> None:
        await self.system.quiesce()

    async def shutdown(self) -> None:
        """Drain is the server's job; this stops everything at once: the server lifecycle goes
        to ``stopped``, then every actor gets a `Stop` (`ActorSystem.stop_all`); each one's
        teardown ends what it holds (a scheduler's and the output stage's requests end
        ``aborted``, a request still live ends itself), so pending replies fail and no request
        is left without its end."""
        self._input("shutdown")
        ctl = self.control_ref
        if ctl.alive:
            if self.snapshot().state != ServerState.draining.name:
                await ctl.ask(ServerEvent("drain", "shutdown"))
            await ctl.ask(ServerEvent("stop", "shutdown"))
        await self.system.shutdown()
        if self.recorder is not None and hasattr(self.recorder, "close"):
            self.recorder.close()
