"""Decode attention that reads the paged KV cache in place: a small C kernel, built here.

Why. The torch path (`paged_attention`) gathers each decode member's blocks into a padded
scratch tensor and then runs SDPA over it: every K/V byte is read, written, and read again,
and SDPA on small per-sequence matrices runs far under the memory bandwidth. At long contexts
attention is most of a step (16 x 8,192 tokens, SmolLM2-135M bf16 on 2 cores: ~90% of it,
`benchmarks/scale.py`). `csrc/paged_decode.c` walks each sequence's block table itself and
reads every K and V row exactly once, straight from the cache, for all the query heads that
share it (GQA), with a float32 softmax; sequences of any mix of lengths share one call, with
no padding and no grouping.

How it is built. Plain C with OpenMP, no torch headers, so it compiles in about a second:
``cc -O3 -march=native -fopenmp -shared``, into ``$ACTORSERVE_KERNEL_CACHE`` or
``~/.cache/actorserve/kernels``, named by a hash of the source, the flags, the
compiler's version and the CPU's model and flags (``-march=native`` code is only reused on the
CPU it was built for), written to a temporary name and renamed into place. It is loaded with
ctypes (which releases the GIL for the call); its ``libgomp`` is the one torch already loaded.
Where it cannot be built (no C compiler) or is turned off (``ACTORSERVE_DECODE_ATTENTION=gather``
or ``--decode-attention gather``) the runner keeps the torch path and says why (`status`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing", "-shared", "-fPIC", "-std=c11"]
MODES = ("auto", "inplace", "gather")


class DecodeKernel:
    """The loaded kernel: `run` fills ``out`` for one group of decode members."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = lib.paged_decode
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        fn.argtypes = [p, p, p, i, p, i, p, i, i, i, i, i, f, f, p, i]
        fn.restype = ctypes.c_int
        self._fn = fn

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
                      float(scale), float(softcap or 0.0), out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("the decode kernel could not allocate its score buffer")


_loaded: dict[str, tuple[DecodeKernel | None, str]] = {}


def _cache_dir() -> Path:
    root = os.environ.get("ACTORSERVE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "actorserve" / "kernels"


def _cpu_key() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return "unknown-cpu"
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(dest_dir: Path | None = None) -> Path:
    """Compile the kernel (or find it already built); return the shared object's path.
    Raises RuntimeError with the compiler's message when it cannot be built."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_key().encode()])).hexdigest()[:20]
    dest_dir = dest_dir or _cache_dir()
    dest = dest_dir / f"paged_decode-{key}.so"
    if dest.exists():
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: {(done.stderr or done.stdout).strip()[-800:]}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


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
