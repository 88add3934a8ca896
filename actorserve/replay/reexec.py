"""Deterministic re-execution: run a recording's inputs through today's actors and compare.

A recording (``serve --record``) holds, besides what happened, every *input* to the actors
(``kind == "input"`` events): the runtime's set-up, each client call (a generation or pooling
request with its prompt ids and parameters, an abort from a disconnect, a control or session
request, the end of a health probe), each model step coming back with what the model answered,
each timer firing. Everything else is the actors' own doing, and the actors are deterministic
given their inputs and the order of their turns.

`reexecute(events)` rebuilds the runtime around stand-ins (`standin.py`: an engine that answers
with the recorded tokens, a detokenizer that stops where the recorded one did, a virtual clock)
and takes over the turn scheduling: turns go on a run queue that the driver runs one at a time,
in the order they were scheduled, exactly as the event loop would. Each input is fed in when
the re-execution has produced as many events as the recording had before it, so it lands
between the same two turns as it did live. A model step is held until its recorded
``step_end``; a timer fires only at its recorded ``timer``.

The report compares, per scheduler, the batch composition of every step (the first differing
step is where a changed batching policy shows), and per lifecycle instance (each request,
control record, session, the server) its sequence of transitions. ``drift`` counts inputs that
could not be placed at their recorded point (there is always a cause among the differences).
A weight update's read and copy are held to their recorded point too, and reloaded or played
back (`reexec_weights`); each step's weights label is compared.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from typing import Any, Iterable

from .. import messages as M
from ..actors.runtime import DuplicateRequestId, Runtime
from ..config import SchedulerConfig
from ..engine.scheduling.base import StepPreempted
from ..engine.scheduling.batching import BatchConfig, BatchPolicy
from ..engine.scheduling.params import PoolingParams, SamplingParams
from ..statemachines import LIFECYCLES
from .check import OLD_CONTROL_NOTE, control_outcomes, legacy, old_control
from .recorder import Event, FlightRecorder
from .reexec_report import ReexecReport, RecordingError, StepDiff, TransitionDiff  # noqa: F401 (their home before)
from .reexec_weights import OPS as WEIGHT_OPS, WeightsPlayback, compare_versions
from .reexec_lora import OPS as LORA_OPS, LoraPlayback
from .standin import ReplayClock, ReplayDetokenizer, ReplayEngine

CONTROL_MESSAGES = ("AbortRequest", "PauseGeneration", "ContinueGeneration", "FlushCache",
                    "OpenSession", "CloseSession", "HealthCheck", "ServerEvent", "Drain",
                    "SessionBegin", "SessionEnd", "ResponseBegin", "ResponseEnd", "ResponseDelete",
                    "ResponseCancel", *LORA_OPS)

# control messages a re-execution cannot replay, and why (the recording says so in its error)
_ENGINE_MEMORY = ("acts on the engine's KV and weights, which the re-execution's stand-in engine does "
                  "not hold")
_TRAINER_GROUP = "a weight update group is a rendezvous with a trainer process, which the recording does not hold"
UNREPLAYABLE = {
    "ReleaseMemory": f"a memory release {_ENGINE_MEMORY}",
    "ResumeMemory": f"a memory resume {_ENGINE_MEMORY}",
    "InitWeightsUpdateGroup": _TRAINER_GROUP,
    "UpdateWeightsFromDistributed": "the tensors were broadcast by a trainer process; the recording "
                                    "holds their names and shapes, never their values",
    "DestroyWeightsUpdateGroup": _TRAINER_GROUP,
}


def _tuples(args: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}


REQUEST_KEYS = ("prompt", "probe", "session", "target", "deadline_s", "priority", "response", "lora")


def _params(d: dict[str, Any]) -> dict[str, Any]:
    """The parameters of a recorded arrival: every key but the request's own."""
    return _tuples({k: v for k, v in d.items() if k not in REQUEST_KEYS})


# -- what the recording says ----------------------------------------------------------------------
def steps_of(events: Iterable[Event]) -> dict[str, list[tuple[int, list[Any]]]]:
    out: dict[str, list[tuple[int, list[Any]]]] = defaultdict(list)
    for e in events:
        if e.kind == "step":
            d = e.data or {}
            drafts = d.get("draft") or {}     # a speculating member's drafts are part of its entry
            out[d.get("sched", "scheduler")].append(
                (e.seq, [list(m) + ([drafts[m[0]]] if m[0] in drafts else []) for m in d.get("batch", [])]))
    return out


