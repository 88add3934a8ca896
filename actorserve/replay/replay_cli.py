"""Check a recording: invariants, divergence from today's lifecycle definitions, timelines.

    actorserve replay run.jsonl            # summary + violations; exit 1 if any
    actorserve replay run.jsonl --rid X    # one request's timeline
    actorserve replay run.jsonl --json     # the report as JSON
    actorserve replay run.jsonl --format html --out run.html [--rid X]
    actorserve replay run.jsonl --format mermaid [--rid X]
    actorserve replay run.jsonl --format chrome-trace --out trace.json   # chrome://tracing, Perfetto
    actorserve replay --reexecute run.jsonl [--max-num-seqs N ...]   # rerun the inputs, compare
    actorserve replay DIR | A.jsonl B.jsonl ...   # a fleet's recordings, merged (fleet_cli)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .check import Report, check, stale_definitions
from .recorder import ended_in_order, incarnation_of, read_all_parts, read_recording
from .stats import by_priority_lines, latency_report, speculation_line, wasted_forwards_line
from .versions import lines as version_lines, report as version_report, request_lines, token_versions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="+",
                   help="a JSONL recording written by `actorserve serve --record PATH`; several, "
                        "or a directory of them (a fleet's, one per replica): merged on one clock")
    p.add_argument("--rid", help="print this request's timeline")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--format", choices=("text", "mermaid", "html", "chrome-trace"), default="text",
                   help="text: the report; mermaid: a sequence diagram; html: timeline + state "
                        "overlays; chrome-trace: Trace Event Format JSON (chrome://tracing, Perfetto)")
    p.add_argument("--out", help="write the picture or trace here instead of stdout")
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
    lora = next(((e.data or {}).get("lora") for e in mine if e.kind == "input" and e.event == "generate"
                 and (e.data or {}).get("lora")), None)
    if lora is not None:             # the adapter it ran under (`Runtime.generate`'s recorded input)
        lines.insert(0, f"LoRA adapter: {lora}")
    return lines


OPEN = "recording is open: server still running or not shut down cleanly"


def _open_status(path: str, report: Report) -> str:
    """The open-recording line: what is missing, and how recent the end is."""
    parts = ["no shutdown recorded"]
    if report.last_ns is not None and report.in_flight:
        oldest = min(f.since_ns for f in report.in_flight)
        parts.append(f"{len(report.in_flight)} request(s) live at the end, the longest in its "
                     f"state for {(report.last_ns - oldest) / 1e9:.3f} s")
    try:
        parts.append(f"file last written {time.time() - os.path.getmtime(path):.0f} s ago")
    except OSError:
        pass
    return f"{OPEN} ({'; '.join(parts)})"


def ending(path: str, header: dict) -> dict:
    """`check.check`'s ``ended`` and ``cut`` for one file: its end marker, and whether it is
    an earlier incarnation (a later one took its path: its process is gone)."""
    return {"ended": ended_in_order(header), "cut": incarnation_of(path)[1] is not None}


def _cut_status(report: Report) -> str:
    return (f"recording was cut: its process was killed (no end marker, and a later incarnation "
            f"took its path); {len(report.lost)} request(s) lost with the process")


def _picture(args: argparse.Namespace, header: dict, events: list) -> int:
    if args.format == "chrome-trace":
        from .chrome_trace import to_chrome_trace

        text = json.dumps(to_chrome_trace(events), separators=(",", ":")) + "\n"
    elif args.format == "mermaid":
        from .render import to_mermaid_sequence

        text = to_mermaid_sequence(events, rid=args.rid)
    else:
        from .render import to_html

        report = check(events, allow_open=True, **ending(args.path, header))
        status = (_cut_status(report) if report.cut else
                  _open_status(args.path, report) if report.open else None)
        text = to_html(events, rid=args.rid, title=f"actorserve replay: {args.path}",
                       status=status)
    from .render import emit       # with the renderers: loaded only to draw
    return emit(text, args.out)


def _reexecute(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from ..engine.scheduling.batching import BatchConfig
    from .reexec import RecordingError, reexecute

    try:
        header, events = read_all_parts(args.path)
        batch = None
        limits = {k: getattr(args, k) for k in ("max_num_seqs", "max_batch_tokens", "max_prefill_chunk")
                  if getattr(args, k) is not None}
        if limits:
            setup = next(e for e in events if e.kind == "input" and e.event == "runtime")
            batch = dataclasses.replace(BatchConfig(**(setup.data or {})["generation"]["batch"]), **limits)
        report = asyncio.run(reexecute(events, batch=batch, cut=ended_in_order(header) is False))
    except (RecordingError, ValueError, StopIteration) as exc:
        print(f"cannot re-execute {args.path}: {exc or 'no runtime set-up recorded'}", file=sys.stderr)
        return 2
    stale = stale_definitions(header)
    if args.json:
        print(json.dumps({**report.to_dict(), "stale_definitions": stale}))
    else:
        if stale and not report.ok:
            print("note: recorded under other lifecycle definitions than today's; today's actors "
                  "are expected to differ from it:\n  " + "\n  ".join(stale))
        print(report.format())
    return 0 if report.ok else 1


def run(args: argparse.Namespace) -> int:
    if isinstance(args.path, list):
        if len(args.path) > 1 or os.path.isdir(args.path[0]):
            from .fleet_cli import run as run_fleet

            return run_fleet(args)
        args.path = args.path[0]
    if args.reexecute:
        return _reexecute(args)
    header, events = read_recording(args.path)
    if args.format != "text":
        return _picture(args, header, events)
    if args.rid:
        lines = timeline(events, args.rid)
        if not lines:
            print(f"no events for rid {args.rid!r}", file=sys.stderr)
            return 2
        print("\n".join(lines + request_lines(token_versions(events), args.rid)))
        return 0
    report = check(events, require_terminal=not args.allow_unfinished, allow_open=True,
                   **ending(args.path, header))
    stale = stale_definitions(header)
    in_flight = [{"kind": f.kind, "rid": f.rid, "state": f.state} for f in report.in_flight]
    if args.json:
        print(json.dumps({
            "events": len(events),
            "open": report.open,
            "ended_in_order": ended_in_order(header),
            "cut": report.cut,
            "in_flight": in_flight if report.open else [],
            "lost_with_process": [{"kind": f.kind, "rid": f.rid, "state": f.state} for f in report.lost],
            "requests": dict(report.requests),
            "terminal": {f"{k}.{s}": n for (k, s), n in sorted(report.terminal.items())},
            "violations": [{"kind": v.kind, "rid": v.rid, "seq": v.seq, "detail": v.detail}
                           for v in report.violations],
            "stale_definitions": stale,
            **latency_report(events),
            "weights": version_report(token_versions(events)),
        }))
    else:
        print(f"{len(events)} events")
        for kind, n in sorted(report.requests.items()):
            ends = ", ".join(f"{s}={c}" for (k, s), c in sorted(report.terminal.items()) if k == kind)
            print(f"  {kind:<11} {n:>7} accepted   {ends}")
        for line in stale:
            print(f"  note: {line}")
        if report.cut:
            print(_cut_status(report) + (" (not violations; what came before the cut is checked "
                                         "in full):" if report.lost else ""))
            for f in report.lost[:20]:
                print(f"    {f.kind:<11} rid={f.rid} in {f.state}")
            if len(report.lost) > 20:
                print(f"    ... and {len(report.lost) - 20} more")
        elif report.open:
            print(_open_status(args.path, report))
            if report.in_flight:
                print(f"  {len(report.in_flight)} request(s) in flight (not violations; "
                      "requests that ended are checked in full):")
            for f in report.in_flight[:20]:
                since = (report.last_ns - f.since_ns) / 1e6 if report.last_ns is not None else 0
                print(f"    {f.kind:<11} rid={f.rid} in {f.state} for {since:.3f} ms")
            if len(report.in_flight) > 20:
                print(f"    ... and {len(report.in_flight) - 20} more")
        lat = latency_report(events)
        if lat["abort_latency"]:
            a = lat["abort_latency"]
            print(f"  abort latency: n={a['n']} p50={a['p50_ms']} ms p99={a['p99_ms']} ms max={a['max_ms']} ms")
        for state, st in lat["time_in_state"].items():  # type: ignore[union-attr]
            print(f"  time in {state:<22} n={st['n']:<6} p50={st['p50_ms']:>9} ms  p99={st['p99_ms']:>9} ms")
        print(wasted_forwards_line(lat["wasted_forwards"]))  # type: ignore[arg-type]
        if lat.get("speculation"):
            print(speculation_line(lat["speculation"]))  # type: ignore[arg-type]
        for line in by_priority_lines(lat.get("by_priority") or {}):  # type: ignore[arg-type]
            print(line)
        for line in version_lines(token_versions(events)):
            print(line)
        if report.ok:
            print("no violations")
        else:
            print(f"{len(report.violations)} violation(s):")
            for v in report.violations[:200]:
                where = f"seq {v.seq}" if v.seq >= 0 else "at end"
                print(f"  [{v.kind}] {where} rid={v.rid}: {v.detail}")
    return 0 if report.ok else 1
