"""A bf16 prompt chunk's causal attention in one C call (`csrc/prefill_attn.c`), built here.

Why. After the linears reached the CPU's matrix peak, a prompt's attention was the largest part
of a prefill left: torch's blocked products (`prefill_attention.causal_blocked`) spent most of
their time in the softmax between the two products and in copies, and SDPA's CPU kernel was
slower still. The kernel packs each KV head's K and V once a call into the layouts
`vdpbf16ps` multiplies directly, and computes each unit's scores, softmax and weighted sum of V
in registers and L2. One layer of SmolLM2-135M, bf16, 2-core AMD EPYC
(`benchmarks/prefill_attention.py`): 256 / 1,024 / 2,048 prompt tokens 0.26 / 3.5 / 13.8 ms
against torch's blocked products' 0.80 / 9.2 / 32.3 and SDPA's 1.1 / 12.3 / 41.2; 32 tokens 0.014
against SDPA's 0.047, 16 after 300 of context 0.063 against 0.147. So every bf16 chunk takes it,
whatever its length.

Where. CPUs with avx512_bf16 (AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and
later), head sizes 64 and 128, at most 16 query heads a KV head, no logit soft-capping. Elsewhere
(AVX2-only machines, no C compiler, ``ACTORSERVE_PREFILL_ATTENTION=blocks``) prompt chunks keep
`prefill_attention`'s torch paths; ``=kernel`` insists (an error where it cannot run).
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

MODES = ("auto", "kernel", "blocks")
HEAD_SIZES = (64, 128)
MAX_GROUP = 16          # query heads a KV head (csrc/prefill_attn.c's MAX_GROUP)


class PrefillKernel:
    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
        self._fn = lib.prefill_attn
        self._fn.argtypes = [p, L, p, p, L, i, i, i, i, i, f, p, L, i]
        self._fn.restype = ctypes.c_int

    @staticmethod
    def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether the kernel computes this chunk: bf16 throughout, a head size it is built
        for, each token's heads contiguous (rows may be strided), K and V laid out alike."""
        n, nh, d = q.shape
        nkv = k.shape[1]
        return (q.dtype is torch.bfloat16 and k.dtype is torch.bfloat16 and v.dtype is torch.bfloat16
                and out.dtype is torch.bfloat16 and d in HEAD_SIZES and k.shape[2] == d
                and nkv > 0 and nh % nkv == 0 and nh // nkv <= MAX_GROUP and v.stride() == k.stride()
                and all(t.stride(2) == 1 and t.stride(1) == d for t in (q, k, out)))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor,
            start: int = 0, threads: int | None = None) -> None:
        """``out [n, nh, d]`` = causal attention of ``q [n, nh, d]`` (positions start .. start + n - 1)
        over ``k``/``v [L, nkv, d]`` (keys past start + n - 1 are never read)."""
        n, nh, d = q.shape
        if k.shape[0] < start + n:
            raise ValueError(f"{k.shape[0]} keys for queries up to position {start + n - 1}")
        rc = self._fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), n, start, nh,
                      k.shape[1], d, float(scale), out.data_ptr(), out.stride(0), threads or torch.get_num_threads())
        if rc == -1:
            raise MemoryError("the prefill attention kernel could not allocate its buffers")
        if rc != 0:
            raise ValueError("the prefill attention kernel does not take this chunk")


_loaded: dict[str, tuple[PrefillKernel | None, str]] = {}


def build(dest_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    return cbuild.build("prefill_attn", dest_dir, extra_flags)


def load(mode: str | None = None) -> tuple[PrefillKernel | None, str]:
    """``(kernel or None, what prompt chunks' attention runs and why)`` for a mode among
    `MODES` (default: ``$ACTORSERVE_PREFILL_ATTENTION`` or ``auto``)."""
    mode = (mode or os.environ.get("ACTORSERVE_PREFILL_ATTENTION") or "auto").lower()
    if mode not in MODES:
        raise ValueError(f"unknown prefill attention {mode!r}; use one of {', '.join(MODES)}")
    if mode == "blocks":
        return None, "torch (asked for)"
    if mode not in _loaded:
        try:
            path = build()
            lib = ctypes.CDLL(str(path))
            if not lib.prefill_attn_supported():
                raise RuntimeError("this CPU has no avx512_bf16")
            _loaded[mode] = PrefillKernel(lib, path), f"C kernel, avx512_bf16 ({path.name})"
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            if mode == "kernel":
                raise RuntimeError(f"the prefill attention kernel cannot run: {exc}") from exc
            log.info("prefill attention kernel unavailable (%s); prompt chunks take torch's paths", exc)
            _loaded[mode] = None, f"torch (the C kernel cannot run: {exc})"
    return _loaded[mode]
