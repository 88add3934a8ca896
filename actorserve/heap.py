"""The heap of a long-lived server: the C heap's arenas capped before it starts
(`cap_malloc_arenas`), the Python heap settled once it has loaded (`settle`).

* ``gc.freeze()``: the model, tokenizer and libraries loaded at start live as long as the
  process, so the cyclic collector stops walking them (a full collection walked the whole loaded
  heap, and per-request cost grew with the count of requests served).
* A first-generation threshold of 20,000 allocations instead of Python's 700: each request and
  each token allocate a few short-lived objects (messages, outputs), and with 700 a young
  collection ran every few requests. Measured with `benchmarks/lifecycle_overhead.py
  --cpu-time` (2-core AMD EPYC, 2026-12-06, two runs each, alternated): 48.1/48.8 us per
  request against 92.6/55.7 with 700; the cost per further token did not change (10.2/10.3
  against 12.8/10.1). What the threshold holds back is at most that many young objects.
* glibc gives each thread that allocates an arena of its own, up to 8 a core: the event loop,
  the step thread, OpenMP's and the tokenizers' threads. Pages a thread's arena keeps for a few
  live objects stay in RSS, and which pages that is changed from one burst of traffic to the
  next: in the soak (`benchmarks/soak.py --smaps`) the threads' arenas held 104-127 MB at rest
  and moved by up to 1% of RSS between cycles. With two arenas the threads share, two soaks
  of three had the second arena at 12-15 MB after every cycle (the churn in the main heap); in
  the third it held the churn, 104-126 MB, moving again. So the cap makes the arenas fewer;
  it does not make the figure at rest steady (docs/engine.md, "Memory at rest").
  `MALLOC_ARENA_MAX` in the environment wins (glibc read it at start).
  `actorserve.cli` caps them first thing, before the imports that start threads: glibc keeps
  the arenas it has made, and threads started before the cap keep theirs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from typing import Any

GEN0_THRESHOLD = 20_000
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8          # mallopt's parameter number (malloc.h)


def glibc_function(name: str) -> Any:
    """The C library's function `name` when the C library is glibc, else None (musl and others
    have nothing to call); the caller sets its argtypes."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except (ValueError, OSError, AttributeError):
        return None
    return getattr(libc, name, None)


def cap_malloc_arenas(n: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas at `n` (``mallopt(M_ARENA_MAX, n)``), before the server starts
    its threads. False where it did nothing: not glibc, or ``MALLOC_ARENA_MAX`` already set."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_ARENA_MAX, n) == 1


def settle() -> None:
    """Collect once, freeze what survived, and raise the young generation's threshold."""
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, g1, g2)
