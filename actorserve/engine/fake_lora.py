"""Adapter slots for the fake engine: `LoraSlots`' interface without a model.

A fake adapter is a folder holding an ``adapter_config.json`` (any JSON object); its digest is
the file's sha256, and under it the fake engine's next token is the base's shifted by a number
taken from that digest (`FakeLoraSlots.shift`), so a request served by the wrong adapter (or by
the base) shows in its tokens. ``gate`` (a `threading.Event`) holds every read until it is set:
a test can keep an adapter ``loading`` for as long as it needs; ``reads`` counts the folder
reads, so racing loads that share one read are seen to.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from pathlib import Path
from typing import Any

from .lora import CONFIG_FILE, LoraError, LoraFolderError, LoraInUse, LoraNotLoaded, LoraSlotsFull
from .sequence import LoraRef

_uids = itertools.count(1)


class FakeLoraSlots:
    def __init__(self, max_loaded: int, *, max_rank: int = 64, gate: threading.Event | None = None) -> None:
        self.max_loaded = max_loaded
        self.max_rank = max_rank
        self.gate = gate
        self.reads = 0
        self._slots: list[LoraRef | None] = [None] * max_loaded
        self._holds: dict[int, int] = {}
        self._lock = threading.Lock()

    def load(self, name: str, path: str | Path) -> LoraRef:
        if self.max_loaded == 0:
            raise LoraSlotsFull("LoRA adapters are off: this engine has no adapter slots (max_loaded_loras=0)")
        if self.gate is not None:
            self.gate.wait()
        self.reads += 1
        cfg = Path(path).expanduser() / CONFIG_FILE
        try:
            raw = cfg.read_bytes()
            if not isinstance(json.loads(raw), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise LoraFolderError(f"LoRA adapter {name!r} at {str(path)!r}: no readable {CONFIG_FILE} ({e})") from None
        with self._lock:
            if self.get_locked(name) is not None:
                raise LoraError(f"a LoRA adapter named {name!r} is already loaded")
            slot = next((i for i, r in enumerate(self._slots) if r is None), None)
            if slot is None:
                raise LoraSlotsFull(f"every LoRA slot is taken ({self.max_loaded} loaded: max_loaded_loras)")
            ref = LoraRef(name, slot, next(_uids), hashlib.sha256(raw).digest())
            self._slots[slot] = ref
            self._holds[ref.uid] = 0
            return ref

    def get_locked(self, name: str) -> LoraRef | None:
        return next((r for r in self._slots if r is not None and r.name == name), None)

    def _entry(self, name: str) -> LoraRef:
        ref = self.get_locked(name)
        if ref is None:
            raise LoraNotLoaded(f"no LoRA adapter named {name!r} is loaded")
        return ref

    def acquire(self, name: str) -> LoraRef:
        with self._lock:
            ref = self._entry(name)
            self._holds[ref.uid] += 1
            return ref

    def release(self, ref: LoraRef) -> None:
        with self._lock:
            if self._holds.get(ref.uid, 0) > 0:
                self._holds[ref.uid] -= 1

    def holders(self, name: str) -> int:
        with self._lock:
            return self._holds.get(self._entry(name).uid, 0)

    def unload(self, name: str) -> LoraRef:
        with self._lock:
            ref = self._entry(name)
            if self._holds.get(ref.uid, 0):
                raise LoraInUse(f"LoRA adapter {name!r} is used by {self._holds[ref.uid]} sequence(s)")
            self._slots[ref.slot] = None
            self._holds.pop(ref.uid, None)
            return ref

    def get(self, name: str) -> LoraRef | None:
        with self._lock:
            return self.get_locked(name)

    def loaded(self) -> list[LoraRef]:
        with self._lock:
            return [r for r in self._slots if r is not None]

    def adapter(self, name: str) -> Any:
        return None

    def resolve(self, ref: LoraRef) -> LoraRef:
        """The step's check: the sequence's adapter is still the load in its slot."""
        held = self._slots[ref.slot] if 0 <= ref.slot < len(self._slots) else None
        if held is None or held.uid != ref.uid:
            raise LoraNotLoaded(f"LoRA adapter {ref.name!r} (slot {ref.slot}) is no longer loaded")
        return held

    @staticmethod
    def shift(ref: LoraRef | None, vocab_size: int) -> int:
        """How far the fake engine moves a token under adapter `ref` (0: the base)."""
        return 0 if ref is None else 1 + int.from_bytes(ref.key[:4], "big") % (vocab_size - 2)
