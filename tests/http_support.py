"""Shared fixtures for the HTTP tests (no tests here): the tiny model, loaded once per module,
and `serve(...)`, an aiohttp test server on 127.0.0.1 over a fresh runtime."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from aiohttp.test_utils import TestClient, TestServer

from actorserve.actors.runtime import Runtime
from actorserve.config import ModelConfig, SchedulerConfig, ServerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.http.edge.app import build_app
from actorserve.http.edge.server import FALLBACK_CHAT_TEMPLATE
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES
from waiting import until as until  # re-exported: the tests import it from here
from actor_access import live_actors

NAME = "tiny-llama"


def load_tiny() -> tuple[Any, Any, Any]:
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer

    model, hf_tok, _ = load_model("tiny", threads=1)
    tok = TextTokenizer(hf_tok, chat_template=FALLBACK_CHAT_TEMPLATE)
    return model, hf_tok, tok


def load_smol() -> tuple[Any, Any, Any]:
    """The embedded SmolLM2-135M-Instruct with its own chat template (structured-output tests)."""
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer

    model, hf_tok, _ = load_model("default", threads=2)
    return model, hf_tok, TextTokenizer(hf_tok, generation_config=model.generation_config)


@contextlib.asynccontextmanager
async def serve(tiny: tuple[Any, Any, Any], *, api_key: str | None = None, kv_blocks: int = 64,
                max_body_bytes: int = 8 << 20, name: str = NAME,
                debug_routes: bool = False,
                record_path: Any = None, responses_store: int = 1000, batch: BatchConfig | None = None,
                **server_kw: Any) -> AsyncIterator[tuple[TestClient, Runtime]]:
    """``server_kw``: more `ServerConfig` fields (metrics_names, metrics_auth, ...)."""
    from actorserve.engine.runners.runner import build_engine

    model, hf_tok, tok = tiny
    engine = build_engine(model, num_blocks=kv_blocks, block_size=16, tokenizer=hf_tok, model_name=name)
    rt = Runtime(engine, config=SchedulerConfig(batch=batch or BatchConfig(), step_in_thread=True,
                                                responses_store=responses_store),
                 recorder=FlightRecorder(capacity=100_000, lifecycles=LIFECYCLES.values(), path=record_path))
    config = ServerConfig(api_key=api_key, max_body_bytes=max_body_bytes,
                          model=ModelConfig(model="tiny", kv_blocks=kv_blocks), debug_routes=debug_routes,
                          **server_kw)
    app = build_app(rt, tok, config, name)
    async with TestServer(app, host="127.0.0.1", port=0, handler_cancellation=True) as server:
        async with TestClient(server) as client:
            yield client, rt


async def settle(rt: Runtime, timeout: float = 10.0) -> None:
    """Wait until no request is live and no KV block is used."""
    def settled() -> bool:
        st = rt.stats()
        return st.live_requests == 0 and st.kv_used_blocks == 0 and not live_actors(rt)
    await until(settled, timeout, poll=0.02, what=lambda: f"runtime did not settle: {rt.stats()}")


def assert_error(body: dict, type_: str | None = None) -> None:
    err = body["error"]
    assert set(err) >= {"message", "type", "code", "param"}, body
    assert isinstance(err["message"], str) and err["message"]
    if type_ is not None:
        assert err["type"] == type_, body


