"""OpenMP defaults (`actorserve.omp`) and the q4 threads rule that follows the spin setting."""

from __future__ import annotations

import os

from actorserve import omp
from actorserve.engine import quant


def test_defaults_fill_only_what_the_environment_leaves_unset(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    omp.apply_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"                 # the user's word wins
    assert os.environ["GOMP_SPINCOUNT"] == omp.OMP_ENV["GOMP_SPINCOUNT"] == "10000"


def test_small_products_stay_on_one_thread_only_without_a_spin(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert quant._parallel_min() == 0
    for value in ("0", "lots"):
        monkeypatch.setenv("GOMP_SPINCOUNT", value)
        assert quant._parallel_min() == 4_000_000
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert quant._parallel_min() == 4_000_000
