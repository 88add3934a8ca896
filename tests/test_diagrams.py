"""Diagram exporters: generated docs are current, every edge is drawn, the SVG is sound."""

from __future__ import annotations

import enum
import itertools
import random
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from actorserve.cli import main
from actorserve.statemachines.core import Edge, Lifecycle
from actorserve.statemachines.diagram import (
    normalize_highlight, to_dot, to_markdown, to_mermaid, to_svg,
)
from actorserve.statemachines.lifecycles import GENERATION, LIFECYCLES, SESSION

ROOT = Path(__file__).resolve().parent.parent
NS = {"s": "http://www.w3.org/2000/svg"}
KINDS = list(LIFECYCLES)
RED = "#dc2626"

PATH_HIGHLIGHT = {
    "current": "paused",
    "visited": {"queued": 1, "prefill": 3, "decode": 2, "paused": 1},
    "edges": {("queued", "schedule", "prefill"): 1, ("prefill", "prefill_chunk", "prefill"): 2,
              ("prefill", "first_token", "decode"): 1, ("decode", "pause", "paused"): 1},
    "failed_edge": ("paused", "finish", None),
}


def rows(lc):
    return [(s.name, e.event, e.dest.name, e.condition) for e in lc.edges for s in e.sources]


def label(event, cond):
    return f"{event} [{cond}]" if cond else event


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def boxes(root: ET.Element, cls: str) -> list[tuple[float, float, float, float]]:
    return [tuple(float(r.get(k)) for k in ("x", "y", "width", "height"))
            for r in root.iterfind(f".//s:rect[@class='{cls}']", NS)]


def overlap(a, b) -> bool:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


def node_groups(root: ET.Element) -> dict[str, ET.Element]:
    return {g.get("data-state"): g for g in root.iterfind(".//s:g[@data-state]", NS)}


# -- generated files are current ---------------------------------------------------------

