"""Memory release messages (issue 28): the control plane's `ReleaseMemory` and `ResumeMemory`
[control], the scheduler's `FreeMemory` and `RestoreMemory` [scheduler] and its own
`MemoryApplied` (the step thread's outcome)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ReleaseMemory", "ResumeMemory", "FreeMemory", "RestoreMemory", "MemoryApplied"]


@dataclass(frozen=True, slots=True)
class ReleaseMemory:
    """Give the memory of `tags` back to the OS (`/release_memory_occupation`, vLLM's `/sleep`);
    no tags: all of them. ``level`` 2 (vLLM's) discards the weights instead of keeping them."""
    tags: tuple[str, ...] | None = None
    level: int = 1


@dataclass(frozen=True, slots=True)
class ResumeMemory:
    """Bring the memory of `tags` back (`/resume_memory_occupation`, vLLM's `/wake_up`); no tags:
    every released one. `model_path`: where discarded (level-2) weights are reloaded from."""
    tags: tuple[str, ...] | None = None
    model_path: str | None = None


@dataclass(frozen=True, slots=True)
class FreeMemory:
    """The scheduler's part of a release: refused (busy) while a request holds KV or a step runs."""
    tags: tuple[str, ...]
    level: int = 1


@dataclass(frozen=True, slots=True)
class RestoreMemory:
    """The scheduler's part of a resume."""
    tags: tuple[str, ...]
    model_path: str | None = None


@dataclass(frozen=True, slots=True)
class MemoryApplied:
    """The scheduler's own: a release or resume ran on the step thread; per tag
    ``{"ok": bool, "bytes": int, "error": str | None}``."""
    op: str
    outcome: Any
    error: BaseException | None = None
