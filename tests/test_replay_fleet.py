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

import pytest
from browser_support import CHROMIUM, SKIP_REASON, dump_dom

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.cli import main as cli
from actorserve.config import SchedulerConfig
from actorserve.engine.batching import BatchConfig
from actorserve.engine.fake import FakeEngine
from actorserve.engine.params import SamplingParams
from actorserve.messages import CloseSession, OpenSession, SessionBegin
from actorserve.replay.fleet import cross_check, load_replicas, merged, recording_path
from actorserve.replay.fleet_render import to_fleet_chrome_trace, to_fleet_html
from actorserve.replay.recorder import FlightRecorder, read_recording
from actorserve.statemachines import LIFECYCLES

WALL0 = 1_700_000_000_000_000_000          # r0's wall clock at its anchor (ns)
START = {"r0": (WALL0, 5.0), "r1": (WALL0 + 2_500_000, 100.0)}   # wall anchor, monotonic start


async def replica(folder, name: str, rids: list[str], *, session: str | None = None):
    """Run `rids` (1 ms apart) on one replica, and a session turn when `session` names one;
    a clean shutdown. Its monotonic clock starts far from the other's: only the anchor ties
    them."""
    wall, mono = START[name]
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

    from actorserve.http import serve_cli

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
