"""Weight-update-group messages (issue 28: weights from a trainer over torch.distributed): the
control plane's `InitWeightsUpdateGroup`, `UpdateWeightsFromDistributed` and
`DestroyWeightsUpdateGroup` [control], and the worker threads' answers `WeightsGroupJoined` and
`WeightsGroupClosed` [control]. Re-exported by `messages`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["InitWeightsUpdateGroup", "UpdateWeightsFromDistributed", "DestroyWeightsUpdateGroup",
           "WeightsGroupJoined", "WeightsGroupClosed"]


@dataclass(frozen=True, slots=True)
class InitWeightsUpdateGroup:
    """Join a trainer's process group as rank `rank_offset` (`/init_weights_update_group`)."""
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"


@dataclass(frozen=True, slots=True)
class UpdateWeightsFromDistributed:
    """Receive named tensors broadcast by rank 0 of the group, in the order of `names`, then
    copy them at a step barrier (`/update_weights_from_distributed`)."""
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = "weight_update_group"
    abort_all: bool = False
    weight_version: str | None = None
    token_step = 0

    @property
    def model_path(self) -> str:
        """Where the weights came from, as the answer and the recording say it."""
        return f"weight update group {self.group_name}"


@dataclass(frozen=True, slots=True)
class DestroyWeightsUpdateGroup:
    """Leave and free the group (`/destroy_weights_update_group`)."""
    group_name: str = "weight_update_group"


@dataclass(frozen=True, slots=True)
class WeightsGroupJoined:
    """The join ran on a worker thread: the group (`engine.weights.weights_group.WeightsGroup`) or why not."""
    rid: str
    group: Any = field(repr=False, compare=False)
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class WeightsGroupClosed:
    """The group was destroyed on a worker thread, for control record `rid`."""
    rid: str
    error: BaseException | None = None
