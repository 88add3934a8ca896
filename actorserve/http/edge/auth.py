"""The API key: which paths need it (`open_paths`) and the middleware that checks it.

With ``--api-key`` every route but `OPEN_PATHS` (and `/metrics` with ``--metrics-auth open``)
needs ``Authorization: Bearer KEY``; the comparison is constant-time. `openapi` reads the same
set to say which operations are guarded.
"""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web

from ...config import ServerConfig
from .errors import APIError, error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/openapi.json"})


def open_paths(config: ServerConfig) -> frozenset[str]:
    """Paths that need no API key: `OPEN_PATHS`, and `/metrics` with ``--metrics-auth open``
    (vLLM leaves it open; here it is behind the key unless chosen, the safer default)."""
    return OPEN_PATHS | {"/metrics"} if config.metrics_auth == "open" else OPEN_PATHS


def auth_middleware(api_key: str | None, open_: frozenset[str] = OPEN_PATHS) -> Any:
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if expected is not None and request.path not in open_:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                return error_response(APIError(401, "invalid or missing API key "
                                                    "(send Authorization: Bearer <key>)",
                                               code="invalid_api_key"))
        return await handler(request)

    return check_key
