"""Where the q4/q8 kernels stop and the packed dense weights start is measured at load
(`engine.kernels.crossover`): the rule that reads the timings, what a measured choice changes
(every quantized weight's widest step, the report, the runner, ``/server_info``'s paths), the
memo a weights reload reuses, and the switches that keep the static widths."""

from __future__ import annotations

import pytest
import torch

from actorserve.engine.kernels import crossover, quant
from actorserve.engine.kernels.widths import kernel_takes


def _timings(kernel, dense, widths=crossover.WIDTHS):
    return [(w, kernel(w), dense(w)) for w in widths]


def test_the_kernels_keep_the_widths_where_they_are_clearly_faster():
    cross = crossover.crossing
    # faster at every width: the cap
    assert cross(_timings(lambda w: w, lambda w: 2 * w), cap=256) == 256
    # dense catches up between 32 (ratio 0.5) and 64 (1.5): the crossing of TIE, down to a multiple of 8
    t = [(8, 1.0, 4.0), (16, 2.0, 4.0), (32, 4.0, 8.0), (64, 12.0, 8.0), (128, 30.0, 10.0)]
    cut = 32 + 32 * (crossover.TIE - 0.5) / (1.5 - 0.5)
    assert cross(t, cap=256) == int(cut) // 8 * 8 == 40
    # a tie is the library's: the kernels lose a width they are not TIE-faster at
    assert cross([(8, 1.0, 2.0), (16, 0.98, 1.0)], cap=256) == 8
    assert cross([(8, 1.0, 2.0), (16, 0.96, 1.0), (32, 1.0, 1.0)], cap=256) == 16
    # at the first width already: the floor (bound by bytes, a quarter through the kernels)
    assert cross([(8, 5.0, 1.0), (16, 9.0, 1.0)], cap=256) == quant.MAX_ROWS
    assert cross([(8, 5.0, 1.0)], cap=256, floor=4) == 4
    # a dense time of zero never lets the kernels keep the width
    assert cross([(8, 1.0, 0.0)], cap=256) == quant.MAX_ROWS


def _model():
    import transformers as tr
    from test_model_families import COMMON

    torch.manual_seed(1)
    model = tr.LlamaForCausalLM(tr.LlamaConfig(**COMMON)).eval().to(torch.bfloat16)
    model.actorserve_quant = quant.quantize_model(model, "q4")
    if not model.actorserve_quant.b16:
        pytest.skip("this CPU has no avx512_bf16: no superblocks, so nothing is measured")
    return model


def _weights(model):
    """Every quantized weight (groups and members), and the LM head's."""
    head = model.lm_head.forward.w
    ws = []
    for mod in model.modules():
        ws += [getattr(mod, g).w for g in (quant.QKV_GROUP, quant.GATE_UP_GROUP) if hasattr(mod, g)]
        if isinstance(getattr(mod, "forward", None), quant.QuantLinear) and mod.forward.w is not head:
            ws.append(mod.forward.w)
    return ws, head


