"""Caps on oneDNN's two primitive caches, set before torch creates its first primitive.

oneDNN keeps every primitive it compiled, keyed by shape, in its own cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and PyTorch's ideep layer keeps them again in a per-thread
LRU cache (``LRU_CACHE_CAPACITY``); both hold 1024 entries by default, and each primitive
holds about 0.6 MB (JIT code and its buffers: measured from 16x16 to 49152x576 weights). A
server whose inputs take many shapes would keep up to ~600 MB of them for good. `engine.runners.dense`
hands oneDNN 24 row counts only, so the packed linears need 24 entries per weight shape; the
caps below bound whatever else makes primitives (an unpacked bf16 linear, a model with many
weight shapes) and so the memory the caches can hold at rest: `CAPACITY` entries, ~150 MB.

Both libraries read their variable once, when their cache is first made (oneDNN: at its first
primitive; ideep: in each thread at its first cached op), so `bound` must run before any torch
arithmetic: ``actorserve.engine`` calls it on import, and only ``actorserve.engine`` imports
torch. A value already in the environment is kept (set either one to tune it; 0 is not valid
for ``LRU_CACHE_CAPACITY``: ideep crashes). This module does not import torch.
"""

from __future__ import annotations

import os

CAPACITY = 256
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound(capacity: int = CAPACITY) -> dict[str, str]:
    """Set each cache's capacity to `capacity` unless the environment already sets it; returns
    the values in force."""
    for name in VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in VARIABLES}
