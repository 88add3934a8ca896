"""OpenMP settings every actorserve process takes before torch loads.

``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep instead of spinning; with spinning
threads on a busy 2-core box decode fell from 18 to 1 tok/s (the event loop and the HTTP
server starved).

``GOMP_SPINCOUNT=10000``: but a thread that sleeps at once after each parallel region has to
be woken for the next one, tens of microseconds each, and a decode step is hundreds of small
regions. A short, bounded spin (10,000 iterations, tens of microseconds) keeps the threads
awake between the regions of one step and lets them sleep between steps. Measured on 2 cores
(benchmarks/quant_decode.py, one run each): bf16 decode at one sequence 38.6 -> 30.1 ms a step,
at eight 46.9 -> 36.4; q4 at one 17.6 -> 13.1. Both are defaults: the environment wins.
"""

from __future__ import annotations

import os

OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def apply_defaults() -> None:
    """Set the OMP_ENV values that the environment does not already set (before torch loads)."""
    for key, value in OMP_ENV.items():
        os.environ.setdefault(key, value)
