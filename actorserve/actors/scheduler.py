"""The scheduler actor: owns the queues and the KV accounting, runs one model step at a time.

The scheduler is the model of the SCHEDULER lifecycle (``idle -> pending -> [windowing ->]
stepping -> pending | idle``, ``isolating``, ``pausing``, ``paused_<mode>``); every phase below
is one of its states, fired through the machine and recorded, and a handler asks the machine
(`_can`) rather than repeating its table in an ``if state is ...`` guard.

It is built from parts handed in: the engine, the output stage, the batching policy, the KV's
`BlockManager`, `BatchWindow`, `PauseControl`, memory, LoRA adapters (`lora_part`), `Isolator`.
What a step's answer means for each member is decided in `step_outputs.decide`.

A step, top to bottom (the section "stepping" below): when the mailbox drains in ``pending``
(`on_drained`), the policy plans the next batch (`_start_step`): retracted requests go back to
their lane, newly admitted ones hear `Scheduled`, and `engine.execute(batch)` goes to a worker
thread (`_run`). Its answer comes back as a `StepDone` (`_step_done`): a failure is isolated
first, then every member is advanced and its verdicts applied (`_apply`: EOS and length free
the KV at once), and the step's tokens go to the output stage in one `StepOutputs`. The stage
detokenizes, finds stop strings and answers with the rids it finished (`_outputs_done`); only
then (`_end_step`, ``step_done``) is the step over, those rids' KV freed, a pause that waited
applied, and the next step planned. So a request that ends on a stop string is never in
another forward.

Because the next step starts only once the mailbox is empty, any `AbortRequest` or `Pause` that
arrived while a step was running is applied before the next step: an aborted request leaves
at once (its client gets `finish_reason: abort` right away), and its blocks are freed when
the in-flight step returns — never while the worker thread may still read its block table.
A request that outranks the step in flight (`step_preempt`) asks the engine to give it up at a
layer boundary; a step given up advances no member.

Pause, continue, flush and idle waits are in `scheduler_control.py`; memory release and resume
in `scheduler_memory.py`; LoRA adapters in `scheduler_lora.py`.
"""

from __future__ import annotations

import logging
from typing import Any

from ..engine.scheduling.base import Engine, StepPreempted
from ..engine.scheduling.batching import BatchConfig
from ..engine.scheduling.block_manager import BlockManager
from ..engine.scheduling.priority import make_policy
from ..messages import (
    QUEUE_TIMEOUT, AbortRequest, Aborted, BatchWindowClosed, Failed, Forget, OutputsDone,
    PoolOut, PrefillProgress, Progress, ProgressQuery, QueueTimeout, Release, Retracted, Scheduled,
    StepDone, StepOutputs, Submit, TokenOut,
)
from ..statemachines import SCHEDULER, STEP_IN_FLIGHT, SchedulerState
from .actor import ActorRef, handles
from .batch_window import BatchWindow
from .isolation import Hooks, Isolator
from .pause_control import PauseControl
from .lora_part import SchedulerLoraPart
from .queues import Queues
from .output import outputs_done
from .scheduler_control import SchedulerControl
from .scheduler_memory import SchedulerMemory, SchedulerMemoryPart
from .scheduler_stats import SchedulerStats, SchedulerView, batch_it_runs, setup_of, stats_of, view_of
from .step_preempt import StepPreemption
from .step_outputs import V, decide, limits_of, step_end_note, step_note

K = SchedulerState
_ISOLATING = (K.isolating, K.isolating_pausing)
log = logging.getLogger("actorserve.scheduler")


