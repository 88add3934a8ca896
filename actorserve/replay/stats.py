"""Latency figures from a recording: abort latency, time spent in each state, wasted forwards.

Abort latency of a request is the time from the abort that reached it — the latest earlier
input that matches it: an `AbortRequest` naming its rid, a prefix of it or ``abort_all``, a
pause in mode abort, its deadline, shutdown — to its `aborted` transition, i.e. the moment its
stream was closed.
Time in state is measured between consecutive transitions of the same request.

A wasted forward is a model step that computed a request already finished. For each generation
request that ended ``done``: k is the step (per scheduler) of the last ``step_end`` input that
gave it a token before its ``finish`` transition (into ``detok``); every ``step`` event of that
scheduler with a step id above k whose batch holds the request is wasted. The step is counted
even when it was planned before the finish transition was recorded: that is exactly the waste
(the scheduler planned the next step before the request actor had seen its last token). The
finish cause is ``stop_string`` (the detokenizer's ``stop_string`` event), ``eos`` (the last
token is an EOS or a stop token id), ``length`` (``max_new_tokens`` reached) or ``other``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from ..engine.scheduling.params import SamplingParams
from .recorder import Event

ABORTERS = ("AbortRequest", "Abort", "PauseGeneration")
DEFAULT_MAX_NEW = SamplingParams().max_new_tokens


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def _summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": round(_pct(values, 0.5), 3), "p99_ms": round(_pct(values, 0.99), 3),
            "max_ms": round(max(values), 3), "mean_ms": round(sum(values) / len(values), 3)}


def abort_latencies_ms(events: Iterable[Event]) -> list[float]:
    """Per aborted request, ms from the abort that matched it to its ``aborted`` transition.

    The cause is matched on what the abort said, from the ``input`` events (what entered the
    actors, with its arguments): an `AbortRequest` naming the rid, a prefix of it, or
    ``abort_all``; a `PauseGeneration` with mode abort; the request's deadline timer; shutdown.
    The latest matching one before the transition is the cause. (Matching on message rids alone
    filed a prefix abort under the prefix string and measured from an older abort or pause.)
    Recordings without inputs fall back to the messages."""
    events = list(events)
    if not any(e.kind == "input" for e in events):
        return _abort_latencies_from_messages(events)
    by_rid: dict[str, int] = {}
    prefixes: dict[str, int] = {}
    everything: int | None = None
    out = []
    for e in events:
        if e.kind == "input":
            d = e.data or {}
            if e.event == "control" and d.get("op") == "AbortRequest":
                args = d.get("args") or {}
                if args.get("abort_all"):
                    everything = e.t_ns
                elif args.get("rid"):
                    (prefixes if args.get("prefix") else by_rid)[args["rid"]] = e.t_ns
            elif e.event == "control" and d.get("op") == "PauseGeneration":
                if ((d.get("args") or {}).get("mode") or "abort") == "abort":
                    everything = e.t_ns
            elif e.event == "abort" and e.rid:          # recordings from before aborts were controls
                by_rid[e.rid] = e.t_ns
            elif e.event == "timer" and str(d.get("label", "")).endswith(":deadline"):
                by_rid[str(d["label"])[4:-len(":deadline")]] = e.t_ns
            elif e.event == "shutdown":
                everything = e.t_ns
        elif e.kind in ("generation", "pooling") and e.ok and e.dst == "aborted" and e.rid:
            cands = [t for t in (by_rid.get(e.rid), everything) if t is not None]
            cands += [t for p, t in prefixes.items() if e.rid.startswith(p)]
            if cands:
                out.append((e.t_ns - max(cands)) / 1e6)
    return out


def _abort_latencies_from_messages(events: list[Event]) -> list[float]:
    last_any: Event | None = None           # latest abort that names no single rid
    last_by_rid: dict[str, Event] = {}
    out = []
    for e in events:
        if e.kind == "message" and e.event in ABORTERS:
            if e.rid:
                last_by_rid[e.rid] = e
            else:
                last_any = e
        elif e.kind in ("generation", "pooling") and e.ok and e.dst == "aborted":
            cands = [c for c in (last_by_rid.get(e.rid or ""), last_any) if c is not None]
            if cands:
                start = max(cands, key=lambda c: c.seq)
                out.append((e.t_ns - start.t_ns) / 1e6)
    return out


def time_in_state_ms(events: Iterable[Event]) -> dict[str, dict[str, float]]:
    entered: dict[tuple[str, str], tuple[str, int]] = {}
    spans: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.kind not in ("generation", "pooling") or not e.ok or e.dst is None or e.rid is None:
            continue
        key = (e.kind, e.rid)
        prev = entered.get(key)
        if prev is not None and prev[0] == e.dst:
            continue  # a self-loop (a prefill chunk) stays in the same state
        if prev is not None:
            spans[f"{e.kind}.{prev[0]}"].append((e.t_ns - prev[1]) / 1e6)
        entered[key] = (e.dst, e.t_ns)
    return {k: _summary(v) for k, v in sorted(spans.items())}


class _Life:
    """One incarnation of a generation request (from its ``create`` to the next one)."""

    __slots__ = ("steps", "last", "tokens", "finished", "stop_string", "done", "max_new", "stop_ids")

    def __init__(self, params: dict[str, Any], eos: tuple[int, ...]) -> None:
        self.steps: list[tuple[str, int, int]] = []   # (sched, step id, n tokens) it was in
        self.last: tuple[str, int, int | None] | None = None  # (sched, step, token) of its last token
        self.tokens = 0
        self.finished = False
        self.stop_string = False
        self.done = False
        self.max_new = int(params.get("max_new_tokens", DEFAULT_MAX_NEW))
        self.stop_ids = set(params.get("stop_token_ids") or ())
        if not params.get("ignore_eos"):
            self.stop_ids.update(eos)

    def cause(self) -> str:
        if self.stop_string:
            return "stop_string"
        if self.last is not None and self.last[2] in self.stop_ids:
            return "eos"
        return "length" if self.tokens >= self.max_new else "other"

    def wasted(self) -> tuple[int, int]:
        """(steps, tokens) computed for it after the step that gave its last token."""
        if self.last is None:
            return 0, 0
        sched, k, _ = self.last
        after = [n for s, step, n in self.steps if s == sched and step > k]
        return len(after), sum(after)


def wasted_forwards(events: Iterable[Event]) -> dict[str, Any]:
    """Model steps spent on generation requests that had already finished (module docstring)."""
    eos: tuple[int, ...] = ()
    params: dict[str, dict[str, Any]] = {}
    live: dict[str, _Life] = {}
    lives: list[_Life] = []
    for e in events:
        if e.kind == "input":
            d = e.data or {}
            if e.event == "runtime":
                eos = tuple(((d.get("generation") or {}).get("engine") or {}).get("eos_token_ids") or ())
            elif e.event == "generate" and e.rid is not None:
                params[e.rid] = d
            elif e.event == "step_end":
                for rid, tok, *_ in d.get("out") or ():
                    life = live.get(rid)
                    toks = tok if isinstance(tok, list) else [tok]     # a speculative step: several
                    if life is None or life.finished:
                        continue
                    for t in toks:            # up to the first the scheduler finished it on
                        if not isinstance(t, int) or isinstance(t, bool):
                            break
                        life.last = (d.get("sched", "scheduler"), int(d.get("step", 0)), t)
                        life.tokens += 1
                        if t in life.stop_ids or life.tokens >= life.max_new:
                            break
        elif e.kind == "step":
            d = e.data or {}
            for rid, n in d.get("batch") or ():
                life = live.get(rid)
                if life is not None:
                    life.steps.append((d.get("sched", "scheduler"), int(d.get("step", 0)), int(n)))
        elif e.kind == "detok" and e.event == "stop_string" and e.rid in live:
            live[e.rid].stop_string = True
        elif e.kind == "generation" and e.rid is not None and e.ok:
            if e.event == "create":
                live[e.rid] = _Life(params.pop(e.rid, {}), eos)
                lives.append(live[e.rid])
            elif e.rid in live:
                if e.dst == "detok":
                    live[e.rid].finished = True
                elif e.dst == "done":
                    live[e.rid].done = True
    by_cause: dict[str, dict[str, int]] = {}
    total = tokens = with_waste = 0
    for life in lives:
        if not (life.done and life.finished):
            continue
        w, n = life.wasted()
        c = by_cause.setdefault(life.cause(), {"requests": 0, "wasted": 0, "with_waste": 0})
        c["requests"] += 1
        c["wasted"] += w
        c["with_waste"] += w > 0
        total += w
        tokens += n
        with_waste += w > 0
    return {"requests": sum(c["requests"] for c in by_cause.values()), "total": total,
            "tokens": tokens, "requests_with_waste": with_waste, "by_cause": dict(sorted(by_cause.items()))}


def wasted_forwards_line(w: dict[str, Any]) -> str:
    """The text summary's line for `wasted_forwards`."""
    causes = ", ".join(f"{k} {c['wasted']}/{c['requests']}" for k, c in w["by_cause"].items())
    return (f"  wasted forwards: {w['total']} in {w['requests_with_waste']} of {w['requests']} done "
            f"generation requests" + (f" (by finish cause, wasted/requests: {causes})" if causes else ""))


