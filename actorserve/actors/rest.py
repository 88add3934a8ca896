"""A server at rest gives memory back: `RestTrimmer` hands the C heap's free pages to the OS once
the generation scheduler has been idle for a while.

What it fixes (measured by `benchmarks/soak.py`): the model steps, the tokenizers and the pooling
encoders run on worker threads, and glibc gives each such thread its own heap (an *arena*, up to
64 MB each). A step's intermediate tensors are allocated and freed there; the freed memory stays
in the arena, counted in the process's RSS, until something returns it. After a burst of mixed
traffic the arenas held 80-160 MB of free pages on the 2-core soak (tiny model). glibc's
``malloc_trim(0)`` returns the free pages of every arena (``madvise``), keeping what is live.

When: every ``interval`` seconds the trimmer looks at the scheduler; when no request is live
and no step runs, now and at its last look, and no step has completed between the two (so it
has been quiet for at least one interval), and something ran since the last trim, it trims
once, on the thread the model
steps run on (``ActorSystem.call_on_step_thread``), so the trim never competes with a step for
the heaps' locks and the event loop never blocks on it. A trim takes a few milliseconds.

The trimmer reads what the scheduler published (`idle`, `steps_done`: `Runtime.scheduler_probe`) and is not an actor:
it sends nothing, so it is not on the flight recorder and never changes what a re-execution
replays. Where the C library is not glibc there is nothing to call and the trimmer does nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


def _rss_kb() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            import os
            return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)
    except (OSError, ValueError, IndexError):
        return None


class RestTrimmer:
    def __init__(self, scheduler: Any, system: Any, *, interval: float = 2.0,
                 trim: Callable[[], bool] | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        from ..engine.weights.memory_release import malloc_trim
        self.scheduler, self.system, self.interval = scheduler, system, interval
        self.trim = trim or malloc_trim
        self._seen_steps = -1          # steps_done at the last look (-1: never looked)
        self._was_idle = False         # the scheduler was idle at the last look
        self._trimmed_at = scheduler.steps_done   # steps_done at the last trim (or the start)
        self.trims = 0                 # trims done
        self.freed_kb = 0              # RSS they gave back (from /proc/self/statm)
        self._task: asyncio.Task[None] | None = None

    def due(self) -> bool:
        """One look: True when the scheduler has been idle since the previous look and ran
        something since the last trim."""
        sched = self.scheduler
        steps, idle = sched.steps_done, sched.idle
        quiet = idle and self._was_idle and steps == self._seen_steps
        self._seen_steps, self._was_idle = steps, idle
        return quiet and steps != self._trimmed_at

    async def check(self) -> bool:
        """Look once and trim if due; returns whether it trimmed."""
        if not self.due():
            return False
        self._trimmed_at = self.scheduler.steps_done
        before = _rss_kb()
        await self.system.call_on_step_thread(self.trim)
        after = _rss_kb()
        self.trims += 1
        if before is not None and after is not None and before > after:
            self.freed_kb += before - after
            log.debug("at rest: gave back %d kB", before - after)
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception:                 # noqa: BLE001  a trim must never take the server down
                log.exception("trim at rest failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="rest-trimmer")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
