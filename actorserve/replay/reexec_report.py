"""What a re-execution reports: the steps and transitions that differ from the recording, the
inputs placed off their recorded point, the weight reloads, and notes on how an old recording
was compared (`ReexecReport`, re-exported by `reexec`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RecordingError(ValueError):
    """The recording cannot be re-executed (no set-up, inputs missing, rotated away)."""


@dataclass(frozen=True, slots=True)
class StepDiff:
    sched: str
    step: int                     # the n-th step of that scheduler
    seq: int | None               # where the recorded step is
    recorded: list[Any] | None    # [[rid, n_tokens], ...]; None: the recording has no such step
    replayed: list[Any] | None


@dataclass(frozen=True, slots=True)
class TransitionDiff:
    kind: str
    rid: str | None
    index: int                    # position in that instance's history
    seq: int | None
    recorded: tuple[Any, ...] | None      # (event, src, dst, ok)
    replayed: tuple[Any, ...] | None


@dataclass(slots=True)
class ReexecReport:
    inputs: int = 0
    steps: dict[str, tuple[int, int]] = field(default_factory=dict)   # sched -> (recorded, replayed)
    instances: int = 0
    step_diffs: list[StepDiff] = field(default_factory=list)
    transition_diffs: list[TransitionDiff] = field(default_factory=list)
    drift: int = 0
    first_drift: tuple[int, str] | None = None
    fillers: int = 0
    weights: list[str] = field(default_factory=list)        # each update: reloaded, or why not
    weights_diffs: list[str] = field(default_factory=list)  # a reload or a step's label that differs
    notes: list[str] = field(default_factory=list)          # how an old recording was compared

    @property
    def ok(self) -> bool:
        return not self.step_diffs and not self.transition_diffs and not self.weights_diffs

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "inputs": self.inputs, "instances": self.instances,
                "steps": {k: {"recorded": a, "replayed": b} for k, (a, b) in self.steps.items()},
                "step_diffs": [_asdict(d) for d in self.step_diffs],
                "transition_diffs": [_asdict(d) for d in self.transition_diffs],
                "drift": self.drift, "first_drift": self.first_drift, "fillers": self.fillers,
                "weights": self.weights, "weights_diffs": self.weights_diffs, "notes": self.notes}

    def format(self, limit: int = 10) -> str:
        lines = [f"re-executed {self.inputs} inputs: "
                 + ", ".join(f"{k} {b}/{a} steps" for k, (a, b) in self.steps.items())
                 + f", {self.instances} lifecycle instances"]
        lines += [f"  note: {n}" for n in self.notes]
        if self.ok:
            lines.append("every step's batch and every transition match the recording")
        for d in self.step_diffs[:limit]:
            lines.append(f"  first differing step of {d.sched}: step {d.step} (seq {d.seq})\n"
                         f"    recorded {d.recorded}\n    replayed {d.replayed}")
        for t in self.transition_diffs[:limit]:
            lines.append(f"  {t.kind} {t.rid}: transition #{t.index} (seq {t.seq}) recorded "
                         f"{t.recorded}, replayed {t.replayed}")
        if len(self.transition_diffs) > limit:
            lines.append(f"  ... {len(self.transition_diffs) - limit} more instances differ")
        lines += [f"  weights: {w}" for w in self.weights] + [f"  weights differ: {w}" for w in self.weights_diffs]
        if self.drift and self.first_drift is not None:
            seq, what = self.first_drift
            lines.append(f"  {self.drift} inputs placed off their recorded point (first at seq {seq}: {what})")
        return "\n".join(lines)


def _asdict(d: Any) -> dict[str, Any]:
    return {f: getattr(d, f) for f in d.__slots__}
