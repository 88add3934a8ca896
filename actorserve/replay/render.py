"""Pictures of a recorded run: a sequence diagram, a timeline page, a state overlay per request.

* `to_mermaid_sequence(events)` — a Mermaid ``sequenceDiagram``: the scheduler and each request
  are lanes; every step is a note on the scheduler lane listing its batch, every transition an
  arrow from the lane that caused it (the scheduler or the control plane) to the request's lane,
  refused ones drawn as a crossed arrow.
* `to_html(events)` — one self-contained page (no network, no library): the timeline of
  `replay.timeline` (actor and request lanes coloured by state, the scheduler's steps, a time
  axis over the span of activity with long idle gaps collapsed, zoom), a fixed legend of
  every state's colour, and a picker that shows any request's lifecycle diagram with its
  visited states, counts and refused edge (`statemachines.diagram.to_svg`).
* `highlights(events)` / `highlight_for(events, rid)` — the overlay data, for every request in
  one pass or for one.
* `emit(text, out)` — a rendered picture to the file ``out`` (saying so), else to stdout.
"""

from __future__ import annotations

import html
import json
import sys
from collections import Counter
from typing import Any, Iterable

from ..statemachines import LIFECYCLES
from ..statemachines.diagram import to_svg
from .palette import STATE_COLORS, legend
from .recorder import Event
from .timeline import (
    ACTOR_KINDS, REQUEST_KINDS, Axis, Lane, Step, busy_spans, fmt_ns, lanes_of, steps_of,
    timeline_svgs,
)
from .timeline_js import SCRIPT
from .versions import ABSENT, describe, token_versions

__all__ = ["STATE_COLORS", "highlight_for", "highlights", "to_html", "to_mermaid_sequence"]


def _lanes(events: list[Event], rid: str | None = None, limit: int = 40) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for e in events:
        if e.kind in REQUEST_KINDS and e.rid is not None and e.rid not in seen:
            if rid is None or e.rid == rid:
                seen[e.rid] = e.kind
    return list(seen.items())[:limit]


def to_mermaid_sequence(events: Iterable[Event], *, rid: str | None = None, limit: int = 20) -> str:
    evs = list(events)
    lanes = dict(_lanes(evs, rid, limit))
    alias = {r: f"R{i}" for i, r in enumerate(lanes, 1)}
    out = ["sequenceDiagram", "    participant S as scheduler", "    participant C as control"]
    for r, a in alias.items():
        out.append(f"    participant {a} as {r} ({lanes[r]})")
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


def highlights(events: Iterable[Event]) -> dict[str, tuple[str, dict[str, Any]]]:
    """rid -> (lifecycle name, highlight) for every request: visited states, edge counts,
    current state and the first refused event, in one pass over the events."""
    acc: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.rid is None or e.kind not in LIFECYCLES:
            continue
        a = acc.get(e.rid)
        if a is None:
            a = acc[e.rid] = {"kind": e.kind, "visited": Counter(), "edges": Counter(),
                              "current": None, "failed": None}
        a["kind"] = e.kind
        if e.event == "create":
            a["visited"][e.dst] += 1
            a["current"] = e.dst
        elif e.ok:
            a["edges"][(e.src, e.event, e.dst)] += 1
            a["visited"][e.dst] += 1
            a["current"] = e.dst
        elif a["failed"] is None:
            a["failed"] = (e.src, e.event, None)
    out = {}
    for rid, a in acc.items():
        hl: dict[str, Any] = {"current": a["current"], "visited": dict(a["visited"]),
                              "edges": dict(a["edges"])}
        if a["failed"] is not None:
            hl["failed_edge"] = a["failed"]
        out[rid] = (a["kind"], hl)
    return out


def highlight_for(events: Iterable[Event], rid: str) -> tuple[str, dict[str, Any]] | None:
    """(lifecycle name, highlight) for one request: visited states, edge counts, refused edge."""
    return highlights(e for e in events if e.rid == rid).get(rid)


def _json_script(id_: str, data: Any) -> str:
    text = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    return f"<script type='application/json' id='{id_}'>{text}</script>"


