"""Test-only access to a runtime's actor objects.

The runtime hands out refs and published data only (`tests/test_boundary.py` pins that no
attribute of it is an actor); a test that inspects or rigs an actor's insides reaches it here,
through the ref the runtime holds."""

from __future__ import annotations

from typing import Any

from actorserve.actors.request import RequestActor

_REFS = {"scheduler": "sched_ref", "control": "control_ref", "sessions": "sessions_ref",
         "responses": "responses_ref", "output": "stage_ref", "watchdog": "watchdog_ref"}


def actor_of(rt: Any, name: str) -> Any:
    """The actor object behind one of the runtime's refs (``scheduler``, ``control``,
    ``sessions``, ``responses``, ``output``, ``watchdog``, or ``pool:<target>``)."""
    ref = rt.pool_refs[name[5:]] if name.startswith("pool:") else getattr(rt, _REFS[name])
    return ref._actor


def live_actors(rt: Any) -> list[Any]:
    """The request actors still running."""
    return [a for a in rt.system.actors.values() if isinstance(a, RequestActor)]
