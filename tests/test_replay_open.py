"""Replay of a recording that is still being written, told from a broken one.

An open recording (a server made it, and it has no clean shutdown at the end) lists its live
requests as in flight and checks everything that is complete; a closed recording that leaves
a request live is a real ``no-terminal`` violation.
"""

from __future__ import annotations

import dataclasses
import json

from actorserve.cli import main as cli
from actorserve.replay.check import check, recording_is_open
from actorserve.replay.recorder import Event

from replay_support import open_run, recorded_run

OPEN = "recording is open: server still running or not shut down cleanly"


def write(path, events, header=None):
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"header": header or {"lifecycles": {}}}) + "\n")
        for e in events:
            f.write(json.dumps(e.to_dict()) + "\n")


async def test_open_recording_lists_in_flight_requests_and_exits_0(tmp_path, capsys):
    path = tmp_path / "open.jsonl"
    rt, events, done, waiting = await open_run(path)
    assert recording_is_open(events)
    strict = check(events)                             # the library default is unchanged
    assert [(v.kind, v.rid) for v in strict.violations] == [("no-terminal", waiting)]
    report = check(events, allow_open=True)
    assert report.open and report.ok
    assert [(f.kind, f.rid, f.state) for f in report.in_flight] == [("generation", waiting, "queued")]
    assert report.terminal[("generation", "done")] == 1          # the finished one, checked
    assert cli(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert OPEN in out and "1 request(s) in flight" in out
    assert f"rid={waiting} in queued" in out and "no violations" in out
    assert cli(["replay", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["open"] is True and data["violations"] == []
    assert data["in_flight"] == [{"kind": "generation", "rid": waiting, "state": "queued"}]
    html = tmp_path / "open.html"
    assert cli(["replay", str(path), "--format", "html", "--out", str(html)]) == 0
    assert OPEN in html.read_text(encoding="utf-8")
    await rt.shutdown()


async def test_open_recording_still_reports_real_violations(tmp_path, capsys):
    rt, events, done, waiting = await open_run(tmp_path / "open.jsonl")
    end = next(e for e in events if e.rid == done and e.dst == "done")
    twice = dataclasses.replace(end, seq=events[-1].seq + 1)       # the ended one ends again
    path = tmp_path / "open-bad.jsonl"
    write(path, events + [twice])
    assert cli(["replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert OPEN in out and "[two-terminals]" in out and "no-terminal" not in out
    await rt.shutdown()


async def test_closed_recording_with_a_live_request_is_broken(tmp_path, capsys):
    events, rids = await recorded_run(tmp_path / "run.jsonl")
    events = [e for e in events if e.ok]               # leave out the deliberate refusal
    assert not recording_is_open(events)
    write(tmp_path / "clean.jsonl", events)
    assert cli(["replay", str(tmp_path / "clean.jsonl")]) == 0     # clean: nothing to say
    assert OPEN not in capsys.readouterr().out
    # the same run with one request's end lost, but the shutdown still on the record
    lost = next(e for e in events if e.rid == rids[1] and e.dst == "done")
    path = tmp_path / "broken.jsonl"
    write(path, [e for e in events if e is not lost])
    assert cli(["replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert OPEN not in out and f"[no-terminal] at end rid={rids[1]}" in out
    report = check([e for e in events if e is not lost], allow_open=True)
    assert not report.open and [v.kind for v in report.violations] == ["no-terminal"]


def test_what_counts_as_a_clean_end():
    def ev(seq, kind, event, src=None, dst=None, rid=None):
        return Event(seq, seq * 1000, rid, kind, event, src, dst, True, None, None, None, None)

    started = [ev(1, "input", "runtime"), ev(2, "server", "create", None, "starting"),
               ev(3, "generation", "create", None, "queued", "r")]
    assert recording_is_open(started)
    assert not recording_is_open(started + [ev(4, "input", "shutdown")])
    # older recordings have no inputs: the server reaching `stopped` is their clean end
    old = [ev(1, "server", "ready", "starting", "serving"),
           ev(2, "server", "drain", "serving", "draining"),
           ev(3, "server", "stop", "draining", "stopped")]
    assert recording_is_open(old[:2]) and not recording_is_open(old)
    # events with no sign of a server (hand-made, a ring buffer) are judged as closed
    assert not recording_is_open(started[2:])
    assert [v.kind for v in check(started[2:], allow_open=True).violations] == ["no-terminal"]