def _overlays(evs: list[Event], rids: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """One <template> per distinct picture (requests that took the same path share one), and
    rid -> [template id, lifecycle]."""
    found = highlights(e for e in evs if e.rid is not None)
    by_path: dict[tuple, str] = {}
    templates, index = [], {}
    for rid in rids:
        if rid not in found:
            continue
        kind, hl = found[rid]
        key = (kind, hl["current"], tuple(sorted(hl["visited"].items())),
               tuple(sorted(hl["edges"].items())), hl.get("failed_edge"))
        tid = by_path.get(key)
        if tid is None:
            tid = by_path[key] = f"ov-{len(by_path)}"
            templates.append(f"<template id='{tid}'>{to_svg(LIFECYCLES[kind], hl)}</template>")
        index[rid] = [tid, kind]
    return templates, index


def _weights_section(evs: list[Event], rid: str | None, limit: int = 50) -> str:
    """Which weights made which tokens (`versions.token_versions`): every label change, and
    each request whose tokens came from more than one version (or the one asked for)."""
    info = token_versions(evs)
    if not info.known:
        return f"<h2>Weights</h2><p class='note'>{html.escape(ABSENT)}.</p>"
    per = info.tokens_per_version()
    rows = [f"<p class='summary'>tokens per version: "
            f"{html.escape(', '.join(f'{v}: {n}' for v, n in per.items()) or 'none')}</p>"]
    for seq, sched, v, cause in info.changes:
        rows.append(f"<p class='summary'>seq {seq}: {html.escape(sched)} steps run with "
                    f"<b>{html.escape(v)}</b> from here ({html.escape(cause)})</p>")
    shown = [rid] if rid is not None else info.spanning()
    for r in shown[:limit]:
        spans = info.spans.get(r)
        rows.append(f"<p class='summary'>{html.escape(r)}: "
                    f"{html.escape(describe(spans) if spans else 'no tokens generated')}</p>")
    if len(shown) > limit:
        rows.append(f"<p class='note'>... and {len(shown) - limit} more requests span versions.</p>")
    return "<h2>Weights</h2>" + "".join(rows)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 16px; color: #0f172a; }
h1 { font-size: 20px; margin: 0 0 6px; } h2 { font-size: 16px; margin: 18px 0 6px; }
.summary { font-size: 13px; color: #334155; margin: 2px 0; }
.note { font-size: 13px; color: #9a3412; }
.controls { font-size: 12px; margin: 4px 0; } .controls button { font: 12px monospace; }
.hint { color: #64748b; }
.tl { display: flex; align-items: flex-start; border: 1px solid #e2e8f0; }
.tl-labels { flex: none; background: #f8fafc; border-right: 1px solid #e2e8f0; cursor: pointer; }
.tl-scroll { overflow-x: auto; flex: 1 1 auto; }
.timeline .lane.request { cursor: pointer; }
.timeline .lane.selected .seg { stroke: #0f172a; stroke-width: 1; }
.legend { margin: 8px 0; font: 11px monospace; }
.legend div { margin: 2px 0; } .legend b { display: inline-block; width: 84px; }
.key { display: inline-block; padding: 1px 6px; margin: 1px; border-radius: 3px; }
#ov-caption { font: 12px monospace; margin: 6px 0; }
"""


def to_html(events: Iterable[Event], *, rid: str | None = None, title: str = "actorserve run",
            limit: int = 500, status: str | None = None, lanes: list[Lane] | None = None,
            steps: list[Step] | None = None) -> str:
    """The self-contained replay page (see the module docstring). `limit` caps the request
    lanes (the page says so when it cuts); `status` is one line shown under the summary
    (the replay's verdict on an open recording, for one). `lanes` and `steps`, when given,
    are drawn instead of those of `events` (a fleet's, grouped by replica: `fleet_render`)."""
    evs = list(events)
    if lanes is None:
        lanes = lanes_of(evs)
    lanes = [ln for ln in lanes if rid is None or ln.kind in ACTOR_KINDS or ln.rid == rid]
    requests = [ln for ln in lanes if ln.kind in REQUEST_KINDS]
    cut = len(requests) - limit if len(requests) > limit else 0
    if cut:
        keep = {id(ln) for ln in requests[:limit]}
        lanes = [ln for ln in lanes if ln.kind in ACTOR_KINDS or id(ln) in keep]
        requests = requests[:limit]
    steps = steps_of(evs) if steps is None else steps
    stamps = [e.t_ns for e in evs if e.kind in LIFECYCLES or e.kind == "step"
              or (e.kind == "input" and e.event == "step_end")]
    counts = Counter(e.kind for e in evs)
    summary = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))
    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p class='summary'>{len(evs)} events ({html.escape(summary)}); "
             f"{len(requests)} request lane(s), {len(steps)} step(s).</p>"]
    if status:
        parts.append(f"<p class='note'>{html.escape(status)}</p>")
    if cut:
        parts.append(f"<p class='note'>Showing the first {limit} requests; {cut} more are "
                     f"in the recording (pass --rid to draw one of them).</p>")
    if not stamps:
        parts.append("<p class='summary'>Nothing to draw: no lifecycle event recorded.</p>")
        axis_json, labels_svg, plot_svg, ov_templates, ov_index = {}, "", "", [], {}
    else:
        first, last = min(stamps), max(stamps)
        axis = Axis(first, last, busy_spans(lanes, steps, last))
        labels_svg, plot_svg = timeline_svgs(lanes, steps, axis, last)
        axis_json = axis.to_json()
        idle = sum(b - a for (_, a), (b, _) in zip(axis.pieces, axis.pieces[1:]))
        span = f"{fmt_ns(last - first)} from the first lifecycle event to the last"
        if idle:
            span += f"; {len(axis.pieces) - 1} idle gap(s), {fmt_ns(idle)} in all, collapsed"
        parts.append(f"<p class='summary'>{html.escape(span)}.</p>")
        ov_templates, ov_index = _overlays(evs, [ln.rid for ln in requests if ln.rid])
    parts.append(_weights_section(evs, rid))
    keys = "".join(
        f"<div><b>{k}</b>" + "".join(f"<span class='key' style='background:{c}'>{s}</span>"
                                     for s, c in states) + "</div>"
        for k, states in legend([*ACTOR_KINDS, *REQUEST_KINDS]))
    options = "".join(f"<option value='{html.escape(r)}'>{html.escape(r)} ({k})</option>"
                      for r, (_, k) in ov_index.items())
    first_ov = ""
    caption = ""
    if ov_index:
        r0, (t0, k0) = next(iter(ov_index.items()))
        first_ov = next(t for t in ov_templates if t.startswith(f"<template id='{t0}'>"))
        first_ov = first_ov[len(f"<template id='{t0}'>"):-len("</template>")]
        caption = f"{html.escape(r0)} ({k0})"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style></head><body>
{''.join(parts)}
<h2>Timeline</h2>
<div class='controls'><button type='button' data-zoom='out' title='zoom out'>−</button>
<button type='button' data-zoom='in' title='zoom in'>+</button>
<button type='button' data-zoom='fit' title='fit the page'>fit</button>
<span id='tl-zoom'>×1</span> <span class='hint'>ctrl + wheel zooms at the pointer; hover a
bar for its state and duration; click a request to see its diagram</span></div>
<div class='tl'>{labels_svg}<div class='tl-scroll'>{plot_svg}</div></div>
<div class='legend'>{keys}</div>
<h2>Lifecycles</h2>
<label class='controls'>request <select id='ov-select'>{options}</select></label>
<p id='ov-caption'>{caption}</p>
<div id='overlay'>{first_ov}</div>
{''.join(ov_templates)}
{_json_script('tl-axis', axis_json)}
{_json_script('ov-map', ov_index)}
<script>{SCRIPT if axis_json else ''}</script>
</body></html>
"""


def emit(text: str, out: str | None) -> int:
    """Write a rendered picture to ``out`` (and say where), else to stdout; exit status 0."""
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {out}")
    else:
        sys.stdout.write(text)
    return 0
