"""Which HF model families the paged runner drives, and the few per-family steps of a layer.

All of them share the Llama shape: ``model.embed_tokens / layers[i].{input_layernorm,
self_attn, post_attention_layernorm, mlp} / norm / rotary_emb`` and ``lm_head``, a
pre-norm residual block, RoPE and causal self-attention with (grouped) KV heads. What
differs is handled without copying or re-implementing a weight, by calling the HF
submodules themselves:

* llama, mistral: the base shape (``q/k/v/o_proj``, SiLU gated MLP).
* qwen2: biases on q/k/v (inside the HF ``nn.Linear``, nothing to do here).
* qwen3: ``q_norm``/``k_norm``, an RMSNorm over each head's ``head_dim`` applied after the
  projections and before RoPE.
* gemma (1): the embedding module scales by ``sqrt(hidden_size)``, the RMSNorm modules use
  ``(1 + weight)`` and the MLP is gelu-tanh gated: all inside the HF modules it calls.
* phi3: fused ``qkv_proj`` (split here as HF splits it: q, then k, then v) and fused
  ``gate_up_proj`` (the HF MLP module is called as is); partial rotary dims are honoured.
* gemma2: Gemma's pieces plus "sandwich" norms (``post_attention_layernorm`` on the
  attention output, ``pre_/post_feedforward_layernorm`` around the MLP), soft-capped
  attention logits (``attn_logit_softcapping``: `paged_attention` then runs HF's eager
  formula instead of SDPA) and soft-capped final logits (``final_logit_softcapping``).

A sliding window (Mistral, Gemma2's alternate layers, Phi-3's) is honoured by capping
``max_model_len`` at the window (`engine.runners.runner.engine_info`), so full attention is exact.
Not here (served by the HF fallback): Gemma3, MoE models, any other layer shape, and any RoPE
whose frequencies depend on the sequence length (``dynamic``, ``longrope``: Phi-3 128k).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.quant import QKV_GROUP

PAGED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")
# RoPE variants whose frequencies are fixed at init, so one cos/sin table serves every step
# ("dynamic"/"longrope" rescale with the sequence length: those models use the fallback).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True, slots=True)
class Family:
    fused_qkv: bool      # attn.qkv_proj instead of q_proj/k_proj/v_proj
    qk_norm: bool        # attn.q_norm / attn.k_norm per head, before RoPE
    sandwich: bool       # Gemma2: norm the attention output, norms before and after the MLP


def family_of(model: Any) -> Family | None:
    """The `Family` of a model the paged runner can drive exactly, else None."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in PAGED_MODEL_TYPES:
        return None
    if cfg.model_type != "gemma2" and (getattr(cfg, "attn_logit_softcapping", None)
                                       or getattr(cfg, "final_logit_softcapping", None)):
        return None
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, a) for a in needed) or not hasattr(model, "lm_head"):
        return None
    if getattr(base.rotary_emb, "rope_type", "default") not in STATIC_ROPE:
        return None
    layer = base.layers[0]
    attn = getattr(layer, "self_attn", None)
    if attn is None or not hasattr(attn, "o_proj") or not hasattr(layer, "mlp"):
        return None
    if not (hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm")):
        return None
    sandwich = any(hasattr(layer, p) for p in _SANDWICH)
    if sandwich != (cfg.model_type == "gemma2") or (sandwich and not all(hasattr(layer, p) for p in _SANDWICH)):
        return None
    fused = hasattr(attn, "qkv_proj")
    if not fused and not all(hasattr(attn, f"{p}_proj") for p in "qkv"):
        return None
    qk_norm = hasattr(attn, "q_norm") or hasattr(attn, "k_norm")
    if qk_norm and not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
        return None
    if qk_norm and cfg.model_type != "qwen3":      # per-head norms of an unknown placement
        return None
    return Family(fused_qkv=fused, qk_norm=qk_norm, sandwich=sandwich)


def supports_paged(model: Any) -> bool:
    """True when the model's module tree is one of the shapes the paged runner drives."""
    return family_of(model) is not None


def project_qkv(fam: Family, attn: Any, x: torch.Tensor, nh: int, nkv: int, d: int,
                lora: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[T, nh, d]``, k and v ``[T, nkv, d]`` of the normed hidden rows `x`, with the
    family's per-head norms applied (before RoPE, as HF does). `lora` (a layer's hook,
    `lora_step.LoraStep.layer`) adds the step's adapter deltas to each projection's output
    before the norms (separate projections only: adapters of fused ones are refused at load)."""
    T = x.shape[0]
    if fam.fused_qkv:
        qkv = attn.qkv_proj(x)
        q = qkv[:, :nh * d].view(T, nh, d)
        k = qkv[:, nh * d:(nh + nkv) * d].view(T, nkv, d)
        v = qkv[:, (nh + nkv) * d:].view(T, nkv, d)
    else:
        if (group := getattr(attn, QKV_GROUP, None)) is not None:     # q4: one kernel call
            q, k, v = group(x)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if lora is not None:
            lora("q_proj", x, q)
            lora("k_proj", x, k)
            lora("v_proj", x, v)
        q, k, v = q.view(T, nh, d), k.view(T, nkv, d), v.view(T, nkv, d)
    if fam.qk_norm:
        q = attn.q_norm(q)
        k = attn.k_norm(k)
    return q, k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, heads, d]`` with cos/sin ``[T, 1, r]``; with ``r < d`` (partial
    rotary) only the first `r` dims rotate, the rest pass through (HF's layout)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot = x[..., :r]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, x[..., r:]), dim=-1)
