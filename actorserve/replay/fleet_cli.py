"""`actorserve replay DIR` / `actorserve replay A.jsonl B.jsonl ...`: a fleet's recordings.

    actorserve replay DIR                       # per replica: counts, violations; then across
    actorserve replay DIR --json
    actorserve replay DIR --rid X               # X's events on every replica, one clock
    actorserve replay DIR --format html --out fleet.html       # a lane group per replica
    actorserve replay DIR --format chrome-trace --out t.json   # a process per replica
    actorserve replay --reexecute DIR [--max-num-seqs N ...]   # each replica's part, alone

The options are those of one recording (`replay_cli`), the merge rule and the checks across
replicas `replay.fleet`'s. A restarted replica's incarnations (``r0.prev-1.jsonl`` ...
``r0.jsonl``) report apart, oldest first (``r0#1``, ``r0#2``); a cut one's requests live at
the kill are "lost with the process" (``lost_with_process`` in ``--json``), not violations. Exit 0: every replica clean and nothing wrong across them; 1: a
violation (or a difference, with ``--reexecute``); 2: a recording that cannot be read (or
re-executed), or a format that draws one recording only (mermaid).
"""

from __future__ import annotations

import argparse
import json
import sys

from .check import stale_definitions
from .fleet import Replica, check_each, cross_check, load_replicas, merged

CUT = "cut (its process was killed: no end marker, and a later incarnation took its path)"


def _load(args: argparse.Namespace) -> list[Replica] | None:
    try:
        reps = load_replicas(args.path)
    except (OSError, ValueError) as exc:
        print(f"actorserve replay: {exc}", file=sys.stderr)
        return None
    if not reps:
        print(f"actorserve replay: no recordings (*.jsonl) in {' '.join(args.path)}", file=sys.stderr)
        return None
    return reps


def _clock_note(reps: list[Replica]) -> list[str]:
    return [f"{r.name}: no clock anchor in its header; its first event is placed at the "
            "fleet's start" for r in reps if not r.anchored]


def _picture(args: argparse.Namespace, reps: list[Replica]) -> int:
    if args.format == "mermaid":
        print("actorserve replay: --format mermaid draws one recording; pass one file",
              file=sys.stderr)
        return 2
    if args.format == "chrome-trace":
        from .fleet_render import to_fleet_chrome_trace

        text = json.dumps(to_fleet_chrome_trace(reps), separators=(",", ":")) + "\n"
    else:
        from .fleet_render import to_fleet_html

        names = ", ".join(f"{r.name} ({len(r.events)} events)" for r in reps)
        status = "; ".join([f"{len(reps)} replicas on one clock: {names}", *_clock_note(reps)])
        text = to_fleet_html(reps, rid=args.rid, status=status,
                             title=f"actorserve replay: {len(reps)} replicas")
    from .render import emit       # with the renderers: loaded only to draw
    return emit(text, args.out)


def _timeline(reps: list[Replica], rid: str) -> int:
    mine = [(t, i, e) for t, i, e in merged(reps) if e.rid == rid]
    if not mine:
        print(f"no events for rid {rid!r} on any replica", file=sys.stderr)
        return 2
    t0, width = mine[0][0], max(len(r.name) for r in reps)
    for t, i, e in mine:
        what = (f"message     {e.event} -> {e.dst}" if e.kind == "message" else
                f"{e.kind:<11} {e.event:<14} {e.src or '∅'} -> {e.dst}" if e.ok else
                f"{e.kind:<11} {e.src} -x {e.event} REFUSED: {e.error}")
        print(f"{reps[i].name:<{width}} {e.seq:>8}  +{(t - t0) / 1e6:10.3f} ms  {what}")
    return 0


