"""Give the KV cache's and the weights' memory back to the OS, and bring it back
(`/release_memory_occupation`, `/resume_memory_occupation`, vLLM's `/sleep`, `/wake_up`).

Everything here runs on the thread the model steps run on, between two steps, with no request
holding KV (the scheduler's barrier, `actors.scheduler_memory`).

* ``kv_cache``: the paged runner's per-layer K/V tensors and its scratch buffers are dropped
  (each layer's tensor becomes an empty one) and, at the resume, allocated again, zeroed, with
  the same shapes. Their contents need not survive: the scheduler flushes the prefix cache
  before the release, so no block's content is ever read again.
* ``weights``: every tensor the weights live in -- each parameter and buffer, and every derived
  copy: the q4/q8 quantized weights (`quant.QuantLinear`, `quant.QuantGroup`, whose members are
  views of the group's concatenation), the oneDNN-packed linears (`dense.PACKED`), the fused
  decode step's tables and the RoPE tables -- is freed. The tensors' storages are grouped (a
  tied embedding, a view, a float32 bias the quantizer shares are one storage) and each one's
  bytes are first written to a private, unnamed temporary file (``$TMPDIR``; gone when closed
  or when the process ends) in safetensors' format, one ``U8`` entry per storage. The storage is
  then resized to 0 bytes: the tensor objects, the modules and every view stay as they are,
  only their memory is gone. A storage that cannot be resized (a float32 model read straight
  from its safetensors file, memory-mapped) is swapped for an empty one in every tensor that
  uses it. At the resume each storage is allocated again with its size and its bytes read back,
  so the weights are bit for bit what they were (weights updated from tensors included); then
  the quantized copies take their new addresses (`quant._Weights.rebind`), the linears are
  packed again and the fused step rebuilt (`refit._rederive`, as a weight update does).
  ``keep=False`` (vLLM's level-2 sleep) writes nothing: the resume reallocates and loads the
  model folder it is given as a weight update from disk does (`refit.read_checked` and
  `refit.apply_checked`, which derive the quantized copies as a fresh load does).

After freeing, glibc's ``malloc_trim(0)`` hands the freed heap pages back to the OS (large
tensors are mmapped and go back at once; the rest may sit in malloc's arenas until trimmed).
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from ...heap import glibc_function

log = logging.getLogger(__name__)

KV, WEIGHTS = "kv_cache", "weights"


# -- the C library -----------------------------------------------------------------------------
def malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``; False where the C library is not glibc (nothing to call)."""
    trim = glibc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def _tidy() -> None:
    gc.collect()
    malloc_trim()


# -- what is held ------------------------------------------------------------------------------
def _kv(engine: Any) -> Any:
    return getattr(engine, "kv", None)


def kv_bytes(engine: Any) -> int:
    """Bytes the KV cache holds now: the K/V tensors and the scratch buffers beside them."""
    kv = _kv(engine)
    if kv is None:
        return 0
    tensors = list(kv.k) + list(kv.v) + list(getattr(kv, "_scratch", {}).values())
    return sum(t.numel() * t.element_size() for t in tensors)


def _model(engine: Any) -> Any:
    model = getattr(engine, "model", None)
    return model if model is not None and hasattr(model, "named_parameters") else None


