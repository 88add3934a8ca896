"""SGLang's own `/update_weights_from_tensor` forms, received safely: tensors a process on the same
host shares through shared memory, described by a pickle (SGLang's ``MultiprocessingSerializer``:
``multiprocessing``'s ForkingPickler with torch's reductions, base64-encoded).

Unpickling client data runs whatever the pickle names, so these pickles are read by
`TensorUnpickler`, which resolves only an allow-list of globals: torch's own rebuild functions for
a tensor whose storage lies in a named shared-memory file (torch's ``file_system`` sharing
strategy), torch's tensor, storage, size and dtype types, and inert stand-ins for SGLang's two
plain data classes (`FlattenedTensorMetadata`, `LocalSerializedTensor`). Any other global is an
`UnsafePayload` before anything is built; no code of the client's choosing can run. A tensor
shared by file descriptor (torch's default strategy) needs the sender's ``multiprocessing``
authentication key, which an unrelated process does not have: that is refused with a message
saying to share by file (``torch.multiprocessing.set_sharing_strategy("file_system")``).

The three payloads SGLang's clients send, one per tensor-parallel rank (this server is one rank,
so exactly one):

* ``load_format`` null or ``"direct"``: a list of ``(name, tensor)`` pairs, where a tensor may
  be a ``LocalSerializedTensor`` holding one nested payload per rank;
* ``"flattened_bucket"`` (slime's): ``{"flattened_tensor": 1-D tensor, "metadata": [...]}``,
  each metadata entry naming a slice of the flat tensor, its shape and dtype; the flat tensor
  is one dtype (indices in elements) or, in SGLang's multi-dtype buckets, bytes (indices in
  bytes, each tensor a view of its slice).

Each tensor is copied out of the shared memory at once (the sender may reuse it as soon as the
request answers), then checked like any other update (`refit_tensors.check_named`).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from .refit import WeightsMismatch

SHARED_FORMATS = (None, "direct", "flattened_bucket")
BY_FILE = ('share the tensors by file: call torch.multiprocessing.set_sharing_strategy("file_system") '
           "in the sending process before serializing")


class UnsafePayload(WeightsMismatch):
    """The pickle names something outside the allow-list (nothing of it was built)."""


class FlattenedTensorMetadata:
    """Stand-in for SGLang's class of that name: plain fields, set by the pickle's state."""
    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


class LocalSerializedTensor:
    """Stand-in for SGLang's: ``values`` holds one nested payload (bytes or base64) per rank."""
    values: list[Any]


_STANDINS = {"FlattenedTensorMetadata": FlattenedTensorMetadata, "LocalSerializedTensor": LocalSerializedTensor}
_REBUILDS = ("rebuild_tensor", "rebuild_storage_filename", "rebuild_typed_storage",
             "rebuild_typed_storage_child", "rebuild_storage_empty")


def _allowed(module: str, name: str) -> Any:
    import torch
    import torch.multiprocessing.reductions as reductions
    if module == "torch.multiprocessing.reductions" and name in _REBUILDS:
        return getattr(reductions, name)
    if module in ("torch", "torch.storage") and name in ("UntypedStorage", "TypedStorage"):
        return getattr(torch, name)
    if module == "torch" and name in ("Tensor", "Size"):
        return getattr(torch, name)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module in ("torch.nn.parameter", "torch.nn") and name == "Parameter":
        return torch.nn.Parameter
    if module.startswith("sglang.") and name in _STANDINS:
        return _STANDINS[name]
    if module == "multiprocessing.resource_sharer" and name == "DupFd":
        raise UnsafePayload(f"the tensors are shared by file descriptor, which only the sending "
                            f"process's children can receive; {BY_FILE}")
    if name == "rebuild_storage_fd":
        raise UnsafePayload(f"the tensors are shared by file descriptor; {BY_FILE}")
    raise UnsafePayload(f"the payload names {module}.{name}, which is not a tensor; only torch's "
                        "shared-memory tensors and SGLang's tensor metadata are accepted")


class TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _allowed(module, name)


def unpickle(blob: bytes) -> Any:
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions for shared storages)
    try:
        return TensorUnpickler(io.BytesIO(blob)).load()
    except UnsafePayload:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError,
            RuntimeError, OSError, KeyError) as exc:
        raise WeightsMismatch(f"cannot read the shared tensors: {type(exc).__name__}: {exc}") from None


