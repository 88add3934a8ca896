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
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable, Iterable

import torch

__all__ = ["StepProfiler", "ACTIVITIES", "MARK"]

#: SGLang's ``activities`` this profiler records (``GPU`` only where CUDA is there, as SGLang
#: drops an activity the platform has not); ``MEM``, ``RPD``, ``CUDA_PROFILER`` are not offered
ACTIVITIES = ("CPU", "GPU")
MARK = "actorserve.profile.sync"


class StepProfiler:
    """One profile: `start`, then `stop` (both on the step thread) -> trace events."""

    def __init__(self, *, activities: Iterable[str] = ACTIVITIES, with_stack: bool | None = None,
                 record_shapes: bool | None = None, now_ns: Callable[[], int]) -> None:
        unknown = sorted(set(activities) - set(ACTIVITIES))
        if unknown:
            raise ValueError(f"activities {unknown} are not supported; choose from {list(ACTIVITIES)}")
        kinds = [torch.profiler.ProfilerActivity.CPU] if "CPU" in activities else []
        if "GPU" in activities and torch.cuda.is_available():
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        if not kinds:
            raise ValueError("activities must name CPU (or GPU on a CUDA machine)")
        self._now_ns = now_ns
        self._kinds, self._with_stack, self._record_shapes = kinds, bool(with_stack), bool(record_shapes)
        self._prof: Any = None           # made on the step thread: kineto binds it to its maker's thread
        self._mark_ns: int | None = None
        self.thread: int | None = None

    def start(self) -> None:
        """Start recording on this thread (the step thread)."""
        import threading
        self.thread = threading.get_ident()
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
        if self._prof is None or threading.get_ident() != self.thread:
            raise RuntimeError("the profiler must be stopped on the thread that started it")
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
