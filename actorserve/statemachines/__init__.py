"""Lifecycle definitions (data) and the shared machines that drive them."""

from .core import Edge, IllegalTransition, Lifecycle, LifecycleError, Subject, UnknownEvent
from .lifecycles import (
    CONTROL, GENERATION, HEALTH, LIFECYCLES, PAUSE_MODES, PAUSED_MODE, POOLING, SCHEDULER, SERVER,
    SESSION, ControlState, GenState, HealthState, PoolState, SchedulerState, ServerState,
    SessionState, lifecycle,
)

__all__ = [
    "Edge", "IllegalTransition", "Lifecycle", "LifecycleError", "Subject", "UnknownEvent",
    "CONTROL", "GENERATION", "HEALTH", "LIFECYCLES", "PAUSE_MODES", "PAUSED_MODE", "POOLING",
    "SCHEDULER", "SERVER", "SESSION", "ControlState", "GenState", "HealthState", "PoolState",
    "SchedulerState", "ServerState", "SessionState", "lifecycle",
]
