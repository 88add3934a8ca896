"""Giving up the step in flight for a higher-priority arrival (priority policy).

The scheduler asks when a request arrives while the engine computes a step and its policy says
the request `preempts` that step's members (`engine.scheduling.priority`: it outranks some member and no
member outranks it; never a probe; first come, first served never asks). Asking is the recorded, drawn
``preempt_step`` transition (``stepping -> stepping``) and setting the engine's ``preempt``
flag; the engine checks it between layers and gives the step up by raising `StepPreempted`
(`engine.scheduling.base`). Such a step advances no member: the scheduler ends it as it is and plans
the next, which holds the arrival; the K/V the abandoned layers wrote past ``num_computed``
is written again by the step that recomputes those tokens. An ask that comes after the
engine's last layer boundary changes nothing (the step's answer says which happened, and
re-execution plays that back). An engine without the flag (one that never gives up) gets one
of this part's own, so the asks are the same whatever the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any


class StepPreemption:
    __slots__ = ("flag", "computing")

    def __init__(self, engine: Any) -> None:
        # the engine's `PreemptFlag` (an Event's set/clear/is_set), or an Event of its own
        self.flag: Any = getattr(engine, "preempt", None) or threading.Event()
        self.computing = False       # the engine holds a step (from its start to its answer)

    def started(self) -> None:
        """A step goes to the engine: an ask is for one step only."""
        self.flag.clear()
        self.computing = True

    def returned(self) -> None:
        self.computing = False

    def wanted(self, seq: Any, policy: Any, members: Iterable[Any]) -> bool:
        """Whether `seq`'s arrival should ask the step in flight (of `members`) to give up."""
        return self.computing and not self.flag.is_set() and policy.preempts(seq, members)

    def ask(self) -> None:
        self.flag.set()
