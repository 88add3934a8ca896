"""The replica lifecycle: one instance per replica a fleet supervises (`actorserve.fleet`), as data.

``stopped -> starting -> ready -> dead -> starting ...``:

* ``launch`` starts a replica's process (or, in a Ray fleet, registers a new incarnation of its
  actor with the router): it is ``starting`` until it answers ``/health`` (the router sees it
  healthy, in a Ray fleet), then ``ready`` (``ready``) and routed to;
* ``die``: its process exited (or stopped answering); the supervisor waits out its backoff and
  launches it again (a Ray actor that restarted is launched again as it arrives);
* ``stop``: the fleet stopped it, in any state.

The models are the fleet's `Replica` records; only this machine writes their ``state``.
"""

from __future__ import annotations

import enum

from .core import Edge, Lifecycle


class ReplicaState(enum.Enum):
    starting = "starting"
    ready = "ready"
    dead = "dead"
    stopped = "stopped"


R = ReplicaState

REPLICA = Lifecycle(
    name="replica",
    states=ReplicaState,
    initial=R.stopped,
    terminal=frozenset(),
    edges=(
        Edge("launch", (R.stopped, R.dead, R.starting), R.starting),   # starting: a Ray actor that restarted
        Edge("ready", (R.starting,), R.ready),
        Edge("die", (R.starting, R.ready), R.dead),
        Edge("stop", tuple(R), R.stopped),
    ),
    doc="A fleet's replica: launched, ready once it answers /health, dead when its process "
        "exits (launched again after a backoff), stopped with the fleet.",
)
