"""One recording across replicas: two runtimes recorded apart, merged and checked as a fleet.

Each replica is a real runtime over the fake engine on its own manual clock (the monotonic
clock of its own process, as it were), its recorder given a fixed wall clock, so the anchor
each header carries is known and the merge is exact. Replica ``r1`` starts 2.5 ms (wall)
after ``r0``; each runs requests 1 ms apart on its own clock.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from browser_support import CHROMIUM, SKIP_REASON, dump_dom

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.cli import main as cli
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import CloseSession, OpenSession, PauseGeneration, SessionBegin
from actorserve.replay.check import check
from actorserve.replay.fleet import check_each, cross_check, load_replicas, merged, recording_path
from actorserve.replay.fleet_render import to_fleet_chrome_trace, to_fleet_html
from actorserve.replay.recorder import FlightRecorder, read_recording
from actorserve.statemachines import LIFECYCLES

WALL0 = 1_700_000_000_000_000_000          # r0's wall clock at its anchor (ns)
START = {"r0": (WALL0, 5.0), "r1": (WALL0 + 2_500_000, 100.0)}   # wall anchor, monotonic start


async def replica(folder, name: str, rids: list[str], *, session: str | None = None,
                  start: tuple[int, float] | None = None):
    """Run `rids` (1 ms apart) on one replica, and a session turn when `session` names one;
    a clean shutdown. Its monotonic clock starts far from the other's: only the anchor ties
    them. `start`: (wall anchor, monotonic start) other than START's (a restart)."""
    wall, mono = start or START[name]
    clock = ManualClock(start=mono)
    path, named = recording_path(str(folder) + "/", name)
    rec = FlightRecorder(path=path, clock=clock, lifecycles=LIFECYCLES.values(), replica=name,
                         wall_clock=lambda: wall)
    rt = Runtime(FakeEngine(), config=SchedulerConfig(batch=BatchConfig()), clock=clock, recorder=rec)
    await rt.start()
    for i, rid in enumerate(rids):
        clock.advance(0.001)
        out = await rt.generate([i + 1, i + 2, i + 3], SamplingParams(max_new_tokens=2 + i),
                                rid=rid).stream.final()
        assert out.finish_reason == "length"
    if session is not None:
        clock.advance(0.001)
        await rt.control(OpenSession(session_id=session))
        res = await rt.session(SessionBegin(session, f"{name}-turn", (7, 8, 9)))
        assert res.ok
        await rt.generate(list(res.detail["prompt_ids"]), SamplingParams(max_new_tokens=2),
                          rid=f"{name}-turn", session=session).stream.final()
        await rt.control(CloseSession(session))
    await rt.quiesce()
    await rt.shutdown()
    assert named == name
    return path


async def fleet(tmp_path, *, shared_rid: bool = False, shared_session: bool = False):
    d = tmp_path / "fleet"
    await replica(d, "r0", ["a-1", "a-2", "dup" if shared_rid else "a-3"],
                  session="s-shared" if shared_session else "s-0")
    await replica(d, "r1", ["b-1", "dup" if shared_rid else "b-2"],
                  session="s-shared" if shared_session else "s-1")
    return d


def test_record_dir_means_one_file_per_replica(tmp_path):
    assert recording_path(str(tmp_path), "r7") == (str(tmp_path / "r7.jsonl"), "r7")
    assert recording_path(str(tmp_path / "new") + "/", "r8") == (str(tmp_path / "new" / "r8.jsonl"), "r8")
    assert recording_path(str(tmp_path / "x.jsonl"), "r9") == (str(tmp_path / "x.jsonl"), "r9")
    assert recording_path(None, None) == (None, None)
    path, rid = recording_path(str(tmp_path), None)           # a default id: host and pid
    assert path == str(tmp_path / f"{rid}.jsonl") and rid


def test_serve_flags_put_the_replica_in_the_config(tmp_path):
    import argparse

    from actorserve.http.edge import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    cfg = serve_cli.config_from_args(p.parse_args(["--record", str(tmp_path), "--replica-id", "r3"]))
    assert (cfg.recorder.path, cfg.recorder.replica_id) == (str(tmp_path / "r3.jsonl"), "r3")
    cfg = serve_cli.config_from_args(p.parse_args(["--record", str(tmp_path / "one.jsonl")]))
    assert (cfg.recorder.path, cfg.recorder.replica_id) == (str(tmp_path / "one.jsonl"), None)


