"""The lifecycles against what they must mean, not against a copy of their tables.

Three kinds of check, none of which restates a transition table:

* **properties** every lifecycle has (hypothesis random walks over the real machine): only the
  machine moves the state, a refused event changes nothing and is reported, terminal states are
  final, every state is reachable and every live state can still end;
* **scenarios** from the semantics in DESIGN.md (a request paused in place resumes where it was,
  a retracted one is recomputed from the queue, a paused server can drain, ...), each a short
  story of events with the state it must end in, or the event that must be refused;
* the **definition hash** (what recordings carry to tell a changed definition): the same data
  gives the same hash, any change gives another, and a pinned value for a fixed definition
  guards the hash function itself (changing it would make every old recording look stale).
"""

from __future__ import annotations

import enum

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actorserve.statemachines import (
    CONTROL, GENERATION, HEALTH, LIFECYCLES, POOLING, SCHEDULER, SERVER, SESSION, Edge,
    IllegalTransition, Lifecycle, Subject, UnknownEvent,
)


class Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None, str | None]] = []

    def transition(self, lc, model, event, src, dst, error, cause):
        self.seen.append((event, src.name, dst.name if dst else None, error))


def subject(lc: Lifecycle, **conditions: bool) -> Subject:
    conds = {e.condition: False for e in lc.edges if e.condition}
    conds.update(conditions)
    return Subject(lc.initial, rid="r", **conds)


def run(lc: Lifecycle, events: list[str], **conditions: bool) -> str:
    s = subject(lc, **conditions)
    for ev in events:
        lc.fire(s, ev)
    return s.state.name


# -- properties of every lifecycle ----------------------------------------------------------------


def reachable(lc: Lifecycle, start: enum.Enum) -> set[enum.Enum]:
    seen, todo = {start}, [start]
    while todo:
        s = todo.pop()
        for e in lc.edges:
            if s in e.sources and e.dest not in seen:
                seen.add(e.dest)
                todo.append(e.dest)
    return seen


@pytest.mark.parametrize("name", list(LIFECYCLES))
def test_every_state_is_reachable_and_every_live_state_can_end(name):
    lc = LIFECYCLES[name]
    assert reachable(lc, lc.initial) == set(lc.states), name
    for s in lc.states:
        if s in lc.terminal:
            assert lc.allowed(s) == (), f"{name}: terminal {s.name} has a way out"
        elif lc.terminal:
            assert reachable(lc, s) & lc.terminal, f"{name}: {s.name} can never end"
        else:   # a region without an end (health) can always come back to where it started
            assert lc.initial in reachable(lc, s), f"{name}: {s.name} is a dead end"


@pytest.mark.parametrize("lc", [GENERATION, POOLING], ids=["generation", "pooling"])
def test_abort_and_fail_reach_every_live_request_state_and_nothing_else(lc):
    live = set(lc.states) - set(lc.terminal)
    for event, dest in (("abort", "aborted"), ("fail", "failed")):
        sources = {s for e in lc.edges if e.event == event for s in e.sources}
        assert sources == live, event
        assert {e.dest.name for e in lc.edges if e.event == event} == {dest}


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(list(LIFECYCLES)), data=st.data())
def test_random_walks_move_only_through_the_machine(name, data):
    lc = LIFECYCLES[name]
    s = subject(lc)
    obs = Observer()
    for _ in range(data.draw(st.integers(1, 30))):
        for cond in {e.condition for e in lc.edges if e.condition}:
            setattr(s, cond, data.draw(st.booleans()))
        ev = data.draw(st.sampled_from(lc.events))
        before = s.state
        targets = lc.targets(ev, before)
        if not targets:
            with pytest.raises(IllegalTransition):
                lc.fire(s, ev, observer=obs)
            assert s.state is before and obs.seen[-1][2] is None and obs.seen[-1][3]
            continue
        first_true = next((e.dest for e in lc.edges if e.event == ev and before in e.sources
                           and (e.condition is None or getattr(s, e.condition))), None)
        got = lc.fire(s, ev, observer=obs)
        assert got is first_true and s.state is got
        assert obs.seen[-1] == (ev, before.name, got.name, None)
        if got in lc.terminal:
            for other in lc.events:
                with pytest.raises(IllegalTransition):
                    lc.fire(s, other)
            return


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


