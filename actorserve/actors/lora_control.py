"""LoRA adapters, the control actor's part (`LoraControl`, a base of `ControlActor`).

`/load_lora_adapter`, `/unload_lora_adapter` (SGLang's), `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter` (vLLM's) and ``--lora-paths`` at start-up are control records
(``load_lora_adapter``, ``unload_lora_adapter``) like any control request: ``received ->
asking`` while the scheduler loads (a read off the loop) or waits for an adapter's holders,
then ``applied | rejected`` with its answer. The adapter's own lifecycle (LORA) and the holds
are the scheduler's (`scheduler_lora`). An unload with ``abort`` then aborts every request
holding the adapter through the ordinary abort (its own record, reaching the scheduler right
after the unload: the adapter is ``unloading`` by then, so no new holder slips in), and the
unload completes when their steps are over.
"""

from __future__ import annotations

from typing import Any

from ..messages import AbortRequest, ControlResult, LoadLora, LoadLoraAdapter, UnloadLora, UnloadLoraAdapter
from ..statemachines import ServerState
from .actor import handles
from .weights_distributed import WeightsGroupControl


class LoraControl(WeightsGroupControl):
    # and ControlActor's `_new`, `_end`, `_ask`, `_abort`, `scheduler`, `server`

    @handles(LoadLoraAdapter)
    def _load_lora_adapter(self, msg: LoadLoraAdapter) -> Any:
        rec = self._new("load_lora_adapter")
        if self.server.state in (ServerState.draining, ServerState.stopped):
            return self._end(rec, ControlResult(False, f"cannot load a LoRA adapter while the server is "
                                                       f"{self.server.state.name}", {"status": 503}))
        self._ask(rec, self.scheduler, LoadLora(msg.lora_name, msg.lora_path, msg.pinned))
        return rec.reply

    @handles(UnloadLoraAdapter)
    def _unload_lora_adapter(self, msg: UnloadLoraAdapter) -> Any:
        rec = self._new("unload_lora_adapter")
        self._ask(rec, self.scheduler, UnloadLora(msg.lora_name))
        if msg.abort:        # its own abort record, after the unload: no holder is admitted between
            self._abort(AbortRequest(reason=f"LoRA adapter {msg.lora_name!r} unloaded", lora=msg.lora_name))
        return rec.reply