def _tensor(value: Any, where: str) -> Any:
    import base64

    import torch
    if isinstance(value, LocalSerializedTensor):
        values = getattr(value, "values", None)
        if not isinstance(values, list) or len(values) != 1:
            raise WeightsMismatch(f"{where}: a LocalSerializedTensor must hold one value per rank, "
                                  "and this server is one rank")
        nested = values[0]
        if isinstance(nested, str):
            nested = base64.b64decode(nested, validate=True)
        if not isinstance(nested, (bytes, bytearray)):
            raise WeightsMismatch(f"{where}: a LocalSerializedTensor's value must be bytes")
        value = unpickle(bytes(nested))
    if not isinstance(value, torch.Tensor):
        raise WeightsMismatch(f"{where}: not a tensor but {type(value).__name__}")
    return value.detach().clone()          # out of the sender's shared memory, now


def _pairs(payload: Any) -> list[tuple[str, Any]]:
    if not isinstance(payload, (list, tuple)):
        raise WeightsMismatch(f"a direct payload is a list of (name, tensor) pairs, not {type(payload).__name__}")
    out = []
    for i, pair in enumerate(payload):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise WeightsMismatch(f"entry {i} of the payload is not a (name, tensor) pair")
        out.append((pair[0], _tensor(pair[1], pair[0])))
    return out


def _bucket(payload: Any) -> list[tuple[str, Any]]:
    import torch
    if not (isinstance(payload, dict) and set(payload) >= {"flattened_tensor", "metadata"}):
        raise WeightsMismatch("a flattened_bucket payload is {flattened_tensor, metadata}")
    flat, metadata = payload["flattened_tensor"], payload["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise WeightsMismatch("flattened_tensor must be a 1-D tensor")
    if not isinstance(metadata, list):
        raise WeightsMismatch("metadata must be a list")
    out = []
    for i, meta in enumerate(metadata):
        if not isinstance(meta, FlattenedTensorMetadata):
            raise WeightsMismatch(f"metadata[{i}] is not a FlattenedTensorMetadata")
        name, shape, dtype = getattr(meta, "name", None), getattr(meta, "shape", None), getattr(meta, "dtype", None)
        start, end = getattr(meta, "start_idx", None), getattr(meta, "end_idx", None)
        if not (isinstance(name, str) and isinstance(start, int) and isinstance(end, int)
                and isinstance(dtype, torch.dtype) and isinstance(shape, (tuple, list, torch.Size))):
            raise WeightsMismatch(f"metadata[{i}] lacks a name, shape, dtype, start_idx or end_idx")
        numel = 1
        for d in shape:
            numel *= int(d)
        # SGLang's multi-dtype buckets flatten every tensor to bytes (``view(torch.uint8)``):
        # the indices count bytes and each tensor is a view of its slice; older buckets are
        # one dtype, the indices count elements
        as_bytes = flat.dtype == torch.uint8 and dtype != torch.uint8
        span = numel * (dtype.itemsize if as_bytes else 1)
        if not (0 <= start <= end <= flat.numel() and end - start == span):
            raise WeightsMismatch(f"metadata[{i}] ({name}): slice {start}:{end} does not fit the flat "
                                  f"tensor of {flat.numel()} or the shape {list(shape)}")
        part = flat[start:end]
        part = part.view(dtype) if as_bytes else part.to(dtype)
        out.append((name, part.reshape(tuple(shape)).clone()))
    return out


def read_shared(blobs: tuple[bytes, ...], load_format: str | None) -> list[tuple[str, Any]]:
    """The named tensors of SGLang's pickled payload (one per rank: this server's is the only
    one), copied out of shared memory. Raises `WeightsMismatch` (`UnsafePayload` for a pickle
    that names anything but tensors)."""
    if load_format not in SHARED_FORMATS:
        raise WeightsMismatch(f"unsupported load_format {load_format!r}")
    if len(blobs) != 1:
        raise WeightsMismatch(f"serialized_named_tensors has {len(blobs)} entries, one per "
                              "tensor-parallel rank; this server is one rank")
    payload = unpickle(blobs[0])
    return _bucket(payload) if load_format == "flattened_bucket" else _pairs(payload)
