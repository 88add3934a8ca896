"""A fleet's replica is a lifecycle (REPLICA): only its machine writes a replica's state."""

from __future__ import annotations

import pytest

from actorserve.fleet.supervisor import Replica, fire
from actorserve.statemachines import REPLICA, IllegalTransition, ReplicaState


def test_a_replica_walks_its_lifecycle_and_refuses_what_it_does_not_allow():
    r = Replica(index=0, port=1, argv=[])
    assert r.state is ReplicaState.stopped
    for event, state in [("launch", "starting"), ("ready", "ready"), ("die", "dead"), ("launch", "starting"),
                         ("die", "dead"), ("launch", "starting"), ("ready", "ready"), ("stop", "stopped")]:
        fire(r, event)
        assert r.state.name == state, event
    with pytest.raises(IllegalTransition):
        fire(r, "ready")                      # a stopped replica is launched first
    with pytest.raises(IllegalTransition):
        fire(r, "die")                        # nothing runs that could die
    assert REPLICA.can(ReplicaState.ready, "die") and not REPLICA.can(ReplicaState.dead, "die")


def test_the_fleet_code_never_assigns_a_replica_state():
    import ast
    import inspect
    from actorserve.fleet import ray_fleet, supervisor

    def targets(node):
        for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
            yield from (t.elts if isinstance(t, ast.Tuple) else [t])

    for mod in (supervisor, ray_fleet):
        tree = ast.parse(inspect.getsource(mod))
        written = [t.lineno for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
                   for t in targets(n) if isinstance(t, ast.Attribute) and t.attr == "state"]
        assert written == [], (mod.__name__, written)
