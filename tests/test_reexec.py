"""Deterministic re-execution: a chaos run recorded to JSONL, checked, and run again offline.

The chaos workload mixes, over 1,000+ requests: generation (some ending on a stop string),
pooling on the generation engine and on a pooling engine with a batching window, client
disconnects, abort_request, pauses in all three modes, continue, flushes (some waiting with a
timeout), health checks with their probes, and session turns; a watchdog ticks on the manual
clock. Re-execution must reproduce every step's batch and every transition.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from collections import Counter

import pytest

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.cli import main as cli
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig, BatchPolicy
from actorserve.engine.runners.fake import FakeDetokenizer, FakeEngine
from actorserve.engine.scheduling.params import PoolingParams, SamplingParams
from actorserve.messages import (
    AbortRequest, CloseSession, ContinueGeneration, FlushCache, HealthCheck, OpenSession,
    PauseGeneration, SessionBegin,
)
from actorserve.replay.check import check
from actorserve.replay.recorder import FlightRecorder, read_all_parts, read_recording
from actorserve.replay.reexec import RecordingError, reexecute, steps_of
from actorserve.replay.stats import speculation
from actorserve.statemachines import LIFECYCLES

BATCH = BatchConfig(max_num_seqs=48, max_batch_tokens=256, max_prefill_chunk=32)


async def chaos(path, *, seed: int, in_thread: bool, n: int = 1000, max_bytes: int = 1 << 30,
                backups: int = 3, spec: bool = False) -> Counter:
    """Run the chaos workload with a recorder writing `path`; return what the clients saw.
    `spec`: with n-gram speculation, greedy requests and a fake model whose outputs loop."""
    rng = random.Random(seed)
    clock = ManualClock()
    rec = FlightRecorder(path=path, clock=clock, capacity=2_000_000, max_bytes=max_bytes,
                         backups=backups, lifecycles=LIFECYCLES.values())
    batch = dataclasses.replace(BATCH, speculative="ngram", speculative_max_batch=48) if spec else BATCH
    cfg = SchedulerConfig(batch=batch, step_in_thread=in_thread, watchdog_timeout_s=5.0,
                          pool_batch_wait_s=0.005)
    greedy = {"temperature": 0.0} if spec else {}
    rt = Runtime(FakeEngine(num_blocks=512, block_size=4, keep_history=False, alphabet=5 if spec else None),
                 config=cfg,
                 clock=clock, recorder=rec,
                 pooling_engines={"embed": FakeEngine(num_blocks=256, block_size=4, keep_history=False)})
    await rt.start()
    shared = [rng.randrange(1, 999) for _ in range(16)]
    handles, pending, seen = [], [], Counter()
    sessions = [(await rt.control(OpenSession(session_id=f"s{k}", timeout=30.0))).detail["session_id"]
                for k in range(3)]

    async def session_turn(sid: str, k: int) -> None:
        rid = f"{sid}-turn{k}"
        res = await rt.session(SessionBegin(sid, rid, tuple(rng.randrange(1, 999) for _ in range(4))))
        if res.ok:
            out = await rt.generate(list(res.detail["prompt_ids"]), SamplingParams(max_new_tokens=4),
                                    rid=rid, session=sid).stream.final()
            seen[f"session:{out.finish_reason}"] += 1

    async def health(k: int) -> None:
        res = await rt.control(HealthCheck())
        if res.ok and res.detail.get("probe"):
            out = await rt.generate([1], SamplingParams(max_new_tokens=1, ignore_eos=True),
                                    rid=f"health-probe-{k}", is_probe=True).stream.final()
            ok = out.finish_reason in ("stop", "length")
            rt.health_done(res.detail["record"], ok, "ok" if ok else str(out.finish_reason))
            seen[f"health:{ok}"] += 1

    for i in range(n):
        prompt = (shared if rng.random() < 0.3 else []) + [rng.randrange(1, 999) for _ in range(rng.randrange(1, 24))]
        r = rng.random()
        if r < 0.15:
            handles.append(rt.pool(prompt, PoolingParams(), target="embed"))
        elif r < 0.25:
            handles.append(rt.pool(prompt, PoolingParams(task="score")))
        else:
            handles.append(rt.generate(prompt, SamplingParams(max_new_tokens=rng.randrange(1, 16), **greedy),
                                       detokenizer=FakeDetokenizer(stop=("<5",) if i % 7 == 0 else ())))
        r = rng.random()
        if r < 0.10:
            pending.append(rt.abort(rng.choice(handles).rid, "client went away"))   # a disconnect
        elif r < 0.12:
            pending.append(rt.control(AbortRequest(rid=rng.choice(handles).rid)))
        elif r < 0.14:
            pending.append(rt.control(PauseGeneration(rng.choice(["abort", "retract", "in_place"]))))
        elif r < 0.17:
            pending.append(rt.control(ContinueGeneration()))
        elif r < 0.18:
            pending.append(rt.control(FlushCache(timeout_s=rng.choice([None, 0.003]))))
        elif r < 0.19:
            pending.append(asyncio.ensure_future(health(i)))
        elif r < 0.23:
            pending.append(asyncio.ensure_future(session_turn(rng.choice(sessions), i)))
        if i % 10 == 0:
            for _ in range(rng.randrange(0, 4)):
                await asyncio.sleep(0)  # sleep-ok: a random number of loop turns between arrivals is the chaos
            clock.advance(rng.choice([0.0, 0.001, 0.004]))
    for _ in range(3):                   # continue (a pause may still be pending at a step)
        await rt.control(ContinueGeneration())
        await rt.quiesce()
    for _ in range(10_000):              # let batching windows and flush timeouts run out
        if all(h.stream.closed for h in handles) and all(p.done() for p in pending):
            break
        clock.advance(0.002)
        await rt.quiesce()
        if in_thread:
            await asyncio.sleep(0)  # sleep-ok: a loop turn (no wall clock) per virtual tick
    else:
        raise AssertionError("requests or controls still open after 20 virtual seconds")
    await asyncio.gather(*pending)
    for h in handles:
        out = await h.stream.final()
        seen[out.finish_reason] += 1
    await rt.control(CloseSession(sessions[0]))
    await rt.quiesce()
    await rt.shutdown()
    return seen


@pytest.mark.parametrize("in_thread,seed,spec", [(False, 11, False), (True, 12, False), (True, 13, True)])
async def test_chaos_recording_replays_clean_and_reexecutes_step_for_step(tmp_path, in_thread, seed, spec):
    path = tmp_path / "chaos.jsonl"
    seen = await chaos(path, seed=seed, in_thread=in_thread, spec=spec)
    header, events = read_recording(path)
    assert header["format"] == "actorserve-recording/1"
    report = check(events)
    assert report.ok, report.violations[:5]
    assert report.requests["generation"] + report.requests["pooling"] >= 1000
    inputs = Counter(e.event for e in events if e.kind == "input")
    for what in ("generate", "pool", "delivered", "control", "session", "health_done", "step_end",
                 "timer", "shutdown"):
        assert inputs[what] > 0, (what, inputs)
    assert inputs["abort"] == 0           # a disconnect is a control request like every abort
    reasons = Counter(e.data["args"]["reason"] for e in events if e.kind == "input"
                      and e.event == "control" and e.data["op"] == "AbortRequest")
    assert reasons["client went away"] > 0 and reasons["abort"] > 0, reasons
    ops = Counter((e.data or {}).get("op") for e in events if e.kind == "input" and e.event == "control")
    assert {"AbortRequest", "PauseGeneration", "ContinueGeneration", "FlushCache", "HealthCheck",
            "OpenSession", "CloseSession"} <= set(ops), ops
    assert seen["abort"] > 0 and seen["length"] > 0 and seen["session:length"] > 0 and seen["health:True"] > 0
    assert any(e.kind == "detok" for e in events)          # a stop string ended some request
    if spec:                       # drafts verified, some accepted, among all the chaos
        drafted = speculation(events)
        assert drafted is not None and drafted["accepted_tokens"] > 0, drafted

    rx = await reexecute(events)
    assert rx.ok, rx.format()
    assert rx.drift == 0 and rx.fillers == 0
    recorded = steps_of(events)
    assert set(recorded) == {"scheduler", "scheduler:embed"}
    for sched, steps in recorded.items():
        assert rx.steps[sched] == (len(steps), len(steps)) and len(steps) > 10


async def test_a_changed_batching_policy_is_detected_at_its_first_differing_step(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    await chaos(path, seed=5, in_thread=False, n=300)
    _, events = read_recording(path)
    gen_steps = steps_of(events)["scheduler"]
    first_big = next(i for i, (_, batch) in enumerate(gen_steps) if len(batch) > 8)
    report = await reexecute(events, batch=BatchConfig(max_num_seqs=8, max_batch_tokens=256,
                                                       max_prefill_chunk=32))
    assert not report.ok
    diff = next(d for d in report.step_diffs if d.sched == "scheduler")
    assert diff.step == first_big + 1 and diff.seq == gen_steps[first_big][0]
    assert diff.recorded == gen_steps[first_big][1] and len(diff.replayed) == 8
    # the embedding scheduler kept its own policy: it can only differ later, as a consequence
    assert all(d.seq is None or d.seq > diff.seq for d in report.step_diffs if d.sched != "scheduler")

    # however far a what-if run strays (requests still running that ended in the recording,
    # recorded tokens running out), it ends with a report, never an exception
    stray = await reexecute(events, batch=BatchConfig(max_num_seqs=1, max_batch_tokens=8, max_prefill_chunk=4))
    assert not stray.ok and stray.step_diffs[0].step == 1 + next(
        i for i, (_, batch) in enumerate(gen_steps) if len(batch) > 1 or batch[0][1] > 4)

    class Youngest(BatchPolicy):     # a subtler change: admit the newest arrival first
        def plan(self, running, lanes, bm):
            for lane in lanes:
                if len(lane) > 1:
                    lane.rotate(1)
            return super().plan(running, lanes, bm)

    other = await reexecute(events, policy=Youngest(BATCH))
    d2 = next(d for d in other.step_diffs if d.sched == "scheduler")
    assert (d2.seq, d2.recorded) == gen_steps[d2.step - 1] and d2.replayed != d2.recorded

    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(path)]) == 0
    assert "every step's batch and every transition match" in capsys.readouterr().out
    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(path), "--max-num-seqs", "8"]) == 1
    out = capsys.readouterr().out
    assert f"first differing step of scheduler: step {first_big + 1} (seq {gen_steps[first_big][0]})" in out
    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


async def test_events_before_the_runtime_started_do_not_shift_the_inputs(tmp_path):
    path = tmp_path / "run.jsonl"
    await chaos(path, seed=4, in_thread=False, n=100)
    _, events = read_recording(path)
    early = [dataclasses.replace(events[0], seq=0, kind="message", event="Hello", data=None)]
    shifted = [dataclasses.replace(e, seq=e.seq + 1) for e in early + events]
    report = await reexecute(shifted)
    assert report.ok and report.drift == 0, report.format()


async def test_a_rotated_recording_is_reexecuted_whole_and_a_gap_is_refused(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    await chaos(path, seed=6, in_thread=False, n=300, max_bytes=100_000, backups=50)
    parts = sorted(tmp_path.glob("run.jsonl.*"))
    assert len(parts) >= 3
    header, events = read_all_parts(path)
    assert events[0].seq == 1 and [e.seq for e in events] == list(range(1, len(events) + 1))
    assert (await reexecute(events)).ok
    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(path)]) == 0
    capsys.readouterr()
    (tmp_path / "run.jsonl.2").unlink()
    with pytest.raises(ValueError, match="gap"):
        read_all_parts(path)
    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(path)]) == 2
    assert "gap" in capsys.readouterr().err


async def test_a_recording_without_its_start_cannot_be_reexecuted(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    await chaos(path, seed=3, in_thread=False, n=50)
    _, events = read_recording(path)
    with pytest.raises(RecordingError, match="set-up"):
        await reexecute(events[200:])
    cut = tmp_path / "cut.jsonl"
    with open(path) as f, open(cut, "w") as g:
        lines = f.readlines()
        g.writelines([lines[0]] + lines[201:])
    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(cut)]) == 2
    assert "cannot re-execute" in capsys.readouterr().err


async def test_a_cut_recording_reexecutes_up_to_its_cut(tmp_path):
    """A process killed mid-run leaves its recording cut: re-executed with ``cut``, everything
    up to the last recorded event is compared and matches; what the re-execution goes on to do
    after it was never recorded. Without ``cut`` the same prefix differs (the run goes on)."""
    path = tmp_path / "chaos.jsonl"
    # seed 4: a run whose first half steps (seed 3's pauses abort everything early on)
    await chaos(path, seed=4, in_thread=False, n=200)
    _, events = read_recording(path)
    shut = next(i for i, e in enumerate(events) if e.kind == "input" and e.event == "shutdown")
    prefix = events[:shut // 2]                       # the kill: mid-run, requests in flight
    assert sum(1 for e in prefix if e.kind == "input" and e.event == "generate") > 10
    rx = await reexecute(prefix, cut=True)
    assert rx.ok, rx.format()
    assert sum(a for a, _ in rx.steps.values()) > 10
    assert not (await reexecute(prefix)).ok
