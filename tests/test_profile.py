"""SGLang's `/start_profile` / `/stop_profile` over the tiny model: torch's operator spans from
the model-step thread and the server's lifecycle tracks, one Chrome-trace file on one timeline."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from actorserve.http.native.profile_routes import ALREADY, NOT_RUNNING, TORCH_PID
from actorserve.http.edge.state import CTX
from http_support import NAME, assert_error, load_tiny, serve, settle, until
from actor_access import actor_of


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def _load(path: Path) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


async def _error(r, status: int, message: str | None = None, param: str | None = None) -> dict:
    body = await r.json()
    assert r.status == status, body
    assert_error(body, "invalid_request_error")
    if message is not None:
        assert body["error"]["message"] == message
    if param is not None:
        assert body["error"]["param"] == param, body
    return body



def _written(ctx) -> bool:
    """The profile stopped and its files are written: ``stop`` holds the profile lock until the
    last file is down (the profile itself is cleared first)."""
    lock = ctx.extra.get("profile_lock")
    return ctx.extra.get("profile") is None and not (lock is not None and lock.locked())

async def test_start_stop_writes_one_trace_with_lifecycles_and_torch_ops(tiny, tmp_path):
    async with serve(tiny, profile_dir=str(tmp_path)) as (http, rt):
        await _error(await http.post("/stop_profile"), 400, NOT_RUNNING)
        r = await http.post("/start_profile")           # sglang.bench_serving posts no body
        assert r.status == 200 and await r.text() == "Start profiling.\n"
        await _error(await http.post("/start_profile", json={}), 400, ALREADY)
        async with AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0) as oa:
            c = await oa.completions.create(model=NAME, prompt="hello there", max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert c.usage.completion_tokens == 4
        r = await http.post("/stop_profile")
        assert r.status == 200 and await r.text() == "Stop profiling. This will take some time.\n"
        await _error(await http.get("/stop_profile"), 400, NOT_RUNNING)
        await settle(rt)
    files = list(tmp_path.glob("*-TP-0.trace.json.gz"))
    assert len(files) == 1, files
    doc = _load(files[0])
    evs = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(1, "actorserve"), (2, "requests"), (TORCH_PID, "torch (model step thread)")}
    # the lifecycle tracks: the request's states, and the scheduler's model steps
    states = [e["name"] for e in evs if e["ph"] in ("X", "i") and e["pid"] == 2 and e.get("cat") == "generation"]
    assert {"queued", "prefill", "decode", "done"} <= set(states), states
    steps = [e for e in evs if e["ph"] == "X" and e.get("cat") == "step"]
    assert len(steps) >= 4                       # a prefill and a decode per token after it
    # torch's operator spans, each inside a model step: the two clocks are one timeline
    ops = [e for e in evs if e["pid"] == TORCH_PID and e["ph"] == "X" and e.get("cat") == "cpu_op"]
    assert {"aten::mul", "aten::rsqrt", "aten::mean"} <= {e["name"] for e in ops}      # RMSNorm, at least
    slack = 500.0                                # µs
    for op in ops:
        assert any(s["ts"] - slack <= op["ts"] and op["ts"] + op["dur"] <= s["ts"] + s["dur"] + slack
                   for s in steps), op


async def test_num_steps_stops_by_itself_and_the_body_is_sglangs(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    async with serve(tiny) as (http, rt):
        for body, param in (({"activities": ["TPU"]}, "activities.0"), ({"start_step": -1}, "start_step"),
                            ({"start_step": "two"}, "start_step"), ({"num_steps": "-3"}, "num_steps"),
                            ({"num_steps": True}, "num_steps"), ({"num_steps": "2.5"}, "num_steps"),
                            ({"profile_by_stage": "maybe"}, "profile_by_stage"),
                            ({"profile_stages": ["verify"]}, "profile_stages.0"),
                            ({"profile_stages": []}, "profile_stages"), ({"num_steps": 0}, "num_steps"),
                            ({"profile_stages": ["decode"]}, "profile_stages"),   # without profile_by_stage
                            ({"bogus": 1}, "bogus"), ({"profile_prefix": "../x"}, "profile_prefix")):
            await _error(await http.post("/start_profile", json=body), 400, param=param)
        r = await http.post("/start_profile", data=b'{"x": 1}', headers={"Content-Type": "text/plain"})
        assert r.status == 415
        r = await http.post("/start_profile", json={"num_steps": 2, "profile_prefix": "auto", "profile_id": "p1",
                                                     "activities": ["CPU", "GPU"], "record_shapes": True,
                                                     "merge_profiles": True, "start_step": None})
        assert r.status == 200, await r.text()
        r = await http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4,
                                                                                "ignore_eos": True}})
        assert r.status == 200
        ctx = http.server.app[CTX]
        await until(lambda: ctx.extra.get("profile_last") is not None)      # written after 2 steps
        first = ctx.extra["profile_last"]
        await _error(await http.post("/stop_profile"), 400, NOT_RUNNING)
        r = await http.get("/start_profile")              # GET starts one too (SGLang's api_route)
        assert r.status == 200
        assert (await http.post("/stop_profile")).status == 200
        await settle(rt)
    path = tmp_path / "env" / "auto-p1-TP-0.trace.json.gz"
    assert first == str(path)
    doc = _load(path)
    assert any(e.get("cat") == "cpu_op" for e in doc["traceEvents"])
    assert len(list((tmp_path / "env").glob("*.trace.json.gz"))) == 2


# -- start_step, profile_by_stage / profile_stages, activities -------------------------------------

def _steps(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") == "step"]


def _ops(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["pid"] == TORCH_PID and e["ph"] == "X" and e.get("cat") == "cpu_op"]


def _inside(ops: list[dict], steps: list[dict], slack: float = 500.0) -> bool:
    return all(any(s["ts"] - slack <= o["ts"] and o["ts"] + o["dur"] <= s["ts"] + s["dur"] + slack
                   for s in steps) for o in ops)


async def _generate(http, tokens: int, text: str = "hello there, how are you") -> None:
    r = await http.post("/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}})
    assert r.status == 200, await r.text()


async def test_start_step_and_num_steps_as_strings_record_exactly_that_window(tiny, tmp_path):
    """bench_serving --profile-start-step 2 --profile-steps 3 sends both as strings."""
    async with serve(tiny, profile_dir=str(tmp_path)) as (http, rt):
        ctx = http.server.app[CTX]
        first = actor_of(rt, "scheduler").step_id + 1                # the first step after the start
        r = await http.post("/start_profile", json={"start_step": "2", "num_steps": "3", "profile_id": "w",
                                                     "activities": ["CPU", "GPU"]})
        assert r.status == 200, await r.text()
        await _generate(http, 8)                        # a prefill and 7 decodes: 8 steps
        await until(lambda: _written(ctx))       # stopped by itself
        await _error(await http.post("/stop_profile"), 400, NOT_RUNNING)
        await settle(rt)
    doc = _load(tmp_path / "w-TP-0.trace.json.gz")
    steps = _steps(doc)
    assert sorted(s["args"]["step"] for s in steps) == [first + 2, first + 3, first + 4]
    ops = _ops(doc)
    assert ops and _inside(ops, steps)                  # torch ran around those steps only
    assert doc["otherData"]["steps"] == 3 and doc["otherData"]["stage"] is None
    assert list(tmp_path.iterdir()) == [tmp_path / "w-TP-0.trace.json.gz"]


async def test_profile_by_stage_writes_one_file_per_stage_with_only_its_steps(tiny, tmp_path):
    """--profile --profile-num-steps 2 --profile-by-stage: SGLang's body, files named its way."""
    async with serve(tiny, profile_dir=str(tmp_path)) as (http, rt):
        ctx = http.server.app[CTX]
        body = {"activities": ["CPU", "GPU"], "num_steps": 2, "profile_by_stage": True, "profile_stages": None,
                "output_dir": str(tmp_path / "out"), "profile_prefix": None, "profile_id": "s"}
        assert (await http.post("/start_profile", json=body)).status == 200
        await _generate(http, 2)          # a prefill, a decode: prefill's file waits for a 2nd
        assert not (tmp_path / "out" / "s-TP-0-prefill.trace.json.gz").exists()
        await _generate(http, 4, "another prompt of several tokens")
        await until(lambda: _written(ctx))
        await _error(await http.post("/stop_profile"), 400, NOT_RUNNING)
        await settle(rt)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["s-TP-0-decode.trace.json.gz", "s-TP-0-prefill.trace.json.gz"]
    for stage in ("prefill", "decode"):
        doc = _load(tmp_path / "out" / f"s-TP-0-{stage}.trace.json.gz")
        steps = _steps(doc)
        assert len(steps) == 2 and doc["otherData"]["stage"] == stage and doc["otherData"]["steps"] == 2
        tokens = [s["args"]["tokens"] for s in steps]
        assert all(t > 1 for t in tokens) if stage == "prefill" else tokens == [1, 1], (stage, tokens)
        ops = _ops(doc)
        assert ops and _inside(ops, steps), stage        # no torch span outside its stage's steps
        # P D | P D D D: each stage's two steps were not adjacent: two windows, torch stopped between
        assert doc["otherData"]["windows"] == 2
        states = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") == "generation"}
        assert stage in states                          # the lifecycle tracks of its windows


