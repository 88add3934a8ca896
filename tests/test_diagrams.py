"""Diagram exporters: generated docs are current, every edge is drawn once, the SVG is sound.

The SVG checks run against both layouts: the pure-Python one always, Graphviz's when ``dot``
is installed (skipped with the reason otherwise). Geometry is checked from the markup alone:
node boxes, label backdrops and every text's extent (estimated from its font size and
character count, 0.6 em per character as the monospace font asks) must not overlap, the
compound state's box must enclose exactly its members, and the generation diagram must fit
a 1,200 px page.
"""

from __future__ import annotations

import enum
import itertools
import json
import random
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from actorserve.cli import main
from actorserve.statemachines.compound import drawn_rows, live_group
from actorserve.statemachines.core import Edge, Lifecycle
from actorserve.statemachines.diagram import (
    VISITED_FILL, normalize_highlight, to_dot, to_markdown, to_mermaid, to_svg,
)
from actorserve.statemachines.graphviz_layout import dot_version
from actorserve.statemachines.lifecycles import GENERATION, LIFECYCLES, SESSION
from actorserve.statemachines.svg import GROUP_FILL, GraphvizUnavailable

from browser_support import CHROMIUM, SKIP_REASON, screenshot

ROOT = Path(__file__).resolve().parent.parent
NS = {"s": "http://www.w3.org/2000/svg"}
KINDS = list(LIFECYCLES)
RED = "#dc2626"
NO_DOT = "Graphviz's dot is not installed (Debian package graphviz; `make setup` installs it)"
needs_dot = pytest.mark.skipif(dot_version() is None, reason=NO_DOT)
LAYOUTS = ["python", pytest.param("graphviz", marks=needs_dot)]

PATH_HIGHLIGHT = {
    "current": "paused",
    "visited": {"queued": 1, "prefill": 3, "decode": 2, "paused": 1},
    "edges": {("queued", "schedule", "prefill"): 1, ("prefill", "prefill_chunk", "prefill"): 2,
              ("prefill", "first_token", "decode"): 1, ("decode", "pause", "paused"): 1},
    "failed_edge": ("paused", "finish", None),
}


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def boxes(root: ET.Element, cls: str) -> list[tuple[float, float, float, float]]:
    return [tuple(float(r.get(k)) for k in ("x", "y", "width", "height"))
            for r in root.iterfind(f".//s:rect[@class='{cls}']", NS)]


def text_boxes(root: ET.Element) -> list[tuple[str, tuple[float, float, float, float]]]:
    """(text, box) for every <text>: width from the character count (0.6 em), height 1 em."""
    out = []
    for t in root.iterfind(".//s:text", NS):
        fs = float(t.get("font-size"))
        w = len(t.text or "") * 0.6 * fs
        x = float(t.get("x"))
        x -= {"middle": w / 2, "end": w}.get(t.get("text-anchor"), 0)
        out.append((t.text or "", (x, float(t.get("y")) - 0.8 * fs, w, fs)))
    return out


def overlap(a, b) -> bool:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


def inside(a, b, slack: float = 0.0) -> bool:
    """Box a lies within box b."""
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    return bx - slack <= ax and ax + aw <= bx + bw + slack and by - slack <= ay and \
        ay + ah <= by + bh + slack


def node_groups(root: ET.Element) -> dict[str, ET.Element]:
    return {g.get("data-state"): g for g in root.iterfind(".//s:g[@data-state]", NS)}


def node_box(g: ET.Element) -> tuple[float, float, float, float]:
    r = g.find("s:rect[@class='node-box']", NS)
    return tuple(float(r.get(k)) for k in ("x", "y", "width", "height"))


def group_box(root: ET.Element):
    r = root.find(".//s:rect[@class='group-box']", NS)
    return None if r is None else tuple(float(r.get(k)) for k in ("x", "y", "width", "height"))


def edge_groups(root: ET.Element) -> list[ET.Element]:
    return [g for g in root.iterfind(".//s:g[@class]", NS) if g.get("class").startswith("edge ")
            or g.get("class") == "edge"]


