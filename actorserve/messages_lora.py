"""LoRA adapter messages (issue 30): the control plane's requests `LoadLoraAdapter` and
`UnloadLoraAdapter` [control actor], the scheduler's `LoadLora` / `UnloadLora` / `LoraWait` and
the answer of an adapter's off-loop read, `LoraRead` [scheduler]. Re-exported by `messages`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LoadLoraAdapter", "UnloadLoraAdapter", "LoadLora", "UnloadLora", "LoraRead", "LoraWait",
           "lora_refusal", "is_lora_refusal"]

_REFUSALS = ("is not loaded", "is being unloaded")


def lora_refusal(name: str, why: str) -> str:
    """Why a request naming adapter `name` cannot run (`why`: one of ``_REFUSALS``): the text a
    request fails with when its adapter went away between the route's check and the scheduler."""
    assert why in _REFUSALS, why
    return f"LoRA adapter {name!r} {why}"


def is_lora_refusal(error: str | None) -> bool:
    """Whether a request's error is `lora_refusal`'s: the client named an adapter that is gone (a
    404 on the OpenAI routes, as for an unknown model), not a server failure."""
    return bool(error) and error.startswith("LoRA adapter ") and error.endswith(_REFUSALS)


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
