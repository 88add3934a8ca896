"""Typed application state shared by every route module (`web.AppKey`s and one context object).

The app holds one `ServerContext`: the runtime, the tokenizer, the config, the served name and
the metrics. Routes read it with ``request.app[CTX]``; nothing else is stored on the app.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ...actors.runtime import Runtime
from ...config import ServerConfig
from ...engine.text.tokenizer import TextTokenizer

DEFAULT_ALIAS = "default"


@dataclass(slots=True)
class ServerContext:
    runtime: Runtime
    tokenizer: TextTokenizer
    config: ServerConfig
    served_name: str
    metrics: Any = None                                   # http.metrics.Metrics
    created: int = 0                                      # unix time, for /v1/models
    extra: dict[str, Any] = field(default_factory=dict)
    background: Any = None                                # http.responses_background.BackgroundRuns

    @property
    def capacity(self) -> int:
        """Tokens one sequence may hold (prompt + output)."""
        return self.runtime.engine_info.capacity

    def model_names(self) -> tuple[str, str]:
        return (self.served_name, DEFAULT_ALIAS)


CTX: web.AppKey[ServerContext] = web.AppKey("actorserve_ctx", ServerContext)
