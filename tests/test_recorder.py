"""Flight recorder: schema, JSONL file with header, rotation, and the replay checks."""

from __future__ import annotations

import json

from actorserve.actors.clock import ManualClock
from actorserve.cli import main as cli
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import AbortRequest, ContinueGeneration, PauseGeneration
from actorserve.replay.check import check
from actorserve.replay.recorder import FIELDS, FlightRecorder, read_recording
from actorserve.statemachines import GENERATION, LIFECYCLES, IllegalTransition, Subject

from runtime_helpers import make_runtime


def test_rejected_transitions_are_recorded_with_error():
    rec = FlightRecorder(clock=ManualClock())
    s = Subject(GENERATION.initial, rid="r1")
    try:
        GENERATION.fire(s, "finish", observer=rec)
    except IllegalTransition:
        pass
    (ev,) = rec.events()
    assert (ev.rid, ev.kind, ev.event, ev.src, ev.dst, ev.ok) == ("r1", "generation", "finish", "queued", None, False)
    assert "not allowed" in ev.error and ev.defn == GENERATION.definition_hash


def test_ring_buffer_is_bounded():
    rec = FlightRecorder(capacity=10)
    for i in range(25):
        rec.note("step", "step", data={"i": i})
    assert len(rec) == 10 and rec.events()[0].seq == 16 and rec.seq == 25


def test_jsonl_file_has_header_and_rotates(tmp_path):
    path = tmp_path / "rec.jsonl"
    rec = FlightRecorder(path=path, lifecycles=LIFECYCLES.values(), max_bytes=2000, backups=2,
                         flush_every=5, clock=ManualClock())
    for i in range(200):
        rec.note("step", "step", rid=f"r{i}")
    rec.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rec.jsonl", "rec.jsonl.1", "rec.jsonl.2"]
    for name in files:
        first = json.loads((tmp_path / name).read_text().splitlines()[0])
        assert first["header"]["lifecycles"]["generation"]["hash"] == GENERATION.definition_hash
    header, events = read_recording(path)
    assert events and set(events[0].to_dict()) == set(FIELDS)
    assert events[-1].seq == 200


