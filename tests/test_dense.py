"""Dense linears through oneDNN with weights packed at load (`engine.runners.dense`)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from actorserve.engine.runners import dense
from actorserve.engine.kernels import quant

pytestmark = pytest.mark.skipif(not dense._ops_available(), reason="this torch has no oneDNN linear ops")


def _module(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(2)
    mod = torch.nn.Module()
    mod.a = torch.nn.Linear(192, 96, bias=True)
    mod.b = torch.nn.Linear(96, 192, bias=False)
    mod.small = torch.nn.Linear(16, 64)                 # under MIN_WEIGHT: float32 keeps F.linear
    mod.emb = torch.nn.Embedding(10, 8)                 # not a linear: left alone
    return mod.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_compute_what_f_linear_does_at_every_width(dtype):
    mod = _module(dtype)
    small_packed = dtype is torch.bfloat16       # bf16 F.linear would compile a primitive per width
    assert dense.pack_model(mod) == 2 + small_packed
    assert getattr(mod.a, dense.PACKED) is not None and not hasattr(mod.emb, dense.PACKED)
    assert hasattr(mod.small, dense.PACKED) is small_packed and ("forward" in vars(mod.small)) is small_packed
    assert isinstance(mod.a.forward, dense.PackedLinear)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 7, 33, 513):
        x = torch.randn(rows, 192).to(dtype)
        got = mod.b(mod.a(x))
        want = F.linear(F.linear(x, mod.a.weight, mod.a.bias), mod.b.weight)
        assert got.shape == (rows, 192) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    x3 = torch.randn(2, 5, 192).to(dtype)[:, ::2]          # leading dims kept, a strided view
    torch.testing.assert_close(mod.a(x3).float(), F.linear(x3, mod.a.weight, mod.a.bias).float(),
                               atol=tol, rtol=tol)
    other = torch.randn(4, 192).to(torch.float64 if dtype == torch.float32 else torch.float32)
    with pytest.raises(RuntimeError):                   # another dtype takes F.linear, which refuses
        mod.a(other)


def test_a_quantized_linears_wide_steps_take_its_packed_weight(monkeypatch):
    mod = _module(torch.float32)
    torch.nn.init.normal_(mod.a.weight, std=0.1)
    quant.quantize_model(mod, "q4")
    assert isinstance(mod.a.forward, quant.QuantLinear)
    assert dense.pack_model(mod) == 2
    assert isinstance(mod.a.forward, quant.QuantLinear)   # the quantizer's forward stays
    calls = []
    real = dense.linear
    monkeypatch.setattr(dense, "linear", lambda m, x: (calls.append(x.shape[0]), real(m, x))[1])
    mod.a(torch.randn(quant.KERNEL_ROWS, 192))             # narrow: the kernel
    assert calls == []
    wide = torch.randn(quant.KERNEL_ROWS + 1, 192)
    got = mod.a(wide)                                     # wide: the packed dense weight
    assert calls == [quant.KERNEL_ROWS + 1]
    torch.testing.assert_close(got, F.linear(wide, mod.a.weight, mod.a.bias), atol=1e-5, rtol=1e-5)


def test_nothing_is_packed_where_onednn_disagrees(monkeypatch):
    mod = _module(torch.float32)
    monkeypatch.setattr(dense, "_agrees", lambda m, p: False)
    assert dense.pack_model(mod) == 0
    assert not hasattr(mod.a, dense.PACKED) and "forward" not in vars(mod.a)


def test_row_buckets_cover_every_width_with_little_padding():
    assert len(dense.BUCKETS) == 24 and dense.BUCKETS[0] == 8 and dense.BUCKETS[-1] == dense.CHUNK
    for rows in range(1, dense.CHUNK + 1):
        b = dense.bucket_rows(rows)
        assert b in dense.BUCKETS and b >= rows
        assert b == min(x for x in dense.BUCKETS if x >= rows)     # the smallest that fits
        if rows > 64:
            assert (b - rows) / rows < 0.25, rows
    assert [dense.bucket_rows(n) for n in (1, 8, 9, 17, 65, 128, 129, 257, 511, 513, 1000)] == \
        [8, 8, 16, 24, 80, 128, 160, 320, 512, 640, 1024]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_sees_only_bucketed_row_counts_and_each_row_keeps_its_result(monkeypatch, dtype):
    mod = _module(dtype)
    assert dense.pack_model(mod) == (2 if dtype is torch.float32 else 3)
    seen = []
    real = dense._product
    monkeypatch.setattr(dense, "_product", lambda x, p, b: (seen.append(x.shape[0]), real(x, p, b))[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    widths = (1, 3, 9, 70, 200, 511, 512, 513, 1100, 2100)
    for rows in widths:
        x = torch.randn(rows, 192).to(dtype)
        got = mod.a(x)
        assert got.shape == (rows, 96) and got.is_contiguous()
        torch.testing.assert_close(got.float(), F.linear(x, mod.a.weight, mod.a.bias).float(), atol=tol, rtol=tol)
        if rows <= dense.CHUNK:       # a row's result does not depend on its neighbours or the padding
            torch.testing.assert_close(got[:1].float(), mod.a(x[:1]).float(), atol=tol, rtol=tol)
    assert set(seen) <= set(dense.BUCKETS)
    # 70 -> 80, 200 -> 224, 513 -> 640, 1100 rows: 1024 + 76 -> 80; 2100: 1024 + 1024 + 52 -> 56
    assert sorted(set(seen)) == [8, 16, 56, 80, 224, 512, 640, 1024]


def test_the_onednn_caches_are_capped_before_torch_runs_unless_the_environment_says(monkeypatch):
    import subprocess
    import sys
    from actorserve.engine.runners import onednn_caches
    code = ("import os, actorserve.engine as e, torch; "
            "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])")
    env = {k: v for k, v in os.environ.items() if k not in onednn_caches.VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(onednn_caches.CAPACITY)] * 2
    out = subprocess.run([sys.executable, "-c", code], env={**env, "LRU_CACHE_CAPACITY": "64"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(onednn_caches.CAPACITY), "64"]     # a set value is kept
    for name in onednn_caches.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert onednn_caches.bound(32) == {n: "32" for n in onednn_caches.VARIABLES}


def test_benchmarks_can_turn_the_buckets_off(monkeypatch):
    monkeypatch.setattr(dense, "BUCKET", dense.BUCKET)          # restored after the test
    monkeypatch.setenv("ACTORSERVE_DENSE", "exact")
    mod = _module(torch.float32)
    assert dense.pack_model(mod) == 2 and dense.BUCKET is False
    seen = []
    real = dense._product
    monkeypatch.setattr(dense, "_product", lambda x, p, b: (seen.append(x.shape[0]), real(x, p, b))[1])
    x = torch.randn(70, 192)
    torch.testing.assert_close(mod.a(x), F.linear(x, mod.a.weight, mod.a.bias), atol=1e-5, rtol=1e-5)
    assert seen == [70]
