"""The watchdog actor: marks the server `unhealthy` when the scheduler stops making progress.

Every ``interval`` seconds (a timer on the runtime's clock, so a `ManualClock` drives it in
tests) the watchdog asks the scheduler for its `Progress` — a message, not a read of the
scheduler's fields — and the answer comes back as a `WatchdogReport`. Progress means a model
step completed since the last report, or there is nothing that should progress (idle, or paused
with no step in flight). When work is pending and no step has completed for ``timeout`` seconds,
the watchdog sends the control actor ``ServerEvent("stall", reason)``: the server lifecycle goes
``unhealthy`` with the reason visible in ``/server_info`` and health answers 503. The first
report that shows progress again sends ``recover``. Whether each event was applied comes back as
a `WatchdogAck`, so the watchdog never fires ``recover`` for a stall the lifecycle refused
(e.g. while draining).

The resolution is the tick interval: a stall is seen between ``timeout`` and
``timeout + interval`` seconds after the last step.
"""

from __future__ import annotations

from typing import Any

from ..messages import Progress, ProgressQuery, ServerEvent, WatchdogAck, WatchdogReport, WatchdogTick
from .actor import Actor, handles
from .clock import Timer


class WatchdogActor(Actor):
    def __init__(self, scheduler: Actor, control: Actor, *, timeout: float,
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
        self.stalled = False          # a stall the server lifecycle accepted
        self.asking = False
        self.reason = ""
        self.stalls = 0
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
            if self.stalled:
                self._send("recover", "model steps resumed")
            return
        idle_for = now - self.last_progress
        if idle_for >= self.timeout and not self.stalled:
            self.reason = (f"watchdog: no scheduler step completed for {idle_for:.1f}s with "
                           f"{p.live} request(s) pending (timeout {self.timeout:g}s)")
            self._send("stall", self.reason)

    def _send(self, event: str, reason: str) -> None:
        if not self.control.alive:
            return
        if event == "stall":
            self.stalled = True        # optimistic: the ack corrects it if the lifecycle refused
        else:
            self.stalled = False
        assert self.system is not None
        self.system.pipe(self.control.ask(ServerEvent(event, reason)), self,
                         wrap=lambda res, err: WatchdogAck(event, err is None and bool(res.ok)))

    @handles(WatchdogAck)
    def _ack(self, msg: WatchdogAck) -> None:
        if msg.event == "stall":
            if msg.ok:
                self.stalls += 1
            else:
                self.stalled = False
        elif not msg.ok:
            self.stalled = False

    def status(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout, "interval_s": self.interval, "stalled": self.stalled,
                "stalls": self.stalls, "reason": self.reason if self.stalled else ""}
