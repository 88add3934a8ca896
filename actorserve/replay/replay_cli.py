"""Check a recording: invariants, divergence from today's lifecycle definitions, timelines.

    actorserve replay run.jsonl            # summary + violations; exit 1 if any
    actorserve replay run.jsonl --rid X    # one request's timeline
    actorserve replay run.jsonl --json     # the report as JSON
    actorserve replay run.jsonl --format html --out run.html [--rid X]
    actorserve replay run.jsonl --format mermaid [--rid X]
    actorserve replay --reexecute run.jsonl [--max-num-seqs N ...]   # rerun the inputs, compare
"""

from __future__ import annotations

import argparse
import json
import sys

from ..statemachines import LIFECYCLES
from .check import check
from .recorder import read_all_parts, read_recording
from .stats import latency_report, wasted_forwards_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a JSONL recording written by `actorserve serve --record PATH`")
    p.add_argument("--rid", help="print this request's timeline")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--format", choices=("text", "mermaid", "html"), default="text",
                   help="text: the report; mermaid: a sequence diagram; html: timeline + state overlays")
    p.add_argument("--out", help="write the mermaid/html picture here instead of stdout")
    p.add_argument("--allow-unfinished", action="store_true",
                   help="do not flag requests still live when the recording ends")
    p.add_argument("--reexecute", action="store_true",
                   help="feed the recorded inputs through today's actors and scheduler (model "
                        "stand-in, virtual clock) and compare every step's batch and every "
                        "transition; exit 1 on the first difference")
    for flag, what in (("--max-num-seqs", "sequences"), ("--max-batch-tokens", "tokens"),
                       ("--max-prefill-chunk", "prefill tokens per sequence")):
        p.add_argument(flag, type=int, default=None,
                       help=f"with --reexecute: replace the recorded limit of {what} per step")


def _stale_definitions(header: dict) -> list[str]:
    out = []
    for name, d in (header.get("lifecycles") or {}).items():
        lc = LIFECYCLES.get(name)
        if lc is None:
            out.append(f"{name}: no longer defined")
        elif d.get("hash") != lc.definition_hash:
            out.append(f"{name}: recorded under definition {d.get('hash')}, today's is {lc.definition_hash}")
    return out


def timeline(events: list, rid: str) -> list[str]:
    mine = [e for e in events if e.rid == rid]
    if not mine:
        return []
    t0 = mine[0].t_ns
    lines = []
    for e in mine:
        ms = (e.t_ns - t0) / 1e6
        if e.kind == "message":
            lines.append(f"{e.seq:>8}  +{ms:10.3f} ms  message     {e.event} -> {e.dst}")
        else:
            arrow = f"{e.src or '∅'} -> {e.dst}" if e.ok else f"{e.src} -x {e.event} REFUSED: {e.error}"
            lines.append(f"{e.seq:>8}  +{ms:10.3f} ms  {e.kind:<11} {e.event:<14} {arrow}"
                         + (f"  (cause {e.cause})" if e.cause else ""))
    return lines


def _picture(args: argparse.Namespace, events: list) -> int:
    from .render import to_html, to_mermaid_sequence

    text = (to_mermaid_sequence(events, rid=args.rid) if args.format == "mermaid"
            else to_html(events, rid=args.rid, title=f"actorserve replay: {args.path}"))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def _reexecute(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from ..engine.batching import BatchConfig
    from .reexec import RecordingError, reexecute

    try:
        _, events = read_all_parts(args.path)
        batch = None
        limits = {k: getattr(args, k) for k in ("max_num_seqs", "max_batch_tokens", "max_prefill_chunk")
                  if getattr(args, k) is not None}
        if limits:
            setup = next(e for e in events if e.kind == "input" and e.event == "runtime")
            batch = dataclasses.replace(BatchConfig(**(setup.data or {})["generation"]["batch"]), **limits)
        report = asyncio.run(reexecute(events, batch=batch))
    except (RecordingError, ValueError, StopIteration) as exc:
        print(f"cannot re-execute {args.path}: {exc or 'no runtime set-up recorded'}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict()) if args.json else report.format())
    return 0 if report.ok else 1


def run(args: argparse.Namespace) -> int:
    if args.reexecute:
        return _reexecute(args)
    header, events = read_recording(args.path)
    if args.format != "text":
        return _picture(args, events)
    if args.rid:
        lines = timeline(events, args.rid)
        if not lines:
            print(f"no events for rid {args.rid!r}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    report = check(events, require_terminal=not args.allow_unfinished)
    stale = _stale_definitions(header)
    if args.json:
        print(json.dumps({
            "events": len(events),
            "requests": dict(report.requests),
            "terminal": {f"{k}.{s}": n for (k, s), n in sorted(report.terminal.items())},
            "violations": [{"kind": v.kind, "rid": v.rid, "seq": v.seq, "detail": v.detail}
                           for v in report.violations],
            "stale_definitions": stale,
            **latency_report(events),
        }))
    else:
        print(f"{len(events)} events")
        for kind, n in sorted(report.requests.items()):
            ends = ", ".join(f"{s}={c}" for (k, s), c in sorted(report.terminal.items()) if k == kind)
            print(f"  {kind:<11} {n:>7} accepted   {ends}")
        for line in stale:
            print(f"  note: {line}")
        lat = latency_report(events)
        if lat["abort_latency"]:
            a = lat["abort_latency"]
            print(f"  abort latency: n={a['n']} p50={a['p50_ms']} ms p99={a['p99_ms']} ms max={a['max_ms']} ms")
        for state, st in lat["time_in_state"].items():  # type: ignore[union-attr]
            print(f"  time in {state:<22} n={st['n']:<6} p50={st['p50_ms']:>9} ms  p99={st['p99_ms']:>9} ms")
        print(wasted_forwards_line(lat["wasted_forwards"]))  # type: ignore[arg-type]
        if report.ok:
            print("no violations")
        else:
            print(f"{len(report.violations)} violation(s):")
            for v in report.violations[:200]:
                where = f"seq {v.seq}" if v.seq >= 0 else "at end"
                print(f"  [{v.kind}] {where} rid={v.rid}: {v.detail}")
    return 0 if report.ok else 1
