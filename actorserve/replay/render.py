"""Pictures of a recorded run: a sequence/timeline per run and a state overlay per request.

* `to_mermaid_sequence(events)` — a Mermaid ``sequenceDiagram``: the scheduler and each request
  are lanes; every step is a note on the scheduler lane listing its batch, every transition an
  arrow from the lane that caused it (the scheduler or the control plane) to the request's lane,
  refused ones drawn as a crossed arrow.
* `to_html(events)` — one self-contained page (no network): a time axis, one lane per request
  with a coloured bar per state it was in, the scheduler's steps as ticks on their own lane,
  and for each request (or the one asked for) its lifecycle diagram with the visited states,
  counts and the refused edge in red, drawn by `statemachines.diagram.to_svg`.
* `highlight_for(events, rid)` — the overlay data for one request.
"""

from __future__ import annotations

import html
from collections import Counter, defaultdict
from typing import Any, Iterable

from ..statemachines import LIFECYCLES
from ..statemachines.diagram import to_svg
from .recorder import Event

REQUEST_KINDS = ("generation", "pooling")
STATE_COLORS = {
    "queued": "#cbd5e1", "prefill": "#fbbf24", "decode": "#34d399", "detok": "#60a5fa",
    "paused": "#a78bfa", "retracted": "#f472b6", "forward": "#fbbf24", "pool": "#60a5fa",
    "done": "#16a34a", "aborted": "#f97316", "failed": "#dc2626",
}


def _lanes(events: list[Event], rid: str | None = None, limit: int = 40) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for e in events:
        if e.kind in REQUEST_KINDS and e.rid is not None and e.rid not in seen:
            if rid is None or e.rid == rid:
                seen[e.rid] = e.kind
    return list(seen.items())[:limit]


def _short(rid: str) -> str:
    return rid if len(rid) <= 12 else rid[:8] + "…"


def to_mermaid_sequence(events: Iterable[Event], *, rid: str | None = None, limit: int = 20) -> str:
    evs = list(events)
    lanes = dict(_lanes(evs, rid, limit))
    alias = {r: f"R{i}" for i, r in enumerate(lanes, 1)}
    out = ["sequenceDiagram", "    participant S as scheduler", "    participant C as control"]
    for r, a in alias.items():
        out.append(f"    participant {a} as {_short(r)} ({lanes[r]})")
    causes = {e.seq: e for e in evs if e.kind == "message"}
    for e in evs:
        if e.kind == "step":
            members = [m for m in (e.data or {}).get("batch", []) if m[0] in alias]
            if members:
                label = ", ".join(f"{alias[m[0]]}:{m[1]}" for m in members)
                out.append(f"    Note over S: step {(e.data or {}).get('step')} [{label}]")
        elif e.kind in REQUEST_KINDS and e.rid in alias:
            a = alias[e.rid]
            if e.event == "create":
                out.append(f"    Note over {a}: create → {e.dst}")
                continue
            cause = causes.get(e.cause or -1)
            src = "C" if cause is not None and cause.dst == "control" else "S"
            if e.ok:
                out.append(f"    {src}->>{a}: {e.event} ({e.src}→{e.dst})")
            else:
                out.append(f"    {src}-x{a}: {e.event} REFUSED in {e.src}")
    return "\n".join(out) + "\n"


def highlight_for(events: Iterable[Event], rid: str) -> tuple[str, dict[str, Any]] | None:
    """(lifecycle name, highlight) for one request: visited states, edge counts, refused edge."""
    kind = None
    visited: Counter = Counter()
    edges: Counter = Counter()
    current = None
    failed = None
    for e in events:
        if e.rid != rid or e.kind not in LIFECYCLES:
            continue
        kind = e.kind
        if e.event == "create":
            visited[e.dst] += 1
            current = e.dst
        elif e.ok:
            edges[(e.src, e.event, e.dst)] += 1
            visited[e.dst] += 1
            current = e.dst
        elif failed is None:
            failed = (e.src, e.event, None)
    if kind is None:
        return None
    hl: dict[str, Any] = {"current": current, "visited": dict(visited), "edges": dict(edges)}
    if failed is not None:
        hl["failed_edge"] = failed
    return kind, hl


