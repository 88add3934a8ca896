"""The replay page's timeline: a lane per actor and per request, coloured by state.

What is drawn, from a recording's events:

* *Lanes.* The long-lived actors first (``server``, ``health``, each scheduler), then one lane
  per request (generation, pooling) in arrival order. A lane is a bar per state visit, in the
  state's colour (`replay.palette`); a visit that is still open when the recording ends runs
  to the end of the axis, hatched. Each bar's tooltip names the request, the state, how long
  it lasted and when. A self-loop (a prefill chunk) does not split a bar.
* *Steps.* Every scheduler step (the ``step`` note, ended by the ``step_end`` input) is a dark
  mark on its scheduler's lane, with its batch in the tooltip.
* *Axis.* Time runs over the span of activity only: from the first lifecycle event to the
  last. Inside it, an idle gap (no request live, no step running) longer than 3% of the span
  (and 20 ms) is collapsed into a fixed-width break, marked and labelled with its length, so
  a 37-minute idle tail no longer squeezes the activity into a few pixels. What remains is
  one linear scale; ticks fall on round multiples (1, 2, 5 x 10^k ns; 15 s, 30 s, 1 min ... past 10 s) about every 70 px.
* *Groups.* Lanes and steps may name a ``group`` (a fleet's replica, `replay.fleet_render`):
  each group's lanes are drawn under a header row of their own, inside ``<g class='replica'
  data-replica=NAME>``, and a scheduler lane shows only its own group's steps.

`Axis` is the piecewise-linear mapping; its JSON form lets the page's script
(`replay.timeline_js`) re-lay the bars and ticks when zooming, with the same arithmetic.
"""

from __future__ import annotations

import bisect
import html
import math
from dataclasses import dataclass, field
from typing import Iterable

from ..statemachines import LIFECYCLES
from .palette import color_of
from .recorder import Event

REQUEST_KINDS = ("generation", "pooling")
ACTOR_KINDS = ("server", "health", "scheduler")
PLOT_W, BREAK_W, TICK_PX = 1000, 28, 70
LANE_H, AXIS_H, LABEL_MAX = 20, 26, 320
GAP_FLOOR_NS, GAP_SHARE = 20_000_000, 0.03
CHAR_W = 6.6                      # 11 px monospace


