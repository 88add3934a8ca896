"""The q4/q8 kernels' library (`csrc/decode_step.c`, built by `cbuild`) and their step pool
(`csrc/step_pool.c`), for `quant` and the fused step."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

import torch

from . import cbuild

# the library with the kernels: csrc/decode_step.c, which includes qgemv.c and glue.c (one
# library, so the kernels, the glue and the fused step share one step pool)
LIBRARY = "decode_step"


class _Lib:
    def __init__(self, path: str | None = None) -> None:
        lib = ctypes.CDLL(path or str(cbuild.build(LIBRARY)))
        self.cdll = lib
        p, i = ctypes.c_void_p, ctypes.c_int
        self.qgemv = lib.qgemv
        self.qgemv.argtypes = [i, p, i, i, i, p, p, p, i, p, p, i, i]
        self.qgemv.restype = ctypes.c_int
        self.bf16_path = lib.qgemv_bf16_path
        self.bf16_path.argtypes = [i]
        self.bf16_path.restype = ctypes.c_int
        # rows ahead a product of one or two rows prefetches its weights (rows >= 0 sets, -1 asks)
        self.prefetch = lib.qgemv_prefetch
        self.prefetch.argtypes = [i]
        self.prefetch.restype = ctypes.c_int
        self.act8_simd = bool(lib.qgemv_act8_simd())
        self.b16 = bool(lib.qgemv_b16())     # q4b16.c's kernel is built (avx512_bf16)
        # bytes ahead a product of 1-8 rows asks for its superblocks (>= 0 sets, -1 asks; -1
        # where q4b16.c is not built)
        self.b16_prefetch = lib.qgemv_b16_prefetch
        self.b16_prefetch.argtypes = [i]
        self.b16_prefetch.restype = ctypes.c_int
        self.qpool_active = lib.qpool_active
        self.qpool_active.argtypes = [i, i]
        self.qpool_active.restype = ctypes.c_int


class StepPool:
    """The kernels' step pool (``csrc/step_pool.c``): ``with pool:`` around a decode step of at
    most the runner's `kernel_rows` rows, and every quantized product of the step is split over `workers`
    threads besides the caller, which spin between the step's products instead of sleeping
    (so small products are worth splitting too) and sleep again when the step ends. The
    results are the same bits as without it."""

    def __init__(self, workers: int) -> None:
        self.lib = _Lib()
        self.workers = max(0, int(workers))

    def __enter__(self) -> StepPool:
        self.lib.qpool_active(1, self.workers)
        return self

    def __exit__(self, *exc: object) -> None:
        self.lib.qpool_active(0, 0)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside an active step: the workers sleep (for a parallel region of OpenMP's, whose
        thread needs the core a spinning worker holds), then spin again."""
        self.lib.qpool_active(0, 0)
        try:
            yield
        finally:
            self.lib.qpool_active(1, self.workers)


def step_pool(model: Any) -> StepPool | None:
    """A step pool for a quantized `model` on more than one thread, else None."""
    if getattr(model, "actorserve_quant", None) is None or torch.get_num_threads() < 2:
        return None
    return StepPool(torch.get_num_threads() - 1)