async def test_profile_stages_picks_the_stage_and_stop_writes_what_was_recorded(tiny, tmp_path):
    async with serve(tiny, profile_dir=str(tmp_path)) as (http, rt):
        r = await http.post("/start_profile", json={"profile_by_stage": True, "profile_stages": ["decode"],
                                                     "num_steps": "50", "profile_id": "d"})
        assert r.status == 200
        await _generate(http, 4)                        # 3 decodes of the 50: still recording
        assert (await http.post("/stop_profile")).status == 200
        await settle(rt)
    assert [p.name for p in tmp_path.iterdir()] == ["d-TP-0-decode.trace.json.gz"]
    doc = _load(tmp_path / "d-TP-0-decode.trace.json.gz")
    assert [s["args"]["tokens"] for s in _steps(doc)] == [1, 1, 1]
    assert doc["otherData"]["steps"] == 3


async def test_activities_this_machine_cannot_record_are_skipped_and_said(tiny, tmp_path):
    import torch
    cuda = torch.cuda.is_available()
    async with serve(tiny, profile_dir=str(tmp_path)) as (http, rt):
        for pid, acts in (("all", ["CPU", "GPU", "MEM", "CUDA_PROFILER", "XPU"]), ("mem", ["MEM"]), ("none", [])):
            r = await http.post("/start_profile", json={"activities": acts, "profile_id": pid, "num_steps": 2})
            assert r.status == 200, await r.text()
            await _generate(http, 2)
            await until(lambda: _written(http.server.app[CTX]))
        await settle(rt)
    doc = _load(tmp_path / "all-TP-0.trace.json.gz")
    other = doc["otherData"]
    assert other["activities_recorded"] == ["CPU"] + (["GPU", "MEM", "CUDA_PROFILER"] if cuda else [])
    assert set(other["activities_skipped"]) == ({"XPU"} if cuda else {"GPU", "MEM", "CUDA_PROFILER", "XPU"})
    assert _ops(doc)
    if not cuda:
        assert "no CUDA memory snapshot" in other["activities_skipped"]["MEM"]
        for pid in ("mem", "none"):                     # nothing torch can record: the lifecycle tracks still
            doc = _load(tmp_path / f"{pid}-TP-0.trace.json.gz")
            assert doc["otherData"]["activities_recorded"] == [] and doc["otherData"]["torch_events"] == 0
            assert not [e for e in doc["traceEvents"] if e["pid"] == TORCH_PID and e["ph"] != "M"]
            assert len(_steps(doc)) == 2
            assert any(e.get("cat") == "generation" for e in doc["traceEvents"])