def histories_of(events: Iterable[Event]) -> dict[tuple[str, str | None], list[tuple[int, tuple[Any, ...]]]]:
    out: dict[tuple[str, str | None], list[tuple[int, tuple[Any, ...]]]] = defaultdict(list)
    for e in events:
        if e.kind in LIFECYCLES:
            out[(e.kind, e.rid)].append((e.seq, (e.event, e.src, e.dst, e.ok)))
    return out


def _model_answers(events: list[Event]) -> tuple[dict[str, deque[Any]], dict[tuple[str, int], int]]:
    """Answers per request, in order (a token, or ``[token, verdict]`` where the engine gave one:
    a grammar that ended, a refused token, or a tuple of the tokens a speculative step yielded);
    and where a detokenizer stopped: (rid, incarnation) -> n."""
    tokens: dict[str, deque[Any]] = defaultdict(deque)
    stops: dict[tuple[str, int], int] = {}
    incarnation: dict[str, int] = defaultdict(lambda: -1)
    seen: dict[str, int] = defaultdict(int)          # tokens of this incarnation so far
    for e in events:
        if e.kind == "input" and e.event == "step_end":
            for rid, tok, *verdict in (e.data or {}).get("out") or ():
                if isinstance(tok, int) and not isinstance(tok, bool):
                    tokens[rid].append([tok, verdict[0]] if verdict else tok)
                    seen[rid] += 1
                elif isinstance(tok, list):          # a speculative step's tokens
                    tokens[rid].append(tuple(tok))
                    seen[rid] += len(tok)
        elif e.kind == "input" and e.event == "generate" and e.rid is not None:
            incarnation[e.rid] += 1
            seen[e.rid] = 0
        elif e.kind == "detok" and e.event == "stop_string" and e.rid is not None:
            # the output stage's verdict comes before the next step is planned: the tokens so
            # far are the ones it had seen
            at = (e.data or {}).get("at")       # where in its tokens (older recordings: after all)
            stops[(e.rid, incarnation[e.rid])] = at if isinstance(at, int) else seen[e.rid]
    return tokens, stops


