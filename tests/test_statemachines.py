"""Each lifecycle against a hand-written model of what it must allow (hypothesis stateful).

The expected tables below are written out independently of `statemachines.lifecycles`,
so a change to a definition that is not mirrored here fails.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actorserve.statemachines import (
    CONTROL, GENERATION, LIFECYCLES, POOLING, SERVER, SESSION, IllegalTransition, Subject,
    UnknownEvent,
)

LIVE_GEN = ["queued", "prefill", "decode", "paused", "retracted", "detok"]
EXPECTED = {
    "generation": {
        ("queued", "schedule"): "prefill",
        ("prefill", "prefill_chunk"): "prefill",
        ("prefill", "first_token"): "decode",
        ("decode", "finish"): "detok",
        ("detok", "deliver"): "done",
        ("prefill", "pause"): "paused",
        ("decode", "pause"): "paused",
        ("paused", "resume"): "decode|prefill",   # decode when the prompt is computed
        ("prefill", "retract"): "retracted",
        ("decode", "retract"): "retracted",
        ("paused", "retract"): "retracted",
        ("retracted", "requeue"): "queued",
        **{(s, "abort"): "aborted" for s in LIVE_GEN},
        **{(s, "fail"): "failed" for s in LIVE_GEN},
    },
    "pooling": {
        ("queued", "schedule"): "forward",
        ("forward", "forward_chunk"): "forward",
        ("forward", "forward_done"): "pool",
        ("forward", "retract"): "queued",
        ("pool", "deliver"): "done",
        **{(s, "abort"): "aborted" for s in ("queued", "forward", "pool")},
        **{(s, "fail"): "failed" for s in ("queued", "forward", "pool")},
    },
    "control": {
        ("received", "apply"): "applied",
        ("received", "reject"): "rejected",
        ("received", "wait"): "waiting",
        ("waiting", "apply"): "applied",
        ("waiting", "reject"): "rejected",
    },
    "server": {
        ("starting", "ready"): "serving",
        ("serving", "pause"): "paused",
        ("paused", "resume"): "serving",
        ("serving", "stall"): "unhealthy",
        ("paused", "stall"): "unhealthy",
        ("unhealthy", "recover"): "serving",
        **{(s, "drain"): "draining" for s in ("starting", "serving", "paused", "unhealthy")},
        ("starting", "stop"): "stopped",
        ("draining", "stop"): "stopped",
    },
    "session": {
        ("open", "close"): "closed",
        ("closing", "close"): "closed",
        ("open", "defer_close"): "closing",
        ("open", "expire"): "closed",
    },
}
TERMINAL = {
    "generation": {"done", "aborted", "failed"},
    "pooling": {"done", "aborted", "failed"},
    "control": {"applied", "rejected"},
    "server": {"stopped"},
    "session": {"closed"},
}


class Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None, str | None]] = []

    def transition(self, lc, model, event, src, dst, error, cause):
        self.seen.append((event, src.name, dst.name if dst else None, error))


def machine_test(lc):
    expected = EXPECTED[lc.name]
    events = sorted({e for (_, e) in expected})

    class LifecycleModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.subject = Subject(lc.initial, rid="r", prefill_complete=False)
            self.model_state = lc.initial.name
            self.obs = Observer()

        @rule(event=st.sampled_from(events), complete=st.booleans())
        def fire(self, event, complete):
            self.subject.prefill_complete = complete
            want = expected.get((self.model_state, event))
            before = len(self.obs.seen)
            if want is None:
                with pytest.raises(IllegalTransition):
                    lc.fire(self.subject, event, observer=self.obs)
                assert self.subject.state.name == self.model_state
                assert self.obs.seen[before][2] is None and self.obs.seen[before][3]
                return
            got = lc.fire(self.subject, event, observer=self.obs)
            if want == "decode|prefill":
                want = "decode" if complete else "prefill"
            assert got.name == want
            self.model_state = want
            assert self.obs.seen[before] == (event, self.obs.seen[before][1], want, None)

        @precondition(lambda self: self.model_state in TERMINAL[lc.name])
        @rule()
        def terminal_is_final(self):
            for ev in events:
                with pytest.raises(IllegalTransition):
                    lc.fire(self.subject, ev)

        @invariant()
        def in_sync(self):
            assert self.subject.state.name == self.model_state

    LifecycleModel.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
    return LifecycleModel.TestCase


TestGeneration = machine_test(GENERATION)
TestPooling = machine_test(POOLING)
TestControl = machine_test(CONTROL)
TestServer = machine_test(SERVER)
TestSession = machine_test(SESSION)


def test_tables_match_expectations_exactly():
    for name, lc in LIFECYCLES.items():
        pairs = {(s.name, e.event) for e in lc.edges for s in e.sources}
        assert pairs == set(EXPECTED[name]), name
        assert {s.name for s in lc.terminal} == TERMINAL[name]


def test_unknown_event_is_an_error_and_recorded():
    obs = Observer()
    s = Subject(GENERATION.initial, rid="x")
    with pytest.raises(UnknownEvent):
        GENERATION.fire(s, "teleport", observer=obs)
    assert obs.seen == [("teleport", "queued", None, obs.seen[0][3])] and obs.seen[0][3]


def test_one_shared_machine_per_kind_and_no_per_model_registration():
    s = Subject(GENERATION.initial, rid="y")
    GENERATION.fire(s, "schedule")
    assert GENERATION.machine.models == []          # model=None: nothing was add_model'ed
    assert not hasattr(s, "trigger")                # no convenience methods bolted on


def test_definition_hash_is_stable_and_distinct():
    hashes = {lc.definition_hash for lc in LIFECYCLES.values()}
    assert len(hashes) == len(LIFECYCLES)
    assert all(len(h) == 16 for h in hashes)
