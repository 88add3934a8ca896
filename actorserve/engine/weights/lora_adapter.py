"""`LoraAdapter`: one loaded LoRA adapter's weights as the step reads them (plain data).

Its own module so that the step (`lora_step`) and the kernel (`lora_kernel`) can name it
without importing the loader (`lora`), which imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoraAdapter:
    """One adapter as the step reads it: per (layer, module) its A ``[r, in]`` and B ``[out, r]``
    (B already multiplied by `scaling`), float32."""

    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    modules: tuple[str, ...]                  # the modules it targets, in SUPPORTED_MODULES order
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    key: bytes                                # digest of its config and weights
    nbytes: int = 0
    layers: frozenset[int] = field(default_factory=frozenset)
