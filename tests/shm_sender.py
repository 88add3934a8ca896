"""A trainer-like process that shares tensors the way SGLang's clients do
(`MultiprocessingSerializer`: ForkingPickler + base64), for tests/test_weights_shm.py.

Usage: python shm_sender.py FORM STRATEGY SAFETENSORS_FILE
FORM: direct | local (LocalSerializedTensor values) | bucket / bytes_bucket (slime's flattened_bucket,
one dtype or SGLang's multi-dtype bytes) | evil.
Prints one JSON line (the `serialized_named_tensors` entry), then keeps the tensors alive until
its stdin closes (the receiver reads the shared memory while the request runs)."""

import base64
import io
import json
import os
import sys
import types
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.multiprocessing  # noqa: E402
from multiprocessing.reduction import ForkingPickler  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _sglang_module(name: str) -> types.ModuleType:
    """Classes pickled under SGLang's module paths (the receiver has no sglang either)."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    return sys.modules[name]


bucket_mod = _sglang_module("sglang.srt.weight_sync.tensor_bucket")
runner_mod = _sglang_module("sglang.srt.model_executor.model_runner")


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    values: list


FlattenedTensorMetadata.__module__ = bucket_mod.__name__
bucket_mod.FlattenedTensorMetadata = FlattenedTensorMetadata
LocalSerializedTensor.__module__ = runner_mod.__name__
runner_mod.LocalSerializedTensor = LocalSerializedTensor


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {sys.argv[3]}.pwned",))


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def main() -> None:
    form, strategy, path = sys.argv[1:4]
    torch.multiprocessing.set_sharing_strategy(strategy)
    tensors = load_file(path) if form != "evil" else {}
    keep = list(tensors.values())
    if form == "direct":
        payload = dumps(list(tensors.items()))
    elif form == "local":
        payload = dumps([(k, LocalSerializedTensor([dumps(v)])) for k, v in tensors.items()])
    elif form in ("bucket", "bytes_bucket"):     # one dtype (indices in elements), or SGLang's
        metadata, flat, at = [], [], 0           # multi-dtype bytes (indices in bytes)
        for i, (k, v) in enumerate(tensors.items()):
            if form == "bytes_bucket":
                v = (v.bfloat16() if i % 2 else v).flatten().view(torch.uint8)   # mixed dtypes
                dtype, shape = (torch.bfloat16 if i % 2 else torch.float32), tensors[k].shape
            else:
                dtype, shape = v.dtype, v.shape
            metadata.append(FlattenedTensorMetadata(k, shape, dtype, at, at + v.numel(), v.numel()))
            flat.append(v.flatten())
            at += v.numel()
        cat = torch.cat(flat)
        keep.append(cat)
        payload = dumps({"flattened_tensor": cat, "metadata": metadata})
    else:
        payload = dumps([("model.norm.weight", Evil())])
    print(json.dumps(base64.b64encode(payload).decode()), flush=True)
    sys.stdin.read()
    del keep


if __name__ == "__main__":
    main()
