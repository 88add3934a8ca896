"""Isolating a failed model step: find the member(s) that make it fail, fail only those.

When a step of several members raises (a poison input the edge did not stop: a value that
overflows in sampling, a token the model cannot embed), failing the whole batch would punish
every request for one. Instead the scheduler re-runs the step's members in halves, bisecting:
a half that succeeds keeps its outputs, a half that fails is split again, and a single member
that still fails is the culprit. Only the culprits fail (with the error); the others get their
token from the re-run they were in, and the step ends as if it had succeeded for them — no
gap a client could see, beyond the re-runs' time. A step that fails with one member fails it.

The re-runs are model steps like any other (recorded as ``step`` notes and ``step_end``
inputs, so re-execution replays them), run while the scheduler is ``isolating`` (or
``isolating_pausing`` when a pause waits for the step): ``isolate`` enters it, ``isolated``
leaves it when the culprits are known. Re-running a member is safe: a step writes each
member's K/V for the same positions again, and nothing of a failed step was committed. Members
aborted during the isolation are left out of the next re-run.

`Isolator` is one of the parts a scheduler is built from: it holds the isolation in progress
and its counters, and acts on the scheduler only through what it is handed (`Hooks`).

Cost: for one culprit in a batch of B, about 2·log2(B) re-runs of ever smaller batches.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, NamedTuple


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


class Hooks(NamedTuple):
    """What an isolation may do to its scheduler, and nothing more."""
    live: Callable[[Any], bool]                  # is this sequence still the scheduler's?
    rerun: Callable[[list[Any]], None]           # run a sub-batch as a model step
    fire: Callable[[str], None]                  # an event of the scheduler's lifecycle
    note: Callable[..., None]                    # a recorder note: (kind, event, rid=, data=)
    fail: Callable[[Any, str], None]             # fail one request with this error


class Isolator:
    __slots__ = ("current", "isolations", "isolated_failures")

    def __init__(self) -> None:
        self.current: Isolation | None = None
        self.isolations = 0            # failed steps isolated
        self.isolated_failures = 0     # requests failed as the cause of a step's failure

    def step_back(self, msg: Any, name: str, h: Hooks) -> Any:
        """A step failed, or one of the isolation's re-runs came back (`msg`, a `StepDone`).
        Starts the next re-run and returns None, or returns the step to apply: `msg` itself
        when there is nothing to tell apart, else, once the isolation is over, the original
        members with the re-runs' outputs (the culprits failed)."""
        iso = self.current
        if iso is None:
            live = [(s, n) for s, n in msg.batch if h.live(s)]
            if len(live) <= 1:
                return msg                          # nothing to tell apart
            iso = self.current = Isolation(live)
            self.isolations += 1
            h.fire("isolate")
            h.note("step", "isolate", data={"sched": name, "step": msg.step, "suspects": [s.rid for s, _ in live],
                                            "error": f"{type(msg.error).__name__}: {msg.error}"})
        else:
            iso.result(msg.batch, msg.outputs, msg.error)
        sub = iso.next(h.live)
        if sub is not None:
            h.rerun(sub)
            return None
        self.current = None
        h.fire("isolated")
        for seq, err in iso.failed:
            if h.live(seq):
                self.isolated_failures += 1
                h.note("step", "isolated", rid=seq.rid, data={"sched": name, "error": err})
                h.fail(seq, f"model step failed on this request: {err}")
        return type(msg)(msg.step, iso.batch, iso.outputs, None)
