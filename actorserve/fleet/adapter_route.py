"""Which replica serves a request that names a LoRA adapter: cache-aware per adapter.

sglang-router's cache-aware policy keeps a radix tree of the *text* each replica has seen, so
two requests with the same prompt under two adapters (or one under the base) look alike to it,
while on a replica their KV never is (each replica's prefix cache is keyed by adapter). The
front therefore routes a request that names an adapter itself: by rendezvous hashing of
(adapter, the first `PREFIX_CHARS` characters of its prompt) over the ready replicas. Requests
of one adapter that share a prompt prefix land on one replica, where that adapter's KV for the
prefix is; other prefixes of the same adapter, and other adapters, spread over the fleet; a
replica that goes away moves only its own keys. Requests on the base model go through the
router as before.

A request names an adapter by (the fleet's replicas all serve the same ones: the front fans
loads and unloads out to each): SGLang's ``model: "<base>:<adapter>"``, ``/generate``'s
``lora_path`` (a name, or per-prompt names: the first one), or vLLM's ``model: "<adapter>"`` for
a name the front knows is an adapter (from ``--lora-paths`` at start-up and the loads and
unloads it fanned out).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Collection, Iterable, Sequence, TypeVar

PREFIX_CHARS = 256
R = TypeVar("R")


def adapter_of(doc: Any, known: Collection[str]) -> str | None:
    """The adapter a generation body names, or None for the base model."""
    if not isinstance(doc, dict):
        return None
    lora = doc.get("lora_path")
    if isinstance(lora, list):
        lora = next((x for x in lora if isinstance(x, str)), None)
    if isinstance(lora, str) and lora:
        return lora
    model = doc.get("model")
    if isinstance(model, str):
        if ":" in model:
            adapter = model.split(":", 1)[1]
            return adapter or None
        if model in known:
            return model
    return None


def prefix_of(doc: dict[str, Any]) -> str:
    """The start of the request's prompt, as text, whichever field holds it."""
    for key in ("messages", "prompt", "text", "input_ids", "input"):
        if key in doc:
            value = doc[key]
            text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"),
                                                                    default=str)
            return text[:PREFIX_CHARS]
    return ""


def pick(replicas: Sequence[R], adapter: str, prefix: str, name: Any = None) -> R | None:
    """The replica with the highest weight for (adapter, prefix) (rendezvous hashing); None when
    there is none. `name(replica)` gives its stable name (default ``replica.name``)."""
    best, best_w = None, b""
    for r in replicas:
        key = f"{adapter}\0{prefix}\0{name(r) if name else getattr(r, 'name')}".encode()
        w = hashlib.blake2b(key, digest_size=8).digest()
        if best is None or w > best_w:
            best, best_w = r, w
    return best


def adapters_in_argv(argv: Iterable[str]) -> set[str]:
    """Adapter names a replica's command line loads (``--lora-paths``/``--lora-modules``, read
    as `serve` reads them: ``name=path``, a bare path, SGLang's JSON)."""
    from ..http.edge.serve_cli import parse_lora_paths
    items: list[str] = []
    taking = False
    for arg in argv:
        if arg in ("--lora-paths", "--lora-modules"):
            taking = True
        elif arg.startswith("--"):
            taking = False
        elif taking:
            items.append(arg)
    try:
        return {name for name, _, _ in parse_lora_paths(items)}
    except ValueError:                  # the replica refuses it too; nothing to route by
        return set()