def check_geometry(root: ET.Element, lc: Lifecycle) -> None:
    """Nothing overlaps, everything is on the canvas, the group box holds exactly its members."""
    width, height = float(root.get("width")), float(root.get("height"))
    groups = node_groups(root)
    nodes = {name: node_box(g) for name, g in groups.items()}
    assert sorted(nodes) == sorted(s.name for s in lc.states)
    for (a, ba), (b, bb) in itertools.combinations(nodes.items(), 2):
        assert not overlap(ba, bb), f"node boxes overlap: {a} {ba}, {b} {bb}"
    labels = boxes(root, "label-bg")
    for a, b in itertools.combinations(labels, 2):
        assert not overlap(a, b), f"label backdrops overlap: {a} {b}"
    for a, b in itertools.product(labels, nodes.values()):
        assert not overlap(a, b), f"label {a} covers node {b}"
    texts = text_boxes(root)
    for (ta, a), (tb, b) in itertools.combinations(texts, 2):
        assert not overlap(a, b), f"texts overlap: {ta!r} {a} and {tb!r} {b}"
    for text, box in texts:                   # a node's text stays in its node
        owner = [n for n, nb in nodes.items() if overlap(box, nb)]
        assert len(owner) <= 1 and all(inside(box, nodes[n], 0.5) for n in owner), (text, owner)
    for x, y, w, h in [*nodes.values(), *labels, *(b for _, b in texts)]:
        assert 0 <= x and x + w <= width and 0 <= y and y + h <= height, ((x, y, w, h), width)
    group = live_group(lc)
    gbox = group_box(root)
    assert (gbox is None) == (group is None)
    if group is not None:
        g = root.find(".//s:g[@class='group']", NS)
        assert g.get("data-members").split() == list(group.members)
        for name, nb in nodes.items():
            if name in group.members:
                assert inside(nb, gbox), f"member {name} {nb} is outside the box {gbox}"
            else:
                assert not overlap(nb, gbox), f"{name} {nb} is inside the box {gbox}"
        label = g.find("s:text[@class='group-label']", NS)
        assert label.text == group.name
        assert inside(next(b for t, b in texts if t == group.name and b[1] > gbox[1]), gbox)
    assert len(root.findall(".//s:circle[@class='initial']", NS)) == 1
    assert root.findall(".//s:marker", NS)


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
    """Byte for byte when this machine has the layout that drew the file; otherwise the file
    must at least show today's definition (its hash) with every state and drawn edge."""
    lc = LIFECYCLES[kind]
    path = ROOT / "docs" / "diagrams" / f"{kind}.svg"
    hint = "run `make diagrams` (actorserve diagram all --format svg --out docs/diagrams)"
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: {hint}"
    text = path.read_text(encoding="utf-8")
    root = parse(text)
    assert root.get("data-definition") == lc.definition_hash, f"{path.name} is stale: {hint}"
    layout = root.get("data-layout") or ""
    if layout == "python" or layout == f"graphviz {dot_version()}":
        assert text == to_svg(lc, layout=layout.split()[0]), f"{path.name} is stale: {hint}"
    else:
        assert layout.startswith("graphviz "), f"{path.name}: unknown layout {layout!r}"
        assert sorted(node_groups(root)) == sorted(s.name for s in lc.states)
        drawn = {(g.get("data-source"), g.get("data-dest")) for g in edge_groups(root)}
        assert {(r.src, r.dest) for r in drawn_rows(lc, live_group(lc))} <= drawn


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


# -- the compound state ------------------------------------------------------------------

def _lc(name: str, states: list[str], terminal: list[str], edges: list[tuple]) -> Lifecycle:
    S = enum.Enum(name.title(), states)
    return Lifecycle(name=name, states=S, initial=S[states[0]],
                     terminal=frozenset(S[t] for t in terminal),
                     edges=tuple(Edge(ev, tuple(S[s] for s in src), S[dst])
                                 for ev, src, dst in edges))


def test_generation_draws_abort_and_fail_once_from_the_live_states():
    group = live_group(GENERATION)
    live = [s.name for s in GENERATION.states if s not in GENERATION.terminal]
    assert group is not None and group.name == "live" and list(group.members) == live
    grouped = [r for r in drawn_rows(GENERATION, group) if r.grouped]
    assert sorted((r.event, r.dest) for r in grouped) == [("abort", "aborted"), ("fail", "failed")]
    assert all(r.src == "live" for r in grouped)
    table_rows = sum(len(e.sources) for e in GENERATION.edges)
    assert len(drawn_rows(GENERATION, group)) == table_rows - 2 * (len(live) - 1)


