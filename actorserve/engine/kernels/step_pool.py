"""The quantized kernels' step pool (``csrc/step_pool.c``), as `quant` and the runner use it:
activated around a narrow decode step, paused around an OpenMP region inside one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class StepPool:
    """The kernels' step pool (``csrc/step_pool.c``): ``with pool:`` around a decode step of at
    most the runner's `kernel_rows` rows, and every quantized product of the step is split over `workers`
    threads besides the caller, which spin between the step's products instead of sleeping
    (so small products are worth splitting too) and sleep again when the step ends. The
    results are the same bits as without it."""

    def __init__(self, workers: int) -> None:
        from .quant import _Lib         # the kernels' library (quant imports this module)
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
