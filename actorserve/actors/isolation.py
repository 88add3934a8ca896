"""Isolating a failed model step: find the member(s) that make it fail, fail only those.

When a step of several members raises (a poison input the edge did not stop: a value that
overflows in sampling, a token the model cannot embed), failing the whole batch would punish
every request for one. Instead the scheduler re-runs the step's members in halves, bisecting:
a half that succeeds keeps its outputs, a half that fails is split again, and a single member
that still fails is the culprit. Only the culprits fail (with the error); the others get their
token from the re-run they were in, and the step ends as if it had succeeded for them — no
gap a client could see, beyond the re-runs' time. A step that fails with one member fails it.

The re-runs are model steps like any other (recorded as ``step`` notes and ``step_end``
inputs, so re-execution replays them), run while the scheduler stays ``stepping``; the
isolation itself is the scheduler lifecycle's ``isolate`` event. Re-running a member is safe:
a step writes each member's K/V for the same positions again, and nothing of a failed step was
committed. Members aborted during the isolation are left out of the next re-run.

Cost: for one culprit in a batch of B, about 2·log2(B) re-runs of ever smaller batches.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from ..messages import Failed


def halves(batch: list[Any]) -> list[list[Any]]:
    mid = len(batch) // 2
    return [batch[:mid], batch[mid:]]


class Isolation:
    """The state of one isolation: the re-runs still to do, what succeeded, who failed."""

    __slots__ = ("batch", "todo", "outputs", "failed", "reruns")

    def __init__(self, batch: list[tuple[Any, int]]) -> None:
        self.batch = batch                               # the failed step's live members
        self.todo: deque[list[tuple[Any, int]]] = deque(halves(batch))
        self.outputs: list[Any] = []                     # outputs of the re-runs that succeeded
        self.failed: list[tuple[Any, str]] = []          # (seq, error) of each culprit
        self.reruns = 0

    def result(self, sub: list[tuple[Any, int]], outputs: list[Any] | None,
               error: BaseException | None) -> None:
        if error is None:
            self.outputs.extend(outputs or ())
        elif len(sub) == 1:
            self.failed.append((sub[0][0], f"{type(error).__name__}: {error}"))
        else:
            self.todo.extendleft(reversed(halves(sub)))

    def next(self, live: Callable[[Any], bool]) -> list[tuple[Any, int]] | None:
        """The next re-run (members still live), or None when the isolation is over."""
        while self.todo:
            sub = [(s, n) for s, n in self.todo.popleft() if live(s)]
            if sub:
                self.reruns += 1
                return sub
        return None


def step_failed_or_rerun(sched: Any, msg: Any) -> tuple[list[Any], list[Any] | None, BaseException | None] | None:
    """The scheduler's side: a step failed, or an isolation's re-run came back (`msg`, a
    `StepDone`). Starts the next re-run and returns None, or returns the step to apply once the
    isolation is over (the original members, the re-runs' outputs)."""
    iso = sched._isolation
    rec = sched.system.recorder if sched.system is not None else None
    if iso is None:
        live = [(s, n) for s, n in msg.batch if sched._live(s)]
        if len(live) <= 1:
            return msg.batch, msg.outputs, msg.error      # nothing to tell apart
        iso = sched._isolation = Isolation(live)
        sched.isolations += 1
        sched.fire("isolate")
        if rec is not None:
            rec.note("step", "isolate", data={
                "sched": sched.name, "step": msg.step, "suspects": [s.rid for s, _ in live],
                "error": f"{type(msg.error).__name__}: {msg.error}"})
    else:
        iso.result(msg.batch, msg.outputs, msg.error)
    sub = iso.next(sched._live)
    if sub is not None:
        sched._run(sub)
        return None
    sched._isolation = None
    for seq, err in iso.failed:
        if sched._live(seq):
            sched.isolated_failures += 1
            if rec is not None:
                rec.note("step", "isolated", rid=seq.rid, data={"sched": sched.name, "error": err})
            sched._end(seq, sched._drop(seq.rid),
                      Failed(seq.rid, f"model step failed on this request: {err}"))
    return iso.batch, iso.outputs, None