@pytest.mark.parametrize("kind", KINDS)
def test_compound_state_rule_holds_for_every_lifecycle(kind):
    lc = LIFECYCLES[kind]
    group = live_group(lc)
    rows = drawn_rows(lc, group)
    assert len(rows) <= sum(len(e.sources) for e in lc.edges)
    if group is None:
        assert rows == drawn_rows(lc)
        return
    live = {s.name for s in lc.states if s not in lc.terminal}
    assert set(group.members) <= live and len(group.members) >= 3
    assert len(group.members) >= len(live) - max(1, len(live) // 4)
    for r in rows:
        if r.grouped:           # the table really has this event from every member
            edge = next(e for e in lc.edges if e.event == r.event and e.dest.name == r.dest
                        and e.condition == r.condition)
            assert set(group.members) <= {s.name for s in edge.sources}
            assert r.dest not in group.members


def test_compound_state_rule_on_made_up_lifecycles():
    # the same event from nearly every live state (6 of 8) is grouped; from 5 of 8 it is not
    names = [f"s{i}" for i in range(8)] + ["end"]
    chain = [(f"go{i}", [f"s{i}"], f"s{i + 1}") for i in range(7)]
    six = _lc("six", names, ["end"], chain + [("kill", names[:6], "end")])
    assert live_group(six).members == tuple(names[:6])
    five = _lc("five", names, ["end"], chain + [("kill", names[:5], "end")])
    assert live_group(five) is None
    # a destination that leads back into the group is never drawn from the group
    back = _lc("back", ["a", "b", "c", "reset", "end"], ["end"],
               [("n", ["a"], "b"), ("m", ["b"], "c"), ("r", ["a", "b", "c"], "reset"),
                ("again", ["reset"], "a"), ("stop", ["a", "b", "c", "reset"], "end")])
    group = live_group(back)
    assert group.members == ("a", "b", "c", "reset")
    assert [r.event for r in drawn_rows(back, group) if r.grouped] == ["stop"]
    # a state called "live" does not collide with the group's name
    named = _lc("named", ["live", "x", "y", "end"], ["end"],
                [("n", ["live"], "x"), ("m", ["x"], "y"), ("stop", ["live", "x", "y"], "end")])
    assert live_group(named).name == "live_"
    assert live_group(SESSION) is None                   # two live states: nothing to save


# -- Mermaid -----------------------------------------------------------------------------

_TRANSITION = re.compile(r"^(\s*)(\S+) --> (\S+)(?:: (.*))?$")


def mermaid_parts(text: str) -> tuple[list[tuple], set[str]]:
    """Transitions as (src, dest, label, inside the composite?) and the ids declared inside."""
    lines = text.splitlines()
    assert lines[:2] == ["stateDiagram-v2", "    direction LR"]
    depth, out, declared = 0, [], set()
    for line in lines[2:]:
        if line.endswith("{"):
            assert re.fullmatch(r"    state \w+ \{", line), line
            depth += 1
            continue
        if line.strip() == "}":
            depth -= 1
            continue
        m = _TRANSITION.match(line)
        if m:
            out.append((m[2], m[3], m[4], depth > 0))
            continue
        assert re.fullmatch(r'\s+(state "[^"]+" as \w+|\w+|\w+ : .+|classDef .+|class \w+ \w+)',
                            line), f"not a Mermaid statement: {line!r}"
        if depth:
            declared.add(line.split()[-1] if line.strip().startswith("state") else line.split()[0])
    assert depth == 0, "unbalanced composite block"
    return out, declared


@pytest.mark.parametrize("kind", KINDS)
def test_every_edge_in_mermaid_once(kind):
    lc = LIFECYCLES[kind]
    text = to_mermaid(lc)
    trans, declared = mermaid_parts(text)
    group = live_group(lc)
    members = set(group.members) if group is not None else set()
    expected = [(r.src, r.dest, r.label, r.src in members and r.dest in members)
                for r in drawn_rows(lc, group)]
    assert sorted(t for t in trans if "[*]" not in t[:2]) == sorted(expected)
    assert [t for t in trans if t[1] == "[*]"] == [(s.name, "[*]", None, False)
                                                  for s in lc.states if s in lc.terminal]
    if group is not None:
        assert f"    state {group.name} {{" in text.splitlines()
        assert declared == members                  # every member inside, nothing else
        assert ("[*]", group.name, None, False) in trans and ("[*]", lc.initial.name, None, True) in trans
        inner_ids = {x for t in trans if t[3] for x in t[:2]}
        assert inner_ids <= members | {"[*]"}      # an outer state named inside would move in
    else:
        assert ("[*]", lc.initial.name, None, False) in trans
    assert to_mermaid(lc) == text                    # deterministic


# -- Graphviz DOT ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_every_edge_in_dot(kind):
    lc = LIFECYCLES[kind]
    text = to_dot(lc)
    assert text.startswith(f'digraph "{lc.name}" {{') and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    body = text.strip().splitlines()[1:-1]
    assert all(line.rstrip().endswith((";", "{", "}")) for line in body)
    group = live_group(lc)
    for r in drawn_rows(lc, group):
        if r.grouped:
            assert len(re.findall(rf'-> "{r.dest}" \[label="{re.escape(r.label)}", '
                                  rf'ltail="cluster_{group.name}"\]', text)) == 1
        else:
            assert f'"{r.src}" -> "{r.dest}" [label="{r.label}"]' in text
    for s in lc.terminal:
        assert f'"{s.name}" [peripheries=2]' in text
    assert f'"__start" -> "{lc.initial.name}"' in text


@needs_dot
@pytest.mark.parametrize("kind", ["generation", "server", "scheduler", "session"])
def test_dot_export_is_valid_graphviz(kind):
    lc = LIFECYCLES[kind]
    hl = PATH_HIGHLIGHT if kind == "generation" else None
    r = subprocess.run([shutil.which("dot"), "-Tjson"], input=to_dot(lc, hl),
                       capture_output=True, text=True, timeout=60, check=True)
    g = json.loads(r.stdout)
    names = {o["name"] for o in g["objects"] if "pos" in o}
    assert {s.name for s in lc.states} <= names
    group = live_group(lc)
    clusters = [o for o in g["objects"] if o.get("name", "").startswith("cluster")]
    if group is None:
        assert clusters == []
    else:
        (cluster,) = clusters
        assert sorted(g["objects"][i]["name"] for i in cluster["nodes"]
                      if g["objects"][i]["name"] != "__start") == sorted(group.members)


# -- SVG ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_edge_in_svg(kind, layout):
    lc = LIFECYCLES[kind]
    root = parse(to_svg(lc, layout=layout))
    drawn = [(g.get("data-source"), g.get("data-dest")) for g in edge_groups(root)]
    labels = [t.text for t in root.iterfind(".//s:g[@class='labels']/s:text", NS)]
    rows = drawn_rows(lc, live_group(lc))
    assert set(drawn) == {(r.src, r.dest) for r in rows}
    assert len(drawn) == len(set(drawn))        # rows between two states share one edge
    assert sorted(labels) == sorted(r.label for r in rows)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_svg_geometry(kind, layout):
    lc = LIFECYCLES[kind]
    root = parse(to_svg(lc, layout=layout))
    check_geometry(root, lc)
    assert root.get("data-layout").split()[0] == layout
    assert root.get("data-definition") == lc.definition_hash
    nodes = {n: node_box(g) for n, g in node_groups(root).items()}
    sinks = [s.name for s in lc.states if s in lc.terminal]
    centres = [nodes[s][0] + nodes[s][2] / 2 for s in sinks]
    assert max(centres, default=0) - min(centres, default=0) < 0.5, f"not aligned: {centres}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generation_fits_a_page_with_abort_and_fail_drawn_once(layout):
    root = parse(to_svg(GENERATION, layout=layout))
    assert float(root.get("width")) <= 1200
    check_geometry(root, GENERATION)
    into = {dest: [g for g in edge_groups(root) if g.get("data-dest") == dest]
            for dest in ("aborted", "failed")}
    for dest, gs in into.items():
        assert [(g.get("data-source"), g.get("class")) for g in gs] == [("live", "edge group-edge")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_svg_edges_run_from_source_to_dest(kind, layout):
    lc = LIFECYCLES[kind]
    root = parse(to_svg(lc, layout=layout))
    rect = {name: node_box(g) for name, g in node_groups(root).items()}
    group = live_group(lc)
    if group is not None:
        rect[group.name] = group_box(root)

    def on_border(point, box, sides_only: bool) -> bool:
        (px, py), (x, y, w, h) = point, box
        tol = 0.2 if sides_only else 2.5
        on_side = (abs(px - x) < tol or abs(px - x - w) < tol) and y - tol <= py <= y + h + tol
        on_top = (abs(py - y) < tol or abs(py - y - h) < tol) and x - tol <= px <= x + w + tol
        return on_side or (not sides_only and on_top)

    for g in root.iterfind(".//s:g[@class]", NS):
        if g.get("class") not in ("edge", "edge group-edge"):
            continue
        path = g.find("s:path", NS)
        assert "url(#" in path.get("marker-end")
        nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", path.get("d"))]
        start, end = (nums[0], nums[1]), (nums[-2], nums[-1])
        sides_only = layout == "python"
        assert on_border(start, rect[g.get("data-source")], sides_only), (g.get("data-source"), start)
        assert on_border(end, rect[g.get("data-dest")], sides_only), (g.get("data-dest"), end)


def random_lifecycle(seed: int) -> tuple[Lifecycle, dict | None]:
    """A random lifecycle (cycles, self-loops, fans, odd event names) and highlight."""
    rnd = random.Random(seed)
    n = rnd.randint(1, 9)
    states = list(enum.Enum(f"R{seed}", [f"s{i}_{'x' * rnd.randint(0, 8)}" for i in range(n)]))
    term = frozenset(rnd.sample(states[1:], rnd.randint(0, n - 1)))
    live = [s for s in states if s not in term]
    edges = [
        Edge(f"ev{k}<&>", tuple(rnd.sample(live, rnd.randint(1, len(live)))),
             rnd.choice(states), rnd.choice([None, "cond"]))
        for k in range(rnd.randint(0, 14))]
    if seed % 3 == 0 and term and len(live) >= 3:      # an abort from every live state
        edges += [Edge("abort", tuple(live), rnd.choice(sorted(term, key=lambda s: s.name)))]
    lc = Lifecycle(name=f"r{seed}", states=states[0].__class__, initial=states[0],
                   terminal=term, edges=tuple(edges))
    if not edges or seed % 2:
        return lc, None
    e = edges[0]
    return lc, {"current": rnd.choice(states),
                "visited": {s: rnd.randint(1, 5) for s in rnd.sample(states, rnd.randint(0, n))},
                "edges": {(e.sources[0], e.event, e.dest): 2},
                "failed_edge": (rnd.choice(states), "bad", rnd.choice([None, *states]))}


def test_random_lifecycles_include_compound_states():
    assert sum(live_group(random_lifecycle(seed)[0]) is not None for seed in range(40)) >= 5


@pytest.mark.parametrize("seed", range(40))
def test_svg_geometry_on_random_lifecycles(seed):
    lc, hl = random_lifecycle(seed)
    check_geometry(parse(to_svg(lc, hl)), lc)
    assert to_dot(lc, hl) and to_mermaid(lc, hl)     # the other formats take it too
    mermaid_parts(to_mermaid(lc, hl))


@needs_dot
@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_graphviz_geometry_on_random_lifecycles(seed):
    lc, hl = random_lifecycle(seed)
    root = parse(to_svg(lc, hl, layout="graphviz"))
    nodes = [node_box(g) for g in node_groups(root).values()]
    for a, b in itertools.combinations(nodes, 2):
        assert not overlap(a, b), (a, b)
    gbox = group_box(root)
    if gbox is not None:
        members = set(live_group(lc).members)
        for name, g in node_groups(root).items():
            assert inside(node_box(g), gbox) == (name in members), name


def test_svg_escapes_text_and_is_deterministic():
    for lc in LIFECYCLES.values():
        svg = to_svg(lc)
        assert svg == to_svg(lc)
        assert "<" not in re.sub(r"<[^>]*>", "", svg)   # no stray markup in text
    # no shipped lifecycle has a guarded edge today: draw one that has
    import enum as _enum

    from actorserve.statemachines import Edge, Lifecycle
    G = _enum.Enum("G", {"a": "a", "b": "b", "c": "c"})
    guarded = Lifecycle(name="guarded", states=G, initial=G.a, terminal=frozenset({G.c}),
                        edges=(Edge("go", (G.a,), G.b, condition="ready"), Edge("go", (G.a,), G.c),
                               Edge("end", (G.b,), G.c)))
    assert "go [ready]" in to_svg(guarded)
    lc, _ = random_lifecycle(4)
    assert "ev0&lt;&amp;&gt;" in to_svg(lc) or not lc.edges


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError):
        to_svg(GENERATION, layout="neato")


# -- highlight ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_svg_highlight_current_visited_and_failed_stub(layout):
    root = parse(to_svg(GENERATION, PATH_HIGHLIGHT, layout=layout))
    groups = node_groups(root)
    cur = groups["paused"].find("s:rect[@class='node-box']", NS)
    assert "current" in groups["paused"].get("class")
    assert float(cur.get("stroke-width")) >= 3
    for name, n in PATH_HIGHLIGHT["visited"].items():
        g = groups[name]
        assert g.find("s:rect", NS).get("fill") == VISITED_FILL
        assert f"×{n}" in [t.text for t in g.iterfind("s:text", NS)]
    assert groups["done"].find("s:rect", NS).get("fill") != VISITED_FILL
    stub = root.find(".//s:g[@class='edge failed-edge']", NS)
    assert stub is not None and stub.get("data-source") == "paused"
    path = stub.find("s:path", NS)
    assert path.get("stroke") == RED and path.get("stroke-dasharray")
    red_labels = [t.text for t in root.iterfind(".//s:text", NS) if t.get("fill") == RED]
    assert any("finish" in t for t in red_labels)
    check_geometry(root, GENERATION)
    hot = [g for g in root.iterfind(".//s:g[@data-source='queued']", NS)
           if g.get("data-dest") == "prefill"]
    assert hot[0].find("s:path", NS).get("stroke") == "#2563eb"


def test_svg_highlight_counts_a_group_edge_over_its_members():
    hl = {"current": "aborted", "visited": {"queued": 1, "decode": 1, "aborted": 1},
          "edges": {("decode", "abort", "aborted"): 1, ("paused", "abort", "aborted"): 2}}
    root = parse(to_svg(GENERATION, hl))
    (edge,) = [g for g in edge_groups(root) if g.get("data-dest") == "aborted"]
    assert edge.get("data-source") == "live"
    assert edge.find("s:path", NS).get("stroke") == "#2563eb"
    assert "abort ×3" in [t.text for t in root.iterfind(".//s:g[@class='labels']/s:text", NS)]
    assert "live --> aborted: abort ×3" in to_mermaid(GENERATION, hl)
    assert re.search(r'-> "aborted" \[label="abort ×3", color="#2563eb", penwidth=2, '
                     r'ltail="cluster_live"\]', to_dot(GENERATION, hl))


def test_svg_failed_edge_with_dest_is_red():
    root = parse(to_svg(SESSION, {"current": "closing",
                                  "failed_edge": ("closing", "defer_close", "open")}))
    edge = [g for g in root.iterfind(".//s:g[@data-source='closing']", NS)
            if g.get("data-dest") == "open"]
    assert edge and edge[0].find("s:path", NS).get("stroke") == RED


def test_mermaid_and_dot_highlight():
    mm = to_mermaid(GENERATION, PATH_HIGHLIGHT)
    mermaid_parts(mm)
    assert "classDef current" in mm and "    class paused current" in mm
    assert "    class prefill visited" in mm and "        prefill : visited ×3" in mm
    assert "        queued --> prefill: schedule ×1" in mm
    assert re.search(r"\n    paused --> rejected_finish: finish \(rejected\)", mm)
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
    out = tmp_path / "svg"
    assert main(["diagram", "all", "--format", "svg", "--layout", "python", "--out", str(out)]) == 0
    for kind in KINDS:
        written = (out / f"{kind}.svg").read_text(encoding="utf-8")
        assert written == to_svg(LIFECYCLES[kind])
    capsys.readouterr()
    assert main(["diagram", "all", "--format", "mermaid"]) == 0
    text = capsys.readouterr().out
    for kind in KINDS:
        assert f"%% {kind}\n" + to_mermaid(LIFECYCLES[kind]) in text
    assert main(["diagram", "session", "--format", "svg", "--layout", "python"]) == 0
    assert capsys.readouterr().out == to_svg(SESSION)


@needs_dot
def test_cli_svg_uses_graphviz_when_dot_is_installed(tmp_path, capsys):
    assert main(["diagram", "generation", "--format", "svg"]) == 0
    auto = capsys.readouterr()
    assert auto.out == to_svg(GENERATION, layout="graphviz") and "note" not in auto.err
    assert parse(auto.out).get("data-layout") == f"graphviz {dot_version()}"


def test_without_dot_svg_falls_back_to_the_builtin_layout(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))          # no dot on this PATH
    assert dot_version() is None
    with pytest.raises(GraphvizUnavailable):
        to_svg(GENERATION, layout="graphviz")
    assert to_svg(GENERATION, layout="auto") == to_svg(GENERATION)
    assert main(["diagram", "generation", "--format", "svg"]) == 0
    res = capsys.readouterr()
    assert res.out == to_svg(GENERATION) and "dot` not found" in res.err
    assert main(["diagram", "generation", "--format", "svg", "--layout", "graphviz"]) == 2
    assert "needs Graphviz" in capsys.readouterr().err


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


