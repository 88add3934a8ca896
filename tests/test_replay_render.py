"""Pictures of a recorded run: Mermaid sequence, the HTML timeline page, and a real browser.

The timeline is checked from its markup (axis, ticks, bars, tooltips, colours, overlays), then
in headless Chromium: the page's own script must lay bars out exactly as the server did and
zoom them, and the screenshot must show each bar's state colour where the markup put it.
"""

from __future__ import annotations

import itertools
import json
import re
import xml.etree.ElementTree as ET

import pytest

from actorserve.cli import main as cli
from actorserve.replay.palette import STATE_COLORS, UNKNOWN, color_of
from actorserve.replay.render import highlight_for, highlights, to_html, to_mermaid_sequence
from actorserve.replay.timeline import Axis, fit_label, fmt_ns, lanes_of, steps_of
from actorserve.statemachines import LIFECYCLES

from browser_support import CHROMIUM, SKIP_REASON, dump_dom, rgb, screenshot
from replay_support import TICK_NS, recorded_run

NS = "{http://www.w3.org/2000/svg}"
DURATION = re.compile(r"\d+(?:\.\d+)? (?:ns|µs|ms|s|min|h)")


def plot_of(page: str) -> ET.Element:
    return ET.fromstring(re.search(r"<svg[^>]*class='timeline'.*?</svg>", page, re.S)[0])


def labels_of(page: str) -> ET.Element:
    return ET.fromstring(re.search(r"<svg[^>]*class='tl-labels'.*?</svg>", page, re.S)[0])


def lanes(plot: ET.Element, kind: str = "request") -> list[ET.Element]:
    return [g for g in plot.iter(f"{NS}g") if g.get("class", "").split()[:2] == ["lane", kind]]


def segs(lane: ET.Element) -> list[ET.Element]:
    return [r for r in lane.iter(f"{NS}rect") if r.get("class") == "seg"]


def extent(rects: list[ET.Element]) -> float:
    xs = [float(r.get("x")) for r in rects]
    return max(x + float(r.get("width")) for x, r in zip(xs, rects)) - min(xs)


# -- Mermaid and overlays ----------------------------------------------------------------

async def test_mermaid_sequence_has_lanes_steps_and_refusals(tmp_path):
    events, rids = await recorded_run(tmp_path / "run.jsonl")
    text = to_mermaid_sequence(events)
    assert text.startswith("sequenceDiagram")
    for i, rid in enumerate(rids, 1):
        assert f"participant R{i} as {rid} (generation)" in text     # the full id
    assert "Note over S: step 1 [" in text
    assert "S->>R1: schedule (queued→prefill)" in text
    assert "-xR1: deliver REFUSED in queued" in text


async def test_highlight_counts_and_failed_edge(tmp_path):
    events, rids = await recorded_run(tmp_path / "run.jsonl")
    kind, hl = highlight_for(events, rids[0])
    assert kind == "generation" and hl["current"] == "done"
    assert hl["edges"][("queued", "schedule", "prefill")] == 1
    assert hl["edges"][("decode", "pause", "paused")] == 1
    assert hl["visited"]["decode"] == 2                 # before and after the pause
    assert hl["failed_edge"] == ("queued", "deliver", None)
    everyone = highlights(events)
    assert all(everyone[r] == highlight_for(events, r) for r in rids)


# -- the time axis -----------------------------------------------------------------------

def test_axis_ticks_fall_on_round_steps():
    axis = Axis(5_000_000, 15_000_000, [(5_000_000, 15_000_000)])
    ticks = axis.ticks()
    assert [t for _, t in ticks] == ["0"] + [f"{k} ms" for k in range(1, 11)]
    xs = [x for x, _ in ticks]
    assert xs[0] == pytest.approx(axis.left) and xs[-1] == pytest.approx(axis.left + 1000)
    assert len({round(b - a, 6) for a, b in zip(xs, xs[1:])}) == 1        # evenly spaced
    clock = {s * 10**9 for s in (15, 30, 60, 120, 300, 600, 900, 1800, 3600)}
    for span in (7_300, 123_456_789, 47 * 60 * 10**9, 3 * 3600 * 10**9, 80 * 3600 * 10**9):
        step = Axis(0, span, [(0, span)]).tick_step()
        hours = step // (3600 * 10**9) if step > 3600 * 10**9 else 0
        assert step in clock or str(hours or step).strip("0") in ("1", "2", "5"), step
        assert len(Axis(0, span, [(0, span)]).ticks()) >= 5, span       # any span: 5+ ticks
    assert Axis(0, 47 * 60 * 10**9, [(0, 47 * 60 * 10**9)]).tick_step() == 300 * 10**9


