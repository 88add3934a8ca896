"""Dense linears through oneDNN with weights packed once at load (the wide steps and prefill).

``F.linear`` hands oneDNN (or MKL) a plain row-major weight on every call, and the library
reorders it into the blocked layout its kernels read, each time. Packing each weight once into
that layout (``torch.ops.mkldnn._reorder_linear_weight``: an opaque oneDNN tensor) and calling
``torch.ops.mkldnn._linear_pointwise`` with it skips the reorder; the arithmetic is the
library's own (AMX tiles, avx512_bf16 or float32 FMA, whatever the CPU has), the results the
same as ``F.linear``'s up to the order of the sums. Measured on the 2-core AMD EPYC
(avx512_bf16, no AMX), SmolLM2 bf16 with the q4 kernels for narrow steps, best of 3: decode
steps of 16 rows 68.1 -> 51.3 ms, 32 rows 88.0 -> 79.0, 64 rows 171.1 -> 138.9, a 512-token
prefill 576 -> 526 ms (``benchmarks/quant_decode.py --batches 16,32,64``).

Cost: the packed copy sits beside the module's own weight (which stays: the quantizer, the
tied embeddings and anything reading ``module.weight`` see the same tensor as before), so the
linears' bytes count twice. `pack_model` checks the packed product against ``F.linear`` on the
first linear and packs nothing where oneDNN is missing or disagrees.

*Row buckets* (the memory at rest, issue 31). oneDNN compiles one primitive per input shape and
keeps it in two caches (its own, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, and ideep's,
``LRU_CACHE_CAPACITY``, 1024 entries each by default); each primitive holds about 0.6 MB
(measured for shapes from 16x16 to 49152x576, float32 and bfloat16) whatever the weight. Every
prefill length and every batch width is a new row count, so a server under mixed traffic
gathered hundreds of them: +300 MB after the soak's first cycles, never given back. `linear`
therefore hands oneDNN 24 row counts only (`BUCKETS`): the rows are padded to the next
multiple of 8 up to 64, of 16 up to 128, of 32 up to 256, of 64 up to 512 and of 128 up to
1,024 (`bucket_rows`: at most 25% padding from 65 rows on, about 10% on average; below 64 rows
a step reads the whole weight for any width anyway), and more than `CHUNK` (1,024, the
scheduler's prefill chunk) rows run as 1,024-row slices plus one bucketed rest. So each weight
shape compiles 24 primitives at most (per thread count), once each. (Eighths of an octave, 32
buckets, padded less but the soak's shapes then outgrew the caches' 256 entries together with
the encoder's GELU primitives, one per batch shape, and were compiled again and again.)
`CHUNK` was 512 until the prefill chunk's two halves and their concatenation measured 5-8%
slower than one product (a step of four 256-token prompts, SmolLM2 bf16, 2-core AMD EPYC:
897-929 ms against 966-970, alternated twice).
The padded rows are zeros and their outputs are dropped; each row's result is its own (a
linear has no cross-row arithmetic). `engine.runners.onednn_caches` caps the two caches as well, so
no other shape (an unpacked linear, an encoder) can grow them without bound.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACKED = "_actorserve_packed"      # the packed weight, an attribute of the nn.Linear
DTYPES = (torch.float32, torch.bfloat16)
MIN_WEIGHT = 1 << 14               # float32 weights with fewer elements keep F.linear (pack_model)
CHUNK = 1024                       # rows per oneDNN call at most (larger inputs are sliced)


def bucket_rows(rows: int) -> int:
    """The row count oneDNN computes for `rows` (1..CHUNK) rows: the next multiple of 8 up to 64,
    then of 16 (up to 128), 32 (up to 256), 64 (up to 512), 128 (up to 1,024): an eighth of the
    power of two at or above `rows`, so at most 25% padding from 65 rows on."""
    step = 1 << max(3, (rows - 1).bit_length() - 3)
    return -(-rows // step) * step


BUCKETS = tuple(sorted({bucket_rows(n) for n in range(1, CHUNK + 1)}))
BUCKET = True        # False under ACTORSERVE_DENSE=exact (benchmarks: every row count as it is)


def _product(x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's packed product of the 2-D `x2` (its row count one of `BUCKETS`)."""
    return torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")


