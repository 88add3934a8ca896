"""OpenMP defaults (`actorserve.omp`) and the q4 threads rule that follows the spin setting."""

from __future__ import annotations

import os

from actorserve import omp
from actorserve.engine.kernels import quant


def test_defaults_fill_only_what_the_environment_leaves_unset(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    omp.apply_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"                 # the user's word wins
    monkeypatch.delenv("OMP_WAIT_POLICY")
    omp.apply_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert omp.OMP_ENV["GOMP_SPINCOUNT"] == "30000"                  # a short spin (omp.py says why)


def test_small_products_stay_on_one_thread_only_without_a_spin(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert quant._parallel_min() == 0
    for value in ("0", "lots"):
        monkeypatch.setenv("GOMP_SPINCOUNT", value)
        assert quant._parallel_min() == 4_000_000
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert quant._parallel_min() == 4_000_000


def test_idle_threads_are_given_back_and_torch_runs_on():
    # a child process: pausing OpenMP here would touch the test run's own threads
    import subprocess
    import sys
    code = ("import torch\n"
            "x = torch.randn(256, 1024); (x @ x.T).sum()\n"        # a parallel region: a team exists
            "from actorserve import omp\n"
            "ok = omp.release_idle_threads()\n"
            "y = (x @ x.T).sum()\n"                                  # and torch goes on after it
            "print(ok, bool(torch.isfinite(y)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