def test_axis_collapses_long_idle_gaps_into_breaks():
    ms, minute = 1_000_000, 60 * 10**9
    busy = [(0, 10 * ms), (10 * minute, 10 * minute + 10 * ms)]
    axis = Axis(0, 47 * minute, busy)
    assert axis.pieces == [(0, 10 * ms), (10 * minute, 10 * minute + 10 * ms),
                           (47 * minute, 47 * minute)]
    assert [fmt_ns(idle) for _, idle in axis.breaks()] == ["10 min", "37 min"]
    # both bursts share the page at one scale; the breaks take fixed room
    assert axis.x(10 * ms) - axis.x(0) == pytest.approx(axis.x(10 * minute + 10 * ms)
                                                       - axis.x(10 * minute))
    assert axis.x(10 * ms) - axis.x(0) > 450
    xs = [axis.x(t) for t in range(0, 47 * minute, minute // 7)]
    assert xs == sorted(xs) and xs[-1] <= axis.left + 1000
    short = Axis(0, 100 * ms, [(0, 40 * ms), (42 * ms, 100 * ms)])   # 2 ms: not a break
    assert len(short.pieces) == 1


def test_durations_read_well():
    assert [fmt_ns(v) for v in (850, 12_500, 3_000_000, 1_250_000_000, 37 * 60 * 10**9)] == \
        ["850 ns", "12.5 µs", "3 ms", "1.25 s", "37 min"]


def test_long_ids_are_cut_in_the_middle_only_when_narrow():
    rid = "9b91c9e197c348018a741fdff6eccc10"
    assert fit_label(rid, 320) == rid
    cut = fit_label("r" * 30 + "-end", 120)
    assert "…" in cut and cut.endswith("end") and len(cut) < 20


# -- the page ----------------------------------------------------------------------------

async def test_timeline_spans_activity_and_marks_the_idle_gaps(tmp_path):
    events, rids = await recorded_run(tmp_path / "run.jsonl", gaps=True)
    page = to_html(events)
    plot = plot_of(page)
    breaks = [g for g in plot.iter(f"{NS}g") if g.get("class") == "break"]
    assert [g.find(f"{NS}text").text for g in breaks] == ["10 min", "37 min"]
    for lane in lanes(plot):              # a linear 47-minute axis gave each under a pixel
        assert extent(segs(lane)) > 150, lane.get("data-rid")
    ticks = [t.text for t in plot.find(f"{NS}g[@class='ticks']").iter(f"{NS}text")]
    assert len(ticks) >= 8 and ticks[0] == "0"
    assert "2 idle gap(s)" in page and "collapsed" in page


async def test_lanes_are_coloured_by_state_with_durations_in_the_tooltips(tmp_path):
    events, rids = await recorded_run(tmp_path / "run.jsonl")
    page = to_html(events)
    plot, labels = plot_of(page), labels_of(page)
    req = lanes(plot)
    assert [g.get("data-rid") for g in req] == rids
    assert [g.get("data-kind") for g in lanes(plot, "actor")] == ["server", "health", "scheduler"]
    shown = [t.itertext() for t in labels.iter(f"{NS}text")]
    texts = ["".join(t) for t in shown]
    for rid in rids:                                  # full ids, never cut to 8 characters
        assert any(t.endswith(rid) for t in texts)
    entered = {}                                      # rid -> [(state, t_ns)] from the events
    for e in events:
        if e.kind == "generation" and e.ok and e.dst and e.rid in rids:
            seq = entered.setdefault(e.rid, [])
            if not seq or seq[-1][0] != e.dst:
                seq.append((e.dst, e.t_ns))
    for lane in req:
        rid = lane.get("data-rid")
        rects = segs(lane)
        assert [r.get("data-state") for r in rects] == [s for s, _ in entered[rid]]
        for r, (state, t), nxt in zip(rects, entered[rid], entered[rid][1:] + [None]):
            assert r.get("fill") == STATE_COLORS[state]
            tip = r.find(f"{NS}title").text
            assert tip.startswith(f"{rid} · generation.{state} · ")
            if nxt is not None:
                assert fmt_ns(nxt[1] - t) in tip and DURATION.search(tip)
            else:
                assert "final state" in tip
    assert set(STATE_COLORS) >= {r.get("data-state") for lane in req for r in segs(lane)}


async def test_scheduler_steps_are_marked_on_its_lane(tmp_path):
    events, rids = await recorded_run(tmp_path / "run.jsonl")
    plot = plot_of(to_html(events))
    (sched,) = [g for g in lanes(plot, "actor") if g.get("data-kind") == "scheduler"]
    marks = [r for r in sched.iter(f"{NS}rect") if r.get("class") == "step"]
    notes = [e for e in events if e.kind == "step"]
    assert len(marks) == len(notes) == len(steps_of(events)) >= 4
    for mark, note in zip(marks, notes):
        tip = mark.find(f"{NS}title").text
        assert tip.startswith(f"scheduler step {note.data['step']} · batch of "
                              f"{len(note.data['batch'])} · ")
        assert all(f"{rid}:{n}" in tip for rid, n in note.data["batch"])


def test_every_state_of_every_lifecycle_has_its_own_colour():
    names = {s.name for lc in LIFECYCLES.values() for s in lc.states}
    missing = sorted(n for n in names if n not in STATE_COLORS)
    assert not missing, f"give these states a colour in replay/palette.py: {missing}"
    assert color_of("no-such-state") == UNKNOWN and UNKNOWN not in STATE_COLORS.values()
    for (a, ca), (b, cb) in itertools.combinations(STATE_COLORS.items(), 2):
        assert max(abs(x - y) for x, y in zip(rgb(ca), rgb(cb))) >= 24, f"{a} {ca} ~ {b} {cb}"


async def test_every_request_has_a_selectable_diagram(tmp_path):
    events, rids = await recorded_run(tmp_path / "run.jsonl")
    page = to_html(events)
    index = json.loads(re.search(r"id='ov-map'>(.*?)</script>", page)[1])
    assert list(index) == rids and all(kind == "generation" for _, kind in index.values())
    templates = dict(re.findall(r"<template id='(ov-\d+)'>(.*?)</template>", page, re.S))
    assert set(templates) == {tid for tid, _ in index.values()}
    def path(hl: dict) -> str:
        return json.dumps({k: sorted(map(str, v.items())) if isinstance(v, dict) else v
                           for k, v in hl.items()}, sort_keys=True, default=str)
    distinct = {path(highlight_for(events, r)[1]) for r in rids}
    assert len(templates) == len(distinct) < len(rids)      # one picture per distinct path
    for rid, (tid, _) in index.items():
        svg = ET.fromstring(templates[tid])
        counts = {g.get("data-state"): [t.text for t in g.iter(f"{NS}text")]
                  for g in svg.iter(f"{NS}g") if g.get("data-state")}
        _, hl = highlight_for(events, rid)
        for state, n in hl["visited"].items():
            assert f"×{n}" in counts[state]
    options = re.findall(r"<option value='([^']+)'>", page)
    assert options == rids
    one = to_html(events, rid=rids[2])
    assert [g.get("data-rid") for g in lanes(plot_of(one))] == [rids[2]]


async def test_cli_writes_self_contained_html(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    events, rids = await recorded_run(path)
    out = tmp_path / "run.html"
    assert cli(["replay", str(path), "--format", "html", "--out", str(out)]) == 0
    page = out.read_text()
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page
    assert "<script src" not in page and "@import" not in page
    assert page.count("class='lane request'") == 4 and "class='step'" in page
    for z in ("in", "out", "fit"):
        assert f"data-zoom='{z}'" in page
    assert "recording is open" not in page
    assert cli(["replay", str(path), "--format", "mermaid", "--rid", rids[1]]) == 0
    assert "participant R1" in capsys.readouterr().out


# -- in a real browser -------------------------------------------------------------------

WINDOW = (1400, 1000)


def _boxes(dom: str) -> tuple[float, float]:
    x, y = re.search(r'class="timeline"[^>]*data-box="([\d.]+),([\d.]+)"', dom).groups()
    return float(x), float(y)


def _dom_rects(dom: str) -> list[tuple[str, float, float]]:
    """(data-a, x, width) of every bar in the plot after the page's script ran."""
    body = re.search(r'<svg[^>]*class="timeline".*?</svg>', dom, re.S)[0]
    out = []
    for tag in re.findall(r"<rect [^>]*data-a=[^>]*>", body):
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', tag))
        out.append((attrs["class"] + attrs["data-a"], float(attrs["x"]), float(attrs["width"])))
    return out


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
async def test_page_script_lays_out_and_zooms_like_the_server(tmp_path):
    events, rids = await recorded_run(tmp_path / "run.jsonl", gaps=True)
    page = tmp_path / "run.html"
    page.write_text(to_html(events), encoding="utf-8")
    server = _dom_rects(page.read_text(encoding="utf-8").replace("'", '"'))
    same = _dom_rects(dump_dom(tmp_path, page, *WINDOW, "#zoom=1"))
    assert len(same) == len(server) > 20
    for (ka, xa, wa), (kb, xb, wb) in zip(server, same):
        assert ka == kb and abs(xa - xb) < 0.15 and abs(wa - wb) < 0.15, (ka, xa, xb, wa, wb)
    zoomed_dom = dump_dom(tmp_path, page, *WINDOW, "#zoom=4")
    zoomed = _dom_rects(zoomed_dom)
    width = float(re.search(r'class="timeline" width="(\d+)"', zoomed_dom.replace(
        '<svg xmlns="http://www.w3.org/2000/svg" ', "<svg "))[1])
    assert width == pytest.approx(8 + 4000 + 30, abs=1)
    axis = json.loads(re.search(r"id='tl-axis'>(.*?)</script>", page.read_text("utf-8"))[1])
    left, fixed = axis["left"], axis["brk"] * (len(axis["pieces"]) - 1)
    ratio = (4 * axis["width"] - fixed) / (axis["width"] - fixed)   # breaks keep their width
    first_burst = [(a, b) for a, b in zip(server, zoomed) if a[1] < server[0][1] + 300]
    assert len(first_burst) > 10
    for (_, xa, _), (_, xb, _) in first_burst:          # before the first break
        assert xb - left == pytest.approx(ratio * (xa - left), abs=0.3)
    ticks_1 = len(re.findall(r"<text", re.search(r'<g class="ticks">.*?</g>', zoomed_dom, re.S)[0]))
    assert ticks_1 > 30                                  # finer ticks, redrawn by the script


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
async def test_screenshot_shows_each_bar_in_its_state_colour(tmp_path):
    events, rids = await recorded_run(tmp_path / "run.jsonl")
    html_text = to_html(events)
    page = tmp_path / "run.html"
    page.write_text(html_text, encoding="utf-8")
    ox, oy = _boxes(dump_dom(tmp_path, page, *WINDOW))
    img = screenshot(tmp_path, page, *WINDOW)
    plot = plot_of(html_text)
    checked = set()
    for lane in lanes(plot) + lanes(plot, "actor"):
        hatched = {r.get("data-a") for r in lane.iter(f"{NS}rect") if r.get("class") == "open"}
        for r in segs(lane):
            x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
            if w < 6 or r.get("data-a") in hatched:
                continue
            px, py = ox + x + w / 2, oy + y + 3          # above the scheduler's step marks
            assert img.near(px, py, r.get("fill")), (lane.get("data-rid") or lane.get(
                "data-kind"), r.get("data-state"), img.pixel(px, py), r.get("fill"))
            checked.add(r.get("data-state"))
    assert {"queued", "decode", "paused", "detok", "serving", "stepping"} <= checked, checked
    (sched,) = [g for g in lanes(plot, "actor") if g.get("data-kind") == "scheduler"]
    marks = [r for r in sched.iter(f"{NS}rect") if r.get("class") == "step"
             and float(r.get("width")) >= 4]
    assert marks
    lane_top = min(float(r.get("y")) for r in segs(sched))
    for m in marks:                     # a dark mark, in place, over the lane's state colour
        x, y, w = (float(m.get(k)) for k in ("x", "y", "width"))
        mark, bar = img.pixel(ox + x + w / 2, oy + y + 2), img.pixel(ox + x + w / 2, oy + lane_top + 3)
        assert sum(mark) < sum(bar) - 90, (mark, bar)