def speculation(events: Iterable[Event]) -> dict[str, Any] | None:
    """Speculative decoding in a recording: per request and in all, the verify steps, the drafts
    they checked (a ``step`` note's ``draft``) and how many the model accepted (its ``step_end``
    answer: the tokens the step yielded, one more than the drafts accepted). None if no step
    had drafts."""
    drafted: dict[tuple[str, int], dict[str, int]] = {}
    per: dict[str, list[int]] = {}
    for e in events:
        d = e.data or {}
        if e.kind == "step" and d.get("draft"):
            drafted[(d.get("sched", "scheduler"), int(d.get("step", 0)))] = {
                rid: len(toks) for rid, toks in d["draft"].items()}
        elif e.kind == "input" and e.event == "step_end":
            step = drafted.pop((d.get("sched", "scheduler"), int(d.get("step", 0))), None)
            for rid, tok, *_ in (d.get("out") or ()) if step else ():
                if rid in step and isinstance(tok, list):
                    mine = per.setdefault(rid, [0, 0, 0])
                    mine[0] += 1
                    mine[1] += step[rid]
                    mine[2] += len(tok) - 1
    if not per:
        return None
    steps, drafts, acc = (sum(v[i] for v in per.values()) for i in range(3))
    return {"verify_steps": steps, "draft_tokens": drafts, "accepted_tokens": acc,
            "accept_rate": round(acc / drafts, 4) if drafts else 0.0,
            "tokens_per_step": round((steps + acc) / steps, 4) if steps else 0.0,
            "requests": {rid: {"verify_steps": v[0], "draft_tokens": v[1], "accepted_tokens": v[2]}
                         for rid, v in per.items()}}


