"""A quantized decode step's layers in one C call (`csrc/decode_step.c`, ``decode_layers``).

Why. With q4, the step pool and the C glue, one SmolLM2 sequence decoded in about 9 ms a step:
about 5.5 ms in the quantized products and most of the rest in Python between them, some
twenty calls a layer (each product's wrapper, the views and splits, the K/V write, the
attention wrapper, SiLU and the multiply), a few microseconds each, 30 layers a step.

What. For a Llama-shaped model (separate q/k/v and gate/up, both grouped by `quant`; HF's
Llama-style norms; SiLU MLP; no per-head norms, sandwich norms or soft-capping) quantized
with q4 and decoding with the in-place attention kernel: a step whose rows are all decode
rows of one attention group (at most the runner's `kernel_rows`) runs every layer in one call, the
operations `PagedLlamaRunner._forward_glued` makes one by one, in the same order and with
the same arithmetic (SiLU's exponential is C's ``expf`` rather than torch's vectorised one: a
float32 rounding apart). In a narrow step the runner lays prompt chunks and speculation's
verify rows out as decode rows too (`paged_attention.plan_step`'s `decode_rows`: each row's
context ends at its own position), so a short prompt's prefill is one call as well. Anything
else (a step planned with chunks, another family) takes the glued or the plain path. A step
with LoRA adapter members runs fused too: each product is followed by its adapters' deltas
(`lora_kernel`). The scheduler's ask to give
the step up (the runner's `PreemptFlag`) is read at each layer boundary, as the Python paths
read it: set, the call returns early and the step raises `StepPreempted`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import quant
from ..runners.paged_attention import StepPlan
from ..scheduling.base import StepPreempted

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _QMat(ctypes.Structure):
    _fields_ = [("q", _p), ("d", _p), ("m", _p), ("bias", _p), ("N", _i), ("K", _i), ("bits", _i)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QMat), ("o", _QMat), ("gate_up", _QMat), ("down", _QMat),
                ("in_norm", _p), ("post_norm", _p), ("in_eps", _f), ("post_eps", _f),
                ("k_cache", _p), ("v_cache", _p)]


class _Step(ctypes.Structure):
    _fields_ = [(name, _i) for name in ("T", "D", "nh", "nkv", "hd", "inter", "rd", "bf16",
                                        "block_size", "nb", "nthreads")] + [("scale", _f)] + \
               [(name, _p) for name in ("h", "x", "qkv", "qf", "of", "attn", "o", "gu", "act", "cos",
                                        "sin", "slots", "table", "ctx", "attention", "lora",
                                        "attention_part", "stop")]


def _qmat(w: Any) -> _QMat:
    q, d, m = w.ptrs
    return _QMat(q, d, m, w.bias_ptr, w.N, w.K, w.kind)


class FusedStep:
    """`run` a step's layers in one call where it can (see the module docstring)."""

    def __init__(self, runner: Any, lib: Any, attention: ctypes._CFuncPtr,
                 attention_part: ctypes._CFuncPtr | None = None) -> None:
        self.r = runner
        self._fn = lib.cdll.decode_layers
        self._fn.argtypes = [_p, _i, _p]
        self._fn.restype = _i
        self._attention = ctypes.cast(attention, _p).value
        # the attention in parts, shared out over the step pool (csrc/decode_step.c, `attn_units`)
        self._attention_part = ctypes.cast(attention_part, _p).value if attention_part is not None else None
        layers = runner.layers
        self.inter = getattr(layers[0].mlp, quant.GATE_UP_GROUP).sizes[0]
        self._layers = (_Layer * len(layers))()
        self._kv_at = None
        for li, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            L = self._layers[li]
            L.qkv = _qmat(getattr(a, quant.QKV_GROUP).w)
            L.o = _qmat(a.o_proj.forward.w)
            L.gate_up = _qmat(getattr(mlp, quant.GATE_UP_GROUP).w)
            L.down = _qmat(mlp.down_proj.forward.w)
            for name in ("in", "post"):
                norm = layer.input_layernorm if name == "in" else layer.post_attention_layernorm
                setattr(L, f"{name}_norm", norm.weight.data_ptr())
                setattr(L, f"{name}_eps", float(norm.variance_epsilon))
        self._bind_kv()

    def _bind_kv(self) -> None:
        kv = self.r.kv
        for li in range(len(self._layers)):
            self._layers[li].k_cache = kv.k[li].data_ptr()
            self._layers[li].v_cache = kv.v[li].data_ptr()
        self._kv_at = kv.k[0].data_ptr()

    @staticmethod
    def supports(runner: Any) -> bool:
        """Whether this runner's model and settings are the shape `decode_layers` computes."""
        fam = runner.family
        if runner.glue is None or runner.decode_kernel is None or runner.attn_softcap or not runner._silu_mlp:
            return False
        if fam.fused_qkv or fam.qk_norm or fam.sandwich:
            return False
        for layer in runner.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv, gu = getattr(a, quant.QKV_GROUP, None), getattr(mlp, quant.GATE_UP_GROUP, None)
            if qkv is None or gu is None or gu.sizes[0] != gu.sizes[1]:
                return False
            if qkv.sizes != [runner.n_heads * runner.head_dim] + [runner.n_kv * runner.head_dim] * 2:
                return False
            for mod in (a.o_proj, mlp.down_proj):
                ql = getattr(mod, "forward", None)
                if not isinstance(ql, quant.QuantLinear) or ql.kind != "q4":
                    return False
        return True

    def run(self, plan: StepPlan, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            lora: Any = None) -> bool:
        """Run the layers over `h` in place; False (nothing done) for a step it does not take.
        `lora` (a `lora_step.LoraStep`): its adapter rows get their deltas after each product
        (``csrc/lora.c``), where the kernel is loaded."""
        T = h.shape[0]
        if lora is not None and lora.args is None:
            return False
        if (T > self.r.kernel_rows or plan.chunks or len(plan.decode) != 1 or not plan.decode[0].dense
                or plan.slots.dtype != torch.int64 or cos.dtype != h.dtype or not cos.is_contiguous()
                or not sin.is_contiguous()):
            return False
        r, g = self.r, plan.decode[0]
        kv = r.kv
        if kv.k[0].data_ptr() != self._kv_at:
            self._bind_kv()
        nh, nkv, hd, D, I = r.n_heads, r.n_kv, r.head_dim, h.shape[1], self.inter
        table = g.table if g.table.dtype == torch.int32 and g.table.is_contiguous() else g.table.to(torch.int32).contiguous()
        ctx = g.ctx if g.ctx.dtype == torch.int32 and g.ctx.is_contiguous() else g.ctx.to(torch.int32).contiguous()
        f32 = torch.float32
        bufs = dict(x=kv.scratch("fused_x", (T, D)), qkv=kv.scratch("fused_qkv", (T, (nh + 2 * nkv) * hd)),
                    qf=kv.scratch("fused_qf", (T, nh * hd), f32), of=kv.scratch("fused_of", (T, nh * hd), f32),
                    attn=kv.scratch("fused_attn", (T, nh * hd)), o=kv.scratch("fused_o", (T, D)),
                    gu=kv.scratch("fused_gu", (T, 2 * I)), act=kv.scratch("fused_act", (T, I)))
        step = _Step(T, D, nh, nkv, hd, I, cos.shape[-1], int(h.dtype == torch.bfloat16), kv.block_size,
                     table.shape[1], r.threads, r.scale, h.data_ptr(),
                     *(bufs[n].data_ptr() for n in ("x", "qkv", "qf", "of", "attn", "o", "gu", "act")),
                     cos.data_ptr(), sin.data_ptr(), plan.slots.data_ptr(), table.data_ptr(), ctx.data_ptr(),
                     self._attention, None if lora is None else lora.args.ptr, self._attention_part,
                     getattr(r.preempt, "address", None))
        rc = self._fn(self._layers, len(self._layers), ctypes.byref(step))
        if rc > 0:          # the scheduler's ask, read at a layer boundary (`PreemptFlag`)
            raise StepPreempted(f"at layer {rc - 1}")
        if rc != 0:
            raise RuntimeError("decode_layers: a quantized product or the attention kernel failed")
        return True
