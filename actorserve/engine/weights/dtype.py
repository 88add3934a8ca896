"""Which floating-point type the model weights and the KV cache use (``--dtype``).

``auto`` picks bfloat16 where the hardware computes it natively — a CUDA device that supports
it, or a CPU with AMX (``amx_bf16``) or AVX-512 BF16 (``avx512_bf16``), where bf16 matmuls run
2-4x faster than fp32 — and float32 elsewhere (bf16 emulated on an older CPU is slower than
fp32). Whatever the choice, sampling, logprobs and pooling run in float32: the runner and the
encoder cast the final rows up before any softmax, normalisation or head.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["DTYPES", "resolve_dtype", "cpu_bf16_flags", "dtype_name"]

DTYPES = ("auto", "float32", "bfloat16")
_BY_NAME = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def cpu_bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The CPU's native bf16 features among ``amx_bf16`` and ``avx512_bf16`` (Linux cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return ()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return tuple(f for f in ("amx_bf16", "avx512_bf16") if f in flags)


def resolve_dtype(name: str | None, *, device: str = "cpu") -> tuple[torch.dtype, str]:
    """``(dtype, why)`` for a ``--dtype`` value; raises ValueError for an unknown one."""
    name = (name or "auto").lower()
    if name != "auto":
        if name not in _BY_NAME:
            raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
        return _BY_NAME[name], "asked for"
    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: the GPU supports bf16"
        return torch.float32, "auto: the GPU has no bf16"
    flags = cpu_bf16_flags()
    if flags:
        return torch.bfloat16, f"auto: the CPU has {' and '.join(flags)}"
    return torch.float32, "auto: the CPU has no native bf16 (amx_bf16 / avx512_bf16)"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
