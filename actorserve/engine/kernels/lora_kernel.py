"""The LoRA deltas in C (``csrc/lora.c``, ``lora_apply``): each adapter row computes its own
adapter's low-rank product only, spread over the step pool's threads.

Why. The grouped torch products (`lora_step`, two ``mm`` a linear over every adapter's
columns, a mask between) cost SmolLM2 four rank-16 adapters some 20-40 ms a decode step on two
cores: about five torch calls a linear, 210 linears, each on one thread while the step pool's
worker spins, plus the float32 copies; and a step with adapters could not take the fused C
decode step (`fused_step`). In C the deltas are one call per group of linears sharing an input
(q/k/v, gate/up; o; down), inside the fused step's layer loop or from the glued loop's hooks.

Layout. A `Table` per `lora_step.Combo`: for every (layer, module, adapter) the adapter's A
``[r, in]`` and B^T ``[r, out]`` (float32, B scaled, as `lora.read_adapter` holds them) or
NULLs. A `StepArgs` per step: each row's adapter index in the combo (-1 for the base model's
rows). The arithmetic is the torch path's: float32 products, the delta added in float32 and
rounded once into the output (the sums in another order: float32 rounding apart).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from typing import TYPE_CHECKING, Any

import torch

from . import cbuild

if TYPE_CHECKING:
    from ..weights.lora_adapter import LoraAdapter

log = logging.getLogger(__name__)

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")   # csrc/lora.c's order
INDEX = {m: i for i, m in enumerate(MODULES)}
_p, _i = ctypes.c_void_p, ctypes.c_int


class _Pair(ctypes.Structure):
    _fields_ = [("a", _p), ("bt", _p)]


class CLora(ctypes.Structure):
    _fields_ = [("T", _i), ("nad", _i), ("nmod", _i), ("row_ad", _p), ("rank", _p), ("pairs", _p)]


class _Out(ctypes.Structure):
    _fields_ = [("mod", _i), ("N", _i), ("y_stride", _i), ("y", _p)]


_fn: list[Any] = []


def kernel() -> Any:
    """``lora_apply`` of the decode-step library, built on first use; None without a compiler."""
    if not _fn:
        try:
            fn = ctypes.CDLL(str(cbuild.build("decode_step"))).lora_apply
            fn.argtypes = [_p, _i, _p, _i, _i, _i, _i, _p, _i, _i]
            fn.restype = _i
            _fn.append(fn)
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
            log.warning("LoRA kernel unavailable (%s); torch computes the adapters' deltas", exc)
            _fn.append(None)
    return _fn[0]


class Table:
    """The (layer, module, adapter) pointer table of a set of adapters (see the module docstring)."""

    __slots__ = ("pairs", "ranks", "nad", "_keep")

    def __init__(self, adapters: list[LoraAdapter]) -> None:
        layers = 1 + max(li for ad in adapters for li, _ in ad.weights)
        self.nad = len(adapters)
        self.pairs = (_Pair * (layers * len(MODULES) * self.nad))()
        self.ranks = (ctypes.c_int32 * self.nad)(*(ad.rank for ad in adapters))
        self._keep = adapters                       # the tensors the pointers point into
        for i, ad in enumerate(adapters):
            for (li, mod), (a, b) in ad.weights.items():
                bt = b.t()
                assert a.is_contiguous() and bt.is_contiguous() and a.dtype == bt.dtype == torch.float32
                self.pairs[(li * len(MODULES) + INDEX[mod]) * self.nad + i] = _Pair(a.data_ptr(), bt.data_ptr())


class StepArgs:
    """One step's ``lora_t``: its rows' adapters over a `Table`."""

    __slots__ = ("c", "row_ad", "table")

    def __init__(self, table: Table, runs: list[tuple[int, int, int]], total_rows: int) -> None:
        self.table = table
        self.row_ad = torch.full((total_rows,), -1, dtype=torch.int32)
        for i, first, n in runs:
            self.row_ad[first:first + n] = i
        self.c = CLora(total_rows, table.nad, len(MODULES), self.row_ad.data_ptr(),
                       ctypes.addressof(table.ranks), ctypes.addressof(table.pairs))

    @property
    def ptr(self) -> int:
        return ctypes.addressof(self.c)

    def apply(self, li: int, name: str, x: torch.Tensor, y: torch.Tensor) -> bool:
        """``y[rows] += delta`` of (`li`, `name`) in C; False (nothing done) for tensors it does
        not take (another dtype than float32/bfloat16, the two dtypes apart, a column stride)."""
        fn = kernel()
        if (fn is None or x.dtype != y.dtype or x.dtype not in (torch.float32, torch.bfloat16)
                or x.dim() != 2 or y.dim() != 2 or x.stride(1) != 1 or y.stride(1) != 1):
            return False
        bf16 = int(x.dtype == torch.bfloat16)
        out = _Out(INDEX[name], y.shape[1], y.stride(0), y.data_ptr())
        if fn(self.ptr, li, x.data_ptr(), bf16, x.stride(0), x.shape[1], 1, ctypes.byref(out), bf16, 1) != 0:
            raise RuntimeError("lora_apply failed (out of memory?)")
        return True