def test_lifecycles_md_is_current():
    path = ROOT / "docs" / "lifecycles.md"
    assert path.exists(), "docs/lifecycles.md is missing: run `make diagrams`"
    assert path.read_text(encoding="utf-8") == to_markdown(LIFECYCLES), (
        "docs/lifecycles.md is stale: run `make diagrams` "
        "(actorserve diagram all --format markdown --out docs/lifecycles.md)"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_diagram_svgs_are_current(kind):
    path = ROOT / "docs" / "diagrams" / f"{kind}.svg"
    hint = "run `actorserve diagram all --format svg --out docs/diagrams` (see `make diagrams`)"
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: {hint}"
    assert path.read_text(encoding="utf-8") == to_svg(LIFECYCLES[kind]), (
        f"{path.relative_to(ROOT)} is stale: {hint}")


def test_markdown_page_layout():
    md = to_markdown(LIFECYCLES)
    assert md.startswith("# Lifecycles\n")
    assert "actorserve diagram all --format markdown" in md and "do not edit" in md
    for lc in LIFECYCLES.values():
        section = md.split(f"\n## {lc.name}\n", 1)[1].split("\n## ", 1)[0]
        assert lc.doc in section and lc.definition_hash in section
        assert "```mermaid\n" + to_mermaid(lc) + "```" in section
        assert "| event | from | to | condition |" in section
        for e in lc.edges:
            assert f"| `{e.event}` | " + ", ".join(f"`{s.name}`" for s in e.sources) in section


# -- every edge is drawn -----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_every_edge_in_mermaid(kind):
    lc = LIFECYCLES[kind]
    text = to_mermaid(lc)
    lines = text.splitlines()
    assert lines[0] == "stateDiagram-v2"
    assert f"    [*] --> {lc.initial.name}" in lines
    for src, event, dest, cond in rows(lc):
        assert f"    {src} --> {dest}: {label(event, cond)}" in lines
    for s in lc.terminal:
        assert f"    {s.name} --> [*]" in lines
    assert to_mermaid(lc) == text          # deterministic


@pytest.mark.parametrize("kind", KINDS)
def test_every_edge_in_dot(kind):
    lc = LIFECYCLES[kind]
    text = to_dot(lc)
    assert text.startswith(f'digraph "{lc.name}" {{') and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    body = text.strip().splitlines()[1:-1]
    assert all(line.rstrip().endswith(";") for line in body)
    for src, event, dest, cond in rows(lc):
        assert f'"{src}" -> "{dest}" [label="{label(event, cond)}"]' in text
    for s in lc.terminal:
        assert f'"{s.name}" [shape=doublecircle]' in text
    assert f'"__start" -> "{lc.initial.name}"' in text


@pytest.mark.parametrize("kind", KINDS)
def test_every_edge_in_svg(kind):
    lc = LIFECYCLES[kind]
    root = parse(to_svg(lc))
    drawn = {(g.get("data-source"), g.get("data-dest"))
             for g in root.iterfind(".//s:g[@class]", NS)
             if g.get("class").startswith("edge")}
    labels = [t.text for t in root.iterfind(".//s:g[@class='labels']/s:text", NS)]
    for src, event, dest, cond in rows(lc):
        assert (src, dest) in drawn
        assert label(event, cond) in labels


# -- SVG geometry ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_svg_nodes_and_geometry(kind):
    lc = LIFECYCLES[kind]
    root = parse(to_svg(lc))
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    width, height = float(root.get("width")), float(root.get("height"))
    groups = node_groups(root)
    assert sorted(groups) == sorted(s.name for s in lc.states)
    for name, g in groups.items():
        assert name in [t.text for t in g.iterfind("s:text", NS)]
        inner = g.findall("s:rect[@class='node-inner']", NS)
        assert len(inner) == (1 if lc.states[name] in lc.terminal else 0)   # double border
    nodes = boxes(root, "node-box")
    assert len(nodes) == len(lc.states)
    for a, b in itertools.combinations(nodes, 2):
        assert not overlap(a, b), f"node boxes overlap: {a} {b}"
    labels = boxes(root, "label-bg")
    for a, b in itertools.combinations(labels, 2):
        assert not overlap(a, b), f"labels overlap: {a} {b}"
    for a, b in itertools.product(labels, nodes):
        assert not overlap(a, b), f"label {a} covers node {b}"
    for x, y, w, h in nodes + labels:
        assert 0 <= x and x + w <= width and 0 <= y and y + h <= height
    assert len(root.findall(".//s:circle[@class='initial']", NS)) == 1
    assert root.findall(".//s:marker", NS)


@pytest.mark.parametrize("kind", KINDS)
def test_svg_edges_run_from_source_side_to_dest_side(kind):
    lc = LIFECYCLES[kind]
    root = parse(to_svg(lc))
    rect = {name: tuple(float(g.find("s:rect", NS).get(k)) for k in ("x", "y", "width", "height"))
            for name, g in node_groups(root).items()}

    def on_side(point, box):
        (px, py), (x, y, w, h) = point, box
        return (abs(px - x) < 0.2 or abs(px - x - w) < 0.2) and y <= py <= y + h

    for g in root.iterfind(".//s:g[@class='edge']", NS):
        d = g.find("s:path", NS).get("d")
        assert "url(#" in g.find("s:path", NS).get("marker-end")
        nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", d)]
        start, end = (nums[0], nums[1]), (nums[-2], nums[-1])
        assert on_side(start, rect[g.get("data-source")]), (g.get("data-source"), d)
        assert on_side(end, rect[g.get("data-dest")]), (g.get("data-dest"), d)


def random_lifecycle(seed: int) -> tuple[Lifecycle, dict | None]:
    """A random lifecycle (cycles, self-loops, fans, odd event names) and highlight."""
    rnd = random.Random(seed)
    n = rnd.randint(1, 9)
    states = list(enum.Enum(f"R{seed}", [f"s{i}_{'x' * rnd.randint(0, 8)}" for i in range(n)]))
    term = frozenset(rnd.sample(states[1:], rnd.randint(0, n - 1)))
    live = [s for s in states if s not in term]
    edges = tuple(
        Edge(f"ev{k}<&>", tuple(rnd.sample(live, rnd.randint(1, len(live)))),
             rnd.choice(states), rnd.choice([None, "cond"]))
        for k in range(rnd.randint(0, 14)))
    lc = Lifecycle(name=f"r{seed}", states=states[0].__class__, initial=states[0],
                   terminal=term, edges=edges)
    if not edges or seed % 2:
        return lc, None
    e = edges[0]
    return lc, {"current": rnd.choice(states),
                "visited": {s: rnd.randint(1, 5) for s in rnd.sample(states, rnd.randint(0, n))},
                "edges": {(e.sources[0], e.event, e.dest): 2},
                "failed_edge": (rnd.choice(states), "bad", rnd.choice([None, *states]))}


@pytest.mark.parametrize("seed", range(40))
def test_svg_geometry_on_random_lifecycles(seed):
    lc, hl = random_lifecycle(seed)
    root = parse(to_svg(lc, hl))
    width, height = float(root.get("width")), float(root.get("height"))
    nodes, labels = boxes(root, "node-box"), boxes(root, "label-bg")
    assert len(nodes) == len(lc.states)
    for a, b in itertools.combinations(nodes + labels, 2):
        assert not overlap(a, b), (a, b)
    for x, y, w, h in nodes + labels:
        assert 0 <= x and x + w <= width and 0 <= y and y + h <= height
    assert to_dot(lc, hl) and to_mermaid(lc, hl)     # the other formats take it too


def test_svg_escapes_text_and_is_deterministic():
    svg = to_svg(GENERATION)
    assert svg == to_svg(GENERATION)
    assert "resume [prefill_complete]" in svg
    assert "<" not in re.sub(r"<[^>]*>", "", svg)   # no stray markup in text


# -- highlight ---------------------------------------------------------------------------

def test_svg_highlight_current_visited_and_failed_stub():
    root = parse(to_svg(GENERATION, PATH_HIGHLIGHT))
    groups = node_groups(root)
    cur = groups["paused"].find("s:rect[@class='node-box']", NS)
    assert "current" in groups["paused"].get("class")
    assert float(cur.get("stroke-width")) >= 3
    for name, n in PATH_HIGHLIGHT["visited"].items():
        g = groups[name]
        assert g.find("s:rect", NS).get("fill") == "#dbeafe"
        assert f"×{n}" in [t.text for t in g.iterfind("s:text", NS)]
    assert groups["done"].find("s:rect", NS).get("fill") != "#dbeafe"
    stub = root.find(".//s:g[@class='edge failed-edge']", NS)
    assert stub is not None and stub.get("data-source") == "paused"
    path = stub.find("s:path", NS)
    assert path.get("stroke") == RED and path.get("stroke-dasharray")
    red_labels = [t.text for t in root.iterfind(".//s:text", NS) if t.get("fill") == RED]
    assert any("finish" in t for t in red_labels)
    nodes = boxes(root, "node-box")
    for a, b in itertools.combinations(nodes + boxes(root, "label-bg"), 2):
        assert not overlap(a, b)
    hot = [g for g in root.iterfind(".//s:g[@data-source='queued']", NS)
           if g.get("data-dest") == "prefill"]
    assert hot[0].find("s:path", NS).get("stroke") == "#2563eb"


def test_svg_failed_edge_with_dest_is_red():
    root = parse(to_svg(SESSION, {"current": "closing",
                                  "failed_edge": ("closing", "defer_close", "open")}))
    edge = [g for g in root.iterfind(".//s:g[@data-source='closing']", NS)
            if g.get("data-dest") == "open"]
    assert edge and edge[0].find("s:path", NS).get("stroke") == RED


def test_mermaid_and_dot_highlight():
    mm = to_mermaid(GENERATION, PATH_HIGHLIGHT)
    assert "classDef current" in mm and "    class paused current" in mm
    assert "    class prefill visited" in mm and "prefill : visited ×3" in mm
    assert "queued --> prefill: schedule ×1" in mm
    assert re.search(r"paused --> rejected_finish: finish \(rejected\)", mm)
    assert "class rejected_finish failed" in mm
    dot = to_dot(GENERATION, PATH_HIGHLIGHT)
    assert re.search(r'"paused" \[[^]]*penwidth=3', dot)
    assert re.search(
        r'"paused" -> "__rejected" \[label="finish \(rejected\)", color="#dc2626"', dot)
    assert '"prefill" [style="rounded,filled", fillcolor="#dbeafe", label="prefill\\n×3"]' in dot


def test_highlight_accepts_enums_and_rejects_unknown_states():
    G = GENERATION.states
    hl = normalize_highlight(GENERATION, {"current": G.decode, "visited": [G.queued],
                                          "edges": {(G.queued, "schedule", G.prefill): 1}})
    assert hl.current == "decode" and hl.visited == {"queued": 1}
    assert hl.edges == {("queued", "schedule", "prefill"): 1}
    with pytest.raises(ValueError):
        to_svg(GENERATION, {"current": "nowhere"})
    with pytest.raises(ValueError):
        to_dot(GENERATION, {"colour": "red"})


# -- CLI ---------------------------------------------------------------------------------

def test_cli_writes_files(tmp_path, capsys):
    assert main(["diagram", "generation", "--format", "dot", "--out", str(tmp_path / "g.dot")]) == 0
    assert (tmp_path / "g.dot").read_text(encoding="utf-8") == to_dot(GENERATION)
    md = tmp_path / "docs" / "lifecycles.md"
    assert main(["diagram", "all", "--format", "markdown", "--out", str(md)]) == 0
    assert md.read_text(encoding="utf-8") == to_markdown(LIFECYCLES)
    assert main(["diagram", "all", "--format", "svg", "--out", str(tmp_path / "svg")]) == 0
    for kind in KINDS:
        written = (tmp_path / "svg" / f"{kind}.svg").read_text(encoding="utf-8")
        assert written == to_svg(LIFECYCLES[kind])
    capsys.readouterr()
    assert main(["diagram", "all", "--format", "mermaid"]) == 0
    out = capsys.readouterr().out
    for kind in KINDS:
        assert f"%% {kind}\n" + to_mermaid(LIFECYCLES[kind]) in out
    assert main(["diagram", "session", "--format", "svg"]) == 0
    assert capsys.readouterr().out == to_svg(SESSION)


def test_cli_all_svg_needs_a_directory(tmp_path, capsys):
    assert main(["diagram", "all", "--format", "svg"]) == 2
    assert "directory" in capsys.readouterr().err
    afile = tmp_path / "x.txt"
    afile.write_text("")
    assert main(["diagram", "all", "--format", "svg", "--out", str(afile)]) == 2
    assert main(["diagram", "all", "--format", "svg", "--out", str(tmp_path / "all.svg")]) == 2
    assert not (tmp_path / "all.svg").exists()


def test_cli_unknown_kind_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["diagram", "nosuchkind"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# -- optional visual check ---------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


@pytest.mark.skipif(CHROMIUM is None, reason="headless chromium not installed")
def test_svg_renders_to_png_with_chromium(tmp_path):
    svg = tmp_path / "generation.svg"
    svg.write_text(to_svg(GENERATION, PATH_HIGHLIGHT), encoding="utf-8")
    root = parse(svg.read_text(encoding="utf-8"))
    png = tmp_path / "generation.png"
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={png}",
         f"--window-size={int(float(root.get('width')))},{int(float(root.get('height')))}",
         svg.as_uri()],
        check=True, capture_output=True, timeout=60,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
