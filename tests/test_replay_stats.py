"""Wasted forwards counted from hand-built recordings (actorserve/replay/stats.py).

Each recording is written event by event in the order the live runtime records them: the
scheduler plans step k+1 (a `step` event) in the same turn that routes step k's token, before
the request actor has seen that token, so a stop-string finish shows its wasted step *before*
the finish transition.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from actorserve.replay import replay_cli
from actorserve.replay.recorder import Event
from actorserve.replay.stats import latency_report, wasted_forwards, wasted_forwards_line

EOS = 2


def replay(*argv: str) -> int:
    """`actorserve replay ARGV...`, through the replay command alone."""
    p = argparse.ArgumentParser()
    replay_cli.add_arguments(p)
    return replay_cli.run(p.parse_args(list(argv)))


class Rec:
    """Builds an event list: one event per call, seq and time (1 ms apart) counted for us."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.input("runtime", data={"generation": {"engine": {"eos_token_ids": [EOS]}}})

    def _add(self, rid, kind, event, src=None, dst=None, data=None) -> None:
        n = len(self.events) + 1
        self.events.append(Event(n, n * 1_000_000, rid, kind, event, src, dst, True, None, None,
                                 None, data))

    def input(self, event: str, rid: str | None = None, data: dict | None = None) -> None:
        self._add(rid, "input", event, data=data)

    def arrive(self, rid: str, **params) -> None:
        self.input("generate", rid, {"prompt": [5, 6, 7], **params})
        self._add(rid, "generation", "create", None, "queued")

    def go(self, rid: str, event: str, src: str, dst: str) -> None:
        self._add(rid, "generation", event, src, dst)

    def step(self, step: int, *members: tuple[str, int], sched: str = "scheduler") -> None:
        self._add(None, "step", "step", data={"sched": sched, "step": step,
                                              "batch": [list(m) for m in members]})

    def step_end(self, step: int, *out: tuple[str, object], sched: str = "scheduler") -> None:
        self.input("step_end", data={"sched": sched, "step": step, "out": [list(o) for o in out],
                                     "error": None})

    def stop_string(self, rid: str) -> None:
        self._add(rid, "detok", "stop_string")

    def finish(self, rid: str) -> None:
        self.go(rid, "finish", "decode", "detok")
        self.go(rid, "deliver", "detok", "done")


def stop_string_run() -> Rec:
    """'a' stops on a stop string after its 2nd token; step 3 was already planned with it."""
    r = Rec()
    r.arrive("a", max_new_tokens=32, stop=["."])
    r.step(1, ("a", 3))
    r.go("a", "schedule", "queued", "prefill")
    r.step_end(1, ("a", 40))
    r.step(2, ("a", 1))
    r.go("a", "first_token", "prefill", "decode")
    r.step_end(2, ("a", 41))
    r.step(3, ("a", 1))            # planned before the request actor sees token 41
    r.stop_string("a")
    r.finish("a")
    r.step_end(3, ("a", 42))       # the wasted forward came back with a token: not a new k
    return r


def clean_run() -> Rec:
    """'e' ends on EOS, 'l' on max_new_tokens: the scheduler knew, neither is in a later step."""
    r = Rec()
    r.arrive("e", max_new_tokens=32)
    r.arrive("l", max_new_tokens=2)
    r.step(1, ("e", 3), ("l", 3))
    r.go("e", "schedule", "queued", "prefill")
    r.go("l", "schedule", "queued", "prefill")
    r.step_end(1, ("e", 40), ("l", 50))
    r.step(2, ("e", 1), ("l", 1))
    r.go("e", "first_token", "prefill", "decode")
    r.go("l", "first_token", "prefill", "decode")
    r.step_end(2, ("e", EOS), ("l", 51))
    r.finish("e")
    r.finish("l")
    r.arrive("z", max_new_tokens=4)          # a later request keeps the scheduler stepping
    r.step(3, ("z", 3))
    r.go("z", "schedule", "queued", "prefill")
    r.step_end(3, ("z", 60))
    r.go("z", "first_token", "prefill", "decode")
    r.go("z", "abort", "decode", "aborted")  # aborted: not a finish, never counted
    return r


def test_stop_string_finish_wastes_the_step_planned_before_it() -> None:
    w = wasted_forwards(stop_string_run().events)
    assert w == {"requests": 1, "total": 1, "tokens": 1, "requests_with_waste": 1,
                 "by_cause": {"stop_string": {"requests": 1, "wasted": 1, "with_waste": 1}}}


def test_eos_and_length_finishes_waste_nothing() -> None:
    w = wasted_forwards(clean_run().events)
    assert w == {"requests": 2, "total": 0, "tokens": 0, "requests_with_waste": 0,
                 "by_cause": {"eos": {"requests": 1, "wasted": 0, "with_waste": 0},
                              "length": {"requests": 1, "wasted": 0, "with_waste": 0}}}


