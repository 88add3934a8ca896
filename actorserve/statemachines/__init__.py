"""Lifecycle definitions (data) and the shared machines that drive them."""

from .core import Edge, IllegalTransition, Lifecycle, LifecycleError, Subject, UnknownEvent
from .lifecycles import (
    CONTROL, GENERATION, LIFECYCLES, POOLING, SERVER, SESSION,
    ControlState, GenState, PoolState, ServerState, SessionState, lifecycle,
)

__all__ = [
    "Edge", "IllegalTransition", "Lifecycle", "LifecycleError", "Subject", "UnknownEvent",
    "CONTROL", "GENERATION", "LIFECYCLES", "POOLING", "SERVER", "SESSION",
    "ControlState", "GenState", "PoolState", "ServerState", "SessionState", "lifecycle",
]
