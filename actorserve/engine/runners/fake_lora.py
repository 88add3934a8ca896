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
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from ..weights.lora import CONFIG_FILE, LoraFolderError, LoraSlots
from ..scheduling.sequence import LoraRef


@dataclass(frozen=True, slots=True)
class FakeAdapter:
    """What a fake slot holds: the digest the fake engine shifts its tokens by."""
    key: bytes


class FakeLoraSlots(LoraSlots):
    """`LoraSlots` (its slots, holds and checks) with the folder read replaced: a fake adapter
    is any JSON object in ``adapter_config.json``."""

    def __init__(self, max_loaded: int, *, max_rank: int = 64, gate: threading.Event | None = None) -> None:
        super().__init__([], max_loaded=max_loaded, max_rank=max_rank)
        self.gate = gate
        self.reads = 0

    def _read(self, name: str, path: str | Path) -> FakeAdapter:
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
        return FakeAdapter(hashlib.sha256(raw).digest())

    @staticmethod
    def shift(ref: LoraRef | FakeAdapter | None, vocab_size: int) -> int:
        """How far the fake engine moves a token under adapter `ref` (0: the base)."""
        return 0 if ref is None else 1 + int.from_bytes(ref.key[:4], "big") % (vocab_size - 2)
