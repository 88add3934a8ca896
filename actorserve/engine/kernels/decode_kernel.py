"""Decode attention that reads the paged KV cache in place: a small C kernel, built here.

Why. The torch path (`paged_attention`) gathers each decode member's blocks into a padded
scratch tensor and then runs SDPA over it: every K/V byte is read, written, and read again,
and SDPA on small per-sequence matrices runs far under the memory bandwidth. At long contexts
attention is most of a step (16 x 8,192 tokens, SmolLM2-135M bf16 on 2 cores: ~90% of it,
`benchmarks/scale.py`). `csrc/paged_decode.c` walks each sequence's block table itself and
reads every K and V row exactly once, straight from the cache, for all the query heads that
share it (GQA), with a float32 softmax; sequences of any mix of lengths share one call, with
no padding and no grouping.

How it is built: by `cbuild` (plain C with OpenMP, ``cc -O3 -march=native``, about a second
on first use, cached by source, flags, compiler and CPU), loaded with ctypes.
Where it cannot be built (no C compiler) or is turned off (``ACTORSERVE_DECODE_ATTENTION=gather``
or ``--decode-attention gather``) the runner keeps the torch path and says why (`status`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import torch

from . import cbuild

log = logging.getLogger(__name__)

MODES = ("auto", "inplace", "gather")
# K elements (context tokens x KV heads x head size) from which a step's attention runs on all
# threads: csrc/paged_decode.c's rule (below it, one thread)
PARALLEL_MIN_ELEMENTS = 1 << 18


class DecodeKernel:
    """The loaded kernel: `run` fills ``out`` for one group of decode members."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = lib.paged_decode
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        fn.argtypes = [p, p, p, i, p, i, p, i, i, i, i, i, f, f, p, i]
        fn.restype = ctypes.c_int
        self._fn = fn
        # `paged_decode_part`: the units of a step that start in a range of its work, on the
        # calling thread (the fused quantized step shares them out over its step pool)
        self.part = lib.paged_decode_part
        self.threads = 0        # OpenMP threads for a parallel step (0: torch's count at the call)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
            ctx: torch.Tensor, block_size: int, scale: float, softcap: float | None,
            out: torch.Tensor) -> None:
        """``q`` float32 ``[D, nkv, g, d]`` contiguous; ``k``/``v`` one layer's cache
        ``[slots, nkv, d]`` (float32 or bfloat16, contiguous); ``table`` int32 ``[D, nb]``
        contiguous; ``ctx`` int32 ``[D]`` (each member's context length, its new token
        included); ``out`` float32 ``[D, nkv, g, d]`` contiguous."""
        D, nkv, g, d = q.shape
        if k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype:
            raise TypeError(f"the decode kernel reads float32 or bfloat16 caches, not {k.dtype}")
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and out.is_contiguous()):
            raise ValueError("the decode kernel needs contiguous q, k, v and out")
        table = table.to(torch.int32).contiguous()
        ctx = ctx.to(torch.int32).contiguous()
        rc = self._fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
                      table.data_ptr(), table.shape[1], ctx.data_ptr(), D, nkv, g, d, block_size,
                      float(scale), float(softcap or 0.0), out.data_ptr(), self.threads or torch.get_num_threads())
        if rc != 0:
            raise MemoryError("the decode kernel could not allocate its score buffer")


_loaded: dict[str, tuple[DecodeKernel | None, str]] = {}


def build(dest_dir: Path | None = None) -> Path:
    """The kernel's shared object, compiled on first use (`cbuild.build`)."""
    return cbuild.build("paged_decode", dest_dir)


def load(mode: str | None = None) -> tuple[DecodeKernel | None, str]:
    """``(kernel or None, what decode attention runs and why)`` for a mode among `MODES`
    (default: ``$ACTORSERVE_DECODE_ATTENTION`` or ``auto``). ``inplace`` insists: a kernel
    that cannot be built is an error; ``auto`` falls back to the gather path."""
    mode = (mode or os.environ.get("ACTORSERVE_DECODE_ATTENTION") or "auto").lower()
    if mode not in MODES:
        raise ValueError(f"unknown decode attention {mode!r}; use one of {', '.join(MODES)}")
    if mode == "gather":
        return None, "gather+sdpa (asked for)"
    if mode not in _loaded:
        try:
            path = build()
            _loaded[mode] = DecodeKernel(ctypes.CDLL(str(path)), path), f"inplace ({path.name})"
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            if mode == "inplace":
                raise RuntimeError(f"the in-place decode kernel cannot be built: {exc}") from exc
            log.warning("in-place decode attention unavailable (%s); using gather+sdpa", exc)
            _loaded[mode] = None, f"gather+sdpa (the in-place kernel cannot be built: {exc})"
    return _loaded[mode]
