"""Weight-only quantized decode (``--quantization q4``): fewer weight bytes per decode step.

Why. Decoding a few sequences reads every weight once per step, so its speed is the weights'
bytes over the memory bandwidth: SmolLM2-135M is 540 MB in fp32 and 270 MB in bf16, about
9-10 GB/s on this 2-core box, hence 25-55 ms a token whatever the arithmetic. llama.cpp runs
the same model from its GGUF's 4-bit blocks, about 98 MB.

What. Every linear layer whose input size is a multiple of 32 keeps its dense weight (for
prefill and wide batches, where the matmul is compute-bound and torch's kernels do well)
and gains a quantized copy used by steps of at most `MAX_ROWS` rows, through the C kernels of
`csrc/qgemv.c` (built by `cbuild`):

* q4 (the transformer's linears): GGUF's Q4_1 layout, 32 weights a group along the input,
  ``w = d * q + m``, q in 0..15, d and m float16: 5 bits a weight;
* q8 (the LM head, which is tied to the embeddings in SmolLM2): GGUF's Q8_0, ``w = d * q``,
  q int8, d float16: 8.5 bits a weight.

Exact for GGUF models. The embedded default model is converted from a GGUF whose linears are
Q4_1 and whose embeddings are Q8_0, and these are the quantizers that made them (min/max for
Q4_1, absmax for Q8_0): re-quantizing the dequantized weights gives back the same q, d and m,
so the quantized path computes with exactly the model's weights (`QuantReport.max_rel_err`
says how close; 0 up to float32 rounding for the default model). For a model that was not
quantized this way it is ordinary 4-bit quantization, with its usual loss: check it.

Arithmetic. Activations and accumulation stay float32 in the kernel; the output is cast to the
model's dtype. With bfloat16 activations (every step the kernels take, CPUs with avx512_bf16) the
q4 kernel multiplies the activations as they are by the nibbles as bfloat16 numbers
(vdpbf16ps; exact products, float32 sums) and applies d and m per group after: the same sums
in another order, about 10% faster a step (`_Lib.bf16_path` turns it off, for comparison).

8-bit activations (``--quantization q4a8``). The same weights; each product rounds its input
rows to int8 per 32-element group (one float32 scale a group: llama.cpp's Q8_1, the arithmetic
its CPU backend multiplies these GGUF blocks with) and sums the products in int32 with
avx512_vnni's vpdpbusd, 64 weights an instruction, then scales per group (`csrc/act8.c`; a
portable C path elsewhere computes the same integer sums). The LM head's q8 weights are then
kept offset by 128 (uint8), as the instruction wants. Faster, and not exact: the activations'
rounding is the model's only change (greedy tokens drift sooner than with q4; the perplexity
figures are in docs/engine.md).

Threads. `StepPool`: during a decode step the kernels' worker threads spin between products.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

# the block formats (GGUF's Q4_1 and Q8_0) and the kernels' regroupings of them
from .formats import GROUP, dequantize_q4, dequantize_q8, quantize_q4, quantize_q8, repack_b16, repack_n16, repack_q8b16  # noqa: F401
from ..runners import dense
# csrc/qgemv.c's MAXM, and how wide a step the kernels take
from .widths import B16_ROWS, DOT_ROWS, KERNEL_ROWS, MAX_ROWS, Q8_B16_ROWS, Q8_BF16_ROWS, _kernel_rows, kernel_rows, weight_rows  # noqa: F401

# the kernels' library (csrc/decode_step.c) and their step pool
from .qlib import LIBRARY, StepPool, _Lib, step_pool  # noqa: F401

log = logging.getLogger(__name__)

MODES = ("auto", "none", "q4", "q4a8")
EXACT_TOL = 1e-5        # auto: a linear is "exact" when its re-quantized weights are within this
                        # fraction of its largest weight (4-bit rounding is ~3e-2; GGUF's own ~1e-7)
ACT8 = 16               # csrc/qgemv.c's QG_ACT8: a product of 8-bit activations (act8.c)
N16 = 32                # csrc/qgemv.c's QG_N16: with ACT8, q4 in q4n16.c's superblocks
N16_MAX_ROWS = 65536    # its N16_MAXM: the superblock kernel takes prefill too
B16 = 64                # csrc/qgemv.c's QG_B16: q4 (q8) in q4b16.c's (q8b16.c's) superblocks, bfloat16 activations


def _parallel_min() -> int:
    """Weights below which a product runs on one thread. With ``OMP_WAIT_POLICY=PASSIVE`` and no
    spin, OpenMP threads sleep between parallel regions and waking them for a small matrix
    costs more than they save (one SmolLM2 sequence: 26.2 ms a step with every product
    parallel, 17.8 with this rule); with a short spin (``GOMP_SPINCOUNT``, set by hand, see
    `actorserve.omp`) they are still awake for the next product and every product is better
    parallel (benchmarks/quant_decode.py)."""
    try:
        spin = int(os.environ.get("GOMP_SPINCOUNT", "0"))
    except ValueError:
        spin = 0
    return 0 if spin > 0 else 4_000_000


PARALLEL_MIN = _parallel_min()


class _Weights:
    """One quantized weight as the kernel reads it: q (packed), d, m (q4 only), an optional
    float32 bias, and their addresses, taken once (the tensors never move). With `act8` the
    products round their activations to 8 bits; a q4 weight whose N is a multiple of 16 is then
    also held in `q4n16.c`'s superblocks (`sb`, or given: a group's members share its), which
    take any number of rows (prefill too), not only `MAX_ROWS`. A q4 weight of a bfloat16 model
    whose N is a multiple of 16 is held in `q4b16.c`'s superblocks as well (`sb16`, set by
    `use_b16`): its products of bfloat16 rows take that kernel, up to `B16_ROWS` rows; a q8 one
    (an LM head kept as Q8_0) in `q8b16.c`'s, up to `Q8_B16_ROWS`."""

    def __init__(self, bits: int, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 bias: torch.Tensor | None, act8: bool = False, sb: torch.Tensor | None = None) -> None:
        self.bits, self.q, self.d, self.m, self.bias, self.act8 = bits, q, d, m, bias, act8
        self.N = q.shape[0]
        self.K = q.shape[1] * (8 // bits)
        self.sb = self.sb16 = None
        if act8 and bits == 4 and self.N % 16 == 0 and m is not None:
            self.sb = sb if sb is not None else repack_n16(q, d, m)
        self.kind = bits | (ACT8 if act8 else 0) | (N16 if self.sb is not None else 0)   # what the kernel is told
        self.rebind()
        self.size = self.N * self.K                                # weights
        self.max_rows = MAX_ROWS if act8 else KERNEL_ROWS
        if self.sb is not None and _act8_simd():     # the portable loops are too slow for prefill
            self.max_rows = N16_MAX_ROWS

    def b16_able(self) -> bool:
        """Whether this weight can take `q4b16.c`'s superblocks (q4) or `q8b16.c`'s (q8): no
        8-bit activations, N a multiple of 16."""
        return (not self.act8 and self.N % 16 == 0
                and (self.bits == 4 and self.m is not None or self.bits == 8))

    def use_b16(self, sb16: torch.Tensor | None = None, rows: int = B16_ROWS) -> None:
        """Hold the weights in `q4b16.c`'s (`q8b16.c`'s) superblocks too (`sb16`, or given: a
        group's members share its) and send bfloat16 products of up to `rows` rows there."""
        if sb16 is None:
            sb16 = repack_b16(self.q, self.d, self.m) if self.bits == 4 else repack_q8b16(self.q, self.d)
        self.sb16 = sb16
        self.kind = self.bits | B16
        self.max_rows = rows
        self.rebind()

    def rebind(self) -> None:
        """Take the tensors' addresses (again: `memory_release` reallocates them at a resume)."""
        q = self.sb if self.sb is not None else self.sb16 if self.sb16 is not None else self.q
        d, m = self.d, self.m
        self.ptrs = (q.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr())
        self.bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def run(self, lib: _Lib, x: torch.Tensor) -> torch.Tensor | None:
        """``x [rows, K] @ W^T (+ bias)`` through the kernel, or None when it does not take `x`
        (more than `max_rows` rows, a dtype it does not read, autograd)."""
        K = x.shape[-1]
        rows = x.numel() // K if K else 0
        if rows == 0 or rows > self.max_rows or x.dtype not in _KERNEL_DTYPES or x.requires_grad:
            return None
        if self.sb16 is not None and x.dtype is not torch.bfloat16:
            return None                 # the superblock kernel reads bfloat16 only: dense
        x2 = x.reshape(rows, K)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch.empty((rows, self.N), dtype=x.dtype)
        bf16 = 1 if x.dtype is torch.bfloat16 else 0
        q, d, m = self.ptrs
        rc = lib.qgemv(self.kind, x2.data_ptr(), bf16, rows, K, q, d, m, self.N, self.bias_ptr,
                       y.data_ptr(), bf16, 1 if self.size * max(1, rows // MAX_ROWS) < PARALLEL_MIN
                       else torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"qgemv refused rows={rows} K={K}")
        return y


class QuantLinear:
    """Replaces one ``nn.Linear``'s forward: at most `KERNEL_ROWS` rows go through the quantized
    kernel (`MAX_ROWS` with 8-bit activations, any number for q4a8's superblocks:
    `_Weights.max_rows`), more through the dense weight the module keeps."""

    def __init__(self, module: torch.nn.Linear, kind: str, lib: _Lib, act8: bool = False) -> None:
        self.module, self.kind, self.lib = module, kind, lib
        w = module.weight
        self.N, self.K = w.shape
        if kind == "q4":
            q, d, m = quantize_q4(w)
            self.err = (dequantize_q4(q, d, m) - w.float()).abs().max().item()
        else:
            (q, d), m = quantize_q8(w), None
            self.err = (dequantize_q8(q, d) - w.float()).abs().max().item()
            if act8:                # the 8-bit-activation kernel reads q + 128 as uint8 (act8.c)
                q = (q.view(torch.uint8) ^ 0x80).contiguous()
        self.scale = w.float().abs().max().item() or 1.0
        bias = None if module.bias is None else module.bias.detach().float()
        self.w = _Weights(4 if kind == "q4" else 8, q, d, m, bias, act8)
        self.nbytes = q.numel() * q.element_size() + d.numel() * 2 * (2 if m is not None else 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w.run(self.lib, x)
        if y is None:
            return dense.linear(self.module, x)
        return y.view(*x.shape[:-1], self.N)


class QuantGroup:
    """Linears that read the same input (q/k/v, gate/up), run as one kernel call over their
    concatenated weights for steps of at most `MAX_ROWS` rows: one pass over the input and
    one call instead of two or three. Wider steps call the members one by one (their dense
    weights). The members' quantized tensors become views of the concatenation, so nothing
    is held twice."""

    def __init__(self, members: list[QuantLinear]) -> None:
        self.members = members
        ws = [ql.w for ql in members]
        self.sizes = [w.N for w in ws]
        q = torch.cat([w.q for w in ws])
        d = torch.cat([w.d for w in ws])
        m = torch.cat([w.m for w in ws]) if ws[0].m is not None else None
        bias = None
        if any(w.bias is not None for w in ws):
            bias = torch.cat([w.bias if w.bias is not None else torch.zeros(w.N) for w in ws])
        sb = torch.cat([w.sb for w in ws]) if all(w.sb is not None for w in ws) else None
        self.w = _Weights(ws[0].bits, q, d, m, bias, ws[0].act8, sb)
        at = 0
        for ql, w in zip(members, ws):                  # share the storage
            sl = slice(at, at + w.N)
            ql.w = _Weights(w.bits, q[sl], d[sl], None if m is None else m[sl],
                            None if bias is None or w.bias is None else bias[sl], w.act8,
                            None if sb is None else sb[at // 16:(at + w.N) // 16])
            at += w.N
        self.lib = members[0].lib

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.w.run(self.lib, x)
        if y is None:
            return tuple(ql.module(x) for ql in self.members)
        lead = x.shape[:-1]
        return tuple(part.view(*lead, n) for part, n in zip(y.split(self.sizes, dim=-1), self.sizes))

    @staticmethod
    def of(modules: list[Any]) -> QuantGroup | None:
        """The group of these linears when all of them run q4 on the same input size."""
        qls = [getattr(mod, "forward", None) for mod in modules]
        if not all(isinstance(ql, QuantLinear) and ql.kind == "q4" for ql in qls):
            return None
        if len({ql.K for ql in qls}) != 1 or len({ql.w.act8 for ql in qls}) != 1:
            return None
        return QuantGroup(qls)


def _b16_group(group: QuantGroup, rows: int) -> None:
    """Give `group` `q4b16.c`'s superblocks, its members views of them (each member's N a
    multiple of 16: else each its own)."""
    if not group.w.b16_able():
        return
    group.w.use_b16(rows=rows)
    at = 0
    for ql in group.members:
        w = ql.w
        if w.b16_able():
            w.use_b16(group.w.sb16[at // 16:(at + w.N) // 16] if at % 16 == 0 else None, rows)
        at += w.N


# Attributes quantize_model sets on a model's modules, read by the paged runner's forward.
QKV_GROUP = "_actorserve_qkv"           # on an attention module with q/k/v_proj
GATE_UP_GROUP = "_actorserve_gate_up"   # on an MLP with gate_proj and up_proj


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _act8_simd() -> bool:
    """Whether this machine's kernels multiply 8-bit activations with avx512_vnni."""
    return _Lib().act8_simd


@dataclass(frozen=True, slots=True)
class QuantReport:
    mode: str
    layers: int                 # linears given a quantized copy
    skipped: int                # linears left dense (input size not a multiple of 32; auto: not exact)
    quant_bytes: int            # bytes a decode step reads from the quantized copies
    dense_bytes: int            # what the same layers hold dense, in the model's dtype
    max_rel_err: float          # max |dequantized - dense| / max |dense| over the quantized layers
    asked: str = ""             # the --quantization value (auto, q4, q4a8)
    kernel_rows: int = MAX_ROWS  # the widest step through the kernels
    b16: bool = False           # the q4 weights are in q4b16.c's superblocks (bfloat16 activations)

    def describe(self) -> str:
        how = f"auto -> {self.mode}" if self.asked == "auto" else self.mode
        return (f"{how}: {self.layers} linears quantized ({self.quant_bytes / 1e6:.0f} MB read "
                f"per decode step instead of {self.dense_bytes / 1e6:.0f} MB; steps of <= {self.kernel_rows} rows), "
                f"{self.skipped} left dense, max relative weight error {self.max_rel_err:.2g}")


def quantize_model(model: Any, mode: str | None, dtype: torch.dtype | None = None) -> QuantReport | None:
    """Give every eligible linear of `model` a quantized decode path (see the module docstring);
    the LM head gets q8, the rest q4. None for mode ``none``. Mode ``auto`` is q4 for the
    linears whose weights re-quantize exactly (`EXACT_TOL`: weights that came from GGUF's
    Q4_1/Q8_0 blocks, so the kernels compute with the model's own weights) and dense for the
    rest; None when no linear is exact. `dtype`: the dtype the model will run in (a load
    quantizes from float32, then casts), which sets how wide a step the kernels take
    (`widths.kernel_rows`); by default its parameters' dtype."""
    asked = (mode or "none").lower()
    if asked not in MODES:
        raise ValueError(f"unknown quantization {asked!r}; use one of {', '.join(MODES)}")
    if asked == "none":
        return None
    mode = "q4" if asked == "auto" else asked
    lib = _Lib()
    getter = getattr(model, "get_output_embeddings", None)    # a bare module (tests) has no head
    head = getter() if callable(getter) else None
    layers = skipped = qbytes = dbytes = 0
    err = 0.0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if mod.in_features % GROUP:
            skipped += 1
            continue
        ql = QuantLinear(mod, "q8" if mod is head else "q4", lib, act8=mode == "q4a8")
        if asked == "auto" and ql.err / ql.scale > EXACT_TOL:
            skipped += 1                       # not the model's own blocks: stays dense
            continue
        mod.forward = ql                       # an instance attribute: nn.Module.__call__ finds it
        layers += 1
        qbytes += ql.nbytes
        dbytes += mod.weight.numel() * mod.weight.element_size()
        err = max(err, ql.err / ql.scale)
    if layers == 0:
        log.info("quantization %s: no linear re-quantizes exactly, all stay dense", asked)
        return None
    for mod in model.modules():
        if all(isinstance(getattr(mod, f"{p}_proj", None), torch.nn.Linear) for p in "qkv"):
            group = QuantGroup.of([mod.q_proj, mod.k_proj, mod.v_proj])
            if group is not None:
                setattr(mod, QKV_GROUP, group)
        if all(isinstance(getattr(mod, p, None), torch.nn.Linear) for p in ("gate_proj", "up_proj")):
            group = QuantGroup.of([mod.gate_proj, mod.up_proj])
            if group is not None:
                setattr(mod, GATE_UP_GROUP, group)
    if mode == "q4a8" and not lib.act8_simd:
        log.warning("q4a8: this CPU has no avx512_vnni, so its products run as portable C loops "
                    "(slower than q4; prefill keeps the dense weights)")
    rows, b16 = MAX_ROWS, False
    if mode != "q4a8":
        if dtype is None:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        dot = lib.bf16_path(-1) == 1
        b16 = dot and lib.b16 and dtype is torch.bfloat16
        rows = kernel_rows(dtype, dot, b16)
        for mod in model.modules():
            ql = getattr(mod, "forward", None) if isinstance(mod, torch.nn.Linear) else None
            groups = [g for g in (getattr(mod, QKV_GROUP, None), getattr(mod, GATE_UP_GROUP, None)) if g is not None]
            for w in [ql.w] if isinstance(ql, QuantLinear) else [g.w for g in groups]:
                if w.sb is None and w.sb16 is None:
                    w.max_rows = weight_rows(w.bits, dtype, dot)
            if b16:
                for g in groups:
                    _b16_group(g, rows)
        if b16:                 # the linears outside a group (o_proj, down_proj)
            for mod in model.modules():
                ql = getattr(mod, "forward", None) if isinstance(mod, torch.nn.Linear) else None
                if isinstance(ql, QuantLinear) and ql.w.sb16 is None and ql.w.b16_able():
                    ql.w.use_b16(rows=rows if ql.w.bits == 4 else min(rows, Q8_B16_ROWS))
    report = QuantReport(mode, layers, skipped, qbytes, dbytes, err, asked, rows, mode != "q4a8" and b16)
    log.info("quantization %s", report.describe())
    return report
