"""Where the q4/q8 kernels stop and the packed dense weights start, measured on this machine at
load (issue 27: "chosen per step from its row count", on every CPU).

A decode step of few rows is bound by the bytes it reads, so the 4-bit superblocks (a quarter of
bf16's bytes) win there on any CPU; a wide one is bound by the arithmetic, where the kernels'
``vdpbf16ps`` dot products meet whatever the CPU's matrix library has: on the 2-core AMD EPYC
(avx512_bf16, no AMX) the same dot products, so the kernels keep every width up to
`widths.B16_ROWS`; on a CPU with AMX, oneDNN's tiles, which may be several times faster from
some width on. A constant measured on one CPU cannot say where that is on another, so the load
times both paths over the model's own products (a few of its layers, every product of each, the
rows the kernels take, the dense weights as `engine.runners.dense` packed them) at widths of 8 to
the static cap and keeps the kernels up to the width where the dense weight catches up
(`crossing`). The LM head (q8) is timed the same way up to its own cap.

The choice only narrows the static widths (`widths.B16_ROWS`, `widths.Q8_B16_ROWS`): every width
below them is one the kernels already take, so nothing new is exercised. It is memoised per
process (the same weights' shapes, dtype and threads measure once; a weights reload reuses it).
``ACTORSERVE_CROSSOVER=static`` keeps the static widths (the test suite does, so that its steps
take the same path on every run); ``ACTORSERVE_Q4_ROWS`` pins a width and skips the measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .widths import MAX_ROWS

log = logging.getLogger(__name__)

WIDTHS = (8, 16, 32, 64, 128, 256)   # rows timed (those up to the cap)
TIE = 0.97        # the kernels keep a width only below this share of the dense time: a tie is the library's
LAYERS = 6        # layers timed (spread over the model): every product of each
REPEATS = 5       # medians of this many alternations (kernels, dense, kernels, ...)
ENV = "ACTORSERVE_CROSSOVER"


@dataclasses.dataclass(frozen=True, slots=True)
class Crossover:
    """What the load measured and chose: `rows` for the layers' q4 products, `head_rows` for the
    q8 LM head; `layers` and `head`: (width, kernels ms, dense ms) medians."""
    rows: int
    head_rows: int | None
    layers: tuple[tuple[int, float, float], ...]
    head: tuple[tuple[int, float, float], ...] = ()

    def describe(self) -> str:
        def table(rows: Sequence[tuple[int, float, float]]) -> str:
            return ", ".join(f"{w}: {k:.2f} vs {d:.2f} ms" for w, k, d in rows)
        text = f"kernels up to {self.rows} rows (measured at load, kernels vs dense: {table(self.layers)})"
        if self.head_rows is not None:
            text += f"; the q8 head up to {self.head_rows} rows ({table(self.head)})"
        return text


def crossing(times: Sequence[tuple[int, float, float]], cap: int, floor: int = MAX_ROWS) -> int:
    """The widest step for the kernels from (width, kernels, dense) timings in rising widths:
    the kernels keep a width while they take under `TIE` of the dense time; between the last
    width they keep and the first they lose, the width where the two times' ratio crosses
    `TIE` (linearly), rounded down to a multiple of 8. All kept: `cap`. At least `floor` (a step
    that few rows is bound by the bytes it reads, a quarter through the kernels)."""
    last_w, last_r = None, None
    for w, k, d in times:
        ratio = k / d if d > 0 else float("inf")
        if ratio >= TIE:
            if last_w is None:
                return floor
            cut = last_w + (w - last_w) * (TIE - last_r) / (ratio - last_r)
            return max(floor, last_w, int(cut) // 8 * 8)
        last_w, last_r = w, ratio
    return cap


Measure = Callable[[int], tuple[float, float]]     # width -> (kernels s, dense s), one alternation


def _medians(measure: Measure, widths: Sequence[int], repeats: int) -> tuple[tuple[int, float, float], ...]:
    out = []
    for w in widths:
        measure(w)                                  # warm: oneDNN compiles the shape once
        ks, ds = zip(*(measure(w) for _ in range(repeats)))
        out.append((w, statistics.median(ks) * 1e3, statistics.median(ds) * 1e3))
    return tuple(out)


def layer_products(model: Any) -> list[list[tuple[Any, list[Any]]]]:
    """Per layer, its quantized products: (the kernels' weights, the dense linears they stand
    for): q/k/v (one group), o_proj, gate/up (one group), down_proj."""
    from .quant import GATE_UP_GROUP, QKV_GROUP, QuantLinear
    out = []
    for layer in model.model.layers:
        prods = []
        for parent, group, names in ((layer.self_attn, QKV_GROUP, ("q_proj", "k_proj", "v_proj")),
                                     (layer.self_attn, None, ("o_proj",)),
                                     (layer.mlp, GATE_UP_GROUP, ("gate_proj", "up_proj")),
                                     (layer.mlp, None, ("down_proj",))):
            mods = [getattr(parent, n, None) for n in names]
            g = getattr(parent, group, None) if group else None
            if g is not None:
                prods.append((g.w, mods))
            elif len(mods) == 1 and isinstance(getattr(mods[0], "forward", None), QuantLinear):
                prods.append((mods[0].forward.w, mods))
        out.append(prods)
    return out


def timer(products: list[tuple[Any, list[Any]]], lib: Any, pool: Any) -> Measure:
    """One alternation over `products` at a width: the kernels as a step runs them (the step
    pool spinning, torch on one thread), then the packed dense weights (torch's threads)."""
    from ..runners import dense
    from ..runners.runner import _torch_threads

    def run(width: int) -> tuple[float, float]:
        xs: dict[int, torch.Tensor] = {}

        def x_of(k: int) -> torch.Tensor:
            if k not in xs:
                xs[k] = torch.randn(width, k).bfloat16()
            return xs[k]
        with pool if pool is not None else contextlib.nullcontext(), _torch_threads(1):
            t0 = time.perf_counter()
            for w, _ in products:
                w.run(lib, x_of(w.K))
            t1 = time.perf_counter()
        for _, mods in products:
            for mod in mods:
                dense.linear(mod, x_of(mod.in_features))
        return t1 - t0, time.perf_counter() - t1
    return run


_MEMO: dict[tuple, Crossover] = {}


def _key(model: Any) -> tuple:
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    return shapes, next(model.parameters()).dtype, torch.get_num_threads()


def calibrate(model: Any, measure: Measure | None = None, head_measure: Measure | None = None) -> Crossover | None:
    """Measure (or reuse) where the dense weights catch up with the kernels and narrow the
    kernels' widths to it (see the module docstring); None where nothing is measured: no q4b16
    superblocks, ``ACTORSERVE_CROSSOVER=static``, or ``ACTORSERVE_Q4_ROWS`` set. `measure`,
    `head_measure`: injected timers (tests)."""
    from .qlib import step_pool
    from .quant import _Lib
    from .widths import Q8_B16_ROWS

    report = getattr(model, "actorserve_quant", None)
    if (report is None or not report.b16 or os.environ.get(ENV, "measure") == "static"
            or os.environ.get("ACTORSERVE_Q4_ROWS")):
        return None
    cap = report.kernel_rows
    head_w = _head_weight(model)
    head_cap = min(cap, Q8_B16_ROWS) if head_w is not None else None
    key = _key(model)
    found = _MEMO.get(key) if measure is None and head_measure is None else None
    if found is None:
        t0 = time.perf_counter()
        lib, pool = _Lib(), step_pool(model)
        if measure is None:
            per_layer = layer_products(model)
            step = max(1, len(per_layer) // LAYERS)
            measure = timer([p for layer in per_layer[::step][:LAYERS] for p in layer], lib, pool)
        layers = _medians(measure, [w for w in WIDTHS if w <= cap], REPEATS)
        head: tuple[tuple[int, float, float], ...] = ()
        if head_cap is not None:
            if head_measure is None:
                head_measure = timer([(head_w, [model.get_output_embeddings()])], lib, pool)
            head = _medians(head_measure, [w for w in WIDTHS if w <= head_cap], REPEATS)
        found = Crossover(crossing(layers, cap), None if head_cap is None else crossing(head, head_cap),
                          layers, head)
        _MEMO[key] = found
        log.info("crossover: %s (%.1f s)", found.describe(), time.perf_counter() - t0)
    apply(model, found)
    return found


def _head_weight(model: Any) -> Any:
    from .quant import QuantLinear
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    ql = getattr(head, "forward", None)
    return ql.w if isinstance(ql, QuantLinear) and ql.w.sb16 is not None and ql.w.bits == 8 else None


def apply(model: Any, found: Crossover) -> None:
    """Narrow every quantized weight's widest step to the chosen widths, and say so in the
    model's quantization report (which the runner and ``/server_info`` read)."""
    from .quant import GATE_UP_GROUP, QKV_GROUP, QuantLinear
    head_w = _head_weight(model)
    for mod in model.modules():
        ws = [getattr(mod, g).w for g in (QKV_GROUP, GATE_UP_GROUP) if getattr(mod, g, None) is not None]
        ql = getattr(mod, "forward", None) if isinstance(mod, torch.nn.Linear) else None
        if isinstance(ql, QuantLinear):
            ws.append(ql.w)
        for w in ws:
            if w is head_w:
                w.max_rows = min(w.max_rows, found.rows, found.head_rows or found.rows)
            else:
                w.max_rows = min(w.max_rows, found.rows)
    model.actorserve_quant = dataclasses.replace(model.actorserve_quant, kernel_rows=min(
        model.actorserve_quant.kernel_rows, found.rows), crossover=found)


def widths_info(model: Any) -> dict[str, Any] | None:
    """The widest step each kind of quantized weight takes, and whether it was measured
    (``/server_info``'s ``kernel_widths``); None for a model without quantized weights."""
    from .quant import QuantLinear
    report = getattr(model, "actorserve_quant", None)
    if report is None:
        return None
    getter = getattr(model, "get_output_embeddings", None)
    head = getattr(getter() if callable(getter) else None, "forward", None)
    found = report.crossover
    return {
        "layers": report.kernel_rows,
        "lm_head": head.w.max_rows if isinstance(head, QuantLinear) else None,
        "chosen": "measured at load" if found is not None else "static (engine/kernels/widths.py)",
        "measured_ms": None if found is None else {
            "layers": [list(t) for t in found.layers], "lm_head": [list(t) for t in found.head]},
    }