def fmt_ns(ns: float) -> str:
    """A duration, short: ``850 ns``, ``12.5 µs``, ``3 ms``, ``1.25 s``, ``37.2 min``."""
    for unit, size in (("h", 3600e9), ("min", 60e9), ("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(ns) >= size:
            v = ns / size
            text = f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
            if "." in text:
                text = text.rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{ns:.0f} ns"


CLOCK_STEPS_S = (15, 30, 60, 120, 300, 600, 900, 1800, 3600)


def nice_step(raw: float) -> int:
    """The smallest round step (ns) of at least `raw`: 1, 2 or 5 x 10^k up to 10 s, then
    clock steps (15 s, 30 s, 1 min ... 1 h), then 1, 2 or 5 x 10^k hours."""
    def decimal(r: float) -> float:
        mag = 10 ** math.floor(math.log10(max(r, 1)))
        return next(m * mag for m in (1, 2, 5, 10) if m * mag >= r)
    if raw <= 10e9:
        return int(decimal(raw))
    for s in CLOCK_STEPS_S:
        if s * 1e9 >= raw:
            return int(s * 1e9)
    return int(decimal(raw / 3600e9) * 3600e9)


@dataclass(frozen=True, slots=True)
class Segment:
    start: int                 # ns
    end: int | None            # None: still in this state when the recording ends
    state: str


@dataclass
class Lane:
    kind: str
    rid: str | None
    label: str
    segments: list[Segment] = field(default_factory=list)
    group: str | None = None       # the replica, in a fleet's timeline


@dataclass(frozen=True, slots=True)
class Step:
    sched: str
    step: int
    start: int
    end: int | None
    batch: tuple
    group: str | None = None       # the replica, in a fleet's timeline


def lanes_of(events: list[Event]) -> list[Lane]:
    """Actor lanes (server, health, schedulers), then request lanes in arrival order."""
    lanes: dict[tuple[str, str | None], Lane] = {}
    for e in events:
        if e.kind not in LIFECYCLES or not e.ok or e.dst is None:
            continue
        if e.kind not in REQUEST_KINDS and e.kind not in ACTOR_KINDS:
            continue
        key = (e.kind, e.rid)
        lane = lanes.get(key)
        if lane is None:
            label = e.rid if e.kind in REQUEST_KINDS else (
                e.rid if e.kind == "scheduler" and e.rid else e.kind)
            lane = lanes[key] = Lane(e.kind, e.rid, str(label))
        segs = lane.segments
        if segs and segs[-1].end is None:
            if segs[-1].state == e.dst:
                continue                  # a self-loop stays in the same bar
            segs[-1] = Segment(segs[-1].start, e.t_ns, segs[-1].state)
        segs.append(Segment(e.t_ns, None, e.dst))
    for e in events:                      # a scheduler that left only steps gets a lane too
        if e.kind == "step" and (e.data or {}).get("sched"):
            key = ("scheduler", e.data["sched"])
            lanes.setdefault(key, Lane("scheduler", e.data["sched"], e.data["sched"]))
    order = {k: i for i, k in enumerate(ACTOR_KINDS)}
    actors = sorted((ln for ln in lanes.values() if ln.kind in ACTOR_KINDS),
                    key=lambda ln: (order[ln.kind], ln.label))
    return actors + [ln for ln in lanes.values() if ln.kind in REQUEST_KINDS]


def steps_of(events: list[Event]) -> list[Step]:
    """The scheduler steps, each from its ``step`` note to its ``step_end`` input."""
    open_: dict[tuple[str, int], tuple[int, tuple]] = {}
    done: list[Step] = []
    for e in events:
        d = e.data or {}
        if e.kind == "step" and e.event == "step":
            open_[(d.get("sched", ""), d.get("step", 0))] = (e.t_ns, tuple(
                tuple(m) for m in d.get("batch", ())))
        elif e.kind == "input" and e.event == "step_end":
            key = (d.get("sched", ""), d.get("step", 0))
            if key in open_:
                start, batch = open_.pop(key)
                done.append(Step(key[0], key[1], start, e.t_ns, batch))
    done += [Step(k[0], k[1], s, None, b) for k, (s, b) in open_.items()]
    return sorted(done, key=lambda s: (s.start, s.sched, s.step))


class Axis:
    """Time -> x: the busy pieces at one linear scale, the idle gaps between them as breaks."""

    def __init__(self, first: int, last: int, busy: Iterable[tuple[int, int]],
                 width: float = PLOT_W, left: float = 8.0):
        self.t0, self.left, self.width = first, left, width
        span = max(last - first, 1)
        threshold = max(GAP_FLOOR_NS, GAP_SHARE * span)
        pieces: list[list[int]] = []
        for a, b in sorted([(first, first), (last, last), *busy]):
            if pieces and a - pieces[-1][1] <= threshold:
                pieces[-1][1] = max(pieces[-1][1], b)
            else:
                pieces.append([a, b])
        self.pieces = [(a - first, b - first) for a, b in pieces]   # relative to t0
        self._lows = [a for a, _ in self.pieces]
        n = len(self.pieces)
        self.brk = min(BREAK_W, width / 2 / (n - 1)) if n > 1 else 0.0
        self.set_width(width)

    def set_width(self, width: float) -> None:
        self.width = width
        total = max(sum(b - a for a, b in self.pieces), 1)
        self.scale = (width - self.brk * (len(self.pieces) - 1)) / total     # px per ns
        self.starts, x = [], self.left
        for a, b in self.pieces:
            self.starts.append(x)
            x += (b - a) * self.scale + self.brk

    def x(self, t: int) -> float:
        """x of absolute time `t` (ns); inside a break, linear across the break."""
        rel = t - self.t0
        i = max(0, bisect.bisect_right(self._lows, rel) - 1)
        a, b = self.pieces[i]
        if rel <= b or i + 1 == len(self.pieces):
            return self.starts[i] + max(0, min(rel, b) - a) * self.scale
        nxt = self.pieces[i + 1][0]
        return self.starts[i] + (b - a) * self.scale + self.brk * (rel - b) / (nxt - b)

    def breaks(self) -> list[tuple[float, int]]:
        """(x where the break starts, idle ns) per collapsed gap."""
        return [(self.starts[i] + (b - a) * self.scale, self.pieces[i + 1][0] - b)
                for i, (a, b) in enumerate(self.pieces[:-1])]

    def tick_step(self) -> int:
        return nice_step(TICK_PX / self.scale if self.scale > 0 else 1)

    def ticks(self) -> list[tuple[float, str]]:
        """(x, label) per tick: round multiples of one step, in every busy piece; a tick too
        close to the one before it or to a break is left out (its label would collide)."""
        step, out = self.tick_step(), []
        gaps = [(x, x + self.brk) for x, _ in self.breaks()]
        for a, b in self.pieces:
            for k in range(-(-a // step), b // step + 1):
                x = self.x(self.t0 + k * step)
                if out and x - out[-1][0] < 40 or any(g0 - 18 < x < g1 + 18 for g0, g1 in gaps):
                    continue
                out.append((x, fmt_ns(k * step) if k else "0"))
        return out

    def to_json(self) -> dict:
        return {"pieces": self.pieces, "width": self.width, "left": self.left,
                "brk": self.brk, "tick_px": TICK_PX, "axis_h": AXIS_H,
                "clock_steps": list(CLOCK_STEPS_S)}


def busy_spans(lanes: list[Lane], steps: list[Step], last: int) -> list[tuple[int, int]]:
    """When something happened: each request from arrival to its end, and each step."""
    out = [(ln.segments[0].start, ln.segments[-1].start if _ended(ln) else last)
           for ln in lanes if ln.kind in REQUEST_KINDS and ln.segments]
    return out + [(s.start, s.end if s.end is not None else last) for s in steps]


def _ended(lane: Lane) -> bool:
    lc = LIFECYCLES[lane.kind]
    return bool(lane.segments) and lc.states[lane.segments[-1].state] in lc.terminal


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def label_width(lanes: list[Lane]) -> float:
    longest = max((max(len(ln.label), len(ln.group or "") + 8) for ln in lanes), default=8)
    return min(LABEL_MAX, longest * CHAR_W + 16)


def fit_label(text: str, width: float) -> str:
    """The text, cut in the middle with an ellipsis only when it is wider than `width`."""
    n = int((width - 16) // CHAR_W)
    return text if len(text) <= n else text[:(n - 1) // 2] + "…" + text[len(text) - n // 2:]


def timeline_svgs(lanes: list[Lane], steps: list[Step], axis: Axis, last: int) -> tuple[str, str]:
    """(the label column's SVG, the plot's SVG): lanes on the same rows."""
    lw = label_width(lanes)
    n = len(lanes) + sum(1 for i, ln in enumerate(lanes)      # a header row per group
                         if ln.group is not None and (i == 0 or lanes[i - 1].group != ln.group))
    height = AXIS_H + LANE_H * n + 8
    labels = [f"<svg xmlns='http://www.w3.org/2000/svg' class='tl-labels' width='{lw:.0f}' "
              f"height='{height}' font-family='monospace' font-size='11'>"]
    pw = axis.left + axis.width + 30
    plot = [f"<svg xmlns='http://www.w3.org/2000/svg' class='timeline' width='{pw:.0f}' "
            f"height='{height}' font-family='monospace' font-size='10'>",
            "<defs><pattern id='tl-open' width='6' height='6' patternUnits='userSpaceOnUse' "
            "patternTransform='rotate(45)'><rect width='3' height='6' fill='#ffffff' "
            "fill-opacity='0.55'/></pattern></defs>", "<g class='ticks'>"]
    for x, text in axis.ticks():
        plot.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{AXIS_H - 6}' y2='{height}' "
                    f"stroke='#e2e8f0'/><text x='{x:.1f}' y='{AXIS_H - 10}' "
                    f"text-anchor='middle' fill='#475569'>{_esc(text)}</text>")
    plot.append("</g><g class='breaks'>")
    for i, (x, idle) in enumerate(axis.breaks()):
        plot.append(f"<g class='break' data-gap='{i}' transform='translate({x:.1f},0)'>"
                    f"<title>{_esc(fmt_ns(idle))} idle, collapsed</title>"
                    f"<rect x='0' y='{AXIS_H - 6}' width='{axis.brk:.1f}' height='{height}' "
                    f"fill='#f8fafc'/><path d='M{axis.brk / 2 - 3:.1f},{AXIS_H - 6} "
                    f"l6,6 l-6,6 l6,6' fill='none' stroke='#94a3b8'/>"
                    f"<text x='{axis.brk / 2:.1f}' y='{AXIS_H - 10}' text-anchor='middle' "
                    f"fill='#94a3b8'>{_esc(fmt_ns(idle))}</text></g>")
    plot.append("</g>")
    by_sched: dict[tuple[str | None, str], list[Step]] = {}
    for s in steps:
        by_sched.setdefault((s.group, s.sched), []).append(s)
    t0 = axis.t0
    row, group = 0, None
    for ln in lanes:
        if ln.group != group:
            if group is not None:
                labels.append("</g>")
                plot.append("</g>")
            group = ln.group
            if group is not None:
                y, g = AXIS_H + row * LANE_H, _esc(group)
                labels.append(f"<g class='replica' data-replica='{g}'><text class='group-label' "
                              f"x='4' y='{y + 14}' font-weight='bold'>replica {g}"
                              f"<title>replica {g}</title></text>")
                plot.append(f"<g class='replica' data-replica='{g}'><rect class='group-band' x='0' "
                            f"y='{y + 2}' width='100%' height='{LANE_H - 4}' fill='#e2e8f0' "
                            f"fill-opacity='0.6'><title>replica {g}</title></rect>")
                row += 1
        y = AXIS_H + row * LANE_H
        row += 1
        who = ln.rid if ln.kind in REQUEST_KINDS else ln.label
        kind = "request" if ln.kind in REQUEST_KINDS else "actor"
        rid_attr = f" data-rid='{_esc(ln.rid)}'" if ln.kind in REQUEST_KINDS else ""
        shown = fit_label(ln.label, lw)
        labels.append(f"<text class='lane-label' x='4' y='{y + 14}'{rid_attr}>"
                      f"<title>{_esc(who)} ({ln.kind})</title>{_esc(shown)}</text>")
        plot.append(f"<g class='lane {kind}' data-kind='{ln.kind}'{rid_attr}>")
        for seg in ln.segments:
            end = seg.end if seg.end is not None else last
            x0, x1 = axis.x(seg.start), axis.x(end)
            terminal = LIFECYCLES[ln.kind].states[seg.state] in LIFECYCLES[ln.kind].terminal
            w = 5.0 if terminal else max(x1 - x0, 2.0)
            dur = "still there at the end of the recording" if seg.end is None else \
                fmt_ns(seg.end - seg.start)
            tip = f"{who} · {ln.kind}.{seg.state} · " + (
                "final state" if terminal else dur) + \
                f" (+{fmt_ns(seg.start - t0)} → +{fmt_ns(end - t0)})"
            fill = color_of(seg.state)
            plot.append(f"<rect class='seg' data-state='{seg.state}' data-a='{seg.start - t0}' "
                        f"data-b='{end - t0}' data-w='{'5' if terminal else ''}' "
                        f"x='{x0:.1f}' y='{y + 3}' width='{w:.1f}' height='{LANE_H - 6}' "
                        f"fill='{fill}'><title>{_esc(tip)}</title></rect>")
            if seg.end is None and not terminal:
                plot.append(f"<rect class='open' data-a='{seg.start - t0}' data-b='{end - t0}' "
                            f"x='{x0:.1f}' y='{y + 3}' width='{w:.1f}' height='{LANE_H - 6}' "
                            f"fill='url(#tl-open)'/>")
        for s in by_sched.get((ln.group, ln.rid or ""), []) if ln.kind == "scheduler" else []:
            end = s.end if s.end is not None else last
            x0 = axis.x(s.start)
            w = max(axis.x(end) - x0, 1.5)
            members = ", ".join(f"{m[0]}:{m[1]}" for m in s.batch[:12]) + (
                " …" if len(s.batch) > 12 else "")
            dur = fmt_ns(s.end - s.start) if s.end is not None else "not ended"
            plot.append(f"<rect class='step' data-a='{s.start - t0}' data-b='{end - t0}' "
                        f"x='{x0:.1f}' y='{y + LANE_H - 7}' width='{w:.1f}' height='5' "
                        f"fill='#0f172a' fill-opacity='{0.9 if s.step % 2 else 0.55}'>"
                        f"<title>{_esc(s.sched)} step {s.step} · batch of {len(s.batch)} · "
                        f"{dur}: {_esc(members)}</title></rect>")
        plot.append("</g>")
    if group is not None:
        labels.append("</g>")
        plot.append("</g>")
    labels.append("</svg>")
    plot.append("</svg>")
    return "".join(labels), "".join(plot)
