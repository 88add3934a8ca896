"""The watchdog actor: marks the server `unhealthy` when the scheduler stops making progress.

Every ``interval`` seconds (a timer on the runtime's clock, so a `ManualClock` drives it in
tests) the watchdog asks the scheduler for its `Progress` — a message, not a read of the
scheduler's fields — and the answer comes back as a `WatchdogReport`. Progress means a model
step completed since the last report, or there is nothing that should progress (idle, or paused
with no step in flight). After each report the watchdog tells the control actor its verdict
(`HealthVerdict`): not ok when work is pending and no step has completed for ``timeout``
seconds. The control actor owns the HEALTH lifecycle and moves it (``stall`` /
``recover``) only when the verdict differs from it, so the watchdog keeps no copy of the
server's health: the reason is visible in ``/server_info`` and health answers 503 while
``unhealthy``.

The resolution is the tick interval: a stall is seen between ``timeout`` and
``timeout + interval`` seconds after the last step.
"""

from __future__ import annotations

from typing import Any

from ..messages import HealthVerdict, Progress, ProgressQuery, WatchdogReport, WatchdogTick
from .actor import Actor, ActorRef, handles
from .clock import Timer


class WatchdogActor(Actor):
    def __init__(self, scheduler: ActorRef, control: ActorRef, *, timeout: float,
                 interval: float | None = None, name: str = "watchdog") -> None:
        super().__init__(name)
        if timeout <= 0:
            raise ValueError(f"watchdog timeout must be > 0, got {timeout}")
        self.scheduler = scheduler
        self.control = control
        self.timeout = float(timeout)
        self.interval = float(interval if interval is not None else max(0.01, timeout / 4))
        self.last_steps = -1
        self.last_progress = 0.0      # clock time of the last report that showed progress
        self.asking = False
        self._timer: Timer | None = None

    # -- timer ---------------------------------------------------------------------------------
    def on_start(self) -> None:
        assert self.system is not None
        self.last_progress = self.system.clock.now()
        self._arm()

    def _arm(self) -> None:
        assert self.system is not None
        self._timer = self.system.call_later(self.interval, self._fire_tick, f"{self.name}:tick")

    def _fire_tick(self) -> None:
        self._timer = None
        if self.alive:
            self.tell(WatchdogTick())

    def on_stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- handlers ------------------------------------------------------------------------------
    @handles(WatchdogTick)
    def _tick(self, msg: WatchdogTick) -> None:
        self._arm()
        if self.asking or not self.scheduler.alive:
            return
        self.asking = True
        assert self.system is not None
        self.system.pipe(self.scheduler.ask(ProgressQuery()), self,
                         wrap=lambda res, err: WatchdogReport(res, err))

    @handles(WatchdogReport)
    def _report(self, msg: WatchdogReport) -> None:
        self.asking = False
        assert self.system is not None
        now = self.system.clock.now()
        p: Progress | None = msg.progress
        if p is None:
            return
        progressed = p.steps_done != self.last_steps or not p.pending
        self.last_steps = p.steps_done
        if progressed:
            self.last_progress = now
        idle_for = now - self.last_progress
        if idle_for < self.timeout:
            verdict = HealthVerdict(True, "model steps are progressing")
        else:
            verdict = HealthVerdict(False, f"watchdog: no scheduler step completed for {idle_for:.1f}s "
                                           f"with {p.live} request(s) pending (timeout {self.timeout:g}s)")
        if self.control.alive:
            self.control.tell(verdict)

    def status(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout, "interval_s": self.interval}