async def test_header_names_the_replica_and_anchors_the_clock(tmp_path):
    d = await fleet(tmp_path)
    header, events = read_recording(d / "r1.jsonl")
    assert header["replica"] == "r1"
    assert header["clock"] == {"t_ns": 100_000_000_000, "wall_ns": WALL0 + 2_500_000}
    assert events[0].t_ns == 100_000_000_000


async def test_merge_keeps_each_file_order_on_the_common_clock(tmp_path):
    d = await fleet(tmp_path)
    reps = load_replicas([str(d)])
    assert [r.name for r in reps] == ["r0", "r1"]
    out = list(merged(reps))
    assert len(out) == sum(len(r.events) for r in reps)
    times = [t for t, _, _ in out]
    assert times == sorted(times)                                   # one clock, in order
    for i, r in enumerate(reps):                                    # each file's own order
        assert [e.seq for _, j, e in out if j == i] == [e.seq for e in r.events]
    # r1's first request arrives 1 ms after its start, 2.5 ms after r0's start on the wall
    first = {e.rid: t for t, _, e in out if e.kind == "input" and e.event == "generate"}
    assert first["a-1"] == WALL0 + 1_000_000
    assert first["b-1"] == WALL0 + 2_500_000 + 1_000_000
    order = [e.rid for _, _, e in out if e.kind == "input" and e.event == "generate" and e.rid[0] in "ab"]
    assert order == ["a-1", "a-2", "a-3", "b-1", "b-2"]


