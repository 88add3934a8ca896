"""Which model steps a profile records: SGLang's ``start_step``, ``num_steps``,
``profile_by_stage`` and ``profile_stages``, and each output file's trace.

A profile is one or more *targets*, each written to one file: the whole run (one target, no
stage), or with ``profile_by_stage`` one per wanted stage, ``prefill`` and ``decode`` (SGLang's
two; ``profile_stages`` picks). A target records in *windows*: torch's profiler is started on
the step thread just before the first step of a window runs and stopped just after its last
(or before the next step of another stage runs), so a stage's file holds only its own steps.

`StepPlan` decides, from the flight recorder's events, when a window opens and closes; it
imports no torch and starts nothing itself: it calls ``begin(target)`` / ``end(window)`` /
``done(target)`` hooks (`profile_routes` submits them to the step thread, whose one worker runs
them in order with the steps: a window's start is queued before the step that opened it).

* ``start_step`` = k: the first k steps after the start request are not recorded;
* ``num_steps`` = n: a target is done after n steps of its own (its file is written then); with
  no ``num_steps`` it records until ``/stop_profile``;
* a step's stage (`step_stage`): **prefill** when any member computes more than one token
  (a prompt or a chunk of it, a recompute, a speculative verify) or has not sampled its first
  token yet (the last chunk of a prompt, or a prompt all but one token of which came from the
  prefix cache), or is a pooling (encoder) forward; otherwise **decode**. SGLang classifies
  with ``ForwardMode.is_prefill()`` = ``is_extend()``: ``EXTEND``, ``MIXED`` (a chunked
  prefill batched with decodes), ``TARGET_VERIFY`` and ``DRAFT_EXTEND`` are all prefill, only
  ``DECODE`` is decode; so is a mixed batch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ...engine.scheduling.batching import step_stage  # noqa: F401  (the scheduler notes it on each step)
from ...replay.chrome_trace import to_chrome_trace

STAGES = ("prefill", "decode")
TORCH_PID = 3


@dataclass
class Window:
    target: "Target"
    begin_ns: int
    end_ns: int | None = None
    steps: set[tuple[str, int]] = field(default_factory=set)
    handle: Any = None                # the caller's: what `end` needs (the running profiler)


@dataclass
class Target:
    stage: str | None                 # None: every step (not by stage)
    limit: int | None                 # num_steps
    count: int = 0
    done: bool = False
    windows: list[Window] = field(default_factory=list)


class StepPlan:
    def __init__(self, *, start_step: int, num_steps: int | None, stages: list[str] | None,
                 now_ns: Callable[[], int], begin: Callable[[Target], Any],
                 end: Callable[[Window], None], done: Callable[[Target], None]) -> None:
        """`stages`: None records every step as one target; else one target per stage."""
        self.skip = start_step
        self.targets = ({None: Target(None, num_steps)} if stages is None
                        else {s: Target(s, num_steps) for s in stages})
        self.now_ns, self._begin, self._end, self._done = now_ns, begin, end, done
        self.open: Window | None = None
        self.finished = False

    def begin(self, target: Target, at_ns: int | None = None) -> None:
        w = Window(target, self.now_ns() if at_ns is None else at_ns)
        target.windows.append(w)
        self.open = w
        w.handle = self._begin(target)

    def close(self, at_ns: int | None = None) -> None:
        w, self.open = self.open, None
        if w is not None:
            w.end_ns = self.now_ns() if at_ns is None else at_ns
            self._end(w)

    def on_step(self, key: tuple[str, int], stage: str | None, t_ns: int | None = None) -> None:
        """A step is about to run (its ``step`` note, at `t_ns`; before it is queued on the
        step thread): a window that opens or closes here does so at that instant."""
        if self.finished:
            return
        if self.skip > 0:
            self.skip -= 1
            return
        want = self.targets.get(stage) if None not in self.targets else self.targets[None]
        if self.open is not None and self.open.target is not want:
            t = self.open.target
            self.close(t_ns)                              # another stage's step: not in this file
            self._maybe_done(t)
        if want is None or want.done:
            return
        if self.open is None:
            self.begin(want, t_ns)
        if want.limit is None or want.count < want.limit:
            self.open.steps.add(key)                      # type: ignore[union-attr]
            want.count += 1

    def on_step_end(self, key: tuple[str, int]) -> None:
        """The step came back (``step_end``): a target whose steps are all in is done."""
        w = self.open
        if self.finished or w is None or key not in w.steps:
            return
        if w.target.limit is not None and w.target.count >= w.target.limit:
            self.close()
            self._maybe_done(w.target)

    def _maybe_done(self, t: Target) -> None:
        if t.done or t.limit is None or t.count < t.limit:
            return
        t.done = True
        self._done(t)
        if all(x.done for x in self.targets.values()):
            self.finished = True

    def stop(self) -> list[Target]:
        """End by hand: close the open window; the targets not done yet that recorded anything."""
        self.close()
        self.finished = True
        return [t for t in self.targets.values() if not t.done and t.windows]


def _overlaps(e: dict[str, Any], spans: list[tuple[float, float]]) -> bool:
    if e["ph"] == "M":
        return True
    a = float(e.get("ts", 0.0))
    b = a + float(e.get("dur", 0.0))
    if e["ph"] != "X":
        return any(lo <= a <= hi for lo, hi in spans)
    return any(a < hi and b > lo for lo, hi in spans)


def target_trace(target: Target, events: list[Any], torch_events: list[dict[str, Any]],
                 other: dict[str, Any]) -> dict[str, Any]:
    """One file's trace: the lifecycle tracks that overlap the target's windows and torch's
    spans, on one timeline from the first window's start (µs)."""
    t0 = target.windows[0].begin_ns
    last = events[-1].t_ns if events else t0
    spans = [((w.begin_ns - t0) / 1000, ((w.end_ns if w.end_ns is not None else last) - t0) / 1000)
             for w in target.windows]
    doc = to_chrome_trace(events, t0=t0)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if _overlaps(e, spans)]
    doc["traceEvents"] += [
        {"ph": "M", "name": "process_name", "pid": TORCH_PID, "tid": 0,
         "args": {"name": "torch (model step thread)"}},
        {"ph": "M", "name": "process_sort_index", "pid": TORCH_PID, "tid": 0, "args": {"sort_index": 2}}]
    shift = t0 / 1000
    for e in torch_events:
        e = {**e, "pid": TORCH_PID}
        if "ts" in e:
            e["ts"] = round(e["ts"] - shift, 3)
        doc["traceEvents"].append(e)
    doc["otherData"] = {**doc.get("otherData", {}), **other, "stage": target.stage,
                        "steps": target.count, "windows": len(target.windows),
                        "torch_events": len(torch_events), "lifecycle_events": len(events)}
    return doc