# -- in a real browser -------------------------------------------------------------------

@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_svg_renders_in_chromium_with_its_fills_in_place(tmp_path, layout):
    """Screenshot the highlighted diagram and read the pixels where the markup says things
    are: visited nodes light blue, the others near-white, the compound box's fill around
    them, the current state's dark-blue border and the refused event's red stub."""
    text = to_svg(GENERATION, PATH_HIGHLIGHT, layout=layout)
    root = parse(text)
    page = tmp_path / "generation.svg"
    page.write_text(text, encoding="utf-8")
    img = screenshot(tmp_path, page, int(float(root.get("width"))), int(float(root.get("height"))))
    nodes = {n: node_box(g) for n, g in node_groups(root).items()}
    for name, (x, y, w, h) in nodes.items():
        want = VISITED_FILL if name in PATH_HIGHLIGHT["visited"] else "#f8fafc"
        inset = 10 if GENERATION.states[name] in GENERATION.terminal else 5
        assert img.near(x + inset, y + h / 2, want), (name, img.pixel(x + inset, y + h / 2), want)
    x, y, w, h = nodes["paused"]
    assert img.near(x + w / 2, y + 0.5, "#1d4ed8", tol=40), img.pixel(x + w / 2, y + 0.5)
    gx, gy, gw, gh = group_box(root)
    assert img.near(gx + 6, gy + gh - 8, GROUP_FILL), img.pixel(gx + 6, gy + gh - 8)
    assert img.near(gx + gw + 12, gy + gh / 2, "#ffffff") or gx + gw + 12 >= img.width
    stub = root.find(".//s:g[@class='edge failed-edge']/s:path", NS).get("d")
    reds = [img.pixel(x, y) for x, y in path_points(stub)[2:-2]]
    assert sum(r > 180 and g < 90 and b < 90 for r, g, b in reds) >= 3, reds


def path_points(d: str, per_segment: int = 8) -> list[tuple[float, float]]:
    """Points along SVG path data made of M, L and C commands (what both layouts write)."""
    pts: list[tuple[float, float]] = []
    for cmd, args in re.findall(r"([MLC])([^MLC]*)", d):
        nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", args)]
        xy = list(zip(nums[::2], nums[1::2]))
        if cmd == "M":
            pts.append(xy[0])
            continue
        p0 = pts[-1]
        for k in range(1, per_segment + 1):
            t = k / per_segment
            if cmd == "L":
                pts.append((p0[0] + (xy[0][0] - p0[0]) * t, p0[1] + (xy[0][1] - p0[1]) * t))
            else:
                (x1, y1), (x2, y2), (x3, y3) = xy
                u = 1 - t
                pts.append((u ** 3 * p0[0] + 3 * u * u * t * x1 + 3 * u * t * t * x2 + t ** 3 * x3,
                            u ** 3 * p0[1] + 3 * u * u * t * y1 + 3 * u * t * t * y2 + t ** 3 * y3))
    return pts
