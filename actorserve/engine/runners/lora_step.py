"""One step's LoRA deltas: each adapter row gets its own adapter's low-rank product.

The runner calls the step at each targeted linear, after the linear's own forward (HF's
``F.linear``, the oneDNN-packed weight, the q4 kernel or a q4 group's concatenated product,
whose split outputs are views of one tensor), in place, and the fused C decode step after each
of its products. Both go to the C kernel (`lora_kernel`, ``csrc/lora.c``) where it is built:
``y[t] += B_i (A_i x[t])`` for each row t of adapter i, float32, the delta rounded once into
the model's dtype; the base rows are never written. Prefill chunks, decode rows and speculative
verify rows are all just rows, so every kind of step takes the same path.

Without the kernel (no C compiler, or a dtype it does not take) the deltas are torch products
over a `Combo`: for every targeted (layer, module) the adapters' A^T side by side, ``[in, R]``,
and their B^T stacked, ``[R, out]``, R the sum of their ranks (zeros where an adapter does not
target that module), and a mask ``[rows, R]`` keeping only each row's own adapter's columns:

    ``y[rows] += ((x[rows] @ A^T) * mask) @ B^T``      (B holds the scaling, `lora.read_adapter`)

(float32 products: bf16 ones this small cost 4-9 times float32's on CPUs without AMX).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..kernels import lora_kernel

if TYPE_CHECKING:
    from ..weights.lora_adapter import LoraAdapter

LayerHook = Callable[[str, torch.Tensor, torch.Tensor], None]


class Combo:
    """Adapters laid side by side (see the module docstring): `cols[i]` is adapter i's column
    range; `weights(key)` the (A^T ``[in, R]``, B^T ``[R, out]``) float32 pair of the torch
    path, built on first use; `table` the C kernel's pointers (`lora_kernel.Table`)."""

    __slots__ = ("adapters", "cols", "rank", "layers", "table", "_weights")

    def __init__(self, adapters: list[LoraAdapter]) -> None:
        self.adapters = adapters
        self.cols: list[tuple[int, int]] = []
        at = 0
        for ad in adapters:
            self.cols.append((at, at + ad.rank))
            at += ad.rank
        self.rank = at
        self.layers = frozenset(li for ad in adapters for li, _ in ad.weights)
        self.table = lora_kernel.Table(adapters) if lora_kernel.kernel() is not None else None
        self._weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}

    def weights(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if key in self._weights:
            return self._weights[key]
        adapters = self.adapters
        pair = None
        if any(key in ad.weights for ad in adapters):
            a_parts, b_parts = [], []
            for ad in adapters:
                w = ad.weights.get(key)
                if w is None:
                    shape = next(x.weights[key] for x in adapters if key in x.weights)
                    a_parts.append(torch.zeros(shape[0].shape[1], ad.rank))
                    b_parts.append(torch.zeros(ad.rank, shape[1].shape[0]))
                else:
                    a_parts.append(w[0].t())
                    b_parts.append(w[1].t())
            pair = (torch.cat(a_parts, 1).contiguous(), torch.cat(b_parts, 0).contiguous())
        self._weights[key] = pair
        return pair


class LoraStep:
    """One step's adapter rows and the `Combo` (see the module docstring): `args` the C
    kernel's (`lora_kernel.StepArgs`, None without it), `rows` and `mask` the torch path's."""

    __slots__ = ("combo", "runs", "count", "args", "_rows", "_mask")

    def __init__(self, combo: Combo, runs: list[tuple[int, int, int]], total_rows: int) -> None:
        self.combo, self.runs = combo, runs
        self.count = total_rows
        self.args = None if combo.table is None else lora_kernel.StepArgs(combo.table, runs, total_rows)
        self._rows: slice | torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    @staticmethod
    def plan(members: list[tuple[LoraAdapter | None, int, int]]) -> tuple[list[LoraAdapter], list[tuple[int, int, int]]]:
        """From each member's (adapter or None, rows it computes, its last flat row): the
        adapters in order of first use, and each adapter member's (adapter index, first row, n)."""
        order: dict[int, int] = {}
        adapters: list[LoraAdapter] = []
        runs: list[tuple[int, int, int]] = []
        for ad, n, last in members:
            if ad is None or n <= 0:
                continue
            if id(ad) not in order:
                order[id(ad)] = len(adapters)
                adapters.append(ad)
            runs.append((order[id(ad)], last - n + 1, n))
        return adapters, runs

    @classmethod
    def of(cls, combo: Combo, runs: list[tuple[int, int, int]], total_rows: int) -> LoraStep:
        """`runs` from `plan` (at least one), `combo` of its adapters."""
        return cls(combo, runs, total_rows)

    def _torch_rows(self) -> tuple[slice | torch.Tensor, torch.Tensor | None]:
        """The adapter rows (a slice where they are one run) and the column mask (None with one
        adapter), built on first use."""
        if self._rows is None:
            runs, combo = self.runs, self.combo
            count = sum(n for _, _, n in runs)
            first = runs[0][1]
            if count == self.count:
                self._rows = slice(None)
            elif runs[-1][1] + runs[-1][2] - first == count:     # ascending, so one run of rows
                self._rows = slice(first, first + count)
            else:
                self._rows = torch.cat([torch.arange(r, r + n) for _, r, n in runs])
            if len(combo.adapters) > 1:
                self._mask = torch.zeros(count, combo.rank)
                at = 0
                for i, _, n in runs:
                    c0, c1 = combo.cols[i]
                    self._mask[at:at + n, c0:c1] = 1.0
                    at += n
        return self._rows, self._mask

    def layer(self, li: int) -> LayerHook | None:
        """The hook of layer `li` (None when no adapter of the step targets it)."""
        if li not in self.combo.layers:
            return None
        return lambda name, x, y: self.add(li, name, x, y)

    def add(self, li: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += ((x[rows] @ A^T) * mask) @ B^T`` where the step's adapters target
        (`li`, `name`); `x` ``[T, in]``, `y` ``[T, out]`` (any row stride). In C where the
        kernel takes the tensors (`lora_kernel`), else in torch."""
        if self.args is not None and self.args.apply(li, name, x, y):
            return
        w = self.combo.weights((li, name))
        if w is None:
            return
        at, bt = w
        rows, mask = self._torch_rows()
        xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        xa = torch.mm(xs.float() if xs.dtype != torch.float32 else xs, at)
        if mask is not None:
            xa.mul_(mask)
        delta = torch.mm(xa, bt)
        if isinstance(rows, slice):
            y[rows].add_(delta)
        else:
            y.index_add_(0, rows, delta.to(y.dtype))


def mlp(module: Any, x: torch.Tensor, hook: LayerHook) -> torch.Tensor:
    """A gated MLP's forward, ``down(act(gate(x)) * up(x))`` as HF's Llama/Gemma MLP modules
    compute it, with the layer's LoRA deltas after each of its three linears."""
    g = module.gate_proj(x)
    hook("gate_proj", x, g)
    u = module.up_proj(x)
    hook("up_proj", x, u)
    return down(module, module.act_fn(g) * u, hook)


def down(module: Any, act: torch.Tensor, hook: LayerHook) -> torch.Tensor:
    y = module.down_proj(act)
    hook("down_proj", act, y)
    return y
