"""Which arithmetic each kind of step takes, and why: the start-up log and ``/server_info``'s
``engine_paths`` (docs/engine.md, "The default engine")."""

from __future__ import annotations

import torch

from ..weights.dtype import cpu_bf16_flags
from ..kernels import prefill_kernel
from ..kernels.quant import MAX_ROWS, Q8_B16_ROWS, Q8_BF16_ROWS, QuantReport, _act8_simd

__all__ = ["phase_paths", "prefill_attention_path"]


def prefill_attention_path(dtype: torch.dtype) -> str:
    """What a prompt chunk's causal attention runs (`prefill_attention.causal`), and why."""
    if dtype is not torch.bfloat16:
        return f"torch SDPA ({str(dtype).removeprefix('torch.')} chunks; the kernel and the blocks are bf16)"
    kernel, why = prefill_kernel.load()
    if kernel is not None:
        return (f"{why}: every chunk of head size {' or '.join(map(str, prefill_kernel.HEAD_SIZES))} "
                "without soft-capping (faster than SDPA at every length); other chunks torch")
    return (f"{why}: bf16 query blocks of oneDNN products from 256 tokens (32 after cached context), "
            "SDPA for shorter chunks")


def phase_paths(report: QuantReport | None, dtype: torch.dtype, dtype_why: str, asked: str = "none",
                packed: int = 0) -> dict[str, str]:
    """Which arithmetic each kind of step takes, and why (start-up log and ``/server_info``)."""
    dense = str(dtype).removeprefix("torch.")
    unit = ("AMX tiles" if "amx_bf16" in cpu_bf16_flags() else "avx512_bf16 dot products") \
        if dtype is torch.bfloat16 else "float32 FMA"
    lib = f"oneDNN, {packed} weights packed at load" if packed else "torch F.linear"
    dense_path = f"dense {dense} matmuls ({lib}, {unit}; dtype {dtype_why})"
    if report is None:
        why = ("auto: the weights are not exact 4-bit blocks, so a quantized copy would change them"
               if asked == "auto" else "--quantization none")
        return {"decode": f"{dense_path} ({why})", "prefill": dense_path,
                "prefill attention": prefill_attention_path(dtype)}
    if report.mode == "q4a8":
        act = "8-bit activations, avx512_vnni"
    elif dtype is torch.bfloat16 and "avx512_bf16" in cpu_bf16_flags():
        layout = "16 output rows a register (q4b16 superblocks)" if report.b16 else "one output row at a time"
        head = (f"the q8 LM head 16 output rows a register too up to {Q8_B16_ROWS} rows, dense from "
                f"{Q8_B16_ROWS + 1} (widths.Q8_B16_ROWS)" if report.b16 else
                f"the q8 LM head in float32 up to {Q8_BF16_ROWS} rows, dense from {Q8_BF16_ROWS + 1} "
                "(widths.Q8_BF16_ROWS)")
        act = f"bf16 activations: q4 through avx512_bf16 dot products, {layout}; {head}"
    else:
        act = "float activations"
    why = ("auto: the weights re-quantize exactly (they came from GGUF Q4_1/Q8_0 blocks), so the "
           "kernels compute with the model's own weights" if report.asked == "auto" else f"--quantization {report.mode}")
    rows = MAX_ROWS if report.mode == "q4a8" else report.kernel_rows
    paths = {f"decode <= {MAX_ROWS} rows": f"q4/q8 C kernels ({act}), one fused C call a step ({why})"}
    if rows > MAX_ROWS:
        how = ("12 input rows a tile against each superblock" if report.b16
               else f"{MAX_ROWS} rows a pass over each weight row")
        paths[f"decode {MAX_ROWS + 1}-{rows} rows"] = (f"q4/q8 C kernels ({act}), {how} (the weights read "
                                                      "once a step), one fused C call a step")
    measured = "widths.B16_ROWS" if report.b16 else "quant.KERNEL_ROWS"
    paths[f"steps > {rows} rows (wide decode)"] = (f"{dense_path}: from {rows + 1} rows as fast as the "
                                                   f"kernels or faster (measured: {measured})")
    paths["prefill"] = ("q4n16 superblocks with 8-bit activations" if report.mode == "q4a8" and _act8_simd()
                        else f"{dense_path}; a step of at most {rows} tokens with a prompt chunk runs as "
                             "decode rows (the kernels above, each prompt row attending at its own length "
                             "through the in-place attention kernel)")
    paths["prefill attention"] = prefill_attention_path(dtype)
    return paths
