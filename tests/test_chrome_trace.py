"""`actorserve replay REC --format chrome-trace`: Trace Event Format that chrome://tracing and
Perfetto load. The structure is checked strictly, the way their importers read it."""

from __future__ import annotations

import json
from collections import defaultdict

from actorserve.cli import main as cli
from actorserve.replay.chrome_trace import to_chrome_trace
from actorserve.statemachines import LIFECYCLES

from replay_support import open_run, recorded_run


def check_structure(trace: dict) -> dict:
    """Every rule the importers rely on; returns {(pid, tid): track name}."""
    assert set(trace) >= {"traceEvents", "displayTimeUnit"} and trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    names: dict[tuple[int, int], str] = {}
    processes: set[int] = set()
    used: set[tuple[int, int]] = set()
    slices: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for ev in events:
        assert ev["ph"] in ("X", "M", "i"), ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int), ev
        assert isinstance(ev["name"], str) and ev["name"], ev
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "process_sort_index", "thread_name",
                                  "thread_sort_index"), ev
            if ev["name"] == "process_name":
                processes.add(ev["pid"])
            elif ev["name"] == "thread_name":
                assert (ev["pid"], ev["tid"]) not in names, f"track named twice: {ev}"
                names[(ev["pid"], ev["tid"])] = ev["args"]["name"]
            continue
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0, ev
        assert isinstance(ev.get("args", {}), dict)
        used.add((ev["pid"], ev["tid"]))
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0, ev
            slices[(ev["pid"], ev["tid"])].append(ev)
        else:
            assert ev["s"] == "t", ev
    assert used <= set(names), f"tracks without a name: {used - set(names)}"
    assert {pid for pid, _ in names} <= processes
    assert len(set(names.values())) == len(names), "two tracks share a name"
    for track, xs in slices.items():
        xs.sort(key=lambda e: e["ts"])
        for a, b in zip(xs, xs[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-6, f"slices overlap on {names[track]}"
    return names


def visits(events, rid):
    """The states a request went through, self-loops merged: [(state, entered ns)]."""
    out = []
    for e in events:
        if e.rid == rid and e.kind in LIFECYCLES and e.ok and e.dst and (not out or out[-1][0] != e.dst):
            out.append((e.dst, e.t_ns))
    return out


async def test_trace_has_a_track_per_request_and_a_slice_per_state(tmp_path):
    events, rids = await recorded_run(tmp_path / "run.jsonl")
    trace = json.loads(json.dumps(to_chrome_trace(events)))          # plain JSON round trip
    names = check_structure(trace)
    t0 = events[0].t_ns
    by_track = {name: key for key, name in names.items()}
    for rid in rids:
        key = by_track[f"{rid} (generation)"]
        xs = sorted((e for e in trace["traceEvents"] if e["ph"] == "X"
                     and (e["pid"], e["tid"]) == key), key=lambda e: e["ts"])
        seen = visits(events, rid)
        assert [x["name"] for x in xs] == [s for s, _ in seen[:-1]]
        for x, (state, start), (_, end) in zip(xs, seen, seen[1:]):
            assert x["ts"] == round((start - t0) / 1000, 3)             # microseconds
            assert abs(x["dur"] - (end - start) / 1000) < 1e-6
            assert x["args"]["rid"] == rid and x["args"]["lifecycle"] == "generation"
        (final,) = [e for e in trace["traceEvents"] if e["ph"] == "i"
                    and (e["pid"], e["tid"]) == key]
        assert final["name"] == seen[-1][0] == "done"
    controls = [e.rid for e in events if e.kind == "control" and e.event == "create"]
    assert controls and all(f"{r} (control)" in by_track for r in controls)
    for actor in ("server", "health", "scheduler"):
        assert actor in by_track


async def test_trace_has_the_scheduler_steps_on_their_own_track(tmp_path):
    events, _ = await recorded_run(tmp_path / "run.jsonl")
    trace = to_chrome_trace(events)
    names = check_structure(trace)
    key = next(k for k, n in names.items() if n == "scheduler steps")
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) == key]
    notes = [e for e in events if e.kind == "step"]
    ends = {e.data["step"]: e.t_ns for e in events if e.kind == "input" and e.event == "step_end"}
    assert [s["name"] for s in steps] == [f"step {n.data['step']}" for n in notes]
    for s, n in zip(steps, notes):
        assert abs(s["dur"] - (ends[n.data["step"]] - n.t_ns) / 1000) < 1e-6
        assert s["args"]["batch"] == n.data["batch"]
        assert s["args"]["batch_size"] == len(n.data["batch"])


async def test_open_recording_trace_ends_live_slices_at_the_last_event(tmp_path):
    rt, events, done, waiting = await open_run(tmp_path / "open.jsonl")
    trace = to_chrome_trace(events)
    names = check_structure(trace)
    key = next(k for k, n in names.items() if n == f"{waiting} (generation)")
    (last,) = [e for e in trace["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) == key]
    assert last["name"] == "queued" and last["args"]["open_at_end"] is True
    assert last["ts"] + last["dur"] == round((events[-1].t_ns - events[0].t_ns) / 1000, 3)
    await rt.shutdown()


async def test_cli_writes_the_trace(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    events, _ = await recorded_run(path)
    out = tmp_path / "trace.json"
    assert cli(["replay", str(path), "--format", "chrome-trace", "--out", str(out)]) == 0
    trace = json.loads(out.read_text(encoding="utf-8"))
    check_structure(trace)
    assert trace == json.loads(json.dumps(to_chrome_trace(events)))
    assert to_chrome_trace([])["traceEvents"]                     # metadata only, still valid
