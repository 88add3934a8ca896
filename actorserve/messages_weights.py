"""Weight-update messages (issue 28): the control plane's requests (`UpdateWeightsFromDisk`,
`UpdateWeightsFromTensor`, `UpdateWeightVersion`, `GetWeightsByName`) [control], the read's answer
`WeightsRead` [control], `LoadWeights` [scheduler] and its own `WeightsApplied`. Re-exported by
`messages`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["UpdateWeightsFromDisk", "UpdateWeightsFromTensor", "UpdateWeightVersion", "GetWeightsByName",
           "LoadWeights", "WeightsApplied", "WeightsRead", "SetWeightVersion"]


@dataclass(frozen=True, slots=True)
class UpdateWeightsFromDisk:
    """Load new weights from a model folder in place, at a step barrier (`/update_weights_from_disk`)."""
    model_path: str
    load_format: str | None = None
    abort_all: bool = False
    weight_version: str | None = None
    token_step: int = 0          # the trainer's step (SGLang's), recorded with the version


@dataclass(frozen=True, slots=True)
class UpdateWeightsFromTensor:
    """Update some or all weights from named tensors (`/update_weights_from_tensor`): each blob a
    safetensors file's bytes (``load_format`` "safetensors"), or SGLang's shared-memory pickle
    (null, "direct", "flattened_bucket"; read by `engine.weights.refit_shm`), checked off the loop,
    copied at a step barrier."""
    blobs: tuple[bytes, ...] = field(repr=False, compare=False)
    abort_all: bool = False
    weight_version: str | None = None
    load_format: str | None = "safetensors"
    model_path = "serialized tensors"      # where the weights came from, as the answer says it
    token_step = 0

    def recorded(self) -> dict[str, Any]:
        """What the recording keeps: the sizes, never the bytes."""
        return {"blob_bytes": [len(b) for b in self.blobs], "abort_all": self.abort_all,
                "weight_version": self.weight_version, "load_format": self.load_format}


@dataclass(frozen=True, slots=True)
class UpdateWeightVersion:
    """Relabel the served weights (`/update_weight_version`); optionally abort every request."""
    new_version: str
    abort_all: bool = False


@dataclass(frozen=True, slots=True)
class GetWeightsByName:
    """Read one parameter of the served model (`/get_weights_by_name`)."""
    name: str
    truncate_size: int = 100


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """Apply weights already read and checked off the loop (`engine.weights.refit.read_checked`'s
    tensors by name) if no request holds KV and no step runs (else answered busy): the prefix
    cache is flushed and the copy runs where the model steps run."""
    model_path: str
    tensors: Any = field(repr=False, compare=False)
    weight_version: str | None = None     # the label of the new weights (None: the label stays)


@dataclass(frozen=True, slots=True)
class SetWeightVersion:
    """Relabel the weights the scheduler's steps run with (`/update_weight_version`): steps
    started from now on say `version`; a step in flight keeps the label it started with."""
    version: str


@dataclass(frozen=True, slots=True)
class WeightsApplied:
    """The scheduler's own: `LoadWeights`' copy finished on the step thread (`tensors` copied)."""
    tensors: int
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class WeightsRead:
    """An update's folder was read and checked on a worker thread, back at the control actor
    for record `rid`: its tensors by name, or why they cannot serve."""
    rid: str
    tensors: Any = field(repr=False, compare=False)
    error: BaseException | None = None
    read_s: float = 0.0
