"""How wide a step the quantized kernels take (`quant`): `MAX_ROWS` rows a pass over each
weight row, and the widest step sent to them rather than to the packed dense weight, which
depends on the activations' path (`kernel_rows`)."""

from __future__ import annotations

import os

import torch

MAX_ROWS = 8            # csrc/qgemv.c's MAXM: rows a pass over each weight row


DOT_ROWS = 16   # the widest step through the kernels when bf16 activations take the dot path
# ... and when the q4 weights are in q4b16.c's superblocks (`quant._Weights.use_b16`): there the
# fused step beat the packed dense weight at every width measured. SmolLM2 greedy decode steps,
# ms, kernel vs dense (`benchmarks/quant_decode.py --configs bf16,q4_bf16 --batches
# 1,8,16,32,64,128,256 --no-variants --prefill 0`, the 2-core AMD EPYC, 2026-12-07): 8 rows 14.0
# vs 44.1, 32 rows 39.7 vs 65.5, 64 rows 75.7 vs 142.0, 128 rows 137.5 vs 217.2, 256 rows 294.6
# vs 338.0. A prompt's prefill as decode rows (one prompt, best of 5): 64 tokens 91 vs 122 ms,
# 128 tokens 182 vs 182, 250 tokens 228 vs 292.
B16_ROWS = 256


def kernel_rows(dtype: torch.dtype | None = None, dot_path: bool = False, b16: bool = False) -> int:
    """The widest step whose q4/q8 products take the C kernels, for a model of `dtype` whose
    bf16 activations take the dot-product path (`dot_path`: `_Lib.bf16_path`). There, one
    fused call a step of up to 16 rows beats the packed dense weight (SmolLM2 decode steps on
    the 2-core AMD EPYC, `benchmarks/quant_decode.py --configs q4_bf16` with the fused step
    allowed that wide, alternated twice, ms: 12 rows 35.0 / 33.1 against dense 52.7 / 51.2,
    16 rows 44.1 / 45.0 against 61.4 / 58.5, 24 rows 69.2 / 70.1 against 74.2 / 73.6 (nearly a
    tie, so dense), 32 rows 109 / 98 against 79 / 81). Otherwise `_kernel_rows`.
    ``ACTORSERVE_Q4_ROWS`` sets another width either way."""
    if os.environ.get("ACTORSERVE_Q4_ROWS"):
        return _kernel_rows()
    if dtype is torch.bfloat16 and dot_path:
        return B16_ROWS if b16 else DOT_ROWS
    return MAX_ROWS


def _kernel_rows() -> int:
    """The widest step whose q4/q8 products take the C kernels (float activations). The kernel
    takes any width, `MAX_ROWS` rows a pass over each output row (so the weights are read once
    a step), but from 9 rows on the dense weight through oneDNN (`engine.runners.dense`, packed at
    load) is as fast or faster: the kernel's cost grows with its float32 arithmetic per row.
    Measured on the 2-core AMD EPYC (avx512_bf16, no AMX), SmolLM2 decode steps, ms (kernel vs
    packed dense; benchmarks/quant_decode.py --batches with ACTORSERVE_Q4_ROWS): bf16 10 rows
    55 vs 55, 12 rows 63 vs 57, 16 rows 87 vs 57-72; float32 12 rows 70 vs 61, 16 rows 102 vs 75.
    A tie goes to the library, so `MAX_ROWS`. ``ACTORSERVE_Q4_ROWS`` sets another width
    (benchmarks)."""
    env = os.environ.get("ACTORSERVE_Q4_ROWS")
    return max(1, int(env)) if env else MAX_ROWS


KERNEL_ROWS = _kernel_rows()

# q8 weights (a q4 GGUF's tied embedding: SmolLM2's LM head) with bf16 activations where the
# CPU has no avx512_bf16: their products take the float loops, and from 6 rows on the packed dense
# weight wins. SmolLM2's LM head (49152 x 576) on the 2-core AMD EPYC, ms, median of 30, q8
# kernel vs dense: 1 row 1.27 vs 2.83, 2 rows 1.67 vs 2.91, 4 rows 2.64 vs 3.28, 6 rows 3.97 vs
# 2.59, 8 rows 3.68 vs 2.48, 16 rows 10.58 vs 3.77.
Q8_BF16_ROWS = 4

# ... and where it has avx512_bf16, in `q8b16.c`'s superblocks (16 output rows a register, the
# int8 weights widened to bf16 in registers): SmolLM2's LM head, ms, the caches flushed before
# each call (a 96 MB read, as a decode step's layers do), median of 10, best of 2 rounds, the
# 2-core AMD EPYC, superblocks vs the float loops vs packed dense bf16: 1 row 1.18 vs 1.55 vs
# 3.37, 4 rows 1.07 vs 2.55 vs 3.27, 8 rows 1.71 vs - vs 3.01, 12 rows 2.25 vs 3.82 (dense),
# 16 rows 3.39 vs 3.63, 32 rows 5.40 vs 5.76; at 64 a tie. So up to 32 rows.
Q8_B16_ROWS = 32


def weight_rows(bits: int, dtype: torch.dtype | None, dot_path: bool) -> int:
    """The widest step one quantized weight of `bits` (4 or 8) takes through the kernels:
    `kernel_rows`, but at most `Q8_BF16_ROWS` for a q8 weight with bf16 activations.
    ``ACTORSERVE_Q4_ROWS`` sets every weight's width."""
    rows = kernel_rows(dtype, dot_path)
    if bits == 8 and dtype is torch.bfloat16 and not os.environ.get("ACTORSERVE_Q4_ROWS"):
        return min(rows, Q8_BF16_ROWS)
    return rows


def kernel_takes(module: object, rows: int) -> bool:
    """Whether `rows` rows through `module` (a linear) take a quantized kernel (its forward a
    `quant.QuantLinear`, whose weight takes at most ``max_rows``), not a dense weight."""
    w = getattr(getattr(module, "forward", None), "w", None)
    return isinstance(getattr(w, "max_rows", None), int) and rows <= w.max_rows