async def test_recording_of_a_run_replays_clean_and_cli_reports(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    rt, engine, _, clock = await make_runtime()
    rec = FlightRecorder(path=path, lifecycles=LIFECYCLES.values(), clock=clock)
    rt.recorder = rt.system.recorder = rec
    hs = [rt.generate([i, i + 1], SamplingParams(max_new_tokens=4)) for i in range(1, 6)]
    await rt.control(PauseGeneration("retract"))
    await rt.control(AbortRequest(rid=hs[0].rid))
    from actorserve.messages import ContinueGeneration
    await rt.control(ContinueGeneration())
    for h in hs:
        await h.stream.final()
    await rt.quiesce()
    await rt.shutdown()
    assert cli(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no violations" in out and "generation" in out and "aborted=1" in out
    assert cli(["replay", str(path), "--rid", hs[1].rid]) == 0
    tl = capsys.readouterr().out
    assert "schedule" in tl and "deliver" in tl and "queued -> prefill" in tl


def _write(path, events):
    with open(path, "w") as f:
        f.write(json.dumps({"header": {"lifecycles": {}}}) + "\n")
        for e in events:
            f.write(json.dumps(e) + "\n")


def _ev(seq, rid, event, src, dst, ok=True, error=None):
    return {"seq": seq, "t_ns": seq * 1000, "rid": rid, "kind": "generation", "event": event,
            "src": src, "dst": dst, "ok": ok, "error": error, "cause": None, "defn": None, "data": None}


def test_checker_flags_missing_duplicate_and_illegal_with_seqs(tmp_path, capsys):
    good = [("schedule", "queued", "prefill"), ("first_token", "prefill", "decode"),
            ("finish", "decode", "detok"), ("deliver", "detok", "done")]
    evs, seq = [], 0
    for rid in ("a", "b", "c"):
        seq += 1
        evs.append(_ev(seq, rid, "create", None, "queued"))
    for rid in ("a", "b", "c"):
        for ev, src, dst in good:
            if rid == "a" and ev == "deliver":
                continue                           # a: its terminal event removed
            seq += 1
            evs.append(_ev(seq, rid, ev, src, dst))
    seq += 1
    dup = seq
    evs.append(_ev(seq, "b", "deliver", "detok", "done"))      # b: terminal twice
    seq += 1
    illegal = seq
    evs.append(_ev(seq, "c", "finish", "done", None, ok=False, error="not allowed"))
    report = check([__import__("actorserve.replay.recorder", fromlist=["Event"]).Event.from_dict(e) for e in evs])
    kinds = {(v.kind, v.rid, v.seq) for v in report.violations}
    assert ("no-terminal", "a", -1) in kinds
    assert ("two-terminals", "b", dup) in kinds
    assert ("illegal", "c", illegal) in kinds
    path = tmp_path / "bad.jsonl"
    _write(path, evs)
    assert cli(["replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"seq {dup}" in out and f"seq {illegal}" in out and "3 violation" in out


def test_checker_reports_divergence_from_todays_definitions():
    from actorserve.replay.recorder import Event
    evs = [_ev(1, "x", "create", None, "queued"), _ev(2, "x", "schedule", "queued", "decode")]
    report = check([Event.from_dict(e) for e in evs], require_terminal=False)
    assert [(v.kind, v.seq) for v in report.violations] == [("divergence", 2)]


async def test_abort_latency_and_time_in_state_from_a_recording():
    from actorserve.replay.stats import abort_latencies_ms, time_in_state_ms

    rt, engine, rec, clock = await make_runtime()
    await rt.control(PauseGeneration("in_place"))
    hs = [rt.generate([i, 2], SamplingParams(max_new_tokens=4)) for i in range(1, 4)]
    await rt.quiesce()
    clock.advance(0.25)
    await rt.control(AbortRequest(rid=hs[0].rid))
    clock.advance(0.5)
    await rt.control(AbortRequest(abort_all=True))
    for h in hs:
        assert (await h.stream.final()).finish_reason == "abort"
    await rt.quiesce()
    lat = abort_latencies_ms(rec.events())
    assert lat == [0.0, 0.0, 0.0]            # the manual clock does not move inside a turn
    spans = time_in_state_ms(rec.events())
    assert spans["generation.queued"]["n"] == 3
    assert spans["generation.queued"]["max_ms"] == 750.0 and spans["generation.queued"]["p50_ms"] == 750.0
    await rt.shutdown()


def test_the_fast_line_writer_is_plain_json_of_the_event():
    from actorserve.replay.recorder import FIELDS, to_line
    events = [
        (1, 10, "r1", "message", "TokenOut", None, "req:r1", True, None, None, None, None),
        (2, 11, "r\u00e9\"1\n", "generation", "pause", "decode", None, False, "not allowed", 1, "abc", None),
        (3, 12, None, "input", "step_end", None, None, True, None, None, None,
         {"sched": "scheduler", "step": 3, "out": [["r1", 7], ["r2", None], ["r3", "pooled"]], "error": None}),
    ]
    for ev in events:
        line = to_line(ev)
        assert "\n" not in line
        assert json.loads(line) == dict(zip(FIELDS, ev))


def test_a_recording_being_written_ends_in_a_half_line_that_is_left_out(tmp_path):
    import pytest
    rec = FlightRecorder(path=tmp_path / "open.jsonl", lifecycles=LIFECYCLES.values())
    rec.note("bench", "one", rid="a")
    rec.note("bench", "two", rid="b")
    rec.close()
    with open(tmp_path / "open.jsonl", "a", encoding="utf-8") as f:
        f.write('{"seq": 3, "t_ns": 12, "rid": "c", "ki')          # the writer is mid-line
    _, events = read_recording(tmp_path / "open.jsonl")
    assert [e.event for e in events] == ["one", "two"]
    text = (tmp_path / "open.jsonl").read_text()
    (tmp_path / "broken.jsonl").write_text(text.replace('"two"', '"two', 1) + "\n")
    with pytest.raises(ValueError, match="line"):
        read_recording(tmp_path / "broken.jsonl")


async def test_abort_latency_matches_a_prefix_abort_to_its_own_request_not_an_older_abort():
    """A prefix abort used to be filed under the prefix string, so each request it aborted was
    measured from an older abort_all or pause (p99 of seconds where the truth was ms)."""
    from actorserve.replay.stats import abort_latencies_ms

    rt, engine, rec, clock = await make_runtime()
    early = rt.generate([9, 9], SamplingParams(max_new_tokens=2))
    await rt.control(PauseGeneration("abort"))           # an old "everything" abort
    await rt.control(ContinueGeneration())
    await early.stream.final()
    await rt.control(PauseGeneration("in_place"))
    hs = [rt.generate([i, 3], SamplingParams(max_new_tokens=4), rid=f"job-{i}") for i in range(3)]
    await rt.quiesce()
    clock.advance(5.0)                                   # long after the old abort
    aborting = rt.control(AbortRequest(rid="job-", prefix=True))
    clock.advance(0.004)                                 # the abort's input is recorded before this
    assert (await aborting).detail["aborted"] == 3
    for h in hs:
        await h.stream.final()
    await rt.quiesce()
    lat = abort_latencies_ms(rec.events())
    assert len(lat) == 4 and lat[0] == 0.0               # `early`, by the pause
    assert lat[1:] == [4.0, 4.0, 4.0]                    # from the prefix abort, not 5 s earlier
    await rt.shutdown()


def _notes(path, n, **kw):
    rec = FlightRecorder(path=path, lifecycles=LIFECYCLES.values(), clock=ManualClock(), **kw)
    for i in range(n):
        rec.note("step", "step", rid=f"r{i}")
    return rec


def test_close_ends_the_file_with_an_end_marker(tmp_path):
    from actorserve.replay.recorder import ended_in_order

    path = tmp_path / "rec.jsonl"
    rec = _notes(path, 3, wall_clock=lambda: 42)
    rec.flush()
    header, _ = read_recording(path)
    assert header["end_marker"] is True and "end" not in header and ended_in_order(header) is False
    rec.close()
    rec.close()                                          # once only
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1]) == {"end": {"seq": 3, "t_ns": 0, "wall_ns": 42}}
    assert sum('"end"' in ln for ln in lines) == 1
    header, events = read_recording(path)
    assert header["end"]["seq"] == events[-1].seq == 3 and ended_in_order(header) is True
    assert ended_in_order({"lifecycles": {}}) is None    # a recorder from before end markers
    with open(path, "a") as f:                           # a marker is the end only as the last line
        f.write(json.dumps(events[0].to_dict()) + "\n")
    assert "end" not in read_recording(path)[0]


def test_a_restart_at_the_same_path_keeps_the_earlier_recording(tmp_path):
    from actorserve.replay.recorder import incarnation_of, incarnation_path, read_all_parts

    path = tmp_path / "rec.jsonl"
    _notes(path, 200, max_bytes=2000, backups=2, flush_every=5).close()
    first = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert sorted(first) == ["rec.jsonl", "rec.jsonl.1", "rec.jsonl.2"]   # rotation as before
    assert "end" not in read_recording(tmp_path / "rec.jsonl.1")[0]       # a rotated part: no end
    killed = _notes(path, 7)                             # the next incarnation, then killed:
    killed.flush()                                       # its file ends at the last flush
    text = path.read_text()
    killed.close()
    path.write_text(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rec.jsonl", "rec.prev-1.jsonl", "rec.prev-1.jsonl.1", "rec.prev-1.jsonl.2"]
    for name, text in first.items():                     # moved whole, parts and all
        assert (tmp_path / name.replace("rec.jsonl", "rec.prev-1.jsonl")).read_text() == text
    header, events = read_all_parts(tmp_path / "rec.prev-1.jsonl")
    assert "end" in header and [e.seq for e in events][-1] == 200
    _notes(path, 1).close()                              # and again: the killed one is prev-2
    assert sorted(p.name for p in tmp_path.iterdir() if "prev-2" in p.name) == ["rec.prev-2.jsonl"]
    header, events = read_all_parts(tmp_path / "rec.prev-2.jsonl")
    assert "end" not in header and [e.seq for e in events] == list(range(1, 8))
    assert [e.seq for e in read_all_parts(path)[1]] == [1]
    (tmp_path / "empty.jsonl").write_text("")            # an empty file holds nothing to keep
    _notes(tmp_path / "empty.jsonl", 1).close()
    assert not any(p.name.startswith("empty.prev") for p in tmp_path.iterdir())
    assert incarnation_path("d/r0.jsonl", 3) == "d/r0.prev-3.jsonl"
    assert incarnation_path("run.log", 1) == "run.log.prev-1"
    assert incarnation_of("d/r0.prev-3.jsonl") == ("d/r0.jsonl", 3)
    assert incarnation_of("run.log.prev-1") == ("run.log", 1)
    assert incarnation_of("d/r0.jsonl") == ("d/r0.jsonl", None)
    assert incarnation_of("d/r0.prev-3.jsonl.1") == ("d/r0.prev-3.jsonl.1", None)


def test_the_ring_keeps_events_compact_and_gives_them_back_whole(tmp_path):
    """Messages are 4-field entries, a prompt 4-byte ints, seq and ok derived (issue 31's memory
    at rest); `events`, subscribers and the file see the same 12-field events as before."""
    import sys
    from array import array
    from dataclasses import dataclass

    @dataclass
    class Ping:
        rid: str

    path = tmp_path / "rec.jsonl"
    rec = FlightRecorder(clock=ManualClock(), path=path, capacity=6, flush_every=1)
    live = []
    rec.subscribe(live.append)
    prompt = list(range(1000, 1400))
    rec.input("generate", rid="r1", data={"prompt": prompt, "max_tokens": 4})
    rec.input("generate", rid="r2", data={"prompt": [1, 2 ** 40]})      # does not fit 4 bytes: kept
    rec.message("req:r1", Ping("r1"))
    s = Subject(GENERATION.initial, rid="r1")
    GENERATION.fire(s, "schedule", observer=rec)
    try:
        GENERATION.fire(s, "deliver", observer=rec)
    except IllegalTransition:
        pass
    rec.note("step", "step", data={"batch": [["r1", 400], ["r2", 1]]})
    rec.message("req:r1", Ping("r1"))
    rec.close()

    _, from_file = read_recording(path)
    assert [e.seq for e in from_file] == list(range(1, 8))
    assert [e.seq for e in live] == list(range(1, 8)) and live == from_file
    ring = rec.events()                      # capacity 6: the first event has left the ring
    assert ring == from_file[1:] and len(rec) == 6
    first = from_file[0]
    assert first.data == {"prompt": prompt, "max_tokens": 4} and type(first.data["prompt"]) is list
    assert from_file[1].data == {"prompt": [1, 2 ** 40]}
    msg = from_file[2]
    assert (msg.kind, msg.event, msg.dst, msg.ok, msg.src, msg.cause, msg.data) == \
        ("message", "Ping", "req:r1", True, None, None, None)
    sched, refused = from_file[3], from_file[4]
    assert (sched.ok, sched.cause, sched.dst) == (True, msg.seq, "prefill")
    assert (refused.ok, refused.dst) == (False, None) and "not allowed" in refused.error
    assert [e.rid for e in rec.events(rid="r1", kind="message")] == ["r1", "r1"]
    assert from_file[5].data == {"batch": [["r1", 400], ["r2", 1]]} and rec.events()[-2] == from_file[5]

    # what the ring holds: a message in 4 fields, a prompt as an array of 4-byte ints
    entries = [t for _, t in rec.ring.entries()]
    assert [len(t) for t in entries] == [10, 4, 10, 10, 10, 4]
    keep = FlightRecorder(clock=ManualClock())
    keep.input("generate", rid="r1", data={"prompt": prompt})
    held = keep.ring.tail[0][-1]["prompt"]
    assert isinstance(held, array) and held.itemsize == 4 and held.tolist() == prompt
    assert sys.getsizeof(held) < 8 * len(prompt)          # a list's pointers alone would be 8 a token
    assert keep.events()[0].data["prompt"] == prompt
    out = [["r1", 7], ["r2", "pooled"]]
    odd = [["r1", 7, "stop"], ["r2", 8]]                     # not all pairs: kept as it is
    keep.input("step_end", data={"step": 1, "out": out, "error": None})
    keep.input("step_end", data={"step": 2, "out": odd, "error": None})
    assert type(keep.ring.tail[1][-1]["out"]).__name__ == "Pairs" and keep.ring.tail[2][-1]["out"] is odd
    assert [e.data["out"] for e in keep.events(kind="input")[1:]] == [out, odd]