def test_a_stop_string_finish_caught_in_time_wastes_nothing() -> None:
    """What issue 10's output stage does: the finish is known before step 3 is planned."""
    r = Rec()
    r.arrive("a", stop=["."])
    r.step(1, ("a", 3))
    r.go("a", "schedule", "queued", "prefill")
    r.step_end(1, ("a", 40))
    r.go("a", "first_token", "prefill", "decode")
    r.stop_string("a")
    r.finish("a")
    r.arrive("b")
    r.step(2, ("b", 3))
    w = wasted_forwards(r.events)
    assert (w["total"], w["requests_with_waste"]) == (0, 0)
    assert w["by_cause"] == {"stop_string": {"requests": 1, "wasted": 0, "with_waste": 0}}


def test_steps_are_matched_per_scheduler_and_per_incarnation() -> None:
    r = stop_string_run()
    r.step(7, ("a", 1), sched="scheduler:embed")   # another scheduler's step 7: not ours
    r.arrive("a", max_new_tokens=1)                # the rid again, a new request
    r.step(4, ("a", 3))
    r.go("a", "schedule", "queued", "prefill")
    r.step_end(4, ("a", 43))
    r.go("a", "first_token", "prefill", "decode")
    r.finish("a")
    r.step(5, ("q", 1))
    w = wasted_forwards(r.events)
    assert (w["requests"], w["total"], w["requests_with_waste"]) == (2, 1, 1)
    assert w["by_cause"]["length"] == {"requests": 1, "wasted": 0, "with_waste": 0}


def test_ignore_eos_makes_an_eos_token_a_length_finish() -> None:
    r = Rec()
    r.arrive("a", max_new_tokens=1, ignore_eos=True)
    r.step(1, ("a", 3))
    r.go("a", "schedule", "queued", "prefill")
    r.step_end(1, ("a", EOS))
    r.go("a", "first_token", "prefill", "decode")
    r.finish("a")
    assert list(wasted_forwards(r.events)["by_cause"]) == ["length"]


def test_latency_report_and_replay_text_carry_it(tmp_path: Path, capsys) -> None:
    events = stop_string_run().events + clean_run().events[1:]   # one runtime set-up
    events = [replace(e, seq=i + 1, t_ns=(i + 1) * 1_000_000) for i, e in enumerate(events)]
    rep = latency_report(events)
    assert rep["wasted_forwards"]["total"] == 1                  # type: ignore[index]
    line = wasted_forwards_line(rep["wasted_forwards"])          # type: ignore[arg-type]
    assert line == ("  wasted forwards: 1 in 1 of 3 done generation requests (by finish cause, "
                    "wasted/requests: eos 0/1, length 0/1, stop_string 1/1)")
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in events))
    assert replay(str(path)) == 0
    assert line in capsys.readouterr().out.splitlines()
    assert replay(str(path), "--json") == 0
    assert json.loads(capsys.readouterr().out)["wasted_forwards"] == rep["wasted_forwards"]


def test_by_priority_counts_queue_stays_and_retractions():
    """Each priority's requests, every stay in ``queued`` (a retracted one queues again) and its
    retractions by cause; None when every request had the default priority."""
    from actorserve.replay.stats import by_priority, by_priority_lines

    r = Rec()
    r.arrive("lo")
    r.events[-1] = replace(r.events[-1], data={"priority": 10})       # create carries it
    r.go("lo", "schedule", "queued", "prefill")                        # 1 ms queued
    r.arrive("hi")                                                     # default priority 0
    r._add("lo", "sched", "retract", data={"cause": "priority:hi", "priority": 10})
    r.go("lo", "retract", "prefill", "retracted")
    r.go("hi", "schedule", "queued", "prefill")                        # 3 ms queued
    r.go("lo", "requeue", "retracted", "queued")
    r.go("lo", "schedule", "queued", "prefill")                        # 1 ms queued again
    got = by_priority(r.events)
    assert got is not None and set(got) == {0, 10}
    assert got[0]["requests"] == 1 and got[0]["queued"]["n"] == 1 and got[0]["queued"]["max_ms"] == 3.0
    assert got[10]["requests"] == 1 and got[10]["queued"]["n"] == 2 and got[10]["retracted"] == {"priority": 1}
    assert any("priority 10" in line and "retracted: priority 1" in line for line in by_priority_lines(got))
    assert latency_report(r.events)["by_priority"] == got
    plain = Rec()
    plain.arrive("a")
    plain.go("a", "schedule", "queued", "prefill")
    assert by_priority(plain.events) is None
