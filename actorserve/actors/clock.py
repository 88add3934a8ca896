"""Clocks: the runtime reads time and sets timers only through one of these.

`LoopClock` follows the event loop's monotonic clock. `ManualClock` moves only when a test
calls `advance()`, firing due timers in order, so timeouts, reaping and latency figures are
exact and no test sleeps.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Callable, Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    def now_ns(self) -> int: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer: ...


class LoopClock:
    """Real time: `time.monotonic` and the running loop's timers."""

    runs_by_itself = True       # a pending timer fires without anyone's help

    def now(self) -> float:
        return time.monotonic()

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, delay), fn)


class _ManualTimer:
    __slots__ = ("when", "fn", "cancelled", "label")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when = when
        self.fn = fn
        self.cancelled = False
        self.label = ""            # the actor system's label (re-execution fires timers by it)

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """Virtual time for tests and deterministic re-execution."""

    runs_by_itself = False      # timers wait for `advance`: for `quiesce` they are the outside world

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[tuple[float, int, _ManualTimer]] = []
        self._ids = itertools.count()

    def now(self) -> float:
        return self._now

    def now_ns(self) -> int:
        return int(round(self._now * 1e9))

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        timer = _ManualTimer(self._now + max(0.0, delay), fn)
        heapq.heappush(self._heap, (timer.when, next(self._ids), timer))
        return timer

    @property
    def pending_timers(self) -> int:
        return sum(1 for _, _, t in self._heap if not t.cancelled)

    def advance(self, seconds: float) -> int:
        """Move time forward, firing every timer that falls due, in order; return how many fired."""
        if seconds < 0:
            raise ValueError("time does not run backwards")
        target = self._now + seconds
        fired = 0
        while self._heap and self._heap[0][0] <= target:
            when, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            self._now = when
            timer.fn()
            fired += 1
        self._now = target
        return fired
