"""Weights from a trainer process over torch.distributed: `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`, the control actor's part
(`WeightsGroupControl`, a base of `ControlActor` on top of `WeightsControl`).

One group at a time, held here (`weights_group`, an `engine.weights.weights_group.WeightsGroup`). Its
join is a control record that is ``working`` while `engine.weights.weights_group.open_group`
runs on a worker thread: the trainer's join and this one rendezvous concurrently, and the
event loop serves meanwhile; a join that does not complete in its bound ends the record
rejected with why. A second init while a group is open (or joining) is refused.

An update is `WeightsControl`'s two phases with another read: the tensors are received from
the group on a worker thread (`engine.weights.weights_group.receive_checked`) instead of read from a
folder, then copied at the step barrier by the scheduler's `LoadWeights` like every other
update (so pause, ``abort_all_requests``, the prefix-cache flush and "no forward mixes two
versions" hold the same). An update naming no open group, or refused by the WEIGHTS or SERVER
lifecycle, receives nothing: the trainer's broadcast then fails at its own timeout.

Destroying frees the group on a worker thread; it is refused while an update is using it.
Stopping the control actor (server shutdown) destroys it too.
"""

from __future__ import annotations

from typing import Any

from ..messages import (
    ControlResult, DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, UpdateWeightsFromDistributed,
    WeightsGroupClosed, WeightsGroupJoined,
)
from ..statemachines import ServerState
from .actor import handles
from .weights_control import WeightsControl

DIST_OP = "update_weights_from_distributed"


class WeightsGroupControl(WeightsControl):
    # owned by ControlActor (set in its __init__ through `_init_weights_group`)
    weights_group: Any          # engine.weights_group.WeightsGroup | None
    _group_joining: str | None  # the init record's rid while the join runs

    def _init_weights_group(self) -> None:
        self.weights_group = None
        self._group_joining = None

    # -- init ----------------------------------------------------------------------------------
    @handles(InitWeightsUpdateGroup)
    def _init_group(self, msg: InitWeightsUpdateGroup) -> Any:
        rec = self._new("init_weights_update_group")
        if self.weights_group is not None:
            return self._end(rec, ControlResult(False, f"a weight update group is already open "
                                                       f"({self.weights_group.name!r}): destroy it first"))
        if self._group_joining is not None:
            return self._end(rec, ControlResult(False, "another weight update group is being joined"))
        if self.server.state in (ServerState.draining, ServerState.stopped):
            return self._end(rec, ControlResult(False, f"cannot join a weight update group while the server "
                                                       f"is {self.server.state.name}"))
        if not 0 < msg.rank_offset < msg.world_size:
            return self._end(rec, ControlResult(False, f"rank_offset {msg.rank_offset} must be in 1..world_size-1 "
                                                       f"({msg.world_size - 1}): rank 0 is the trainer's"))
        from ..engine.weights import weights_group
        assert self.system is not None
        self._fire(rec, "work")
        rec.msg = msg
        self._group_joining = rec.rid
        rid = rec.rid
        fut = self.system.loop.run_in_executor(None, weights_group.open_group, msg.master_address, msg.master_port,
                                               msg.rank_offset, msg.world_size, msg.group_name, msg.backend)
        self.system.pipe(fut, self, off_loop=True, wrap=lambda g, err: self._joined(rid, g, err))
        return rec.reply

    def _joined(self, rid: str, group: Any, error: BaseException | None) -> WeightsGroupJoined:
        if group is not None and not self.alive:      # stopped while joining: nobody will destroy it
            from ..engine.weights import weights_group
            weights_group.close_group(group)
        return WeightsGroupJoined(rid, group, error)

    @handles(WeightsGroupJoined)
    def _group_joined(self, msg: WeightsGroupJoined) -> None:
        self._group_joining = None
        rec = self.open.get(msg.rid)
        if msg.error is not None:
            if rec is not None:
                self._end(rec, ControlResult(False, str(msg.error) or type(msg.error).__name__))
            return
        self.weights_group = msg.group
        if self._rec is not None:
            self._rec.note("weights_group", "joined", rid="weights", data=msg.group.describe())
        if rec is not None:
            self._end(rec, ControlResult(True, f"joined weight update group {msg.group.name!r} as rank "
                                               f"{msg.group.rank} of {msg.group.world_size}",
                                         msg.group.describe()))

    # -- update --------------------------------------------------------------------------------
    @handles(UpdateWeightsFromDistributed)
    def _update_distributed(self, msg: UpdateWeightsFromDistributed) -> Any:
        rec = self._new(DIST_OP)
        group = self.weights_group
        if group is None or group.name != msg.group_name:
            have = f" (the open one is {group.name!r})" if group is not None else ""
            return self._end(rec, ControlResult(False, f"no weight update group named {msg.group_name!r} is "
                                                       f"open{have}: POST /init_weights_update_group first"))
        return self._begin_update(rec, msg)

    def _read_update(self, engine: Any, msg: Any) -> dict[str, Any]:
        """On a worker thread: receive the broadcast tensors, then check them."""
        if not isinstance(msg, UpdateWeightsFromDistributed):
            return super()._read_update(engine, msg)
        from ..engine.weights import weights_group
        from ..engine.weights.refit import WeightsMismatch
        group = self.weights_group
        if group is None:
            raise WeightsMismatch("the weight update group was destroyed")
        return weights_group.receive_checked(engine, group, list(msg.names), list(msg.dtypes),
                                             [list(s) for s in msg.shapes])

    # -- destroy -------------------------------------------------------------------------------
    @handles(DestroyWeightsUpdateGroup)
    def _destroy_group(self, msg: DestroyWeightsUpdateGroup) -> Any:
        rec = self._new("destroy_weights_update_group")
        group = self.weights_group
        if group is None or group.name != msg.group_name:
            return self._end(rec, ControlResult(False, f"no weight update group named {msg.group_name!r} is open"))
        if any(r.op == DIST_OP for r in self.open.values()):
            return self._end(rec, ControlResult(False, "an update is using the weight update group; "
                                                       "destroy it once the update has answered"))
        from ..engine.weights import weights_group
        assert self.system is not None
        self.weights_group = None
        self._fire(rec, "work")
        rid = rec.rid
        fut = self.system.loop.run_in_executor(None, weights_group.close_group, group)
        self.system.pipe(fut, self, off_loop=True, wrap=lambda _, err: WeightsGroupClosed(rid, err))
        if self._rec is not None:
            self._rec.note("weights_group", "destroyed", rid="weights", data={"group_name": group.name})
        return rec.reply

    @handles(WeightsGroupClosed)
    def _group_closed(self, msg: WeightsGroupClosed) -> None:
        rec = self.open.get(msg.rid)
        if rec is None:
            return
        if msg.error is not None:        # the group is forgotten either way
            self._end(rec, ControlResult(True, f"destroyed the weight update group ({type(msg.error).__name__}: "
                                               f"{msg.error})"))
        else:
            self._end(rec, ControlResult(True, "destroyed the weight update group"))

    def _close_weights_group(self) -> None:
        """Server shutdown: free the group (off the loop; a receive still running then fails)."""
        group, self.weights_group = self.weights_group, None
        if group is None or self.system is None:
            return
        from ..engine.weights import weights_group
        try:
            self.system.loop.run_in_executor(None, weights_group.close_group, group)
        except RuntimeError:             # the loop's executor is already shut down
            weights_group.close_group(group)
