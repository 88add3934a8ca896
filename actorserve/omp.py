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

Measured again on 2026-12-06 (2-core AMD EPYC, q4 up to 8 rows, packed oneDNN for wider steps):
- a 32-row decode step in the engine alone: 89-92 ms without a spin, 57-60 ms with
  ``GOMP_SPINCOUNT=100000``. A third of the wide step is waking OpenMP threads for each of its
  ~250 parallel regions.
- the server (`benchmarks/peers.py --levels 1:6,8:24,32:64 --max-tokens 128 --ignore-eos
  --omp-spin 0|100000`): 126.3 / 236.7 / 371.6 tok/s at 1 / 8 / 32 streams without the spin,
  124.6 / 222.9 / 377.1 with it. In the server the event loop takes one of the two cores in
  every step, and a parallel region then waits for the thread that lost it.

Still no default spin. Taking that third back in the server needs either fewer, larger parallel
regions in a wide step, or the HTTP side in another process.
"""

from __future__ import annotations

import os

OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_defaults() -> None:
    """Set the OMP_ENV values that the environment does not already set (before torch loads)."""
    for key, value in OMP_ENV.items():
        os.environ.setdefault(key, value)