class SchedulerActor(SchedulerMemory, SchedulerControl):
    mailbox_capacity = 1 << 16

    def __init__(self, engine: Engine, *, stage: ActorRef, batch: BatchConfig | None = None,
                 block_manager: BlockManager | None = None, step_in_thread: bool = True,
                 name: str = "scheduler", batch_wait_s: float = 0.0, weight_version: str = "default",
                 window: BatchWindow | None = None, isolator: Isolator | None = None,
                 queues: Queues | None = None, pause_control: PauseControl | None = None,
                 memory: SchedulerMemoryPart | None = None, adapters: SchedulerLoraPart | None = None) -> None:
        super().__init__(name)
        self.weight_version = weight_version  # the label of the weights its steps run with now
        self.step_version = weight_version    # the label of the step in flight (or the last one)
        self.rid = name                      # the lifecycle instance's id in the recording
        self.state = SCHEDULER.initial
        self.engine = engine
        self.stage = stage                   # the output stage (detokenizer, stop strings)
        self.window = window or BatchWindow(batch_wait_s)   # batching window of an idle scheduler
        self.isolator = isolator or Isolator()              # bisects a failed step (isolation.py)
        info = engine.info
        self.bm = queues.bm if queues is not None else (
            block_manager or BlockManager(info.num_blocks, info.block_size))
        batch = batch_it_runs(engine, batch, name)    # what is recorded is what runs
        self.policy = make_policy(batch)     # FCFS, or by priority (engine.priority)
        # its configuration as plain data, published with every view
        self.setup = setup_of(engine, batch, self.window.wait_s, self.bm.enable_prefix_cache, weight_version)
        self.step_in_thread = step_in_thread
        # the requests and their KV (queues.py); the names below are the part's own containers
        q = self.queues = queues or Queues(self.bm, self.policy.new_lane(), self._released)
        self.probe_lane, self.lane, self.running, self.seqs = q.probe_lane, q.lane, q.running, q.seqs
        self.actors, self.inflight, self._free_after_step = q.actors, q.inflight, q.free_after_step
        self.queue_timeouts = 0              # requests ended by --max-queue-time
        self.step_id = 0
        self.pause_control = pause_control or PauseControl()   # pause, flush, idle waits (pause_control.py)
        self.memory = memory or SchedulerMemoryPart()          # memory release / resume (scheduler_memory.py)
        self.generated_tokens = 0      # business traffic only: probes are not counted
        self.prompt_tokens = 0
        self.steps_done = 0            # completed model steps (the watchdog's progress signal)
        self.spec_steps = 0            # speculative verifications (a member's step with drafts)
        self.spec_draft_tokens = 0     # drafts proposed in them
        self.spec_accepted_tokens = 0  # of those, confirmed by the model
        # How a step runs: None = the system's worker thread (or inline); re-execution holds
        # each step until the recording says it came back. Called (self, fn, batch, wrap=...).
        self.runner: Any = None
        self.preemption = StepPreemption(engine)   # giving the step in flight up (step_preempt)
        self._init_lora(adapters)        # LoRA adapters: their lifecycle and holds (lora_part)

    @property
    def batch_wait_s(self) -> float:
        return self.window.wait_s

    def on_start(self) -> None:
        rec = self.system.recorder if self.system is not None else None
        if rec is not None:
            rec.created(SCHEDULER, self)

    # -- admission -----------------------------------------------------------------------------
    @handles(Submit)
    def _submit(self, msg: Submit) -> None:
        seq, actor = msg.seq, msg.ref
        if msg.rid in self.seqs:
            self._end(seq, actor, Failed(msg.rid, f"duplicate request id {msg.rid!r}"))
            return
        room = self.engine.info.capacity
        if seq.num_tokens >= room:
            self._end(seq, actor, Failed(msg.rid, f"prompt of {seq.num_tokens} tokens leaves no room "
                                                  f"to generate (capacity {room} tokens)"))
            return
        lora = None
        if msg.lora is not None:       # the adapter it names: held from here to its end
            lora = self._lora_check(msg.lora)
            if isinstance(lora, str):
                self._end(seq, actor, Failed(msg.rid, lora))
                return
        if self._can("admit"):
            self.fire("admit")
        self.queues.add(seq, actor)
        if not seq.is_probe:
            self.prompt_tokens += len(seq.prompt_ids)
        if lora is not None and not self._lora_hold_or_park(seq, lora):
            return                     # parked until its adapter's load is over
        self.queues.enqueue(seq)
        if self._can("preempt_step") and self.preemption.wanted(seq, self.policy, self.inflight.values()):
            self.fire("preempt_step")        # it outranks the whole step in flight (step_preempt)
            self.preemption.ask()

    # -- leaving -------------------------------------------------------------------------------
    def _end(self, seq: Any, actor: ActorRef | None, msg: Aborted | Failed) -> None:
        """Tell a request it ended. A generation request hears it through the output stage,
        after any token of it the stage still has, with the text its detokenizer held back."""
        if seq.pooling is None and self.stage.alive:
            self.stage.tell(msg)
        elif actor is not None and actor.alive:
            actor.tell(msg)

    def _drop(self, rid: str) -> ActorRef | None:
        """Forget a request; free its blocks now, or after the in-flight step if it is in it."""
        gone = self.queues.remove(rid)
        if gone is None:
            return None
        if not self.seqs:
            self._settle()
            self._check_idle()
        return gone[1]

    def _released(self, seq: Any) -> None:
        """What a leaving sequence gives back besides its blocks (the queues call it)."""
        self.engine.release(seq)
        self._lora_release(seq)

    def _settle(self) -> None:
        """No request left while no step runs: a window closes, ``pending -> idle``."""
        if self._can("window_closed"):
            self._cancel_window()
            self.fire("window_closed")
        if not self.seqs and self._can("empty"):
            self.fire("empty")

    @handles(AbortRequest)
    def _abort(self, msg: AbortRequest) -> list[str]:
        """Abort the matching requests; answers their rids."""
        rids = self.queues.matches(msg)
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
        if self._can("step") and not self._hold_for_batch():
            self._start_step()

    def _start_step(self, drain: bool = False) -> bool:
        """Plan and start a step; `drain` (a wait pause): of the running requests only, none
        admitted, and an empty plan starts nothing. Returns whether a step started. None starts
        while a memory tag is released (`scheduler_memory`): requests queue until the resume."""
        if self.released:
            return False
        self.policy.max_len = self.engine.info.capacity
        plan = self.policy.plan(self.running, [] if drain else [self.probe_lane, self.lane], self.bm)
        rec = self.system.recorder if self.system is not None else None
        if plan.retracted:
            for seq, cause in zip(plan.retracted, plan.causes):
                if rec is not None:           # why: the cause, and the priority it had
                    rec.note("sched", "retract", rid=seq.rid, data={"cause": cause, "priority": seq.priority})
                self._tell(seq.rid, Retracted(seq.rid, cause))
            self.queues.requeue(reversed(plan.retracted))
        for seq, cached in plan.admitted:
            seq.admitted = True
            self._tell(seq.rid, Scheduled(seq.rid, cached))
        if not plan.batch:
            if not drain:
                self._fail_unfittable()
            return False
        self.queues.start(plan.batch)
        self.fire("drain_step" if drain else "step")
        self._run(plan.batch)
        return True

    def _run(self, batch: list[Any]) -> None:
        """Hand `batch` to the model (a planned step, or an isolation's re-run)."""
        self.step_id += 1
        rec = self.system.recorder if self.system is not None else None
        if rec is not None:
            rec.note("step", "step", data=step_note(self.name, self.step_id, batch))
        step = self.step_id
        self.step_version = self.weight_version     # its tokens are this version's (no load mid-step)
        self.preemption.started()
        run = self.runner or (self.system.run_in_thread if self.step_in_thread else self.system.run_inline)
        run(self.ref, self.engine.execute, batch, wrap=lambda res, err: self._returned(step, batch, res, err))

    def _returned(self, step: int, batch: list[Any], res: Any, err: BaseException | None) -> StepDone:
        """The model step came back (on the loop, outside any turn): an input to the actors.
        The recorder notes what the model answered, which re-execution plays back."""
        self.preemption.returned()
        rec = self.system.recorder if self.system is not None else None
        if rec is not None:
            rec.input("step_end", data=step_end_note(self.name, step, res, err))
        return StepDone(step, batch, res, err)

    def _hold_for_batch(self) -> bool:
        """With a batching window (`batch_window`): a next step that would be part-empty waits
        for more arrivals, ``pending -> windowing``."""
        if not self.window.wanted(probes=len(self.probe_lane), waiting=len(self.lane), running=len(self.running),
                                  max_seqs=self.policy.config.max_num_seqs):
            return False
        self.window.open(self)
        self.fire("window")
        return True

    def _cancel_window(self) -> None:
        """Cancel an open window's timer (the caller fires ``window_closed``)."""
        self.window.cancel(self)

    @handles(BatchWindowClosed)
    def _window_done(self, msg: BatchWindowClosed) -> None:
        if self._can("window_closed"):     # else it was cancelled meanwhile (pause, empty)
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
        return self.queues.live(seq)

    @handles(StepDone)
    def _step_done(self, msg: StepDone) -> None:
        """The model step came back: isolate a failure, advance every member, apply the
        verdicts, and hand the step's tokens to the output stage (or end the step)."""
        self.steps_done += 1
        if isinstance(msg.error, StepPreempted) and self.state not in _ISOLATING:
            self.queues.step_over(msg.batch)     # given up: no member advanced
            self._end_step(())
            return
        if msg.error is not None or self.state in _ISOLATING:
            msg = self.isolator.step_back(msg, self.name, self._hooks())
            if msg is None:
                return                      # a re-run is in flight
        items: list[TokenOut] = []
        if msg.error is not None:
            err = f"model step failed: {type(msg.error).__name__}: {msg.error}"
            for seq, _ in msg.batch:
                if self._live(seq):
                    self._end(seq, self._drop(seq.rid), Failed(seq.rid, err))
        else:
            counts = {id(seq): n for seq, n in msg.batch}
            limits = limits_of(self.engine.info, self.step_version)
            seqs, commit = self.seqs, self.bm.commit
            for out in msg.outputs or ():
                seq = out.seq
                if seqs.get(seq.rid) is not seq:
                    continue                # aborted or released while the step ran
                # a verified draft: the KV of the last token and of the accepted drafts is good
                if seq.draft:
                    seq.num_computed += 1 + len(out.extra)
                    self.spec_steps += 1
                    self.spec_draft_tokens += len(seq.draft)
                    self.spec_accepted_tokens += len(out.extra)
                else:
                    seq.num_computed += counts[id(seq)]
                commit(seq)
                verdict = decide(seq, out, limits, items)
                if verdict is not None:
                    self._apply(seq, verdict)
        self.queues.step_over(msg.batch)
        if not items:
            self._end_step(())
            return
        assert self.system is not None
        self.system.pipe(self.stage.ask(StepOutputs(msg.step, tuple(items))), self,
                         wrap=outputs_done(msg.step))

    def _apply(self, seq: Any, verdict: tuple[V, Any]) -> None:
        """Apply what `step_outputs.decide` said besides the tokens it routed."""
        kind, value = verdict
        rid = seq.rid
        if kind is V.finished:
            self._drop(rid)                 # its KV is free before the next plan
        elif kind is V.progress:
            self._tell(rid, PrefillProgress(rid, seq.num_computed))
        elif kind is V.pooled:
            actor = self._drop(rid)
            if actor is not None and actor.alive:
                actor.tell(PoolOut(rid, value))
        else:                               # V.fail
            self._end(seq, self._drop(rid), Failed(rid, value))

    def _hooks(self) -> Hooks:
        """What the isolation of a failed step may do here."""
        rec = self.system.recorder if self.system is not None else None
        return Hooks(live=self._live, rerun=self._run, fire=self.fire,
                     note=rec.note if rec is not None else (lambda *a, **k: None),
                     fail=lambda seq, err: self._end(seq, self._drop(seq.rid), Failed(seq.rid, err)))

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
        self.generated_tokens += msg.output      # what reached its requests (probes' left out)
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

    @handles(ProgressQuery)
    def _progress(self, msg: ProgressQuery) -> Progress:
        stepping = self.state in STEP_IN_FLIGHT
        pending = stepping or (bool(self.seqs) and self.paused_mode is None and not self.released)
        return Progress(self.steps_done, pending, len(self.seqs))

    # -- introspection and teardown ------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return stats_of(self)

    def publish(self) -> SchedulerView:
        """What the runtime reads of this scheduler (stats, admission, adapters), after each turn."""
        return view_of(self)

    def on_stop(self) -> None:
        self._cancel_window()               # an open batching window no longer owes a step
        for rid in list(self.seqs):
            seq = self.seqs[rid]
            self._end(seq, self._drop(rid), Aborted(rid, "server shutting down"))
        self._answer_waiters("server shutting down")
        self._lora_teardown("server shutting down")
        self.fire("stop")
