"""One step's LoRA deltas: the grouped low-rank products of a mixed batch.

A step's flat rows belong to its members in order, each member's rows contiguous. `LoraStep`
groups them by adapter: per adapter the rows of its members, as a slice when they are one run
and as an index otherwise; the base model's rows are in no group. The runner calls the step at
each targeted linear, after the linear's own forward (whatever it is: HF's ``F.linear``, the
oneDNN-packed weight, the q4 kernel or a q4 group's concatenated product, whose split outputs
are views of one tensor) with the linear's input ``x`` and output ``y``, and for each adapter
that targets that linear in that layer

    ``y[rows] += (x[rows] @ A^T) @ B^T``      (B holds the scaling, `lora.read_adapter`)

in place, in the model's dtype, the two products as PEFT computes them (``lora_B(lora_A(x))``).
The base rows are never written. Prefill chunks, decode rows and speculative verify rows are all
just rows, so every kind of step takes the same path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .lora import LoraAdapter

Rows = slice | torch.Tensor
LayerHook = Callable[[str, torch.Tensor, torch.Tensor], None]


class LoraStep:
    """The adapters of one step and the rows each one serves (see the module docstring)."""

    __slots__ = ("groups", "layers")

    def __init__(self, groups: list[tuple[LoraAdapter, Rows]]) -> None:
        self.groups = groups
        self.layers = frozenset().union(*(ad.layers for ad, _ in groups)) if groups else frozenset()

    @classmethod
    def of(cls, members: list[tuple[LoraAdapter | None, int, int]]) -> LoraStep | None:
        """From each member's (adapter or None, rows it computes, its last flat row)."""
        rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for ad, n, last in members:
            if ad is None or n <= 0:
                continue
            rows.setdefault(id(ad), (ad, []))[1].extend(range(last - n + 1, last + 1))
        if not rows:
            return None
        groups: list[tuple[LoraAdapter, Rows]] = []
        for ad, idx in rows.values():
            if idx[-1] - idx[0] + 1 == len(idx):          # ascending by construction: one run
                groups.append((ad, slice(idx[0], idx[-1] + 1)))
            else:
                groups.append((ad, torch.tensor(idx, dtype=torch.long)))
        return cls(groups)

    def layer(self, li: int) -> LayerHook | None:
        """The hook of layer `li` (None when no adapter of the step targets it)."""
        if li not in self.layers:
            return None
        return lambda name, x, y: self.add(li, name, x, y)

    def add(self, li: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += (x[rows] @ A^T) @ B^T`` for each adapter of the step with weights at
        (`li`, `name`); `x` ``[T, in]``, `y` ``[T, out]`` (any row stride)."""
        for ad, rows in self.groups:
            w = ad.weights.get((li, name))
            if w is None:
                continue
            a, b = w
            if isinstance(rows, slice):
                y[rows].add_(F.linear(F.linear(x[rows], a), b))
            else:
                y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))


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
