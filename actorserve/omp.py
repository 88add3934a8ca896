"""OpenMP settings every actorserve process takes before torch loads (the environment wins).

``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep instead of spinning. With spinning
threads on a busy 2-core box decode fell from 18 to 1 tok/s: the event loop and the HTTP
server starved.

``GOMP_SPINCOUNT=30000``: a short spin, after a history. Until 2026-12-06 there was no spin
(``GOMP_SPINCOUNT`` left unset, so 0 under PASSIVE), although the engine alone is faster with a
short one. With ``GOMP_SPINCOUNT=10000`` the threads stay awake between the
hundreds of small parallel regions of one step. Measured on 2 cores:
- the engine alone (`benchmarks/quant_decode.py`): bf16 decode at one sequence went from 38.6 to
  30.1 ms a step, and q4 from 17.6 to 13.1;
- the server (`benchmarks/peers.py --levels 1:8 --omp-spin 0|10000`): q4 at one stream fell
  from 50.9 to 34.6 tok/s. The spinning thread takes the core that the event loop, the output
  stage and the SSE writer need between the steps.

So it was not a default then.

Measured again on 2026-12-06 (2-core AMD EPYC, q4 up to 8 rows, packed oneDNN for wider steps):
- a 32-row decode step in the engine alone: 89-92 ms without a spin, 57-60 ms with
  ``GOMP_SPINCOUNT=100000``. A third of the wide step is waking OpenMP threads for each of its
  ~250 parallel regions.
- the server (`benchmarks/peers.py --levels 1:6,8:24,32:64 --max-tokens 128 --ignore-eos
  --omp-spin 0|100000`): 126.3 / 236.7 / 371.6 tok/s at 1 / 8 / 32 streams without the spin,
  124.6 / 222.9 / 377.1 with it. In the server the event loop takes one of the two cores in
  every step, and a parallel region then waits for the thread that lost it.

Why the server did not gain: libgomp counts the threads of every team, and with more than
there are cores it cuts the spin a thousandfold. The model is loaded on the main thread, whose
team stays, and the steps run on the step thread with a team of their own. A loop of small
parallel ops on a worker thread, with ``GOMP_SPINCOUNT=100000``, takes:
- 17 us an op while the worker is the only OpenMP thread;
- 57 us once the main thread has a team too, the same as with no spin.

So `serve` now gives the main thread's threads back after loading (`release_idle_threads`).
With that, in the same server (`peers.py --omp-spin 0|30000 --passes 2`, tok/s at 1 / 8 / 32
streams):
- no spin: 133 / 226 / 351;
- ``GOMP_SPINCOUNT=30000``: 105 / 199 / 456.

The narrow steps lost because their step pool's worker and the spinning OpenMP thread took turns
on the core. So a step of at most 8 rows now runs torch on one thread (`runner._torch_threads`:
its products are the pool's, its attention gets the runner's thread count explicitly), and the
OpenMP team serves only wide steps and prefill. Then:
- no spin: 121 / 226 / 358;
- ``GOMP_SPINCOUNT=30000``: 119 / 224 / 421, and TTFT p50 53 / 224 / 441 ms against
  72 / 294 / 564.

Hence the default spin of 30000, roughly a millisecond of spinning after a parallel region
before the thread sleeps. The environment still wins: ``GOMP_SPINCOUNT=0`` restores the old
behaviour.
"""

from __future__ import annotations

import os

OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}


def apply_defaults() -> None:
    """Set the OMP_ENV values that the environment does not already set (before torch loads)."""
    for key, value in OMP_ENV.items():
        os.environ.setdefault(key, value)


def release_idle_threads() -> bool:
    """Give back the OpenMP threads this thread's parallel regions made (``omp_pause_resource_all``
    on the libgomp that torch loaded), so that the step thread's team is the process's only one.
    libgomp counts every team's threads, and when there are more than cores it cuts
    ``GOMP_SPINCOUNT`` a thousandfold: after a model load on the main thread the step thread's
    threads slept between parallel regions whatever the spin. Call it on the main thread after
    loading, before serving. True when libgomp did it."""
    import ctypes
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libgomp" in line and "/" in line})
    except OSError:
        return False
    for path in paths:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn(1) == 0           # omp_pause_soft: the threads go, the settings stay
    return False
