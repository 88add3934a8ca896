"""LoRA adapter messages (issue 30): the control plane's requests `LoadLoraAdapter` and
`UnloadLoraAdapter` [control actor], the scheduler's `LoadLora` / `UnloadLora` / `LoraWait` and
the answer of an adapter's off-loop read, `LoraRead` [scheduler]. Re-exported by `messages`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LoadLoraAdapter", "UnloadLoraAdapter", "LoadLora", "UnloadLora", "LoraRead", "LoraWait"]


@dataclass(frozen=True, slots=True)
class LoadLoraAdapter:
    """Load the PEFT folder `lora_path` as adapter `lora_name` (`/load_lora_adapter`,
    `/v1/load_lora_adapter`, ``--lora-paths``); a pinned one is never evicted."""
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class UnloadLoraAdapter:
    """Unload adapter `lora_name` once the requests holding it have ended; with `abort`, abort
    them first (through the ordinary abort)."""
    lora_name: str
    abort: bool = False


@dataclass(frozen=True, slots=True)
class LoadLora:
    """control actor -> scheduler: start (or join) the adapter's load."""
    name: str
    path: str
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class UnloadLora:
    """control actor -> scheduler: unload when no request holds it."""
    name: str


@dataclass(frozen=True, slots=True)
class LoraWait:
    """runtime -> scheduler: answered (the adapter's state name, or None: unknown) once the
    adapter named is no longer loading."""
    name: str


@dataclass(frozen=True, slots=True)
class LoraRead:
    """The adapter's read (off the loop) came back: its `LoraRef`, or the error."""
    rid: str                  # the adapter's lifecycle instance
    ref: Any = None
    error: BaseException | None = None
    read_s: float = 0.0