async def test_a_clean_pair_reports_clean(tmp_path, capsys):
    d = await fleet(tmp_path)
    assert cross_check(load_replicas([str(d)])) == []
    assert cli(["replay", str(d)]) == 0
    text = capsys.readouterr().out
    assert "2 replicas" in text and "== replica r0" in text and "== replica r1" in text
    assert "== across replicas: no violations" in text
    assert cli(["replay", str(d / "r0.jsonl"), str(d / "r1.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["cross_replica"] == []
    assert [r["replica"] for r in report["replicas"]] == ["r0", "r1"]
    assert all(r["violations"] == [] and r["requests"]["generation"] >= 2 for r in report["replicas"])


async def test_a_rid_on_two_replicas_and_a_moved_session_are_violations(tmp_path, capsys):
    d = await fleet(tmp_path, shared_rid=True, shared_session=True)
    found = {(v.kind, v.key): v for v in cross_check(load_replicas([str(d)]))}
    assert set(found) == {("rid-on-two-replicas", "dup"), ("session-moved", "s-shared")}
    assert [r for r, _ in found[("rid-on-two-replicas", "dup")].where] == ["r0", "r1"]
    assert cli(["replay", str(d)]) == 1
    text = capsys.readouterr().out
    assert "[rid-on-two-replicas] request 'dup' on r0 (seq" in text
    assert "[session-moved] session 's-shared' on r0 (seq" in text
    assert cli(["replay", str(d), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert sorted(v["kind"] for v in report["cross_replica"]) == ["rid-on-two-replicas", "session-moved"]
    assert all(r["violations"] == [] for r in report["replicas"])   # each replica is clean alone
    assert cli(["replay", str(d), "--rid", "dup"]) == 0              # both replicas' lives of it
    lines = capsys.readouterr().out.splitlines()
    assert {ln.split()[0] for ln in lines} == {"r0", "r1"}


async def test_one_file_is_read_as_before(tmp_path, capsys):
    d = await fleet(tmp_path)
    assert cli(["replay", str(d / "r0.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "replica" not in text and "no violations" in text


async def test_timeline_has_a_lane_group_per_replica(tmp_path):
    d = await fleet(tmp_path, shared_rid=True)
    page = to_fleet_html(load_replicas([str(d)]))
    groups = re.findall(r"<g class='replica' data-replica='([^']+)'>", page)
    assert groups == ["r0", "r1", "r0", "r1"]                       # labels column, then plot
    plot = page[page.index("<svg xmlns='http://www.w3.org/2000/svg' class='timeline'"):]
    for name, rids in (("r0", ["a-1", "a-2", "dup", "r0-turn"]), ("r1", ["b-1", "dup", "r1-turn"])):
        start = plot.index(f"data-replica='{name}'")
        body = plot[start:plot.index("<g class='replica'", start + 1)] if name == "r0" else plot[start:]
        assert re.findall(r"<g class='lane request' data-kind='generation' data-rid='([^']+)'", body) \
            == [f"{name}/{r}" for r in rids]
        assert "data-kind='server'" in body and "data-kind='scheduler'" in body
        assert "class='step'" in body                               # its own steps, on its lane
    ov = json.loads(re.search(r"id='ov-map'>(.*?)</script>", page).group(1))
    assert {"r0/dup", "r1/dup"} <= set(ov)


async def test_chrome_trace_has_a_process_per_replica(tmp_path, capsys):
    d = await fleet(tmp_path)
    trace = to_fleet_chrome_trace(load_replicas([str(d)]))
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {1: "replica r0", 2: "replica r1"}
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {1, 2}
    assert all(e["args"]["replica"] == names[e["pid"]].split()[1] for e in slices)
    b1 = min(e["ts"] for e in slices if e["args"].get("rid") == "b-1")
    a1 = min(e["ts"] for e in slices if e["args"].get("rid") == "a-1")
    assert round(b1 - a1, 3) == 2500.0                               # µs, on the common clock
    tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert len(tracks) == sum(1 for e in trace["traceEvents"] if e["name"] == "thread_name")
    out = tmp_path / "t.json"
    assert cli(["replay", str(d), "--format", "chrome-trace", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["otherData"]["replicas"][1]["replica"] == "r1"
    html = tmp_path / "t.html"
    assert cli(["replay", str(d), "--format", "html", "--out", str(html)]) == 0
    assert "2 replicas on one clock" in html.read_text()
    assert cli(["replay", str(d), "--format", "mermaid"]) == 2
    capsys.readouterr()


async def test_reexecute_reports_each_replica(tmp_path, capsys):
    d = await fleet(tmp_path)
    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(d)]) == 0
    text = capsys.readouterr().out
    assert "== replica r0" in text and "== replica r1" in text
    assert "2 replicas: every replica re-executed exactly" in text
    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(d), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and [(r["replica"], r["ok"]) for r in report["replicas"]] == [("r0", True), ("r1", True)]


def test_an_empty_folder_is_an_error(tmp_path, capsys):
    assert cli(["replay", str(tmp_path)]) == 2
    assert "no recordings" in capsys.readouterr().err


async def test_rid_draws_that_request_on_every_replica(tmp_path):
    d = await fleet(tmp_path, shared_rid=True)
    page = to_fleet_html(load_replicas([str(d)]), rid="dup")
    assert re.findall(r"<g class='lane request' data-kind='generation' data-rid='([^']+)'", page) \
        == ["r0/dup", "r1/dup"]
    assert page.count("data-kind='server'") == 2                    # each replica's actors stay


async def test_a_file_without_anchor_starts_with_the_fleet_and_parts_join(tmp_path, capsys):
    d = await fleet(tmp_path)
    old = d / "r1.jsonl"
    lines = old.read_text().splitlines()
    header = json.loads(lines[0])
    del header["header"]["clock"], header["header"]["replica"]
    (d / "old.jsonl").write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    old.unlink()
    clock = ManualClock(start=7.0)                                  # a rotated recording: parts
    rec = FlightRecorder(path=d / "rot.jsonl", clock=clock, lifecycles=LIFECYCLES.values(),
                         replica="rot", wall_clock=lambda: WALL0 + 1_000_000, max_bytes=4096,
                         backups=50)
    rt = Runtime(FakeEngine(), config=SchedulerConfig(batch=BatchConfig()), clock=clock, recorder=rec)
    await rt.start()
    for i in range(6):
        rec.flush()
        await rt.generate([1, 2, 3], SamplingParams(max_new_tokens=4), rid=f"rot-{i}").stream.final()
    await rt.shutdown()
    assert (d / "rot.jsonl.1").exists()
    reps = load_replicas([str(d)])
    assert [(r.name, r.anchored) for r in reps] == [("old", False), ("r0", True), ("rot", True)]
    old_rep = reps[0]
    assert old_rep.common(old_rep.events[0].t_ns) == min(r.common(r.events[0].t_ns) for r in reps[1:])
    assert [e.seq for e in reps[2].events] == list(range(1, len(reps[2].events) + 1))
    assert cli(["replay", str(d)]) == 0
    text = capsys.readouterr().out
    assert "old: no clock anchor in its header" in text and "3 replicas" in text


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
async def test_the_fleet_page_zooms_and_picks_a_replicas_request_in_a_browser(tmp_path):
    d = await fleet(tmp_path, shared_rid=True)
    page = tmp_path / "fleet.html"
    page.write_text(to_fleet_html(load_replicas([str(d)])), encoding="utf-8")
    dom = await asyncio.to_thread(dump_dom, tmp_path, page, 1200, 900, "#zoom=2&rid=r1/dup")
    assert re.search(r"class=\"lane request selected\" data-kind=\"generation\" data-rid=\"r1/dup\"", dom)
    assert not re.search(r"selected\" data-kind=\"generation\" data-rid=\"r0/dup\"", dom)
    assert "r1/dup (generation)" in dom
    assert dom.count("class=\"replica\" data-replica=\"r1\"") == 2
    assert "×2" in dom


# -- a replica killed and restarted at the same path (issue 14) ----------------------------------

RESTART = (WALL0 + 50_000_000, 900.0)      # r0's second incarnation: 50 ms later, a new process


async def killed(folder, name: str, rids: list[str], live: str, *, session: str | None = None) -> str:
    """`rids` done on `name` (in `session` when one is named), then `live` accepted and queued
    behind a pause when the process is killed: the file ends where it was last flushed, with
    no end marker (SIGKILL)."""
    wall, mono = START[name]
    clock = ManualClock(start=mono)
    path, _ = recording_path(str(folder) + "/", name)
    rec = FlightRecorder(path=path, clock=clock, lifecycles=LIFECYCLES.values(), replica=name,
                         wall_clock=lambda: wall)
    rt = Runtime(FakeEngine(), config=SchedulerConfig(batch=BatchConfig()), clock=clock, recorder=rec)
    await rt.start()
    if session is not None:
        await rt.control(OpenSession(session_id=session))
    for i, rid in enumerate(rids):
        clock.advance(0.001)
        await rt.generate([i + 1, i + 2], SamplingParams(max_new_tokens=2), rid=rid).stream.final()
    clock.advance(0.005)
    await rt.control(PauseGeneration("in_place"))
    clock.advance(0.001)                                            # its cut: 8 ms after its start
    rt.generate([4, 5, 6], SamplingParams(max_new_tokens=3), rid=live)
    await rt.quiesce()
    rec.flush()
    text = Path(path).read_text()
    await rt.shutdown()                 # the test's own clean-up: the kill left the file as it was
    Path(path).write_text(text)
    return path


async def restarted_fleet(tmp_path, *, again: str = "lost", r1_too: bool = False,
                          sessions: tuple[str | None, str | None] = (None, None)):
    """r0 killed with `lost` live, restarted at the same path where it runs `again`; r1 runs
    `lost` too (3.5 ms, before r0's cut) when `r1_too`. `sessions`: the one r0 opens in each
    incarnation, the one r1 uses."""
    d = tmp_path / "fleet"
    await killed(d, "r0", ["a-1", "a-2"], "lost", session=sessions[0])
    await replica(d, "r0", [again, "a-3"], start=RESTART, session=sessions[0])
    await replica(d, "r1", ["lost" if r1_too else "b-1", "b-2"], session=sessions[1])
    return d


async def test_a_session_of_a_killed_incarnation_did_not_move_to_the_restarted_one(tmp_path):
    d = await restarted_fleet(tmp_path, sessions=("s", None))
    assert cross_check(load_replicas([str(d)])) == []
    d = await restarted_fleet(tmp_path / "again", sessions=("s", "s"))     # r1 took it: moved
    found = cross_check(load_replicas([str(d)]))
    assert [(v.kind, v.key, [r for r, _ in v.where]) for v in found] == \
        [("session-moved", "s", ["r0#1", "r0#2", "r1"])]


async def test_a_restart_keeps_the_earlier_recording_and_replay_merges_both(tmp_path, capsys):
    d = await restarted_fleet(tmp_path)
    assert sorted(p.name for p in d.iterdir()) == ["r0.jsonl", "r0.prev-1.jsonl", "r1.jsonl"]
    first, _ = read_recording(d / "r0.prev-1.jsonl")
    assert "end" not in first and first["clock"]["wall_ns"] == WALL0   # the killed one, kept
    assert read_recording(d / "r0.jsonl")[0]["end"]["wall_ns"] == RESTART[0]
    reps = load_replicas([str(d)])
    assert [(r.name, r.replica, r.earlier) for r in reps] == \
        [("r0#1", "r0", True), ("r0#2", "r0", False), ("r1", "r1", False)]
    assert reps[0].events[0].seq == reps[1].events[0].seq == 1       # each its own seq, anchor
    given = load_replicas([str(d / "r0.jsonl"), str(d / "r0.prev-1.jsonl")])   # in any order
    assert [(r.name, r.path) for r in given] == [(r.name, r.path) for r in reps[:2]]
    out = list(merged(reps))
    accepted = [(reps[i].name, e.rid) for _, i, e in out if e.kind == "input" and e.event == "generate"]
    assert accepted == [("r0#1", "a-1"), ("r0#1", "a-2"), ("r1", "b-1"), ("r1", "b-2"),
                        ("r0#1", "lost"), ("r0#2", "lost"), ("r0#2", "a-3")]
    first_at = {(reps[i].name, e.rid): t for t, i, e in out if e.kind == "input" and e.event == "generate"}
    assert first_at[("r0#2", "lost")] == RESTART[0] + 1_000_000      # on its own anchor
    reports = check_each(reps)
    assert [(r.cut, [f.rid for f in r.lost], r.violations) for r in reports] == \
        [(True, ["lost"], []), (False, [], []), (False, [], [])]
    assert cross_check(reps) == []                                  # the router's retry
    assert cli(["replay", str(d)]) == 0
    text = capsys.readouterr().out
    assert "3 replicas" in text and "== replica r0#1" in text and "== replica r0#2" in text
    assert "cut (its process was killed" in text
    assert "1 request(s) lost with the process (live at the cut; not violations): lost (queued)" in text
    assert "no violations" in text.splitlines()[-1]
    assert cli(["replay", str(d), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["cross_replica"] == []
    assert report["lost_with_process"] == [{"replica": "r0#1", "kind": "generation", "rid": "lost",
                                            "state": "queued"}]
    r0 = report["replicas"][0]
    assert (r0["replica"], r0["replica_id"], r0["cut"], r0["ended_in_order"], r0["violations"]) == \
        ("r0#1", "r0", True, False, [])
    assert r0["lost_with_process"] == [{"kind": "generation", "rid": "lost", "state": "queued"}]
    assert [r["ended_in_order"] for r in report["replicas"][1:]] == [True, True]
    page = to_fleet_html(reps)
    groups = re.findall(r"<g class='replica' data-replica='([^']+)'>", page)
    assert groups == ["r0#1", "r0#2", "r1"] * 2                     # lanes in order
    assert {"r0#1/lost", "r0#2/lost"} <= set(json.loads(re.search(r"id='ov-map'>(.*?)</script>",
                                                                   page).group(1)))


async def test_a_second_restart_is_the_next_incarnation(tmp_path):
    d = await restarted_fleet(tmp_path)
    await replica(d, "r0", ["c-1"], start=(WALL0 + 90_000_000, 50.0))   # r0#2 closed in order
    assert sorted(p.name for p in d.iterdir()) == ["r0.jsonl", "r0.prev-1.jsonl",
                                                   "r0.prev-2.jsonl", "r1.jsonl"]
    reps = load_replicas([str(d)])
    assert [r.name for r in reps] == ["r0#1", "r0#2", "r0#3", "r1"]
    assert [r.ended for r in reps] == [False, True, True, True]
    assert [sorted({e.rid for e in r.events if e.kind == "input" and e.event == "generate"})
            for r in reps[:3]] == [["a-1", "a-2", "lost"], ["a-3", "lost"], ["c-1"]]
    reports = check_each(reps)
    assert [r.cut for r in reports] == [True, False, False, False]   # closed in order: not cut
    assert all(r.ok for r in reports) and cross_check(reps) == []


async def test_a_rid_done_before_the_kill_and_accepted_again_is_still_a_violation(tmp_path):
    d = await restarted_fleet(tmp_path, again="a-1")
    found = cross_check(load_replicas([str(d)]))
    assert [(v.kind, v.key, [r for r, _ in v.where]) for v in found] == \
        [("rid-on-two-replicas", "a-1", ["r0#1", "r0#2"])]


async def test_a_lost_rid_another_replica_took_before_the_cut_was_held_twice(tmp_path):
    d = await restarted_fleet(tmp_path, again="x", r1_too=True)
    found = cross_check(load_replicas([str(d)]))
    assert [(v.kind, v.key, [r for r, _ in v.where]) for v in found] == \
        [("rid-on-two-replicas", "lost", ["r0#1", "r1"])]


async def test_a_cut_recording_loses_its_live_requests_a_closed_one_breaks(tmp_path, capsys):
    d = await restarted_fleet(tmp_path)
    cut = d / "r0.prev-1.jsonl"
    assert cli(["replay", str(cut)]) == 0
    text = capsys.readouterr().out
    assert "recording was cut: its process was killed" in text and "1 request(s) lost" in text
    assert "rid=lost in queued" in text and "no violations" in text
    assert cli(["replay", str(cut), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["cut"], data["open"], data["in_flight"], data["violations"]) == (True, True, [], [])
    assert data["lost_with_process"] == [{"kind": "generation", "rid": "lost", "state": "queued"}]
    # the same file as the newest incarnation: still running, or killed; in flight, not lost
    (tmp_path / "alone").mkdir()
    newest = tmp_path / "alone" / "r0.jsonl"
    newest.write_text(cut.read_text())
    assert cli(["replay", str(newest), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["cut"], data["open"], data["lost_with_process"]) == (False, True, [])
    assert [f["rid"] for f in data["in_flight"]] == ["lost"]
    # the same request live at the end of a recording closed in order: a real no-terminal
    closed = tmp_path / "alone" / "closed.prev-1.jsonl"
    closed.write_text(cut.read_text() + json.dumps({"end": {"seq": 0, "t_ns": 0, "wall_ns": 0}}) + "\n")
    assert cli(["replay", str(closed)]) == 1
    assert "[no-terminal] at end rid=lost" in capsys.readouterr().out
    assert cli(["replay", str(closed), "--allow-unfinished", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["cut"], data["ended_in_order"], data["lost_with_process"]) == (False, True, [])
    header, events = read_recording(closed)
    assert header["end"] == {"seq": 0, "t_ns": 0, "wall_ns": 0}
    report = check(events, ended=True, cut=True)                    # the marker wins
    assert not report.cut and [v.kind for v in report.violations] == ["no-terminal"]


async def test_a_cut_only_truncates_the_end_what_came_before_is_checked(tmp_path, capsys):
    d = await restarted_fleet(tmp_path)
    cut = d / "r0.prev-1.jsonl"
    lines = cut.read_text().splitlines()
    done = next(json.loads(ln) for ln in lines[1:] if '"rid":"a-1"' in ln and '"dst":"done"' in ln)
    done["seq"] = json.loads(lines[-1])["seq"] + 1                  # a-1 ends twice before the cut
    cut.write_text("\n".join(lines + [json.dumps(done)]) + "\n")
    assert cli(["replay", str(d)]) == 1
    text = capsys.readouterr().out
    assert "[two-terminals]" in text and "lost with the process" in text and "no-terminal" not in text
    reports = check_each(load_replicas([str(d)]))
    assert [v.kind for v in reports[0].violations] == ["two-terminals"]
    assert [f.rid for f in reports[0].lost] == ["lost"]
