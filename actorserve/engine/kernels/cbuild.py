"""Build the engine's small C kernels (`csrc/*.c`) with the machine's C compiler, once.

Plain C with OpenMP and no torch headers, so a kernel compiles in about a second on first use:
``cc -O3 -march=native -fopenmp -shared``, into ``$ACTORSERVE_KERNEL_CACHE`` or
``~/.cache/actorserve/kernels``, named by a hash of the sources (all of ``csrc/``: one may
include another), the flags, the compiler's version and the CPU's model and flags
(``-march=native`` code is only reused on the CPU it was built for), written to a temporary name and renamed into place. Callers load the result with
ctypes (which releases the GIL for each call); its ``libgomp`` is the one torch already loaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing", "-shared", "-fPIC", "-std=c11"]


def cache_dir() -> Path:
    root = os.environ.get("ACTORSERVE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "actorserve" / "kernels"


def _cpu_key() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return "unknown-cpu"
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(name: str, dest_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile ``csrc/<name>.c`` (or find it already built); return the shared object's path.
    `extra_flags` go after the usual ones (tests build the portable paths with
    ``-mno-avx512f``). Raises RuntimeError with the compiler's message when it cannot be built."""
    flags = [*FLAGS, *extra_flags]
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    source = CSRC / f"{name}.c"
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    # every file of csrc/, not only `source`: a kernel may #include another
    sources = [source.read_bytes()] + [p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")) if p != source]
    key = hashlib.sha256(b"\0".join([*sources, " ".join(flags).encode(), version.encode(),
                                     _cpu_key().encode()])).hexdigest()[:20]
    dest_dir = dest_dir or cache_dir()
    dest = dest_dir / f"{name}-{key}.so"
    if dest.exists():
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: {(done.stderr or done.stdout).strip()[-800:]}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest
