"""The model step runs off the event loop: the server answers while a step is in progress."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from actorserve.actors.runtime import Runtime
from actorserve.config import ModelConfig, SchedulerConfig, ServerConfig
from actorserve.http.edge.app import build_app

from http_support import NAME, load_tiny


class StalledEngine:
    """Wraps a real runner; its steps wait on a gate so a test can hold one open."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.info = inner.info
        self.gate = threading.Event()
        self.in_step = threading.Event()

    def execute(self, batch):
        self.in_step.set()
        self.gate.wait(30)
        return self.inner.execute(batch)

    def release(self, seq):
        self.inner.release(seq)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


async def test_health_answers_during_a_long_model_step(tiny):
    from actorserve.engine.runners.runner import build_engine

    model, hf_tok, tok = tiny
    engine = StalledEngine(build_engine(model, num_blocks=64, block_size=16, tokenizer=hf_tok, model_name=NAME))
    rt = Runtime(engine, config=SchedulerConfig(step_in_thread=True))
    app = build_app(rt, tok, ServerConfig(model=ModelConfig(model="tiny")), NAME)
    async with TestServer(app, host="127.0.0.1", port=0) as server, TestClient(server) as client:
        gen = asyncio.ensure_future(client.post("/generate", json={
            "text": "hello there", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}))
        assert await asyncio.to_thread(engine.in_step.wait, 10)
        for _ in range(3):   # the step is still blocked, the loop is not
            r = await asyncio.wait_for(client.get("/health"), 5)
            assert r.status == 200
            info = await asyncio.wait_for(client.get("/server_info"), 5)
            assert info.status == 200
        assert not gen.done() and rt.stats().step_in_flight
        engine.gate.set()
        resp = await asyncio.wait_for(gen, 30)
        body = await resp.json()
        assert resp.status == 200 and body["meta_info"]["completion_tokens"] == 3