def test_step_stage_is_sglangs_forward_mode_split():
    from actorserve.http.native.profile_plan import step_stage
    assert step_stage([(7, 0, False)]) == "prefill"              # a prompt
    assert step_stage([(1, 0, False)]) == "prefill"              # its last chunk / a cached prompt's last token
    assert step_stage([(1, 3, False), (1, 5, False)]) == "decode"
    assert step_stage([(1, 3, False), (16, 0, False)]) == "prefill"     # MIXED (chunked prefill + decodes)
    assert step_stage([(4, 3, False)]) == "prefill"              # a speculative verify (TARGET_VERIFY)
    assert step_stage([(3, 0, True)]) == "prefill"               # an encoder forward


def test_step_plan_windows():
    from actorserve.http.native.profile_plan import StepPlan
    log: list = []
    clock = iter(range(1000))
    plan = StepPlan(start_step=1, num_steps=2, stages=["prefill", "decode"], now_ns=lambda: next(clock),
                    begin=lambda t: log.append(("begin", t.stage)), end=lambda w: log.append(("end", w.target.stage)),
                    done=lambda t: log.append(("done", t.stage)))
    seq = [("p", 1), ("p", 2), ("d", 3), ("p", 4), ("d", 5), ("d", 6), ("p", 7)]
    for stage, step in seq:
        plan.on_step(("s", step), {"p": "prefill", "d": "decode"}[stage])
        plan.on_step_end(("s", step))
    assert log == [("begin", "prefill"), ("end", "prefill"),                   # step 1 skipped; 2
                   ("begin", "decode"), ("end", "decode"),                     # 3
                   ("begin", "prefill"), ("end", "prefill"), ("done", "prefill"),   # 4: prefill has 2
                   ("begin", "decode"), ("end", "decode"), ("done", "decode")]      # 5: decode has 2
    assert plan.finished and plan.stop() == []
    assert [sorted(w.steps) for w in plan.targets["prefill"].windows] == [[("s", 2)], [("s", 4)]]
