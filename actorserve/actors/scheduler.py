"""The scheduler actor: owns the queues and the KV accounting, runs one model step at a time.

The scheduler is the model of the SCHEDULER lifecycle (``idle -> pending -> [windowing ->]
stepping -> pending | idle``, ``pausing``, ``paused_<mode>``); every phase below is one of its
states, fired through the machine and recorded.

A step's life: when the scheduler's mailbox drains (`on_drained`) in ``pending``, it asks the
`BatchPolicy` for the next batch, tells newly admitted request actors `Scheduled`, and hands
`engine.execute(batch)` to a worker thread (``step``). The result comes back as a `StepDone`
message; the scheduler advances each member, applies its own verdicts (EOS, length: the KV is
freed at once), and sends the step's tokens to the output stage in one `StepOutputs`. The
stage detokenizes, finds stop strings and answers with the rids it finished; only then
(``step_done``) is the step over, those rids' KV freed, and the next step planned. So a
request that ends on a stop string is never in another forward.

Because the next step starts only once the mailbox is empty, any `Abort` or `Pause` that
arrived while a step was running is applied before the next step: an aborted request leaves
at once (its client gets `finish_reason: abort` right away), and its blocks are freed when
the in-flight step returns — never while the worker thread may still read its block table.
A pause that arrives mid-step takes effect at the step boundary, and its reply waits for it.

Pause, continue, flush and idle waits are in `scheduler_control.py` (the `SchedulerControl` base);
memory release and resume in `scheduler_memory.py` (`SchedulerMemory`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from ..engine.base import Engine
from ..engine.batching import BatchConfig
from ..engine.block_manager import BlockManager
from ..engine.lane import Lane
from ..engine.priority import make_policy
from ..messages import (
    QUEUE_TIMEOUT, Abort, Aborted, BatchWindowClosed, ControlResult, Failed, Forget, OutputsDone,
    PoolOut, PrefillProgress, Progress, ProgressQuery, QueueTimeout, Release, Retracted, Scheduled,
    StepDone, StepOutputs, Submit, TokenItem,
)
from ..statemachines import SCHEDULER, SchedulerState
from .actor import Actor, handles
from .isolation import Isolation, step_failed_or_rerun
from .scheduler_stats import SchedulerStats, stats_of
from .output import outputs_done
from .scheduler_control import SchedulerControl
from .scheduler_memory import SchedulerMemory

K = SchedulerState
log = logging.getLogger("actorserve.scheduler")


def _answer(o: Any) -> list[Any]:
    """What the recording keeps of one member's answer: ``[rid, token | "pooled"]``, and the
    engine's own verdict when it gave one (``"stop"``: its grammar ended; ``{"error": ...}``).
    A speculating member's is ``[rid, [token, ...]]``: every token its step yielded."""
    if o.seq.draft and o.token_id is not None:
        return [o.seq.rid, [o.token_id] + [m.token_id for m in o.extra]]
    entry = [o.seq.rid, "pooled" if o.pooled is not None else o.token_id]
    if o.error is not None:
        entry.append({"error": o.error})
    elif o.stop:
        entry.append("stop")
    return entry


