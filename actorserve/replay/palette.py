"""One fixed colour per lifecycle state, for the replay timeline's lanes and legend.

Every state name of every lifecycle has its own colour, and no two names share one (the
timeline used to paint ``prefill``/``forward`` and ``detok``/``pool`` alike). A name that
several lifecycles use for the same thing (``queued``, ``done``, ``aborted``, ``failed``,
``stopped``, ``paused_*``) keeps one colour everywhere. Request states are saturated, the
long-lived actors' states (server, health, scheduler, session, control) lighter, terminal
states dark. A state added to a lifecycle later gets a grey until it is given a colour here;
`tests/test_replay_render.py` fails until then.
"""

from __future__ import annotations

from ..statemachines import LIFECYCLES

__all__ = ["STATE_COLORS", "UNKNOWN", "color_of", "legend"]

STATE_COLORS: dict[str, str] = {
    # generation and pooling requests
    "queued": "#94a3b8", "prefill": "#f59e0b", "decode": "#10b981", "detok": "#3b82f6",
    "paused": "#a855f7", "retracted": "#ec4899", "forward": "#84cc16", "pool": "#06b6d4",
    "done": "#15803d", "aborted": "#ea580c", "failed": "#dc2626",
    # control requests
    "received": "#fde68a", "asking": "#818cf8", "waiting_idle": "#fcd9bd", "working": "#bef264",
    "probing": "#38bdf8", "applied": "#86efac", "rejected": "#fca5a5",
    "waiting": "#a5b4fc",    # control's one waiting state before issue 31 (old recordings)
    # server run phase and health
    "starting": "#fef3c7", "serving": "#bbf7d0", "paused_abort": "#fdba74",
    "paused_retract": "#f9a8d4", "paused_in_place": "#d8b4fe", "draining": "#fcd34d",
    "stopped": "#475569", "healthy": "#5eead4", "unhealthy": "#b91c1c",
    # scheduler actors
    "idle": "#e2e8f0", "pending": "#bae6fd", "windowing": "#99f6e4", "stepping": "#0284c7",
    "pausing": "#e879f9", "isolating": "#1d4ed8", "isolating_pausing": "#c026d3",
    # sessions
    "open": "#a3e635", "closing": "#f0abfc", "closed": "#64748b",
    # stored responses (/v1/responses)
    "in_progress": "#fb923c", "completed": "#166534", "incomplete": "#ca8a04",
    "cancelled": "#9a3412", "deleted": "#1e293b", "evicted": "#7c3aed",
    # the served weights (serving and failed as above)
    "updating": "#0d9488",
    # memory per tag (release / resume; failed as above)
    "resident": "#c0d8e0", "releasing": "#f888b0", "released": "#c01038", "discarded": "#881038",
    "resuming": "#f87088",
    # LoRA adapters (failed as above)
    "loading": "#68e8f8", "ready": "#20c860", "unloading": "#f068b8", "unloaded": "#303858",
    # a fleet's replicas (starting, ready, stopped as above)
    "dead": "#78350f",
}
UNKNOWN = "#9ca3af"


def color_of(state: str) -> str:
    return STATE_COLORS.get(state, UNKNOWN)


def legend(kinds: list[str] | None = None) -> list[tuple[str, list[tuple[str, str]]]]:
    """(lifecycle, [(state, colour), ...]) for the given lifecycles (all of them by default),
    states in their Enum's order."""
    names = kinds if kinds is not None else list(LIFECYCLES)
    return [(k, [(s.name, color_of(s.name)) for s in LIFECYCLES[k].states])
            for k in names if k in LIFECYCLES]