# -- the driver -----------------------------------------------------------------------------------
class _Driver:
    def __init__(self, events: list[Event], *, batch: BatchConfig | None,
                 policy: BatchPolicy | None) -> None:
        self.inputs = [e for e in events if e.kind == "input"]
        if not self.inputs or self.inputs[0].event != "runtime":
            raise RecordingError("the recording does not start with the runtime's set-up (an 'input' "
                                 "event 'runtime'): it was rotated away or made before inputs were "
                                 "recorded; re-execution needs the whole run")
        if not any(e.kind == "message" for e in events):
            raise RecordingError("the recording has no message events (record_messages was off)")
        setup = self.inputs[0].data or {}
        tokens, self.stops = _model_answers(events)
        self.incarnation: dict[str, int] = defaultdict(lambda: -1)
        gen = setup["generation"]
        self.engine = ReplayEngine(gen["engine"], tokens)
        pooling = {k: ReplayEngine(v["engine"], tokens, v["batch"]) for k, v in setup.get("pooling", {}).items()}
        wait = next((v["batch_wait_s"] for v in setup.get("pooling", {}).values()), 0.0)
        wd = setup.get("watchdog")
        cfg = SchedulerConfig(batch=batch or BatchConfig(**gen["batch"]), step_in_thread=False,
                              watchdog_timeout_s=wd["timeout"] if wd else None, pool_batch_wait_s=wait,
                              responses_store=setup.get("responses_store", 1000),
                              max_queue_time_s=setup.get("max_queue_time_s"))
        self.clock = ReplayClock(self.inputs[0].t_ns / 1e9)
        self.rec = FlightRecorder(clock=self.clock, capacity=len(events) * 2 + 1024,
                                  lifecycles=LIFECYCLES.values())
        self.rt = Runtime(self.engine, config=cfg, clock=self.clock, recorder=self.rec,
                          pooling_engines=pooling, weight_version=setup.get("weight_version", "default"))
        if policy is not None:
            self.rt.take_over(policy=policy)
        self.queue: deque[tuple[Any, Any]] = deque()
        self.rt.system.dispatch = lambda fn, actor: self.queue.append((fn, actor))
        self.pending: dict[str, tuple[Any, Any, list[Any], Any]] = {}
        self.rt.take_over(steps=self._hold)
        self.report = ReexecReport(inputs=len(self.inputs))
        self.weights = WeightsPlayback(self, self.inputs, RecordingError)
        self.loras = LoraPlayback(self, setup, RecordingError)      # adapters: reloaded where they were
        # events the recording has before the runtime's set-up (made by whoever owned the recorder)
        self.offset = self.inputs[0].seq - 1
        self.futures: list[Any] = []
        self.shut_down = False

    def _hold(self, target: Any, fn: Any, batch: list[Any], *, wrap: Any) -> None:
        self.pending[target.name] = (target, fn, batch, wrap)

    async def _pump(self, until: int | None) -> None:
        """Run turns, in order, until `until` events exist (or nothing more can happen)."""
        idle_spins = 0
        while until is None or self.rec.seq + self.offset < until:
            if self.queue:
                fn, actor = self.queue.popleft()
                fn(actor)
                idle_spins = 0
            elif self.rt.system.callbacks_ready() and idle_spins < 100:
                await asyncio.sleep(0)     # the loop delivers a resolved reply / piped result
                idle_spins += 1
            else:
                return

    def _drifted(self, e: Event) -> None:
        self.report.drift += 1
        if self.report.first_drift is None:
            self.report.first_drift = (e.seq, e.event)

    def _keep(self, fut: Any) -> None:
        if fut is not None and hasattr(fut, "add_done_callback"):
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.futures.append(fut)

    async def run(self) -> list[Event]:
        self._keep(self.rt.begin())
        for e in self.inputs[1:]:
            await self._pump(e.seq - 1)
            if self.rec.seq + self.offset != e.seq - 1:
                self._drifted(e)
            self.clock.set_time(e.t_ns / 1e9)
            if e.event == "shutdown":
                await self._replay_shutdown()
                break
            self._apply(e)
        else:
            await self._pump(None)
        replayed = self.rec.events()
        await self._cleanup()
        return replayed

    async def _replay_shutdown(self) -> None:
        """`Runtime.shutdown` awaits its steps: run it beside the pump until it is over."""
        task = asyncio.ensure_future(self.rt.shutdown())
        for _ in range(10_000):
            await asyncio.sleep(0)
            await self._pump(None)
            if task.done():
                break
        self.shut_down = True
        if not task.done():
            task.cancel()

    def _apply(self, e: Event) -> None:
        try:
            self._feed(e)
        except DuplicateRequestId:      # after a difference: that request is still running here
            self._drifted(e)
        except (TypeError, KeyError) as exc:
            raise RecordingError(f"seq {e.seq}: cannot rebuild input {e.event!r}: {exc}") from exc

    def _feed(self, e: Event) -> None:
        d = e.data or {}
        rt = self.rt
        if e.event == "generate":
            assert e.rid is not None
            self.incarnation[e.rid] += 1
            stop_at = self.stops.get((e.rid, self.incarnation[e.rid]))
            rt.generate(list(d["prompt"]), SamplingParams(**_params(d)), rid=e.rid,
                        detokenizer=ReplayDetokenizer(stop_at), is_probe=d.get("probe", False),
                        session=d.get("session"), deadline_s=d.get("deadline_s"),
                        priority=d.get("priority"), response=d.get("response"), lora=d.get("lora"))
        elif e.event == "pool":
            rt.pool(list(d["prompt"]), PoolingParams(**_params(d)), rid=e.rid,
                    is_probe=d.get("probe", False), target=d.get("target"),
                    deadline_s=d.get("deadline_s"))
        elif e.event == "abort":    # recordings from before every abort was a control request
            assert e.rid is not None
            self._keep(rt.abort(e.rid, d.get("reason", "abort")))
        elif e.event in ("control", "session"):
            if d.get("op") in UNREPLAYABLE:
                raise RecordingError(f"seq {e.seq}: {d['op']} cannot be re-executed: {UNREPLAYABLE[d['op']]}")
            if d.get("op") not in CONTROL_MESSAGES + WEIGHT_OPS:
                raise RecordingError(f"seq {e.seq}: unknown control message {d.get('op')!r}")
            args = _tuples(d.get("args") or {})
            msg = (self.weights.message(e, d["op"], args) if d["op"] in WEIGHT_OPS
                   else getattr(M, d["op"])(**args))
            self._keep(rt.control(msg) if e.event == "control" else rt.session(msg))
        elif e.event == "health_done":
            rt.health_done(d["record"], d["ok"], d["reason"])
        elif e.event in ("shed", "grammar"):   # refused at admission / a compile: no actor saw it
            self.rec.input(e.event, data=d)
        elif e.event == "delivered":
            assert e.rid is not None
            info = rt.request_info(e.rid)
            if info is not None and info["state"] not in ("detok", "pool"):
                self._drifted(e)     # a what-if run: this request has not got that far here
            else:
                rt.delivered(e.rid)
        elif e.event == "step_end":
            self._step_end(e, d)
        elif e.event == "lora_read":
            if not self.loras.feed(e):
                self._drifted(e)
        elif e.event in ("weights_read", "weights_applied"):
            if not self.weights.feed(e):
                self._drifted(e)
        elif e.event == "timer":
            label = d.get("label")
            fired = self.clock.fire_labelled(label) if label else self.clock.fire_next()
            if not fired:
                self._drifted(e)
        else:
            raise RecordingError(f"seq {e.seq}: unknown input {e.event!r}")

    def _step_end(self, e: Event, d: dict[str, Any]) -> None:
        held = self.pending.pop(d.get("sched", "scheduler"), None)
        if held is None:
            self._drifted(e)
            return
        target, fn, batch, wrap = held
        preemption = getattr(target, "preemption", None)
        if d.get("preempted"):       # given up at a layer boundary: nothing computed counts
            res, err = None, StepPreempted("recorded")
        elif d.get("error"):
            res, err = None, RuntimeError(f"recorded failure: {d['error']}")
        else:
            if preemption is not None:   # it ran to its end: an ask to give up came too late
                preemption.flag.clear()
            res, err = fn(batch), None
        msg = wrap(res, err)
        if target.alive:
            target.tell(msg)

    async def _cleanup(self) -> None:
        """Hand the turns back to the event loop and stop what is left (not compared)."""
        sysm = self.rt.system
        sysm.dispatch = None
        while self.queue:
            fn, actor = self.queue.popleft()
            sysm.loop.call_soon(fn, actor)
        if not self.shut_down:
            await self.rt.shutdown()
        for f in self.futures:
            if not f.done():
                f.cancel()