def _reexecute(args: argparse.Namespace, reps: list[Replica]) -> int:
    import asyncio
    import dataclasses

    from ..engine.scheduling.batching import BatchConfig
    from .reexec import RecordingError, reexecute

    limits = {k: getattr(args, k) for k in ("max_num_seqs", "max_batch_tokens", "max_prefill_chunk")
              if getattr(args, k) is not None}
    rows, worst = [], 0
    for r in reps:
        try:
            batch = None
            if limits:
                setup = next(e for e in r.events if e.kind == "input" and e.event == "runtime")
                batch = dataclasses.replace(BatchConfig(**(setup.data or {})["generation"]["batch"]),
                                            **limits)
            report = asyncio.run(reexecute(r.events, batch=batch, cut=r.ended is False))
        except (RecordingError, ValueError, StopIteration) as exc:
            rows.append((r, None, str(exc) or "no runtime set-up recorded"))
            worst = 2
            continue
        rows.append((r, report, None))
        worst = max(worst, 0 if report.ok else 1)
    if args.json:
        print(json.dumps({"ok": worst == 0, "replicas": [
            {"replica": r.name, "path": r.path, "stale_definitions": stale_definitions(r.header),
             **({"ok": False, "error": err} if rep is None else rep.to_dict())}
            for r, rep, err in rows]}))
        return worst
    for r, rep, err in rows:
        if rep is None:
            print(f"== replica {r.name} ({r.path}): cannot re-execute: {err}")
            continue
        print(f"== replica {r.name} ({r.path}): {'ok' if rep.ok else 'DIFFERS'}")
        print(rep.format())
    verdict = {0: "every replica re-executed exactly", 1: "a replica differs",
               2: "a replica could not be re-executed"}[worst]
    print(f"{len(reps)} replicas: {verdict}")
    return worst


def run(args: argparse.Namespace) -> int:
    reps = _load(args)
    if reps is None:
        return 2
    if args.reexecute:
        return _reexecute(args, reps)
    if args.format != "text":
        return _picture(args, reps)
    if args.rid:
        return _timeline(reps, args.rid)

    reports = check_each(reps, require_terminal=not args.allow_unfinished)
    across = cross_check(reps, reports)
    ok = not across and all(rep.ok for rep in reports)
    if args.json:
        print(json.dumps({"ok": ok, "replicas": [{
            "replica": r.name, "replica_id": r.replica, "path": r.path, "events": len(r.events),
            "open": rep.open, "ended_in_order": r.ended, "cut": rep.cut, "clock_anchor": r.anchored,
            "in_flight": [{"kind": f.kind, "rid": f.rid, "state": f.state} for f in rep.in_flight]
            if rep.open else [],
            "lost_with_process": [{"kind": f.kind, "rid": f.rid, "state": f.state} for f in rep.lost],
            "requests": dict(rep.requests),
            "terminal": {f"{k}.{s}": n for (k, s), n in sorted(rep.terminal.items())},
            "violations": [{"kind": v.kind, "rid": v.rid, "seq": v.seq, "detail": v.detail}
                           for v in rep.violations],
            "stale_definitions": stale_definitions(r.header)} for r, rep in zip(reps, reports)],
            "lost_with_process": [{"replica": r.name, "kind": f.kind, "rid": f.rid, "state": f.state}
                                  for r, rep in zip(reps, reports) for f in rep.lost],
            "cross_replica": [v.to_dict() for v in across]}))
        return 0 if ok else 1
    print(f"{len(reps)} replicas, {sum(len(r.events) for r in reps)} events, merged on one clock")
    for line in _clock_note(reps):
        print(f"  note: {line}")
    for r, rep in zip(reps, reports):
        print(f"== replica {r.name} ({r.path}): {len(r.events)} events"
              + (f", {CUT}" if rep.cut else ", open (no shutdown recorded)" if rep.open else ""))
        for kind, n in sorted(rep.requests.items()):
            ends = ", ".join(f"{s}={c}" for (k, s), c in sorted(rep.terminal.items()) if k == kind)
            print(f"  {kind:<11} {n:>7} accepted   {ends}")
        for line in stale_definitions(r.header):
            print(f"  note: {line}")
        if rep.open and rep.in_flight:
            print(f"  {len(rep.in_flight)} request(s) in flight (not violations)")
        if rep.lost:
            print(f"  {len(rep.lost)} request(s) lost with the process (live at the cut; not "
                  "violations): " + ", ".join(f"{f.rid} ({f.state})" for f in rep.lost[:20])
                  + (f" ... and {len(rep.lost) - 20} more" if len(rep.lost) > 20 else ""))
        for v in rep.violations[:200]:
            where = f"seq {v.seq}" if v.seq >= 0 else "at end"
            print(f"  [{v.kind}] {where} rid={v.rid}: {v.detail}")
        print(f"  {'no violations' if rep.ok else f'{len(rep.violations)} violation(s)'}")
    if across:
        print(f"== across replicas: {len(across)} violation(s)")
        for c in across[:200]:
            print(f"  [{c.kind}] {c.detail}")
    else:
        print("== across replicas: no violations")
    lost = sum(len(rep.lost) for rep in reports)
    if lost:
        print(f"{lost} request(s) lost with a killed process (not violations)")
    print("no violations" if ok else "violations found")
    return 0 if ok else 1