# -- scenarios from the semantics -----------------------------------------------------------------

ACCEPTED = [
    (GENERATION, "schedule first_token finish deliver", {}, "done"),
    (GENERATION, "schedule prefill_chunk prefill_chunk first_token finish deliver", {}, "done"),
    # pause in_place keeps the KV: back to where it was
    (GENERATION, "schedule first_token pause resume_decode finish deliver", {}, "done"),
    (GENERATION, "schedule prefill_chunk pause resume_prefill first_token", {}, "decode"),
    # retract frees the KV: the request is recomputed from the queue
    (GENERATION, "schedule first_token retract schedule first_token", {}, "decode"),
    (GENERATION, "schedule first_token pause retract", {}, "queued"),
    # a client that leaves while its final text waits aborts a request in detok
    (GENERATION, "schedule first_token finish abort", {}, "aborted"),
    (GENERATION, "fail", {}, "failed"),
    (POOLING, "schedule forward_chunk forward_done deliver", {}, "done"),
    (POOLING, "schedule retract schedule forward_done abort", {}, "aborted"),
    (CONTROL, "ask apply", {}, "applied"),
    (CONTROL, "reject", {}, "rejected"),
    # an abort asked of three schedulers: two answers, then the last one ends it
    (CONTROL, "ask answered answered apply", {}, "applied"),
    # a flush with a timeout: busy, waits for idle, asks again; or its timeout runs out
    (CONTROL, "ask busy retry apply", {}, "applied"),
    (CONTROL, "ask busy time_out", {}, "rejected"),
    # a weight update: read off the loop, asked, busy, retried; a drain waits for each idle
    (CONTROL, "work ask busy retry apply", {}, "applied"),
    (CONTROL, "wait_idle answered apply", {}, "applied"),
    (CONTROL, "probe reject", {}, "rejected"),
    (SERVER, "ready drain stop", {}, "stopped"),
    (SERVER, "ready drain", {}, "draining"),
    (HEALTH, "stall recover stall", {}, "unhealthy"),
    (SESSION, "defer_close close", {}, "closed"),
    (SESSION, "expire", {}, "closed"),
    (SCHEDULER, "admit step step_done", {}, "pending"),
    (SCHEDULER, "admit step step_done empty", {}, "idle"),
    # a pause mid-step waits for the boundary, then applies
    (SCHEDULER, "admit window window_closed step defer_pause step_done pause_retract resume", {}, "pending"),
    (SCHEDULER, "admit step defer_pause cancel_pause step_done empty", {}, "idle"),
    # a failed step is isolated (its members re-run in halves), then its outputs go on as a step's
    (SCHEDULER, "admit step isolate isolated step_done", {}, "pending"),
    (SCHEDULER, "admit step defer_pause isolate isolated step_done pause_abort", {}, "paused_abort"),
    # a pause that arrives while isolating waits for the step, and can be cancelled there
    (SCHEDULER, "admit step isolate defer_pause cancel_pause defer_pause isolated", {}, "pausing"),
    (SCHEDULER, "admit empty pause_in_place resume empty", {}, "idle"),
    (SCHEDULER, "admit window window_closed pause_abort stop", {}, "stopped"),
]

REFUSED = [
    (GENERATION, "schedule finish", "finish"),              # no token yet: decode comes first
    (GENERATION, "schedule first_token finish pause", "pause"),   # the result is known
    (GENERATION, "resume_decode", "resume_decode"),
    (GENERATION, "retract", "retract"),                     # nothing to retract in the queue
    (POOLING, "schedule deliver", "deliver"),
    (CONTROL, "ask ask", "ask"),                            # asked once; its answers come back
    (CONTROL, "ask retry", "retry"),                        # only a record waiting for idle retries
    (CONTROL, "probe busy", "busy"),
    (CONTROL, "time_out", "time_out"),                      # only what waits for an answer times out
    (SERVER, "drain stop ready", "ready"),                  # stopped is terminal
    (SERVER, "ready drain ready", "ready"),
    (HEALTH, "recover", "recover"),
    (SCHEDULER, "admit step step", "step"),                 # one step at a time
    (SCHEDULER, "admit step pause_abort", "pause_abort"),   # mid-step: defer_pause
    (SCHEDULER, "admit window pause_abort", "pause_abort"),   # the window closes first
    (SCHEDULER, "admit step empty", "empty"),               # a step's requests are not gone
    (SCHEDULER, "admit isolate", "isolate"),                # only a step in flight is isolated
    (SCHEDULER, "admit step isolate isolate", "isolate"),   # one isolation at a time
    (SCHEDULER, "admit step isolate step_done", "step_done"),   # the culprits are known first
    (SCHEDULER, "admit pause_in_place pause_abort", "pause_abort"),
    (SESSION, "close defer_close", "defer_close"),
]