def _bucketed(x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x2.shape[0]
    padded = bucket_rows(rows)
    if padded == rows:
        return _product(x2, packed, bias)
    xp = x2.new_zeros(padded, x2.shape[1])
    xp[:rows] = x2
    return _product(xp, packed, bias)[:rows]


def _ops_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


def linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` through its packed weight where it has one (and `x` suits it), else
    ``F.linear``. oneDNN sees `BUCKETS` row counts only (`bucket_rows`, `CHUNK`)."""
    packed = getattr(module, PACKED, None)
    if packed is None or x.dtype != module.weight.dtype or x.requires_grad or x.numel() == 0:
        return F.linear(x, module.weight, module.bias)
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if not BUCKET:
        y = _product(x2, packed, module.bias)
    elif rows <= CHUNK:
        y = _bucketed(x2, packed, module.bias)
    else:
        y = torch.cat([_bucketed(x2[i:i + CHUNK], packed, module.bias) for i in range(0, rows, CHUNK)])
    return y.view(*x.shape[:-1], y.shape[-1])


class PackedLinear:
    """An ``nn.Linear``'s forward through `linear` (an instance attribute, as the quantizer's is)."""

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.module, x)


def _agrees(mod: torch.nn.Linear, packed: torch.Tensor) -> bool:
    x = torch.randn(3, mod.in_features, generator=torch.Generator().manual_seed(0)).to(mod.weight.dtype)
    want = F.linear(x, mod.weight, mod.bias).float()
    got = _bucketed(x, packed, mod.bias).float()
    tol = 1e-3 if mod.weight.dtype is torch.float32 else 3e-2
    return bool(torch.allclose(got, want, atol=tol * float(want.abs().max() or 1.0), rtol=tol))


@torch.no_grad()
def pack_model(model: Any) -> int:
    """Pack every float32/bfloat16 ``nn.Linear`` of `model` (in its final dtype); a linear whose
    forward the quantizer already replaced keeps it (`quant.QuantLinear` falls back to `linear`
    for its wide steps). A float32 weight of fewer than `MIN_WEIGHT` elements (the tiny test
    model's 16x16 and 64x16) stays with ``F.linear``, which is MKL's sgemm there: no reorder
    worth saving, oneDNN's call costs more (27 against 4 us for one row of a 64x16 weight, 117
    against 27 for 512 rows) and each compiled shape would hold ~0.6 MB. A bfloat16 one is
    packed whatever its size: ``F.linear`` takes oneDNN's matmul for it, which compiles and
    keeps a primitive per row count (+164 MB for 300 row counts of a 16x16 weight), and
    packed, its row counts are bucketed. Returns how many were packed: 0 where oneDNN
    is missing or its product disagrees with ``F.linear`` on the first one, or
    ``ACTORSERVE_DENSE=plain`` is set (benchmarks; ``exact``: packed, without the row buckets)."""
    global BUCKET
    mode = os.environ.get("ACTORSERVE_DENSE", "packed")
    if mode == "plain":
        return 0
    BUCKET = mode != "exact"
    if not _ops_available():
        log.info("dense linears: oneDNN not available, plain F.linear")
        return 0
    count = 0
    for mod in model.modules():
        if (not isinstance(mod, torch.nn.Linear) or mod.weight.dtype not in DTYPES
                or (mod.weight.dtype is torch.float32 and mod.weight.numel() < MIN_WEIGHT)):
            continue
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(mod.weight.detach(), None)
        except RuntimeError as e:              # a shape or dtype this build's oneDNN refuses
            log.info("dense linears: oneDNN packing refused (%s), plain F.linear", e)
            return count
        if count == 0 and not _agrees(mod, packed):
            log.warning("dense linears: oneDNN's packed product disagrees with F.linear; not packing")
            return 0
        setattr(mod, PACKED, packed)
        if "forward" not in vars(mod):
            mod.forward = PackedLinear(mod)
        count += 1
    return count