def _segments(events: list[Event]) -> dict[str, list[tuple[int, int | None, str]]]:
    """rid -> [(start ns, end ns or None, state)]."""
    segs: dict[str, list[tuple[int, int | None, str]]] = defaultdict(list)
    for e in events:
        if e.kind not in REQUEST_KINDS or not e.ok or e.dst is None or e.rid is None:
            continue
        lst = segs[e.rid]
        if lst and lst[-1][1] is None:
            s, _, st = lst[-1]
            lst[-1] = (s, e.t_ns, st)
        lst.append((e.t_ns, None, e.dst))
    return segs


def _timeline_svg(events: list[Event], lanes: list[tuple[str, str]]) -> str:
    if not events:
        return "<svg xmlns='http://www.w3.org/2000/svg' width='10' height='10'/>"
    t0 = events[0].t_ns
    t1 = max(events[-1].t_ns, t0 + 1)
    label_w, width, lane_h = 150, 900, 22
    top = 30 + lane_h  # scheduler lane first
    height = top + lane_h * len(lanes) + 30

    def x(t: int) -> float:
        return label_w + (t - t0) / (t1 - t0) * width

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='timeline' width='{label_w + width + 20}' "
             f"height='{height}' font-family='monospace' font-size='11'>",
             f"<text x='4' y='{30 + 15}' font-weight='bold'>scheduler</text>"]
    steps = [e for e in events if e.kind == "step"]
    for e in steps:
        parts.append(f"<line class='step' x1='{x(e.t_ns):.1f}' x2='{x(e.t_ns):.1f}' y1='32' "
                     f"y2='{30 + lane_h - 2}' stroke='#475569'/>")
    segs = _segments(events)
    for i, (rid, kind) in enumerate(lanes):
        y = top + i * lane_h
        parts.append(f"<g class='lane' data-rid='{html.escape(rid)}'>"
                     f"<text x='4' y='{y + 15}'>{html.escape(_short(rid))}</text>")
        for start, end, state in segs.get(rid, []):
            x0 = x(start)
            x1 = x(end) if end is not None else x0 + 4
            w = max(x1 - x0, 2.0)
            color = STATE_COLORS.get(state, "#94a3b8")
            parts.append(f"<rect class='seg' x='{x0:.1f}' y='{y + 3}' width='{w:.1f}' height='{lane_h - 6}' "
                         f"fill='{color}'><title>{html.escape(rid)}: {state}</title></rect>")
        parts.append("</g>")
    ms = (t1 - t0) / 1e6
    parts.append(f"<text x='{label_w}' y='{height - 8}'>0 ms</text>"
                 f"<text x='{label_w + width - 80}' y='{height - 8}'>{ms:.1f} ms</text></svg>")
    return "".join(parts)


def to_html(events: Iterable[Event], *, rid: str | None = None, title: str = "actorserve run",
            limit: int = 40) -> str:
    evs = list(events)
    lanes = _lanes(evs, rid, limit)
    legend = "".join(f"<span class='key' style='background:{c}'>{s}</span>"
                     for s, c in STATE_COLORS.items())
    overlays = []
    for r, _ in (lanes if rid is not None else lanes[:6]):
        found = highlight_for(evs, r)
        if found is None:
            continue
        kind, hl = found
        overlays.append(f"<figure><figcaption>{html.escape(r)} ({kind})</figcaption>"
                        f"{to_svg(LIFECYCLES[kind], hl)}</figure>")
    counts = Counter(e.kind for e in evs)
    summary = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 16px; color: #0f172a; }}
.key {{ display: inline-block; padding: 2px 6px; margin: 2px; font: 11px monospace; border-radius: 3px; }}
figure {{ margin: 12px 0; }} figcaption {{ font: 12px monospace; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{len(evs)} events ({html.escape(summary)}); {len(lanes)} request lane(s).</p>
<div>{legend}</div>
<h2>Timeline</h2>
{_timeline_svg(evs, lanes)}
<h2>Lifecycles</h2>
{''.join(overlays)}
</body></html>
"""