# -- comparing ------------------------------------------------------------------------------------
def compare(recorded: list[Event], replayed: list[Event], report: ReexecReport,
            cut: bool = False) -> ReexecReport:
    """`cut`: the recording stops where its process did (killed, or still running): what the
    re-execution goes on to do after the recording's last event was never recorded, so it is
    not compared; everything up to there is."""
    if cut and recorded:
        last = max(e.seq for e in recorded)
        replayed = [e for e in replayed if e.seq <= last]
    rs, ps = steps_of(recorded), steps_of(replayed)
    for sched in sorted(set(rs) | set(ps)):
        a, b = rs.get(sched, []), ps.get(sched, [])
        report.steps[sched] = (len(a), len(b))
        for i in range(max(len(a), len(b))):
            ra = a[i] if i < len(a) else None
            rb = b[i] if i < len(b) else None
            if ra is None or rb is None or ra[1] != rb[1]:
                report.step_diffs.append(StepDiff(sched, i + 1, ra[0] if ra else None,
                                                  ra[1] if ra else None, rb[1] if rb else None))
                break
    # a recording made before a rename is compared as today's machines name it (check.legacy)
    rh = histories_of(e for e in map(legacy, recorded) if e is not None)
    ph = histories_of(replayed)
    if old_control(recorded):      # an old record does not say which of today's states it passed
        report.notes.append(OLD_CONTROL_NOTE)
        for h in (rh, ph):
            for key in [k for k in h if k[0] == "control"]:
                h[key] = control_outcomes(h[key])
    report.instances = len(rh)
    diffs = []
    for key in set(rh) | set(ph):
        a, b = rh.get(key, []), ph.get(key, [])
        for i in range(max(len(a), len(b))):
            ta = a[i] if i < len(a) else None
            tb = b[i] if i < len(b) else None
            if ta is None or tb is None or ta[1] != tb[1]:
                diffs.append(TransitionDiff(key[0], key[1], i, ta[0] if ta else (tb[0] if tb else None),
                                            ta[1] if ta else None, tb[1] if tb else None))
                break
    diffs.sort(key=lambda d: d.seq if d.seq is not None else 1 << 62)
    report.transition_diffs = diffs
    return report


async def reexecute(events: list[Event], *, batch: BatchConfig | None = None,
                    policy: BatchPolicy | None = None, cut: bool = False) -> ReexecReport:
    """Re-execute a whole recording (its events in seq order); see the module docstring.
    `batch` / `policy` replace the generation scheduler's batching to ask "what if"; `cut`:
    the recording was not closed in order (see `compare`)."""
    driver = _Driver(events, batch=batch, policy=policy)
    replayed = await driver.run()
    report = compare(events, replayed, driver.report, cut=cut)
    report.fillers = driver.engine.fillers
    report.weights = driver.weights.notes + driver.loras.notes
    report.weights_diffs = driver.weights.diffs + compare_versions(events, replayed)
    return report
