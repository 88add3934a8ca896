"""SGLang's `/start_profile` / `/stop_profile` over the tiny model: torch's operator spans from
the model-step thread and the server's lifecycle tracks, one Chrome-trace file on one timeline."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from actorserve.http.profile_routes import ALREADY, NOT_RUNNING, TORCH_PID
from actorserve.http.state import CTX
from http_support import NAME, assert_error, load_tiny, serve, settle, until


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
        for body, param in (({"activities": ["MEM"]}, "activities.0"), ({"start_step": 3}, "start_step"),
                            ({"profile_by_stage": True}, "profile_by_stage"), ({"num_steps": 0}, "num_steps"),
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
        await _error(await http.post("/stop_profile"), 400, NOT_RUNNING)
        r = await http.get("/start_profile")              # GET starts one too (SGLang's api_route)
        assert r.status == 200
        assert (await http.post("/stop_profile")).status == 200
        await settle(rt)
    path = tmp_path / "env" / "auto-p1-TP-0.trace.json.gz"
    assert ctx.extra["profile_last"] == str(path) or path.exists()
    doc = _load(path)
    assert any(e.get("cat") == "cpu_op" for e in doc["traceEvents"])
    assert len(list((tmp_path / "env").glob("*.trace.json.gz"))) == 2
