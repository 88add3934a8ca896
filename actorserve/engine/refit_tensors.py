"""Named tensors sent in a request (`/update_weights_from_tensor`), read and checked like a
folder (`refit.read_checked`): phase one of an update, on a worker thread, off the event loop.

Each blob is a safetensors file's bytes (parsed by `safetensors`, which reads a JSON header and
raw little-endian data: no code runs). The tensors of all blobs together may be any non-empty
subset of the served model's parameters (a partial update, as SGLang's buckets); every name
must be a served parameter, appear once, and have its shape and a floating dtype. Anything else
is a `WeightsMismatch` and nothing is touched; `refit.apply_checked` then copies only these.
"""

from __future__ import annotations

from typing import Any

from .refit import WeightsMismatch, _model_of


def read_tensors_checked(engine: Any, blobs: tuple[bytes, ...] | list[bytes]) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    model = _model_of(engine)
    served = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    new: dict[str, Any] = {}
    for i, blob in enumerate(blobs):
        try:
            tensors = load_safetensors(bytes(blob))
        except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
            raise WeightsMismatch(f"serialized_named_tensors[{i}] is not a safetensors file: "
                                  f"{type(exc).__name__}: {exc}") from None
        for name, t in tensors.items():
            if name in new:
                raise WeightsMismatch(f"serialized_named_tensors[{i}]: {name} is sent twice")
            if name not in served:
                raise WeightsMismatch(f"serialized_named_tensors[{i}]: no parameter named {name!r} "
                                      "in the served model")
            if tuple(t.shape) != served[name]:
                raise WeightsMismatch(f"serialized_named_tensors[{i}]: {name} has shape {list(t.shape)}, "
                                      f"the served model's is {list(served[name])}")
            if not t.is_floating_point():
                raise WeightsMismatch(f"serialized_named_tensors[{i}]: {name} has dtype {t.dtype}, "
                                      "not a floating point one")
            new[name] = t
    if not new:
        raise WeightsMismatch("serialized_named_tensors holds no tensor")
    return new