class SchedulerActor(SchedulerMemory, SchedulerControl):
    mailbox_capacity = 1 << 16

    def __init__(self, engine: Engine, *, stage: Actor, batch: BatchConfig | None = None,
                 block_manager: BlockManager | None = None, step_in_thread: bool = True,
                 name: str = "scheduler", batch_wait_s: float = 0.0, weight_version: str = "default") -> None:
        super().__init__(name)
        self.weight_version = weight_version  # the label of the weights its steps run with now
        self.step_version = weight_version    # the label of the step in flight (or the last one)
        self.rid = name                      # the lifecycle instance's id in the recording
        self.state = SCHEDULER.initial
        self.engine = engine
        self.stage = stage                   # the output stage (detokenizer, stop strings)
        self.batch_wait_s = batch_wait_s     # batching window of an idle scheduler (0 = none)
        self._window: Any = None             # the open window's timer
        info = engine.info
        self.bm = block_manager or BlockManager(info.num_blocks, info.block_size)
        if batch is not None and batch.speculative and not getattr(engine, "verifies_drafts", False):
            log.warning("%s: the engine cannot verify drafts (%s): speculative decoding is off",
                        name, type(engine).__name__)
            batch = dataclasses.replace(batch, speculative=None)   # what is recorded is what runs
        self.policy = make_policy(batch)     # FCFS, or by priority (engine.priority)
        self.step_in_thread = step_in_thread
        self.probe_lane = Lane()             # waiting probes (served first), then the rest:
        self.lane = self.policy.new_lane()   # FIFO or by priority, O(1) removal (an abort)
        self.arrivals = 0                    # submissions so far: each one's order (ties by it)
        self.queue_timeouts = 0              # requests ended by --max-queue-time
        self.running: list[Any] = []
        self.seqs: dict[str, Any] = {}
        self.actors: dict[str, Actor] = {}
        self.step_id = 0
        self.inflight: dict[str, Any] = {}       # rid -> seq of the step being computed
        self._free_after_step: list[Any] = []
        self._pending_pause: tuple[str, asyncio.Future[ControlResult]] | None = None
        self._idle_waiters: list[asyncio.Future[bool]] = []
        self._isolation: Isolation | None = None   # bisecting a failed step (isolation.py)
        self.isolations = 0            # failed steps isolated
        self.isolated_failures = 0     # requests failed as the cause of a step's failure
        self.generated_tokens = 0      # business traffic only: probes are not counted
        self.prompt_tokens = 0
        self.steps_done = 0            # completed model steps (the watchdog's progress signal)
        self.spec_steps = 0            # speculative verifications (a member's step with drafts)
        self.spec_draft_tokens = 0     # drafts proposed in them
        self.spec_accepted_tokens = 0  # of those, confirmed by the model
        # How a step runs: None = the system's worker thread (or inline); re-execution holds
        # each step until the recording says it came back. Called (self, fn, batch, wrap=...).
        self.runner: Any = None
        self._init_lora()                # LoRA adapters: their lifecycle and holds (scheduler_lora)

    def on_start(self) -> None:
        rec = self.system.recorder if self.system is not None else None
        if rec is not None:
            rec.created(SCHEDULER, self)

    # -- admission -----------------------------------------------------------------------------
    @handles(Submit)
    def _submit(self, msg: Submit) -> None:
        seq, actor = msg.seq, msg.actor
        if msg.rid in self.seqs:
            self._end(seq, actor, Failed(msg.rid, f"duplicate request id {msg.rid!r}"))
            return
        info = self.engine.info
        capacity = min(info.max_model_len, info.num_blocks * info.block_size)
        if seq.num_tokens >= capacity:
            self._end(seq, actor, Failed(msg.rid, f"prompt of {seq.num_tokens} tokens leaves no room "
                                                  f"to generate (capacity {capacity} tokens)"))
            return
        lora = None
        if msg.lora is not None:       # the adapter it names: held from here to its end
            lora = self._lora_check(msg.lora)
            if isinstance(lora, str):
                self._end(seq, actor, Failed(msg.rid, lora))
                return
        if self.state is K.idle:
            self.fire("admit")
        self.seqs[msg.rid] = seq
        self.actors[msg.rid] = actor
        if not seq.is_probe:
            self.prompt_tokens += len(seq.prompt_ids)
        self.arrivals += 1
        seq.order = self.arrivals
        if lora is not None and not self._lora_hold_or_park(seq, lora):
            return                     # parked until its adapter's load is over
        (self.probe_lane if seq.is_probe else self.lane).append(seq)

    def _requeue(self, seqs: Any) -> None:
        """Put retracted requests back at the front of their own lane (a probe in the probe
        lane), in order: the first of `seqs` ends up first."""
        seqs = list(seqs)
        self.lane.extendleft(reversed([s for s in seqs if not s.is_probe]))
        self.probe_lane.extendleft(reversed([s for s in seqs if s.is_probe]))

    # -- leaving -------------------------------------------------------------------------------
    def _end(self, seq: Any, actor: Actor | None, msg: Aborted | Failed) -> None:
        """Tell a request it ended. A generation request hears it through the output stage,
        after any token of it the stage still has, with the text its detokenizer held back."""
        if seq.pooling is None and self.stage.alive:
            self.stage.tell(msg)
        elif actor is not None and actor.alive:
            actor.tell(msg)

    def _drop(self, rid: str) -> Actor | None:
        """Forget a request; free its blocks now, or after the in-flight step if it is in it."""
        seq = self.seqs.pop(rid, None)
        actor = self.actors.pop(rid, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        elif not self.lane.discard(seq):
            self.probe_lane.discard(seq)
        if rid in self.inflight:
            self._free_after_step.append(seq)
        else:
            self.bm.free(seq)
            self.engine.release(seq)
            self._lora_release(seq)
        if not self.seqs:
            self._settle()
            self._check_idle()
        return actor

    def _settle(self) -> None:
        """No request left while no step runs: a window closes, ``pending -> idle``."""
        if self.state is K.windowing:
            self._cancel_window()
            self.fire("window_closed")
        if self.state is K.pending and not self.seqs:
            self.fire("empty")

    def _matches(self, msg: Abort) -> list[str]:
        if msg.abort_all:
            return list(self.seqs)
        if msg.lora is not None:       # the requests holding an adapter (an unload that aborts)
            return [rid for rid, seq in self.seqs.items() if seq.lora is not None and seq.lora.name == msg.lora]
        if not msg.rid:  # an empty rid never matches everything
            return []
        if msg.prefix:
            return [rid for rid in self.seqs if rid.startswith(msg.rid)]
        return [msg.rid] if msg.rid in self.seqs else []

    @handles(Abort)
    def _abort(self, msg: Abort) -> list[str]:
        """Abort the matching requests; answers their rids."""
        rids = self._matches(msg)
        for rid in rids:
            seq = self.seqs[rid]
            self._end(seq, self._drop(rid), Aborted(rid, msg.reason))
        return rids

    @handles(QueueTimeout)
    def _queue_timeout(self, msg: QueueTimeout) -> None:
        """A request's queue deadline passed: ended (``abort``, SGLang's message) if it still
        waits for its first admission; one admitted since, or retracted after, goes on."""
        seq = self.seqs.get(msg.rid)
        if seq is None or seq.admitted or seq not in self.lane:
            return
        self.queue_timeouts += 1
        self._end(seq, self._drop(msg.rid), Aborted(msg.rid, QUEUE_TIMEOUT))

    @handles(Release)
    def _release(self, msg: Release) -> None:
        seq = self.seqs.get(msg.rid)
        self._drop(msg.rid)
        if seq is not None and seq.pooling is None and self.stage.alive:
            self.stage.tell(Forget(msg.rid))

    # -- stepping ------------------------------------------------------------------------------
    def on_drained(self) -> None:
        if self.state is K.pending and not self._hold_for_batch():
            self._start_step()

    def _start_step(self, drain: bool = False) -> bool:
        """Plan and start a step; `drain` (a wait pause): of the running requests only, none
        admitted, and an empty plan starts nothing. Returns whether a step started. None starts
        while a memory tag is released (`scheduler_memory`): requests queue until the resume."""
        if self.released:
            return False
        info = self.engine.info
        self.policy.max_len = min(info.max_model_len, info.num_blocks * info.block_size)
        plan = self.policy.plan(self.running, [] if drain else [self.probe_lane, self.lane], self.bm)
        rec = self.system.recorder if self.system is not None else None
        if plan.retracted:
            for seq, cause in zip(plan.retracted, plan.causes):
                if rec is not None:           # why: the cause, and the priority it had
                    rec.note("sched", "retract", rid=seq.rid, data={"cause": cause, "priority": seq.priority})
                self._tell(seq.rid, Retracted(seq.rid, cause))
            self._requeue(reversed(plan.retracted))
        for seq, cached in plan.admitted:
            seq.admitted = True
            self._tell(seq.rid, Scheduled(seq.rid, cached))
        if not plan.batch:
            if not drain:
                self._fail_unfittable()
            return False
        self.inflight = {seq.rid: seq for seq, _ in plan.batch}
        self.fire("drain_step" if drain else "step")
        self._run(plan.batch)
        return True

    def _run(self, batch: list[Any]) -> None:
        """Hand `batch` to the model (a planned step, or an isolation's re-run)."""
        self.step_id += 1
        rec = self.system.recorder if self.system is not None else None
        if rec is not None:
            data = {"sched": self.name, "step": self.step_id, "batch": [[s.rid, n] for s, n in batch]}
            drafts = {s.rid: list(s.draft) for s, _ in batch if s.draft}
            if drafts:                      # what each speculating member's step verifies
                data["draft"] = drafts
            rec.note("step", "step", data=data)
        step = self.step_id
        self.step_version = self.weight_version     # its tokens are this version's (no load mid-step)
        run = self.runner or (self.system.run_in_thread if self.step_in_thread else self.system.run_inline)
        run(self, self.engine.execute, batch, wrap=lambda res, err: self._returned(step, batch, res, err))

    def _returned(self, step: int, batch: list[Any], res: Any, err: BaseException | None) -> StepDone:
        """The model step came back (on the loop, outside any turn): an input to the actors.
        The recorder notes what the model answered, which re-execution plays back."""
        rec = self.system.recorder if self.system is not None else None
        if rec is not None:
            out = None if err is not None else [_answer(o) for o in res or ()]
            rec.input("step_end", data={
                "sched": self.name, "step": step, "out": out,
                "error": None if err is None else f"{type(err).__name__}: {err}"})
        return StepDone(step, batch, res, err)

    def _hold_for_batch(self) -> bool:
        """With a batching window: a scheduler whose next step would be part-empty waits
        `batch_wait_s` for more arrivals (``pending -> windowing``; throughput of small encoder
        forwards). On a clock that runs by itself the timer counts as outstanding work for
        `quiesce`; on a manual clock it waits for the clock to be moved, like any timer. Probes
        never wait, and a full batch does not either."""
        if not self.batch_wait_s or self.probe_lane or not self.lane:
            return False
        if self.running or len(self.lane) >= self.policy.config.max_num_seqs:
            return False
        sysm = self.system
        assert sysm is not None
        counted = self._window_busy
        if counted:
            sysm._inc()

        def close() -> None:
            self._window = None        # fired: nothing to cancel any more
            if self.alive:
                self.tell(BatchWindowClosed())
            if counted:
                sysm._dec()

        self._window = sysm.call_later(self.batch_wait_s, close, f"{self.name}:batch_window")
        self.fire("window")
        return True

    def _cancel_window(self) -> None:
        """Cancel an open window's timer (the caller fires ``window_closed``)."""
        if self._window is not None:
            self._window.cancel()
            self._window = None
            if self._window_busy:
                assert self.system is not None
                self.system._dec()

    @property
    def _window_busy(self) -> bool:
        """An open window counts for `quiesce` only on a clock that fires it by itself."""
        return getattr(self.system.clock, "runs_by_itself", True) if self.system is not None else False

    @handles(BatchWindowClosed)
    def _window_done(self, msg: BatchWindowClosed) -> None:
        if self.state is K.windowing:     # else it was cancelled meanwhile (pause, empty)
            self.fire("window_closed")
            self._start_step()

    def _fail_unfittable(self) -> None:
        """Nothing runs and the head of the queue still does not fit: it never will."""
        if self.running:
            return
        for lane in (self.probe_lane, self.lane):
            if lane:
                seq = lane.peek()
                self._end(seq, self._drop(seq.rid),
                          Failed(seq.rid, "the request needs more KV blocks than the cache has"))
                return

    def _live(self, seq: Any) -> bool:
        return self.seqs.get(seq.rid) is seq

    @handles(StepDone)
    def _step_done(self, msg: StepDone) -> None:
        self.steps_done += 1
        batch, outputs, error = msg.batch, msg.outputs, msg.error
        if error is not None or self._isolation is not None:
            done = self._isolate(msg)
            if done is None:
                return                      # a re-run is in flight
            batch, outputs, error = done
        items: list[TokenItem] = []
        if error is not None:
            err = f"model step failed: {type(error).__name__}: {error}"
            for seq, _ in batch:
                if self._live(seq):
                    self._end(seq, self._drop(seq.rid), Failed(seq.rid, err))
        else:
            counts = {id(seq): n for seq, n in batch}
            for out in outputs or ():
                seq = out.seq
                if self.seqs.get(seq.rid) is not seq:
                    continue  # aborted or released while the step ran
                # a verified draft: the KV of the last token and of the accepted drafts is good
                seq.num_computed += 1 + len(out.extra) if seq.draft else counts[id(seq)]
                self.bm.commit(seq)
                self._routed(seq, out, items)
        for seq, _ in batch:
            seq.draft = []
        self.inflight = {}
        for seq in self._free_after_step:
            self.bm.free(seq)
            self.engine.release(seq)
            self._lora_release(seq)
        self._free_after_step.clear()
        if not items:
            self._end_step(())
            return
        assert self.system is not None
        self.system.pipe(self.stage.ask(StepOutputs(msg.step, tuple(items))), self,
                         wrap=outputs_done(msg.step))

    def _isolate(self, msg: StepDone) -> tuple[list[Any], list[Any] | None, BaseException | None] | None:
        return step_failed_or_rerun(self, msg)

    @handles(OutputsDone)
    def _outputs_done(self, msg: OutputsDone) -> None:
        if msg.error is not None:     # the stage itself failed: its requests cannot go on
            err = f"output stage failed: {type(msg.error).__name__}: {msg.error}"
            for rid in list(self.seqs):
                seq = self.seqs[rid]
                if seq.pooling is None:
                    actor = self._drop(rid)
                    if actor is not None and actor.alive:
                        actor.tell(Failed(rid, err))
        self.generated_tokens -= msg.dropped     # counted as routed; the stage did not output them
        self._end_step(msg.stopped + msg.failed)

    def _end_step(self, stopped: tuple[str, ...]) -> None:
        """The step and its outputs are over: free what the stage finished, then plan anew."""
        for rid in stopped:
            self._drop(rid)
        self.fire("step_done")
        self._apply_pending_pause()
        self._settle()
        self._check_idle()

    def _tell(self, rid: str, message: Any) -> None:
        """Tell a request actor, unless it has already stopped: an actor that ended on its own
        (a stop string, its own failure) has a `Release` on the way that frees its sequence."""
        actor = self.actors.get(rid)
        if actor is not None and actor.alive:
            actor.tell(message)

    def _routed(self, seq: Any, out: Any, items: list[TokenItem]) -> None:
        """Route a member's output, and a speculating member's further accepted tokens one by
        one while it goes on (a finish among them drops the rest)."""
        spec = (len(seq.draft), len(out.extra)) if seq.draft else None
        if spec is not None:
            self.spec_steps += 1
            self.spec_draft_tokens += spec[0]
            self.spec_accepted_tokens += spec[1]
        item = self._route(seq, out, spec)
        if item is not None:
            items.append(item)
        for more in out.extra:
            if not self._live(seq) or item is None or item.finish_reason is not None:
                break
            item = self._route(seq, more)
            if item is not None:
                items.append(item)

    def _route(self, seq: Any, out: Any, spec: tuple[int, int] | None = None) -> TokenItem | None:
        """One member's output: pooled values and prefill progress go to the request actor;
        a token goes to the output stage (returned), with the scheduler's own verdict."""
        actor = self.actors[seq.rid]
        if seq.pooling is not None:
            if out.pooled is None:
                self._tell(seq.rid, PrefillProgress(seq.rid, seq.num_computed))
            else:
                self._drop(seq.rid)
                if actor.alive:
                    actor.tell(PoolOut(seq.rid, out.pooled))
            return None
        if out.token_id is None:
            self._tell(seq.rid, PrefillProgress(seq.rid, seq.num_computed))
            return None
        tok = out.token_id
        if out.error is not None:        # the engine's verdict on this request alone
            self._end(seq, self._drop(seq.rid), Failed(seq.rid, out.error))
            return None
        seq.output_ids.append(tok)
        if not seq.is_probe:
            self.generated_tokens += 1
        reason = self._finish_reason(seq, tok, out.stop)
        if reason is not None:
            self._drop(seq.rid)
        return TokenItem(seq.rid, tok, out.logprob, out.top_logprobs, reason, out.ids_logprobs,
                         out.prompt_logprobs, spec, self.step_version)

    def _finish_reason(self, seq: Any, tok: int, grammar_done: bool = False) -> str | None:
        sp = seq.sampling
        info = self.engine.info
        if grammar_done or tok in sp.stop_token_ids or (not sp.ignore_eos and tok in info.eos_token_ids):
            return "stop"
        if len(seq.output_ids) >= sp.max_new_tokens:
            return "length"
        if seq.num_tokens >= min(info.max_model_len, info.num_blocks * info.block_size):
            return "length"
        return None

    @handles(ProgressQuery)
    def _progress(self, msg: ProgressQuery) -> Progress:
        stepping = self.state in (K.stepping, K.pausing)
        pending = stepping or (bool(self.seqs) and self.paused_mode is None and not self.released)
        return Progress(self.steps_done, pending, len(self.seqs))

    # -- introspection and teardown ------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return stats_of(self)

    def on_stop(self) -> None:
        self._cancel_window()               # an open batching window no longer owes a step
        for rid in list(self.seqs):
            seq = self.seqs[rid]
            self._end(seq, self._drop(rid), Aborted(rid, "server shutting down"))
        self._answer_waiters("server shutting down")
        self._lora_teardown("server shutting down")
        self.fire("stop")
