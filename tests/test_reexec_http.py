"""Re-execution of a recording made by the real server: the tiny model in a worker thread, the
event loop's own clock, the official `openai` client, a client that walks away mid-stream,
pause/continue, a health probe, scoring (a pooling forward), and a session over HTTP."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from openai import AsyncOpenAI

from actorserve.cli import main as cli
from actorserve.replay.check import check
from actorserve.replay.recorder import read_recording
from actorserve.replay.reexec import reexecute, steps_of

from http_support import NAME, load_tiny, serve, settle, until


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


async def test_a_live_server_recording_reexecutes_step_for_step(tiny, tmp_path, capsys):
    path = tmp_path / "live.jsonl"
    async with serve(tiny, kv_blocks=128, record_path=path) as (http, rt):
        oa = AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0, timeout=60)

        async def chat(i: int) -> str | None:
            stream = await oa.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": f"count to {i}"}],
                max_tokens=4 + 3 * i, temperature=0.8, seed=i, stream=True,
                stop=["e"] if i % 3 == 0 else None, extra_body={"ignore_eos": i % 3 != 0})
            return [c.choices[0].finish_reason async for c in stream if c.choices][-1]

        async def walk_away() -> None:
            resp = await http.post("/generate", json={"text": "go", "stream": True, "sampling_params":
                                                      {"max_new_tokens": 500, "ignore_eos": True}})
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
            resp.close()                                    # the client disconnects

        async def pause_continue() -> None:
            await until(lambda: rt.stats().running > 0)     # the retract finds requests decoding
            assert (await http.post("/pause_generation", json={"mode": "retract"})).status == 200
            assert (await http.post("/continue_generation", json={})).status == 200

        async def session() -> None:
            assert (await http.post("/open_session", json={"session_id": "s"})).status == 200
            for i in range(2):
                r = await http.post("/generate", json={"text": f"turn {i}", "session_params": {"id": "s"},
                                                       "sampling_params": {"max_new_tokens": 3}})
                assert r.status == 200, await r.text()
            assert (await http.post("/close_session", json={"session_id": "s"})).status == 200

        async def score() -> None:
            r = await http.post("/v1/score", json={"query": "is it", "items": ["yes", "no"],
                                                   "label_token_ids": [1, 2]})
            assert r.status == 200, await r.text()

        results = await asyncio.gather(*(chat(i) for i in range(8)), walk_away(), pause_continue(),
                                       session(), score(), http.get("/health_generate"))
        assert set(results[:8]) <= {"stop", "length"} and results[-1].status == 200
        await oa.close()
        await settle(rt)
        await rt.shutdown()

    _, events = read_recording(path)
    assert check(events).ok
    inputs = Counter(e.event for e in events if e.kind == "input")
    assert {"generate", "pool", "delivered", "control", "session", "step_end", "health_done"} <= set(inputs), inputs
    aborts = [e.data["args"]["reason"] for e in events if e.kind == "input" and e.event == "control"
              and e.data["op"] == "AbortRequest"]
    assert "client went away" in aborts, aborts    # the walk-away is a recorded control request
    report = await reexecute(events)
    assert report.ok, report.format()
    assert report.drift == 0 and report.fillers == 0
    n_steps = len(steps_of(events)["scheduler"])
    assert report.steps["scheduler"] == (n_steps, n_steps) and n_steps > 10
    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(path)]) == 0
    assert "every step's batch and every transition match" in capsys.readouterr().out