def speculation_line(s: dict[str, Any]) -> str:
    return (f"  speculative decoding: {s['verify_steps']} verify steps in {len(s['requests'])} requests, "
            f"{s['accepted_tokens']}/{s['draft_tokens']} drafts accepted ({s['accept_rate']:.1%}), "
            f"{s['tokens_per_step']:.2f} tokens per verify step")


def by_priority(events: Iterable[Event]) -> dict[int, dict[str, Any]] | None:
    """Per scheduling priority (a generation request's ``create`` carries it; 0 when absent):
    its requests, their time in ``queued`` (every stay: a retracted request queues again) and
    how many times a request of it was retracted (the scheduler's ``retract`` notes, with
    their cause). None when every request had the default priority."""
    prio: dict[str, int] = {}
    queued_at: dict[str, int] = {}
    waits: dict[int, list[float]] = defaultdict(list)
    retracts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in events:
        if e.kind == "generation" and e.ok and e.rid is not None:
            if e.event == "create":
                prio[e.rid] = int((e.data or {}).get("priority", 0) or 0)
            if e.dst == "queued":
                queued_at[e.rid] = e.t_ns
            elif e.rid in queued_at:
                waits[prio.get(e.rid, 0)].append((e.t_ns - queued_at.pop(e.rid)) / 1e6)
        elif e.kind == "sched" and e.event == "retract":
            d = e.data or {}
            cause = str(d.get("cause", "?")).split(":", 1)[0]
            retracts[int(d.get("priority", 0) or 0)][cause] += 1
    if not any(prio.values()) and not any(p for p in retracts):
        return None
    out: dict[int, dict[str, Any]] = {}
    for p in sorted(set(prio.values()) | set(retracts)):
        out[p] = {"requests": sum(1 for v in prio.values() if v == p),
                  "queued": _summary(waits[p]) if waits[p] else None,
                  "retracted": dict(retracts[p])}
    return out


def by_priority_lines(bp: dict[int, dict[str, Any]]) -> list[str]:
    lines = []
    for p, d in bp.items():
        q = d["queued"]
        wait = f"queued p50={q['p50_ms']} ms p99={q['p99_ms']} ms (n={q['n']})" if q else "never queued"
        why = ", ".join(f"{c} {n}" for c, n in sorted(d["retracted"].items())) or "none"
        lines.append(f"  priority {p:<6} requests={d['requests']:<6} {wait}; retracted: {why}")
    return lines


def latency_report(events: list[Event]) -> dict[str, object]:
    aborts = abort_latencies_ms(events)
    return {"abort_latency": _summary(aborts) if aborts else None,
            "time_in_state": time_in_state_ms(events),
            "wasted_forwards": wasted_forwards(events),
            "speculation": speculation(events),
            "by_priority": by_priority(events)}
