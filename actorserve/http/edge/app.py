"""`build_app`: the aiohttp application over a started (or to-be-started) `Runtime`.

One route table (OpenAI, native, control, pooling, Cohere v2, metrics, `/openapi.json` from
`openapi`), two middlewares (errors outermost, then auth: with an API key every route but
`/health` and `/openapi.json` needs ``Authorization: Bearer KEY``), the body limit from
``config.max_body_bytes``, and typed app state under `CTX`. The live-inspection routes
(`/debug/*`, see `debug_routes`) exist only with ``config.debug_routes``. The runtime is
started and shut down in a ``cleanup_ctx`` step, so the app owns its lifetime.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from aiohttp import web

from ...actors.runtime import Runtime
from ...config import ServerConfig
from ...engine.text.tokenizer import TextTokenizer
from ..pooling import cohere_routes, pooling_routes
from ..native import control_routes, native_routes
from . import debug_routes
from ..openai import openai_routes
from ..responses import responses_routes
from ..pooling import classify_routes, score_routes, vllm_routes
from ..native import profile_routes, reasoning_routes, tokenize_routes
from ..native import lora_routes, memory_routes, vllm_control_routes, weights_dist_routes, weights_routes
from .openapi import openapi_handler
from ..responses.responses_background import BackgroundRuns
from .auth import auth_middleware, open_paths
from .errors import error_middleware
from .metrics import Metrics, metrics_handler
from .state import CTX, ServerContext

async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """A client's ``X-Request-Id`` comes back on its response (errors and streams too)."""
    rid = request.headers.get("X-Request-Id")
    if rid is not None and len(rid) <= 256 and rid.isprintable():
        response.headers["X-Request-Id"] = rid


async def _runtime_lifetime(app: web.Application) -> AsyncIterator[None]:
    rt = app[CTX].runtime
    await rt.start()
    yield
    await rt.shutdown()
    await app[CTX].background.close()     # each background reader's stream ended with the runtime


async def _leave_background(app: web.Application) -> None:
    await app[CTX].background.close(cancel=True)    # not our runtime: abort what still runs


def build_app(runtime: Runtime, tokenizer: TextTokenizer, config: ServerConfig, served_name: str,
              *, own_runtime: bool = True, pool_models: dict[str, Any] | None = None) -> web.Application:
    """The app; with ``own_runtime`` it starts the runtime on startup and shuts it down on cleanup.
    ``pool_models``: target -> `http.pooling.pooling.PoolModel` for the runtime's pooling engines."""
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[error_middleware,
                                       auth_middleware(config.api_key, open_paths(config))])
    app.on_response_prepare.append(_echo_request_id)
    ctx = ServerContext(runtime=runtime, tokenizer=tokenizer, config=config, served_name=served_name,
                        created=int(time.time()), background=BackgroundRuns(runtime.responses_capacity))
    ctx.metrics = Metrics(runtime.stats, runtime.snapshot, runtime.pool_stats, model_name=served_name,
                          scheme=config.metrics_names,
                          pool_names={t: pm.name for t, pm in (pool_models or {}).items()})
    if runtime.new_detokenizer is None and tokenizer is not None:   # the output stage detokenizes
        runtime.new_detokenizer = tokenizer.detokenizer_for
    app[CTX] = ctx
    ctx.extra["pooling"] = dict(pool_models or {})
    app.router.add_routes(tokenize_routes.ROUTES + score_routes.ROUTES + reasoning_routes.ROUTES
                          + profile_routes.ROUTES)
    app.router.add_routes(pooling_routes.ROUTES + cohere_routes.ROUTES)
    app.router.add_routes(classify_routes.ROUTES + vllm_routes.ROUTES + weights_routes.ROUTES
                          + vllm_control_routes.ROUTES + memory_routes.ROUTES)
    app.router.add_routes(weights_dist_routes.ROUTES + lora_routes.ROUTES)
    app.router.add_routes(openai_routes.ROUTES + responses_routes.ROUTES + native_routes.ROUTES + control_routes.ROUTES
                          + [web.get("/metrics", metrics_handler), web.get("/openapi.json", openapi_handler)])
    if config.debug_routes:
        debug_routes.setup(app)
    if own_runtime:
        app.cleanup_ctx.append(_runtime_lifetime)
    if config.model.lora_paths:        # after the runtime has started (cleanup_ctx runs first)
        app.on_startup.append(lora_routes.load_at_startup)
    else:
        app.on_cleanup.append(_leave_background)
    return app
