"""Causal attention of a bfloat16 prompt chunk (issue 27, item 3): `causal` takes the C kernel
(`kernels.prefill_kernel`, every bf16 chunk, where the CPU has avx512_bf16) or else the torch
query blocks below (`causal_blocked`, long chunks; shorter ones keep SDPA).

The torch blocks. Why. SDPA's CPU flash kernel reached about 67 GFLOP/s at head size 64, so
attention took a third of a 1,024-token prefill while its FLOPs are a seventh. Here each block of `BLOCK`
queries is two batched bf16 matrix products (oneDNN) over the keys up to the block's end, with
the softmax between them. Per layer of SmolLM2-135M (9 heads, 3 KV heads, d = 64), 2-core AMD
EPYC, best of 7, with the server's OpenMP settings (`actorserve.omp`: a short spin):

| tokens | 256 | 512 | 1,024 | 2,048 |
|---|---:|---:|---:|---:|
| SDPA | 1.35 ms | 5.11 | 14.35 | 47.5 |
| blocks | 1.05 ms | 3.62 | 8.68 | 36.9 |

A whole prefill (`PagedLlamaRunner`, bf16 with the default q4 decode path, one process, on and
off alternated 6 times, min / median): 512 tokens 462 / 471 ms against 499 / 509, 1,024 tokens
992 / 1,110 against 1,104 / 1,205. Without the spin (`OMP_WAIT_POLICY=PASSIVE` alone) the blocks'
many small operations wait on sleeping threads: 12.9 against 14.1 ms at 1,024, slower at 256.
The same blocks in float32 were slower than SDPA (24.0 ms at 1,024), so float32 chunks keep
SDPA, and so do chunks shorter than `MIN_ROWS`.

Arithmetic. Transformers' eager attention, step for step: scores as a bf16 product, scaled
in bf16, masked, softmax in float32, probabilities back to bf16, a bf16 product with V.
SDPA's flash kernel keeps its scores in float32, so the two differ by a score's bf16
rounding (max error against a float32 reference: 0.010-0.012 here, SDPA's 0.007-0.010).

GQA. The query heads sharing a KV head are rows of one product (``[n_kv, group * block, d]``),
so K and V are read once per KV head, never repeated.
"""

from __future__ import annotations

import math

import torch

from ..kernels import prefill_kernel

BLOCK = 128            # queries a block
MIN_ROWS = 2 * BLOCK   # shorter chunks from position 0 keep SDPA (its causal flash kernel)
MIN_ROWS_AFTER = 32    # a chunk after cached context: shorter ones keep SDPA (with its mask)

_masks: dict[int, torch.Tensor] = {}


def _mask(b: int) -> torch.Tensor:
    """True above the diagonal of a ``b x b`` block: keys after each query."""
    m = _masks.get(b)
    if m is None:
        m = _masks[b] = torch.ones(b, b, dtype=torch.bool).triu_(1)
    return m


def power_of_two(scale: float) -> bool:
    """Whether `scale` is a power of two (head sizes 64 and 256: 1/8, 1/16). Multiplying by one
    only moves the exponent, so it commutes with the product's float32 sums and its rounding to
    bfloat16: ``round(sum((q * c) k)) == round(sum(q k)) * c`` bit for bit (short of underflow
    past 2^-126, far below any score that survives the softmax). So the queries can be scaled
    before the product, once, instead of every score after it: a pass over the scores less
    (27 of 900 ms in a step of four 256-token prompts)."""
    return scale > 0 and math.frexp(scale)[0] == 0.5


def takes(q: torch.Tensor, n: int, start: int = 0) -> bool:
    """Whether a chunk of `n` query rows of `q`'s dtype and head size whose first token is at
    position `start` goes through `causal`: every bf16 chunk where the C kernel runs (it is
    faster than SDPA at every length), else long enough ones for the torch blocks."""
    if q.dtype is not torch.bfloat16:
        return False
    if q.shape[-1] in prefill_kernel.HEAD_SIZES and prefill_kernel.load()[0] is not None:
        return True
    return n >= (MIN_ROWS if start == 0 else MIN_ROWS_AFTER)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor,
           start: int = 0) -> None:
    """`causal_blocked`'s contract, through the C kernel where it takes the chunk."""
    kernel = prefill_kernel.load()[0]
    if kernel is not None and kernel.takes(q, k, v, out):
        kernel.run(q, k, v, scale, out, start)
    else:
        causal_blocked(q, k, v, scale, out, start)


def causal_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   out: torch.Tensor, start: int = 0) -> None:
    """``out[n, nh, d]`` = causal attention of ``q [n, nh, d]``, the tokens at positions
    ``start .. start + n - 1``, over ``k``/``v [L, n_kv, d]`` (L >= start + n; the query at
    position p sees keys 0..p, keys past ``start + n`` are never read)."""
    n, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    end = start + n
    # laid out once a chunk, so that no block's product copies its operands: K^T and V of each
    # KV head contiguous (a block reads a prefix of their columns / rows), and the queries
    # ordered (KV head, query, head of the group), so a block's rows are one slice
    kt = k[:end].permute(1, 2, 0).contiguous()           # [nkv, d, end]
    vh = v[:end].transpose(0, 1).contiguous()            # [nkv, end, d]
    qh = q.view(n, nkv, g, d).permute(1, 0, 2, 3).contiguous()   # [nkv, n, g, d]
    folded = power_of_two(scale)
    if folded:      # the queries scaled first: the same bits (see `power_of_two`), one pass less
        qh.mul_(scale)
    for s in range(0, n, BLOCK):
        e = min(n, s + BLOCK)
        b = e - s
        seen = start + e                                 # keys this block's last query sees
        scores = torch.bmm(qh[:, s:e].view(nkv, b * g, d), kt[:, :, :seen])
        if not folded:
            scores.mul_(scale)
        scores.view(nkv, b, g, seen)[..., start + s:seen].masked_fill_(_mask(b)[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)               # float32 inside, rounded to bf16 once
        o = torch.bmm(p, vh[:, :seen])                   # [nkv, b * g, d]
        out[s:e].view(b, nkv, g, d).copy_(o.view(nkv, b, g, d).transpose(0, 1))