def _weight_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the weights live in, by a readable name: parameters, buffers and the
    quantized copies (`quant`)."""
    from ..kernels.quant import GATE_UP_GROUP, QKV_GROUP, QuantGroup, QuantLinear
    out: list[tuple[str, torch.Tensor]] = list(model.named_parameters(remove_duplicate=False))
    out += list(model.named_buffers(remove_duplicate=False))
    for mname, mod in model.named_modules():
        attrs = vars(mod)
        held = [("forward", attrs.get("forward"))] + [(g, attrs.get(g)) for g in (QKV_GROUP, GATE_UP_GROUP)]
        for what, obj in held:
            if not isinstance(obj, (QuantLinear, QuantGroup)):
                continue
            for part in ("q", "d", "m", "sb", "sb16", "bias"):
                t = getattr(obj.w, part, None)
                if isinstance(t, torch.Tensor):
                    out.append((f"{mname}.{what}.{part}", t))
            for i, member in enumerate(getattr(obj, "members", ())):
                for part in ("q", "d", "m", "sb", "sb16", "bias"):
                    t = getattr(member.w, part, None)
                    if isinstance(t, torch.Tensor):
                        out.append((f"{mname}.{what}.{i}.{part}", t))
    return out


def _packed_bytes(model: Any) -> int:
    from ..runners.dense import PACKED
    n = 0
    for mod in model.modules():
        p = vars(mod).get(PACKED)
        if isinstance(p, torch.Tensor):
            n += p.numel() * p.element_size()
    return n


def weights_bytes(engine: Any) -> int:
    """Bytes the weights hold now: each storage once, plus the packed copies."""
    model = _model(engine)
    if model is None:
        return 0
    seen: dict[int, int] = {}
    for _, t in _weight_tensors(model):
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values()) + _packed_bytes(model)


def memory_bytes(engine: Any) -> dict[str, int]:
    return {KV: kv_bytes(engine), WEIGHTS: weights_bytes(engine)}


# -- kv_cache ----------------------------------------------------------------------------------
def release_kv(engine: Any) -> int:
    """Drop the K/V tensors and scratch buffers; returns the bytes they held."""
    kv = _kv(engine)
    if kv is None:
        return 0
    n = kv_bytes(engine)
    kv.k = [torch.empty(0, dtype=kv.dtype) for _ in kv.k]
    kv.v = [torch.empty(0, dtype=kv.dtype) for _ in kv.v]
    kv._scratch.clear()
    _tidy()
    return n


def resume_kv(engine: Any) -> int:
    """Allocate the K/V tensors again (zeroed, the same shapes); returns their bytes."""
    kv = _kv(engine)
    if kv is None:
        return 0
    shape = (kv.num_blocks * kv.block_size, kv.n_kv, kv.head_dim)
    kv.k = [torch.zeros(shape, dtype=kv.dtype) for _ in kv.k]
    kv.v = [torch.zeros(shape, dtype=kv.dtype) for _ in kv.v]
    return kv_bytes(engine)


# -- weights -----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Storage:
    key: str                      # its entry in the spill file (the first tensor's name)
    nbytes: int
    storage: Any                  # the resizable storage itself, or None (swapped out)
    swapped: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    offset: int = 0               # where its bytes start in the spill file's data
    kept: bool = True             # spilled (level 2 spills only what no model folder holds)


@dataclass(slots=True)
class WeightsHeld:
    """What a weights release keeps to bring them back: the storages and the spill file."""
    storages: list[_Storage]
    spill: BinaryIO | None        # the spilled storages' bytes
    kept: bool = True             # False: discarded (level 2), reloaded from a model folder
    data_at: int = 0              # where the spill file's data section starts
    freed: int = 0                # bytes given back

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None


def _bytes_of(storage: Any) -> memoryview:
    """The storage's memory as a writable buffer (through ctypes: a numpy view would leave the
    storage unresizable)."""
    return memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


def _group(model: Any) -> list[_Storage]:
    groups: dict[int, _Storage] = {}
    for name, t in _weight_tensors(model):
        s = t.untyped_storage()
        n = s.nbytes()
        if n == 0:
            continue
        g = groups.get(s._cdata)
        if g is None:
            g = groups[s._cdata] = _Storage(name, n, s if s.resizable() else None)
        if g.storage is None:
            g.swapped.append((t, t.storage_offset(), tuple(t.shape), tuple(t.stride())))
    return list(groups.values())


def _write_spill(storages: list[_Storage], spill_dir: str | None) -> tuple[BinaryIO, int]:
    """One safetensors file: a ``U8`` entry per kept storage, written straight from its memory."""
    header: dict[str, Any] = {"__metadata__": {"format": "actorserve weights spill"}}
    at = 0
    storages = [g for g in storages if g.kept]
    for g in storages:
        g.offset = at
        header[g.key] = {"dtype": "U8", "shape": [g.nbytes], "data_offsets": [at, at + g.nbytes]}
        at += g.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f = tempfile.TemporaryFile(prefix="actorserve-weights-", suffix=".safetensors", dir=spill_dir)
    try:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for g in storages:
            source = g.storage if g.storage is not None else g.swapped[0][0].untyped_storage()
            f.write(_bytes_of(source))
        f.flush()
    except BaseException:
        f.close()
        raise
    return f, 8 + len(raw)


def _drop_derived(engine: Any, model: Any) -> None:
    """The copies a resume makes again: packed linears, the fused step, the RoPE tables."""
    from ..runners.dense import PACKED
    for mod in model.modules():
        vars(mod).pop(PACKED, None)
    model.actorserve_packed = 0
    if getattr(engine, "fused", None) is not None:
        engine.fused = None
    if hasattr(engine, "_rope_cos"):
        engine._rope_cos = engine._rope_sin = torch.empty(0)


def _free(storages: list[_Storage]) -> None:
    for g in storages:
        if g.storage is not None:
            g.storage.resize_(0)
        else:
            for t, *_ in g.swapped:
                t.data = torch.empty(0, dtype=t.dtype)


def release_weights(engine: Any, keep: bool = True, spill_dir: str | None = None) -> WeightsHeld:
    """Free every weight tensor; with `keep`, spilled first (a failed write frees nothing)."""
    model = _model(engine)
    if model is None:
        return WeightsHeld([], None)
    before = weights_bytes(engine)
    storages = _group(model)
    if not keep:               # a folder holds the state dict, not the buffers computed at load
        computed = {n for n, _ in model.named_buffers(remove_duplicate=False)} - set(model.state_dict())
        for g in storages:
            g.kept = g.key in computed          # (RoPE's inv_freq): kept; the rest discarded
    spill, data_at = _write_spill(storages, spill_dir)
    _drop_derived(engine, model)
    _free(storages)
    _tidy()
    held = WeightsHeld(storages, spill, keep, data_at)
    held.freed = before - weights_bytes(engine)
    return held


def _readinto(f: BinaryIO, at: int, storage: Any) -> None:
    view = _bytes_of(storage)
    f.seek(at)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"the weights spill file ended {len(view) - done} bytes early")
        done += n


def _reallocate(held: WeightsHeld) -> None:
    for g in held.storages:
        if g.storage is not None:
            g.storage.resize_(g.nbytes)
        else:
            fresh = torch.UntypedStorage(g.nbytes)
            for t, offset, size, stride in g.swapped:
                t.data = torch.empty(0, dtype=t.dtype).set_(fresh, offset, size, stride)
            g.storage = fresh                         # resizable from now on
            g.swapped = []
        if g.kept and held.spill is not None:
            _readinto(held.spill, held.data_at + g.offset, g.storage)


def _rebind_quant(model: Any) -> None:
    from ..kernels.quant import GATE_UP_GROUP, QKV_GROUP, QuantGroup, QuantLinear
    for mod in model.modules():
        attrs = vars(mod)
        for obj in (attrs.get("forward"), attrs.get(QKV_GROUP), attrs.get(GATE_UP_GROUP)):
            if isinstance(obj, (QuantLinear, QuantGroup)):
                obj.w.rebind()
                for member in getattr(obj, "members", ()):
                    member.w.rebind()


def resume_weights(engine: Any, held: WeightsHeld, model_path: str | None = None) -> int:
    """Bring the weights back (read from the spill, or, discarded, loaded from `model_path`);
    returns the bytes they hold. On failure the weights are freed again and `held` still holds
    what it held (the resume can be tried again)."""
    from . import refit
    model = _model(engine)
    if model is None:
        return 0
    model_path = model_path or getattr(model.config, "_name_or_path", None)   # the folder it was loaded from
    if not held.kept and not model_path:
        raise refit.WeightsMismatch("the weights were discarded (level 2) and no model folder is known "
                                    "to reload them from")
    try:
        _reallocate(held)
        if held.kept:
            _rebind_quant(model)
            refit._rederive(engine, model)
        else:
            refit.apply_checked(engine, refit.read_checked(engine, str(model_path)))
    except BaseException:
        model = _model(engine)
        _drop_derived(engine, model)
        _free(held.storages)
        _tidy()
        raise
    held.close()
    return weights_bytes(engine)
