"""torch's profiler over the model-step thread, its spans put on the server's clock.

`StepProfiler` wraps ``torch.profiler.profile``. torch records operators only on the thread
that started it, so `start` and `stop` must run on the thread that runs the model steps (the
runtime calls them there, between steps: `ActorSystem.call_on_step_thread`).

Its operator spans come back as Chrome trace events (``"ph": "X"``, ``ts`` / ``dur`` in
microseconds) whose ``ts`` is on the caller's clock (``now_ns``, the runtime's, which also
stamps the flight recorder's events), so they can share one timeline with the lifecycle
tracks. torch stamps its events with a clock of its own; the two are tied by a marker: right
after the profiler starts (and a first, warming span), an empty ``record_function`` span is
opened and closed between two readings of ``now_ns`` (microseconds apart); the marker's torch ``ts`` and the middle of those readings are the same
instant, and every torch ``ts`` is moved by their difference.

Activities (SGLang's names, `resolve_activities`): ``CPU`` always; ``GPU`` (torch's CUDA
activity), ``XPU``, ``CUDA_PROFILER`` (``cudaProfilerStart``/``Stop``: a capture range for an
outside ``nsys``, no file of its own) and ``MEM`` (a CUDA memory-history snapshot, a
``.pickle``) only where their device is; ``RPD`` (ROCm's tracer) never: it is not installed.
An activity the machine cannot record is skipped, with the reason, as SGLang drops the
activities a platform has not; an empty set records nothing (the caller still writes its
lifecycle tracks).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable, Iterable

import torch

__all__ = ["StepProfiler", "ACTIVITIES", "DEFAULT_ACTIVITIES", "MARK", "resolve_activities"]

#: SGLang's ``activities`` (``ProfileReqInput``; bench_serving offers all but ``RPD``)
ACTIVITIES = ("CPU", "GPU", "CUDA_PROFILER", "XPU", "MEM", "RPD")
DEFAULT_ACTIVITIES = ("CPU", "GPU")          # SGLang's default
MARK = "actorserve.profile.sync"


def _xpu() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def resolve_activities(requested: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """What this machine records of `requested` (in its order, once each) and, for the rest,
    why not."""
    cuda = torch.cuda.is_available()
    why_not = {
        "CPU": None,
        "GPU": None if cuda else "no CUDA device on this machine",
        "XPU": None if _xpu() else "no XPU device on this machine",
        "CUDA_PROFILER": None if cuda else "no CUDA device on this machine (cudaProfilerStart)",
        "MEM": None if cuda else "no CUDA device on this machine: there is no CUDA memory snapshot",
        "RPD": "the ROCm rpd tracer is not installed",
    }
    recorded: list[str] = []
    skipped: dict[str, str] = {}
    for a in dict.fromkeys(requested):
        if a not in why_not:
            raise ValueError(f"activity {a!r} is not one of {list(ACTIVITIES)}")
        reason = why_not[a]
        if reason is None:
            recorded.append(a)
        else:
            skipped[a] = reason
    return recorded, skipped


class StepProfiler:
    """One profile: `start`, then `stop` (both on the step thread) -> trace events."""

    def __init__(self, *, activities: Iterable[str] = DEFAULT_ACTIVITIES, with_stack: bool | None = None,
                 record_shapes: bool | None = None, now_ns: Callable[[], int],
                 mem_path: str | None = None) -> None:
        """`activities`: what to record (`resolve_activities`' first answer); `mem_path`: where
        ``MEM``'s snapshot goes."""
        acts = set(activities)
        unknown = sorted(acts - {"CPU", "GPU", "XPU", "CUDA_PROFILER", "MEM"})
        if unknown:
            raise ValueError(f"activities {unknown} cannot be recorded here")
        kinds = [torch.profiler.ProfilerActivity.CPU] if "CPU" in acts else []
        if "GPU" in acts:
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        if "XPU" in acts:
            kinds.append(torch.profiler.ProfilerActivity.XPU)
        self._cudart = "CUDA_PROFILER" in acts
        self._mem_path = mem_path if "MEM" in acts else None
        self._now_ns = now_ns
        self._kinds, self._with_stack, self._record_shapes = kinds, bool(with_stack), bool(record_shapes)
        self._prof: Any = None           # made on the step thread: kineto binds it to its maker's thread
        self._mark_ns: int | None = None
        self.thread: int | None = None

    def start(self) -> None:
        """Start recording on this thread (the step thread)."""
        import threading
        self.thread = threading.get_ident()
        if self._mem_path is not None:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if self._cudart:
            torch.cuda.cudart().cudaProfilerStart()
        if not self._kinds:
            return
        self._prof = torch.profiler.profile(activities=self._kinds, with_stack=self._with_stack,
                                            record_shapes=self._record_shapes)
        self._prof.start()
        with torch.profiler.record_function(MARK + ".warm"):    # the first span pays a one-off cost
            pass
        before = self._now_ns()
        with torch.profiler.record_function(MARK):
            pass
        self._mark_ns = (before + self._now_ns()) // 2

    def stop(self) -> list[dict[str, Any]]:
        """Stop (on the thread that started it) and return torch's events, ``ts`` moved onto
        the ``now_ns`` clock (microseconds), process metadata dropped: the caller names the
        process its events go in."""
        import threading
        if self.thread is None or threading.get_ident() != self.thread:
            raise RuntimeError("the profiler must be stopped on the thread that started it")
        if self._cudart:
            torch.cuda.cudart().cudaProfilerStop()
        if self._mem_path is not None:
            torch.cuda.memory._dump_snapshot(self._mem_path)
            torch.cuda.memory._record_memory_history(enabled=None)
        if self._prof is None:          # nothing for torch's profiler to record
            return []
        self._prof.stop()
        fd, path = tempfile.mkstemp(suffix=".json", prefix="actorserve-torch-")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        finally:
            os.unlink(path)
        events = [e for e in doc.get("traceEvents", []) if isinstance(e, dict)]
        mark = next((e for e in events if e.get("name") == MARK and e.get("ph") == "X"), None)
        if mark is None or self._mark_ns is None:
            raise RuntimeError("the profiler's sync marker is missing from its trace")
        shift = self._mark_ns / 1000 - float(mark["ts"]) - float(mark.get("dur", 0)) / 2
        out = []
        for e in events:
            if e.get("ph") == "M" and e.get("name", "").startswith("process_"):
                continue
            if "ts" in e:
                e = {**e, "ts": round(float(e["ts"]) + shift, 3)}
            out.append(e)
        return out
