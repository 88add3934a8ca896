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


def read_tensors_checked(engine: Any, blobs: tuple[bytes, ...] | list[bytes],
                         load_format: str | None = "safetensors") -> dict[str, Any]:
    """The sent tensors by name, checked. ``load_format`` "safetensors": each blob a safetensors
    file; SGLang's shared-memory forms (null, "direct", "flattened_bucket") are read by
    `refit_shm.read_shared`."""
    if load_format != "safetensors":
        from .refit_shm import read_shared
        return check_named(engine, [("serialized_named_tensors[0]", read_shared(tuple(blobs), load_format))])
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    groups = []
    for i, blob in enumerate(blobs):
        try:
            tensors = load_safetensors(bytes(blob))
        except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
            raise WeightsMismatch(f"serialized_named_tensors[{i}] is not a safetensors file: "
                                  f"{type(exc).__name__}: {exc}") from None
        groups.append((f"serialized_named_tensors[{i}]", list(tensors.items())))
    return check_named(engine, groups)


def check_named(engine: Any, groups: list[tuple[str, list[tuple[str, Any]]]]) -> dict[str, Any]:
    """Named tensors (grouped by where they came from, for the errors) checked against the
    served model: each a served parameter, once, of its shape and a floating dtype."""
    model = _model_of(engine)
    served = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    new: dict[str, Any] = {}
    for where, tensors in groups:
        for name, t in tensors:
            if name in new:
                raise WeightsMismatch(f"{where}: {name} is sent twice")
            if name not in served:
                raise WeightsMismatch(f"{where}: no parameter named {name!r} in the served model")
            if tuple(t.shape) != served[name]:
                raise WeightsMismatch(f"{where}: {name} has shape {list(t.shape)}, "
                                      f"the served model's is {list(served[name])}")
            if not t.is_floating_point():
                raise WeightsMismatch(f"{where}: {name} has dtype {t.dtype}, not a floating point one")
            new[name] = t
    if not new:
        raise WeightsMismatch("serialized_named_tensors holds no tensor")
    return new
