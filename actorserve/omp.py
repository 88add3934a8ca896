"""OpenMP settings every actorserve process takes before torch loads (the environment wins).

``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep instead of spinning. With spinning
threads on a busy 2-core box decode fell from 18 to 1 tok/s: the event loop and the HTTP
server starved.

No spin (``GOMP_SPINCOUNT`` left unset, so 0 under PASSIVE), although the engine alone is
faster with a short one. With ``GOMP_SPINCOUNT=10000`` the threads stay awake between the
hundreds of small parallel regions of one step. Measured on 2 cores:
- the engine alone (`benchmarks/quant_decode.py`): bf16 decode at one sequence went from 38.6 to
  30.1 ms a step, and q4 from 17.6 to 13.1;
- the server (`benchmarks/peers.py --levels 1:8 --omp-spin 0|10000`): q4 at one stream fell
  from 50.9 to 34.6 tok/s. The spinning thread takes the core that the event loop, the output
  stage and the SSE writer need between the steps.

So it is not a default. Set it by hand for offline use of the engine.
"""

from __future__ import annotations

import os

OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_defaults() -> None:
    """Set the OMP_ENV values that the environment does not already set (before torch loads)."""
    for key, value in OMP_ENV.items():
        os.environ.setdefault(key, value)
