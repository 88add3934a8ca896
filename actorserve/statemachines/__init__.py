"""Lifecycle definitions (data) and the shared machines that drive them."""

from .core import Edge, IllegalTransition, Lifecycle, LifecycleError, Subject, UnknownEvent
from .memory import MEMORY, MEMORY_TAGS, MemoryState
from .replica import REPLICA, ReplicaState
from .lifecycles import (
    CONTROL, GENERATION, HEALTH, LIFECYCLES, LORA, LoraState, PAUSE_MODES, PAUSED_MODE, POOLING, SCHEDULER, SERVER,
    STEP_IN_FLIGHT, RESPONSE, SESSION, ControlState, GenState, HealthState, PoolState, ResponseState, SchedulerState,
    ServerState, SessionState, WEIGHTS, WeightsState, lifecycle,
)

__all__ = [
    "Edge", "IllegalTransition", "Lifecycle", "LifecycleError", "Subject", "UnknownEvent",
    "CONTROL", "GENERATION", "HEALTH", "LIFECYCLES", "LORA", "LoraState", "PAUSE_MODES", "PAUSED_MODE", "POOLING",
    "STEP_IN_FLIGHT", "RESPONSE", "SCHEDULER", "SERVER", "SESSION", "ResponseState", "ControlState", "GenState",
    "HealthState", "PoolState",
    "SchedulerState", "ServerState", "SessionState", "WEIGHTS", "WeightsState", "lifecycle",
    "MEMORY", "MEMORY_TAGS", "MemoryState", "REPLICA", "ReplicaState",
]
