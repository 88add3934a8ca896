"""What crosses the runtime's boundary: handles, snapshots and the errors a caller can get.

Plain data only (a rid, an output stream, strings and numbers), so the HTTP layer never holds
an actor, and a replica could answer the same calls from another process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .stream import OutputStream


class DuplicateRequestId(ValueError):
    """A live request already has this rid."""


class Overloaded(RuntimeError):
    """Admission control refused a request: too many are waiting (HTTP 503 + Retry-After)."""

    def __init__(self, queued: int, limit: int, retry_after_s: int, unit: str = "") -> None:
        what = f"{queued} prompt tokens are queued" if unit == "tokens" else f"{queued} requests are waiting"
        super().__init__(f"server overloaded: {what} (limit {limit}); retry after {retry_after_s}s")
        self.unit = unit             # "" (requests, --max-queued-requests) | "tokens" (--max-queued-tokens)
        self.queued = queued
        self.limit = limit
        self.retry_after_s = retry_after_s


class RequestHandle(NamedTuple):
    """What a caller gets for a request: its id and its output stream (no actor). Immutable."""
    rid: str
    stream: OutputStream


@dataclass(frozen=True, slots=True)
class ServerSnapshot:
    """The server's regions as plain data, read at one moment."""
    state: str                  # the SERVER state: starting, serving, draining, stopped
    pause_mode: str | None      # the generation scheduler's pause (its paused_<mode>), in any server state
    reason: str                 # why the run phase last changed (drain: signal, shutdown)
    health: str                 # the HEALTH state: healthy | unhealthy
    health_reason: str
    stalls: int
    shed: int = 0               # requests refused by admission control so far

    @property
    def paused(self) -> bool:
        return self.pause_mode is not None

    @property
    def accepting(self) -> bool:
        """New requests are taken (they wait while paused)."""
        return self.state not in ("starting", "draining", "stopped")


__all__ = ["DuplicateRequestId", "Overloaded", "RequestHandle", "ServerSnapshot"]
