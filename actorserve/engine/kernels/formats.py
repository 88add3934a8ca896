"""The quantized weights' block formats, and the regroupings of their bytes the kernels read.

* q4: GGUF's Q4_1, 32 weights a group along the input, ``w = d * q + m``, q in 0..15 two to a
  byte (byte j of a group: weight j in its low nibble, j + 16 in its high one), d and m float16;
* q8: GGUF's Q8_0, ``w = d * q``, q int8, d float16;
* `repack_n16`: q4 regrouped 16 output rows a superblock (`csrc/q4n16.c`, 8-bit activations);
* `repack_b16`: the same, another order of the nibbles (`csrc/q4b16.c`, bfloat16 activations).
* `repack_q8b16`: q8 weights 16 output rows a superblock too (`csrc/q8b16.c`, bfloat16 activations).
"""

from __future__ import annotations

import torch

GROUP = 32


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (packed uint8 ``[N, K/2]``, d float16 ``[N, K/32]``, m float16 ``[N, K/32]``):
    per 32-weight group, m = its minimum, d = (max - min) / 15 (GGUF's Q4_1); byte j of a group
    holds weight j in its low nibble and weight j + 16 in its high one."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d16, m16 = ((hi - lo) / 15).half(), lo.half()
    d, m = d16.float()[..., None], m16.float()[..., None]
    q = torch.where(d > 0, torch.round((g - m) / torch.where(d > 0, d, 1)), 0).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(N, K // 2).contiguous(), d16.contiguous(), m16.contiguous()


def dequantize_q4(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    N, half = packed.shape
    p = packed.reshape(N, half // 16, 16)
    q = torch.cat([p & 0xF, p >> 4], dim=-1).float()
    return (q * d.float()[..., None] + m.float()[..., None]).reshape(N, half * 2)


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (int8 ``[N, K]``, d float16 ``[N, K/32]``): d = absmax / 127 per group (Q8_0)."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // GROUP, GROUP)
    d16 = (g.abs().amax(-1) / 127).half()
    d = d16.float()[..., None]
    q = torch.where(d > 0, torch.round(g / torch.where(d > 0, d, 1)), 0).clamp_(-127, 127).to(torch.int8)
    return q.reshape(N, K).contiguous(), d16.contiguous()


def dequantize_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    return (q.reshape(N, K // GROUP, GROUP).float() * d.float()[..., None]).reshape(N, K)


def repack_n16(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q4 (packed, d, m) with N a multiple of 16 -> `csrc/q4n16.c`'s superblocks, uint8
    ``[N/16, G, 320]``: per 16 rows and group, dword j (0..3) of each row's 16 packed bytes for
    j in turn (256 bytes), then the 16 rows' d and m (float16). The same bytes, regrouped."""
    N, half = packed.shape
    G, nb = half // 16, N // 16
    nib = packed.reshape(nb, 16, G, 4, 4).permute(0, 2, 3, 1, 4).reshape(nb, G, 256)
    dd = d.reshape(nb, 16, G).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(nb, G, 32)
    mm = m.reshape(nb, 16, G).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(nb, G, 32)
    return torch.cat([nib, dd, mm], dim=-1).contiguous()



def repack_b16(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q4 (packed, d, m) with N a multiple of 16 -> `csrc/q4b16.c`'s superblocks, uint8
    ``[N/16, G, 320]``: per 16 rows and group, four vectors of the 16 rows' dwords, where
    nibble s of vector j's low half is weight 8j + 2s and of its high half weight 8j + 2s + 1,
    then the 16 rows' d and m (float16). The same nibbles, regrouped."""
    N, half = packed.shape
    G, nb = half // 16, N // 16
    p = packed.reshape(N, G, 16).to(torch.int32)
    q = torch.cat([p & 0xF, p >> 4], dim=-1).reshape(nb, 16, G, 4, 4, 2)     # [.., j, s, e]
    shift = (4 * torch.arange(4, dtype=torch.int32))[:, None] + torch.tensor([0, 16], dtype=torch.int32)
    words = (q << shift).sum(dim=(-2, -1), dtype=torch.int64).to(torch.int32)  # [nb, n, G, j]
    nib = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(nb, G, 256)
    dd = d.reshape(nb, 16, G).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(nb, G, 32)
    mm = m.reshape(nb, 16, G).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(nb, G, 32)
    return torch.cat([nib, dd, mm], dim=-1).contiguous()


def repack_q8b16(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q8 (q int8 ``[N, K]``, d float16 ``[N, G]``) with N a multiple of 16 -> `csrc/q8b16.c`'s
    superblocks, uint8 ``[N/16, G, 544]``: per 16 rows and group, for each pair p (0..15) the
    16 rows' weight 2p, then their weight 2p + 1 (16 bytes each), then the 16 rows' d. The same
    bytes, regrouped."""
    N, K = q.shape
    G, nb = K // 32, N // 16
    pairs = q.reshape(nb, 16, G, 16, 2).permute(0, 2, 3, 4, 1).contiguous().view(torch.uint8).reshape(nb, G, 512)
    dd = d.reshape(nb, 16, G).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(nb, G, 32)
    return torch.cat([pairs, dd], dim=-1).contiguous()

