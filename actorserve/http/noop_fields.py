"""What sglang-router (0.3) writes into the bodies it forwards, and what it may leave out.

The router does not pass a client's body through: it parses it into its own typed request and
serialises that again, so every field of its type that has a default comes along, whether the
client sent it or not (chat: ``separate_reasoning: true``, ``return_hidden_states: false``,
...; ``/generate``: ``log_metrics: true``, ``background: false``, ...; rerank: ``rid: null``,
``user: null``). A body of ours refuses a field it would not honour, so each of these is
accepted here **only with the value that changes nothing** (the router's default) and only
where the body does not declare the field itself; any other value is still the 400 it was.

`drop_router_defaults` is called by every body model (`schemas._Body`) before validation.
"""

from __future__ import annotations

from typing import Any, Iterable

# field -> its no-op value, as sglang-router 0.3.2 serialises it (seen on the wire, see
# docs/fleet.md); `None` means "not set".
ROUTER_DEFAULTS: dict[str, object] = {
    "model": None, "rid": None, "user": None,
    "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
    "return_hidden_states": False, "skip_special_tokens": True, "no_stop_trim": False,
    "ignore_eos": False, "echo": False, "logprobs": False, "stream": False,
    "return_text_in_logprobs": False, "log_metrics": True, "background": False,
    "no_logs": False, "return_bytes": False, "return_entropy": False,
}


def drop_router_defaults(data: Any, declared: Iterable[str]) -> Any:
    """`data` without the router's no-op fields that the body (whose fields are `declared`)
    does not declare; a value other than the no-op one stays, to be refused as before."""
    if not isinstance(data, dict) or ROUTER_DEFAULTS.keys().isdisjoint(data):
        return data
    names = set(declared)
    return {k: v for k, v in data.items()
            if k in names or k not in ROUTER_DEFAULTS or not _same(v, ROUTER_DEFAULTS[k])}


def _same(value: object, default: object) -> bool:
    return value is None if default is None else type(value) is type(default) and value == default
