"""The Python heap of a long-lived server, settled once it has loaded (`settle`).

* ``gc.freeze()``: the model, tokenizer and libraries loaded at start live as long as the
  process, so the cyclic collector stops walking them (a full collection walked the whole loaded
  heap, and per-request cost grew with the count of requests served).
* A first-generation threshold of 20,000 allocations instead of Python's 700: each request and
  each token allocate a few short-lived objects (messages, outputs), and with 700 a young
  collection ran every few requests. Measured with `benchmarks/lifecycle_overhead.py
  --cpu-time` (2-core AMD EPYC, 2026-12-06, two runs each, alternated): 48.1/48.8 us per
  request against 92.6/55.7 with 700; the cost per further token did not change (10.2/10.3
  against 12.8/10.1). What the threshold holds back is at most that many young objects.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000


def settle() -> None:
    """Collect once, freeze what survived, and raise the young generation's threshold."""
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, g1, g2)
