"""A quantized decode step's small per-layer operations in C (`csrc/glue.c`, built into the
kernels' library, `csrc/decode_step.c`).

Why. With q4 and the step pool, one SmolLM2 sequence decodes in about 12 ms a step, of which
the quantized products are about 7; most of the rest was torch dispatch for tiny tensors: HF's
RMSNorm is six operations (cast, square, mean, add, rsqrt, two multiplies) and RoPE seven for
each of q and k, each a few microseconds for a few hundred numbers, 30 layers a step.

What. `Glue.add_rmsnorm` (the residual add and the next norm in one call) and `Glue.rope`
(in place, q and k of a layer in one call when they are adjacent in the q/k/v product's
output), for the steps that already take the quantized kernels (at most the runner's `kernel_rows`
rows, ``--quantization q4``) and only for the norms whose arithmetic it copies (HF's
Llama-style RMSNorm: Llama, Mistral, Qwen2/3, Phi-3; Gemma's ``1 + w`` norms keep torch).
Dense steps keep HF's own modules, so the dense paths stay HF's arithmetic exactly.

Arithmetic. HF's order and roundings, step by step (see the C file); for float32 the only
difference can be the summation order of the norm's mean of squares.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from typing import Any

import torch

from . import cbuild

log = logging.getLogger(__name__)

# RMSNorm classes computing w * (x * rsqrt(mean(x^2) + eps)).to(dtype), eps in `variance_epsilon`
LLAMA_STYLE_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm")
_DTYPES = (torch.float32, torch.bfloat16)
MT_ROWS = 64        # fewer rows stay on the calling thread (waking OpenMP's costs more)


class Glue:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
        self._norm = lib.add_rmsnorm
        self._norm.argtypes = [p, p, L, p, f, p, L, i, i, i]
        self._norm.restype = None
        self._rope = lib.rope
        self._rope.argtypes = [p, L, i, i, i, p, p, i, i]
        self._rope.restype = None
        # the same over OpenMP threads (a prompt chunk's rows): a trailing thread count
        self._norm_mt = lib.add_rmsnorm_mt
        self._norm_mt.argtypes = [p, p, L, p, f, p, L, i, i, i, i]
        self._norm_mt.restype = None
        self._rope_mt = lib.rope_mt
        self._rope_mt.argtypes = [p, L, i, i, i, p, p, i, i, i]
        self._rope_mt.restype = None
        self._silu_mt = lib.silu_mul_mt
        self._silu_mt.argtypes = [p, L, p, L, p, L, i, i, i, i]
        self._silu_mt.restype = None

    def add_rmsnorm(self, h: torch.Tensor, delta: torch.Tensor | None, norm: Any, out: torch.Tensor,
                    threads: int = 1) -> None:
        """``h += delta`` (unless None), then ``out = norm(h)``; h ``[T, D]`` contiguous, delta
        and out ``[T, D]`` with unit stride along D, all of h's dtype. With `threads` > 1 and
        at least `MT_ROWS` rows, the rows are shared out over that many OpenMP threads."""
        T, D = h.shape
        args = (h.data_ptr(), None if delta is None else delta.data_ptr(),
                0 if delta is None else delta.stride(0), norm.weight.data_ptr(),
                norm.variance_epsilon, out.data_ptr(), out.stride(0), T, D, h.dtype is torch.bfloat16)
        if threads > 1 and T >= MT_ROWS:
            self._norm_mt(*args, threads)
        else:
            self._norm(*args)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, threads: int = 1) -> bool:
        """RoPE in place on ``x [T, heads, d]`` with the step's cos/sin rows ``[T, 1, rd]``;
        False (x untouched) where it does not take them: heads not contiguous within a row,
        cos/sin not contiguous or not of x's dtype. `threads`: as `add_rmsnorm`'s."""
        T, heads, d = x.shape
        if (x.stride(2) != 1 or x.stride(1) != d or cos.dtype != x.dtype or sin.dtype != x.dtype
                or not (cos.is_contiguous() and sin.is_contiguous()) or x.dtype not in _DTYPES):
            return False
        args = (x.data_ptr(), x.stride(0), T, heads, d, cos.data_ptr(), sin.data_ptr(),
                cos.shape[-1], x.dtype is torch.bfloat16)
        if threads > 1 and T >= MT_ROWS:
            self._rope_mt(*args, threads)
        else:
            self._rope(*args)
        return True

    def silu_mul(self, g: torch.Tensor, u: torch.Tensor, threads: int = 1) -> torch.Tensor | None:
        """``SiLU(g) * u`` into `g` (in place, as the torch path's ``g.mul_(u)``), the fused
        decode step's arithmetic (`csrc/glue.c`'s ``silu_mul_row``: SiLU rounded to the dtype
        before the multiply, as torch's); None (nothing done) where it does not take them: not
        ``[rows, I]`` alike, another dtype, a row not contiguous. `threads`: as `add_rmsnorm`'s."""
        if (g.dim() != 2 or u.shape != g.shape or g.dtype not in _DTYPES or u.dtype != g.dtype
                or g.stride(1) != 1 or u.stride(1) != 1):
            return None
        rows, inner = g.shape
        self._silu_mt(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), g.data_ptr(), g.stride(0), inner,
                      rows, g.dtype is torch.bfloat16, threads if rows >= MT_ROWS else 1)
        return g


def usable(layers: list[Any], dtype: torch.dtype) -> bool:
    """Whether the glue computes these layers' norms as HF does (see the module docstring)."""
    return all(norm_usable(getattr(layer, name, None), dtype)
               for layer in layers for name in ("input_layernorm", "post_attention_layernorm"))


def norm_usable(norm: Any, dtype: torch.dtype) -> bool:
    """Whether `add_rmsnorm` computes this norm module as HF does on `dtype` rows."""
    return (dtype in _DTYPES and type(norm).__name__ in LLAMA_STYLE_NORMS and hasattr(norm, "variance_epsilon")
            and norm.weight.dtype == dtype and norm.weight.is_contiguous())


_lib: list[Glue | None] = []


def load() -> Glue | None:
    """The loaded glue, built on first use; None (and a warning, once) without a C compiler."""
    if not _lib:
        try:
            _lib.append(Glue(ctypes.CDLL(str(cbuild.build("decode_step")))))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("decode glue unavailable (%s); torch runs the norms and RoPE", exc)
            _lib.append(None)
    return _lib[0]
