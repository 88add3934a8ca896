"""`actorserve.heap.settle`: what `actorserve serve` does to the Python heap once it has loaded."""

from __future__ import annotations

import gc

from actorserve import heap


def test_settle_freezes_the_loaded_heap_and_raises_the_young_threshold():
    before = gc.get_threshold()
    kept = [object() for _ in range(10)]        # something alive to freeze
    try:
        gc.unfreeze()
        heap.settle()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (heap.GEN0_THRESHOLD, before[1], before[2])
        assert heap.GEN0_THRESHOLD > before[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert kept


_ARENAS = r"""
import ctypes, ctypes.util, os, re, sys, tempfile, threading
from actorserve import heap
capped = heap.cap_malloc_arenas() if sys.argv[1] == "cap" else None
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
go = threading.Barrier(8)

def work():
    go.wait()                                   # all at once: each thread asks for an arena
    ptrs = [libc.malloc(4096) for _ in range(2000)]
    for p in ptrs:
        libc.free(p)

ts = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in ts]
[t.join() for t in ts]
path = tempfile.mktemp()
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
f = libc.fopen(path.encode(), b"w")
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.malloc_info(0, f)
libc.fclose.argtypes = [ctypes.c_void_p]
libc.fclose(f)
print(capped, len(re.findall(r'<heap nr="', open(path).read())))
os.unlink(path)
"""


def test_the_server_caps_glibc_arenas_unless_the_environment_says_otherwise():
    import os
    import subprocess
    import sys

    import pytest

    if not os.confstr("CS_GNU_LIBC_VERSION"):
        pytest.skip("not glibc")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}

    def arenas(mode: str, **extra: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _ARENAS, mode], env={**env, **extra},
                             capture_output=True, text=True, timeout=120, check=True).stdout.split()
        return out[0], int(out[1])

    assert arenas("cap") == ("True", 2)                   # the main arena and one more
    capped, n = arenas("plain")
    assert capped == "None" and n > 2                     # glibc's own rule: up to 8 a core
    assert arenas("cap", MALLOC_ARENA_MAX="3") == ("False", 3)    # the environment wins


def test_the_cli_caps_the_arenas_before_it_imports_a_subcommand(monkeypatch):
    from actorserve import cli

    order = []
    monkeypatch.setattr(heap, "cap_malloc_arenas", lambda: order.append("cap") or True)
    real = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: order.append("imports") or real())
    try:
        cli.main(["models", "--help"])
    except SystemExit:
        pass
    assert order[:2] == ["cap", "imports"]