def test_a_measured_crossover_narrows_every_weight_and_says_where(monkeypatch):
    from actorserve.engine.runners import dense
    from actorserve.engine.runners.paths import phase_paths
    from actorserve.engine.runners.runner import build_engine

    monkeypatch.setenv(crossover.ENV, "measure")
    monkeypatch.setattr(crossover, "_MEMO", {})
    model = _model()
    cap = model.actorserve_quant.kernel_rows
    assert cap == quant.B16_ROWS
    asked = []

    def layers(w):             # the kernels 1 ms a row, dense 20 ms + 0.5 a row: dense from 64 on
        asked.append(w)
        return w * 1e-3, (20 + 0.5 * w) * 1e-3

    def head(w):               # the head's dense weight wins from 16 rows
        return w * 1e-3, (4 + 0.25 * w) * 1e-3
    found = crossover.calibrate(model, layers, head)
    # ratios 8: 0.33, 16: 0.57, 32: 0.89, 64: 1.23: the crossing of TIE lies between 32 and 40
    assert found.rows == 32 and found.head_rows == 8
    assert [w for w, _, _ in found.layers] == list(crossover.WIDTHS)
    assert found.layers[2] == (32, pytest.approx(32.0), pytest.approx(36.0))
    assert set(asked) == set(crossover.WIDTHS) and len(asked) == len(crossover.WIDTHS) * (crossover.REPEATS + 1)
    rep = model.actorserve_quant
    assert rep.kernel_rows == 32 and rep.crossover is found
    ws, head_w = _weights(model)
    assert len(ws) == 2 * (2 + 3 + 1 + 2 + 1) and {w.max_rows for w in ws} == {32}
    assert head_w.max_rows == 8
    # the steps follow: 32 rows through the kernels, 33 through the packed dense weight
    layer = model.model.layers[0]
    assert kernel_takes(layer.self_attn.o_proj, 32) and not kernel_takes(layer.self_attn.o_proj, 33)
    assert kernel_takes(model.lm_head, 8) and not kernel_takes(model.lm_head, 9)
    x = torch.randn(33, 64).bfloat16()
    assert torch.equal(layer.self_attn.o_proj(x), dense.linear(layer.self_attn.o_proj, x))
    engine = build_engine(model, num_blocks=32, block_size=4)
    assert engine.kernel_rows == engine.decode_rows == 32
    paths = phase_paths(rep, torch.bfloat16, "auto", "q4", 1)
    assert "steps > 32 rows (wide decode)" in paths and "decode 9-32 rows" in paths
    assert "measured at load" in paths["steps > 32 rows (wide decode)"]
    assert "32: 32.00 vs 36.00 ms" in paths["steps > 32 rows (wide decode)"]
    assert "up to 8 rows, dense from 9 (measured at load)" in paths["decode <= 8 rows"]
    assert "kernels up to 32 rows" in rep.describe()
    info = crossover.widths_info(model)                     # /server_info's kernel_widths
    assert info["layers"] == 32 and info["lm_head"] == 8 and info["chosen"] == "measured at load"
    assert info["measured_ms"]["layers"][2] == [32, pytest.approx(32.0), pytest.approx(36.0)]
    assert [w for w, _, _ in info["measured_ms"]["lm_head"]] == [8, 16, 32]

    # a reload quantizes again (the static widths) and reuses the load's measurement
    model.actorserve_quant = quant.quantize_model(model, "q4")
    assert {w.max_rows for w in _weights(model)[0]} == {cap}
    again = crossover.calibrate(model)
    assert again is found and len(asked) == len(crossover.WIDTHS) * (crossover.REPEATS + 1)
    assert {w.max_rows for w in _weights(model)[0]} == {32} and model.actorserve_quant.kernel_rows == 32


@pytest.mark.parametrize("env", [{crossover.ENV: "static"}, {"ACTORSERVE_Q4_ROWS": "12"}])
def test_the_static_widths_when_asked(monkeypatch, env):
    monkeypatch.delenv(crossover.ENV, raising=False)
    monkeypatch.setattr(crossover, "_MEMO", {})
    model = _model()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    before = model.actorserve_quant
    assert crossover.calibrate(model, lambda w: (1.0, 0.001), lambda w: (1.0, 0.001)) is None
    assert model.actorserve_quant is before and before.crossover is None
    assert {w.max_rows for w in _weights(model)[0]} == {before.kernel_rows}
    info = crossover.widths_info(model)
    assert info["chosen"].startswith("static") and info["measured_ms"] is None
    assert info["layers"] == before.kernel_rows and info["lm_head"] == min(quant.Q8_B16_ROWS, before.kernel_rows)


def test_an_unquantized_or_float32_model_measures_nothing(monkeypatch):
    import transformers as tr
    from test_model_families import COMMON

    monkeypatch.setenv(crossover.ENV, "measure")
    model = tr.LlamaForCausalLM(tr.LlamaConfig(**COMMON)).eval()
    model.actorserve_quant = None
    assert crossover.calibrate(model, lambda w: (1.0, 0.001)) is None
    assert crossover.widths_info(model) is None
    model.actorserve_quant = quant.quantize_model(model, "q4")      # float32: no superblocks
    assert not model.actorserve_quant.b16
    assert crossover.calibrate(model, lambda w: (1.0, 0.001)) is None
    assert model.actorserve_quant.crossover is None


def test_a_real_measurement_stays_within_the_static_widths_and_is_measured_once(monkeypatch):
    """The timers themselves (the step pool, the packed dense weights): whatever this machine
    measures, the widths stay between the floor and the static caps, every figure is a time,
    and the same weights measure once a process."""
    monkeypatch.setenv(crossover.ENV, "measure")
    monkeypatch.setattr(crossover, "_MEMO", {})
    monkeypatch.setattr(crossover, "REPEATS", 2)
    model = _model()
    found = crossover.calibrate(model)
    assert quant.MAX_ROWS <= found.rows <= quant.B16_ROWS
    assert quant.MAX_ROWS <= found.head_rows <= quant.Q8_B16_ROWS
    assert [w for w, _, _ in found.layers] == list(crossover.WIDTHS)
    assert [w for w, _, _ in found.head] == [w for w in crossover.WIDTHS if w <= quant.Q8_B16_ROWS]
    assert all(k > 0 and d > 0 for _, k, d in found.layers + found.head)
    ws, head = _weights(model)
    assert {w.max_rows for w in ws} == {found.rows} == {model.actorserve_quant.kernel_rows}
    assert head.max_rows == min(found.rows, found.head_rows)
    assert crossover.calibrate(model) is found
