"""LoRA adapters in a re-execution (`reexec`): each recorded load reloaded from its recorded path.

An adapter's read comes back from a worker thread (``lora_read`` on the recording, an input at
the scheduler). Re-execution holds each read until its recorded point, as it holds a model step,
then reads the folder again at its recorded path into the stand-in engine's slots
(`engine.runners.fake_lora.FakeLoraSlots`: the steps' tokens are the recording's, what is checked is
that today's actors take the same path: the holds, the parked requests, the unload's wait). A
read that failed in the recording fails again with its recorded error. One that succeeded but
whose folder can no longer be read cannot be re-executed: `RecordingError` says which adapter,
which folder, and why.
"""

from __future__ import annotations

from typing import Any

from .recorder import Event

OPS = ("LoadLoraAdapter", "UnloadLoraAdapter")


class LoraPlayback:
    def __init__(self, driver: Any, setup: dict[str, Any], error: type[Exception]) -> None:
        self.error = error
        self.reads: dict[str, tuple[Any, Any, str, str, Any]] = {}   # lora rid -> held read
        self.notes: list[str] = []
        lora = setup.get("lora")
        if lora is None:
            return
        from ..engine.runners.fake_lora import FakeLoraSlots
        driver.engine.lora = FakeLoraSlots(int(lora["max_loaded"]), max_rank=int(lora.get("max_rank", 64)))
        driver.rt.take_over(lora_reads=self._hold)

    def _hold(self, target: Any, rid: str, read: Any, name: str, path: str, *, wrap: Any) -> None:
        self.reads[rid] = (target, read, name, path, wrap)

    def feed(self, e: Event) -> bool:
        """A recorded ``lora_read``: run the held read now (False: nothing was held for it)."""
        held = self.reads.pop(e.rid or "", None)
        if held is None:
            return False
        target, read, name, path, wrap = held
        d = e.data or {}
        if not d.get("ok"):
            msg = wrap(None, RuntimeError(f"recorded failure: {d.get('error')}"))
        else:
            try:
                res = read()
            except Exception as exc:
                raise self.error(f"seq {e.seq}: LoRA adapter {name!r} cannot be reloaded from its recorded "
                                 f"folder {path!r} ({exc}); re-execution needs the adapter's folder "
                                 "where it was") from None
            self.notes.append(f"LoRA adapter {name!r}: reloaded from {path}")
            msg = wrap(res, None)
        if target.alive:
            target.tell(msg)
        return True