@pytest.mark.parametrize("lc,story,conds,end", ACCEPTED,
                         ids=[f"{lc.name}:{story}" for lc, story, _, _ in ACCEPTED])
def test_a_story_the_semantics_allow_ends_where_it_must(lc, story, conds, end):
    assert run(lc, story.split(), **conds) == end


@pytest.mark.parametrize("lc,story,refused", REFUSED, ids=[f"{lc.name}:{s}" for lc, s, _ in REFUSED])
def test_a_story_the_semantics_forbid_is_refused_at_the_right_event(lc, story, refused):
    events = story.split()
    s = subject(lc)
    for ev in events[:-1]:
        lc.fire(s, ev)
    before = s.state
    with pytest.raises(IllegalTransition) as err:
        lc.fire(s, events[-1])
    assert err.value.event == refused and s.state is before


def test_pause_modes_are_states_of_the_scheduler_only():
    """Pause lives in one machine: the server's run phase has no copy of it."""
    from actorserve.statemachines import PAUSE_MODES, PAUSED_MODE
    for mode in PAUSE_MODES:
        s = subject(SCHEDULER)
        SCHEDULER.fire(s, f"pause_{mode}")
        assert PAUSED_MODE[s.state] == mode
    assert {PAUSED_MODE.get(s) for s in SCHEDULER.states} == {None, *PAUSE_MODES}
    assert not any(s in PAUSED_MODE for s in SERVER.states)
    assert not any(e.startswith("pause") or e == "resume" for e in SERVER.events)


# -- the definition hash --------------------------------------------------------------------------


class Light(enum.Enum):
    red = "red"
    green = "green"
    off = "off"


def light(*, extra: tuple[Edge, ...] = (), doc: str = "") -> Lifecycle:
    return Lifecycle(name="light", states=Light, initial=Light.red, terminal=frozenset({Light.off}),
                     edges=(Edge("go", (Light.red,), Light.green), Edge("stop", (Light.green,), Light.red),
                            Edge("off", (Light.red, Light.green), Light.off), *extra), doc=doc)


def test_definition_hash_depends_on_the_definition_only():
    assert light().definition_hash == light().definition_hash
    assert light(doc="another description").definition_hash == light().definition_hash
    changed = light(extra=(Edge("blink", (Light.green,), Light.green),))
    assert changed.definition_hash != light().definition_hash
    guarded = Lifecycle(name="light", states=Light, initial=Light.red, terminal=frozenset({Light.off}),
                        edges=(Edge("go", (Light.red,), Light.green, condition="ready"),
                               Edge("stop", (Light.green,), Light.red),
                               Edge("off", (Light.red, Light.green), Light.off)))
    assert guarded.definition_hash != light().definition_hash
    # pinned: sha256 of the canonical JSON of this definition, first 16 hex digits
    assert light().definition_hash == PINNED_LIGHT_HASH
    assert len({lc.definition_hash for lc in LIFECYCLES.values()}) == len(LIFECYCLES)


PINNED_LIGHT_HASH = "c5e2b4e93bdca979"


def test_can_answers_from_the_table_as_fire_would():
    """`Lifecycle.can` is the guard a handler asks instead of repeating an edge's sources."""
    for lc in (SCHEDULER, SERVER, GENERATION):
        for state in lc.states:
            for event in lc.events:
                s = subject(lc)
                s.state = state
                try:
                    lc.fire(s, event)
                    fired = True
                except IllegalTransition:
                    fired = False
                assert lc.can(state, event) == fired, (lc.name, state, event)
