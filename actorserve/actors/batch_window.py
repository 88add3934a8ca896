"""The batching window: one of the parts a scheduler is built from (`SchedulerActor(window=...)`).

A scheduler whose next step would be part-empty may wait `wait_s` for more arrivals before it
steps (the SCHEDULER lifecycle's ``pending -> windowing -> pending``; throughput of small
encoder forwards). The window owns its timer and nothing else: the scheduler asks `wanted`,
`open`s it (then fires ``window``) and, when it ends early (a pause, the last request left),
`cancel`s it (then fires ``window_closed``). When the timer fires, the scheduler is told
`BatchWindowClosed`.

On a clock that runs by itself the open timer counts as outstanding work for `quiesce`; on a
manual clock it waits for the clock to be moved, like any timer.
"""

from __future__ import annotations

from typing import Any

from ..messages import BatchWindowClosed


class BatchWindow:
    __slots__ = ("wait_s", "_timer", "_counted")

    def __init__(self, wait_s: float = 0.0) -> None:
        self.wait_s = wait_s        # 0: no window, a scheduler steps as soon as it can
        self._timer: Any = None
        self._counted = False       # the open timer counts for `quiesce`

    def wanted(self, *, probes: int, waiting: int, running: int, max_seqs: int) -> bool:
        """Wait for more? Only with a window, requests waiting, none running, room in the batch
        and no probe (a probe never waits)."""
        return bool(self.wait_s) and not probes and 0 < waiting < max_seqs and not running

    def open(self, owner: Any) -> None:
        sysm = owner.system
        assert sysm is not None
        counted = self._counted = getattr(sysm.clock, "runs_by_itself", True)
        if counted:
            sysm._inc()

        def close() -> None:
            self._timer = None          # fired: nothing to cancel any more
            if owner.alive:
                owner.tell(BatchWindowClosed())
            if counted:
                sysm._dec()

        self._timer = sysm.call_later(self.wait_s, close, f"{owner.name}:batch_window")

    def cancel(self, owner: Any) -> None:
        """Cancel the open timer, if any (the owner fires ``window_closed``)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            if self._counted:
                owner.system._dec()
