"""Which weights made which tokens, read back from a recording.

The recording says it in three places: the runtime's set-up (``input``/``runtime``) carries the
label the scheduler started with (``weight_version``); the scheduler notes each change of its
label (a ``sched``/``weight_version`` note: an update's copy, a rename), always between two
steps; every ``step`` note comes after the last change before it, so a step's tokens (its
``step_end`` input) are the label's then. `token_versions` walks the events once and rebuilds,
per request, its tokens as spans per version, ``[(version, start, end), ...]`` (end exclusive)
over the tokens the model answered it (what the response's ``weight_versions`` says, save for
tokens a stop string cut off in the same step).

A recording made before versions were recorded has no label in its set-up: `VersionInfo.known`
is False and the lines below say so instead of guessing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from .recorder import Event

ABSENT = ("no weight-version information in this recording (made before the scheduler recorded "
          "its weights' label): which tokens came from which weights is unknown")


@dataclass(slots=True)
class VersionInfo:
    known: bool = False
    spans: dict[str, list[list[Any]]] = field(default_factory=dict)    # rid -> [[version, start, end]]
    # every change of a scheduler's label: (seq, sched, version, cause)
    changes: list[tuple[int, str, str, str]] = field(default_factory=list)
    # the control plane's version notes (update / rename answered): (seq, version)
    announced: list[tuple[int, str]] = field(default_factory=list)
    step_versions: dict[str, list[str]] = field(default_factory=dict)  # sched -> each step's label

    def tokens_per_version(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for spans in self.spans.values():
            for v, a, b in spans:
                out[v] += b - a
        return out

    def spanning(self) -> list[str]:
        """The requests whose tokens came from more than one version."""
        return [rid for rid, spans in self.spans.items() if len({s[0] for s in spans}) > 1]


def _count(tok: Any) -> int:
    if isinstance(tok, bool):
        return 0
    if isinstance(tok, int):
        return 1
    if isinstance(tok, list):            # a speculative step's tokens
        return len(tok)
    return 0                             # a prefill chunk (None), a pooled answer


def token_versions(events: Iterable[Event]) -> VersionInfo:
    info = VersionInfo()
    label: dict[str, str] = {}
    of_step: dict[tuple[str, int], str] = {}
    spans: dict[str, list[list[Any]]] = defaultdict(list)
    for e in events:
        d = e.data or {}
        if e.kind == "input" and e.event == "runtime":
            v = d.get("weight_version")
            info.known = isinstance(v, str)
            if info.known:
                label = defaultdict(lambda v=v: v)     # every scheduler starts with it
        elif not info.known:
            if e.kind == "weights_version":
                info.announced.append((e.seq, d.get("version")))
            continue
        elif e.kind == "sched" and e.event == "weight_version":
            sched = d.get("sched", "scheduler")
            label[sched] = d["version"]
            info.changes.append((e.seq, sched, d["version"], d.get("cause", "")))
        elif e.kind == "weights_version":
            info.announced.append((e.seq, d.get("version")))
        elif e.kind == "step":
            sched = d.get("sched", "scheduler")
            of_step[(sched, d.get("step"))] = label[sched]
            info.step_versions.setdefault(sched, []).append(label[sched])
        elif e.kind == "input" and e.event == "generate" and e.rid is not None:
            spans.pop(e.rid, None)         # a rid used again: a new request
        elif e.kind == "input" and e.event == "step_end":
            sched = d.get("sched", "scheduler")
            v = of_step.pop((sched, d.get("step")), label[sched])
            for rid, tok, *_ in d.get("out") or ():
                n = _count(tok)
                if not n:
                    continue
                mine = spans[rid]
                end = mine[-1][2] if mine else 0
                if mine and mine[-1][0] == v:
                    mine[-1][2] = end + n
                else:
                    mine.append([v, end, end + n])
    info.spans = dict(spans)
    return info


def describe(spans: list[list[Any]]) -> str:
    return ", ".join(f"{v} [{a}, {b})" for v, a, b in spans)


def request_lines(info: VersionInfo, rid: str) -> list[str]:
    """The `--rid` timeline's lines on the request's weights."""
    if not info.known:
        return [f"weights: {ABSENT}"]
    spans = info.spans.get(rid)
    if not spans:
        return ["weights: no tokens generated"]
    head = "weights: its tokens came from " + ("one version" if len(spans) == 1 else f"{len(spans)} spans")
    return [f"{head}: {describe(spans)}"]


def report(info: VersionInfo) -> dict[str, Any]:
    """The stats' ``weights`` entry (``--json``)."""
    if not info.known:
        return {"known": False, "note": ABSENT,
                "announced": [{"seq": s, "version": v} for s, v in info.announced]}
    return {"known": True, "tokens_per_version": dict(info.tokens_per_version()),
            "changes": [{"seq": s, "sched": sc, "version": v, "cause": c} for s, sc, v, c in info.changes],
            "spanning": {rid: [list(x) for x in info.spans[rid]] for rid in info.spanning()}}


def lines(info: VersionInfo, limit: int = 10) -> list[str]:
    """The text report's lines on weights."""
    if not info.known:
        out = [f"  weights: {ABSENT}"]
        if info.announced:
            out.append("    versions announced by the control plane: "
                       + ", ".join(f"{v} (seq {s})" for s, v in info.announced))
        return out
    per = info.tokens_per_version()
    out = ["  weights: " + (", ".join(f"{v} {n} tokens" for v, n in per.items()) or "no tokens generated")]
    for s, sc, v, c in info.changes:
        out.append(f"    seq {s}: {sc} steps run with {v} from here ({c})")
    spanning = info.spanning()
    if spanning:
        out.append(f"    {len(spanning)} request(s) with tokens from more than one version:")
        for rid in spanning[:limit]:
            out.append(f"      {rid}: {describe(info.spans[rid])}")
        if len(spanning) > limit:
            out.append(f"      ... and {len(spanning) - limit} more")
    return out
