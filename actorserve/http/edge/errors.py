"""Errors in the OpenAI shape, and the middleware that maps every failure to one.

Body: ``{"error": {"message", "type", "code", "param"}}``. Client mistakes are 4xx, never 500:

* bad JSON (`safe_json`: too deep, NaN, lone surrogates, ...), pydantic ``ValidationError``,
  ``ParamError``, ``ValueError`` (chat template, tokenizer), ``DuplicateRequestId`` -> 400
  ``invalid_request_error``, with ``param`` naming the field where it is known (a pydantic
  location as ``messages.0.content``; a `FieldError`'s own; else the field a ``ParamError``
  message begins with, as in ``top_k must be ...``)
* unknown model -> 404 ``model_not_found``; bad key -> 401; body too large -> 413; a body
  that is not JSON by its Content-Type -> 415; server starting/draining/stopped -> 503
* any other exception -> 500 with the same shape, logged with its traceback; if an SSE
  stream had already started, the error goes out as a last ``data:`` event instead.

Handlers raise `APIError` (or one of the exceptions above) and let the middleware answer.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from ...actors.surface import DuplicateRequestId, Overloaded
from ...engine.scheduling.params import ParamError

log = logging.getLogger("actorserve.http")
# An SSE response already sent for this request (set by sse.open_sse).
SSE_KEY: web.RequestKey[web.StreamResponse] = web.RequestKey("actorserve_sse", web.StreamResponse)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error meant for the client, with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 code: str | int | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.code = code if code is not None else status
        self.param = param
        self.headers = headers or {}      # e.g. Retry-After on a 503 from admission control


class FieldError(ParamError):
    """A client value out of range, naming the field (``param``) it was found in."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def error_body(status: int, message: str, *, type: str | None = None, code: Any = None,
               param: str | None = None) -> dict[str, Any]:
    err = APIError(status, message, type=type, code=code, param=param)
    return {"error": {"message": err.message, "type": err.type, "code": err.code, "param": err.param}}


def error_response(err: APIError) -> web.Response:
    body = {"error": {"message": err.message, "type": err.type, "code": err.code, "param": err.param}}
    return web.json_response(body, status=err.status, headers=err.headers or None)


# pydantic names a union's member in the location (``stop.list[str]``, ``prompt.list[constrained-int].0``).
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
_LEADING_FIELD = re.compile(r"^([A-Za-z_]\w*(?:\[\d+\]|\.\w+)*) (?:must|requires|is required)")


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part or part[:1].isupper()
                                      or part.startswith(("constrained-", "function-")))


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One line for the client, and the field (``param``). A union's members each report; where
    one of them has a specific complaint (a bound, a length), the field's "not a valid <type>"
    reports from the other members are noise and are dropped."""
    found = []
    for e in exc.errors(include_url=False):
        loc = [str(x) for x in e.get("loc", ()) if not _is_union_tag(x)]
        msg = str(e.get("msg"))
        if e.get("type") == "extra_forbidden":
            msg = "unsupported field: actorserve would not honour it (see docs/api.md, accepted fields)"
        found.append((".".join(loc), loc[0] if loc else "", str(e.get("type", "")).endswith("_type"), msg))
    specific = {top for _, top, is_type, _ in found if not is_type}
    by_loc: dict[str, list[str]] = {}
    for loc, top, is_type, msg in sorted(found, key=lambda f: f[2]):       # stable: specific first
        if is_type and top in specific:
            continue
        msgs = by_loc.setdefault(loc, [])
        if msg not in msgs:
            msgs.append(msg)
    parts = [f"{loc}: {' or '.join(m)}" if loc else " or ".join(m) for loc, m in list(by_loc.items())[:5]]
    param = next((loc for loc in by_loc if loc), None)
    return "; ".join(parts) or "invalid request", param


def _param_of(exc: BaseException) -> str | None:
    param = getattr(exc, "param", None)
    if isinstance(param, str):
        return param
    m = _LEADING_FIELD.match(str(exc))
    return re.sub(r"\[(\d+)\]", r".\1", m.group(1)) if m else None


def to_api_error(exc: BaseException) -> APIError | None:
    """Map a known client-side exception to an `APIError`; None when it is unexpected."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Overloaded):       # admission control: come back later
        return APIError(503, str(exc), type="server_overloaded", code="server_overloaded",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, json.JSONDecodeError):
        return APIError(400, f"request body is not valid JSON: {exc}")
    if isinstance(exc, ValidationError):
        msg, param = _validation_message(exc)
        return APIError(400, msg, param=param)
    if isinstance(exc, DuplicateRequestId):
        return APIError(400, str(exc), param="rid")
    if isinstance(exc, UnicodeDecodeError):
        return APIError(400, "request body is not UTF-8")
    if isinstance(exc, ValueError):      # ParamError; chat template / tokenizer shape errors
        return APIError(400, str(exc), param=_param_of(exc))
    return None


def _from_http_exception(exc: web.HTTPException) -> APIError:
    status = exc.status
    if status == 413:
        return APIError(413, exc.text or "request body too large")
    if status == 404:
        return APIError(404, "not found", code="not_found")
    if status == 405:
        return APIError(405, "method not allowed")
    return APIError(status, exc.reason or "error")


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ConnectionError:      # the client went away: nothing to answer, nothing to log
        raise
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_http_exception(exc))
    except Exception as exc:      # noqa: BLE001 - this is the one place that answers 500
        err = to_api_error(exc)
        if err is None:
            log.exception("unhandled error in %s %s", request.method, request.path)
            err = APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")
        stream = request.get(SSE_KEY)
        if stream is not None and stream.prepared:
            return await _error_event(stream, err)
        return error_response(err)


async def _error_event(stream: web.StreamResponse, err: APIError) -> web.StreamResponse:
    """The SSE stream had started: report the error as an event, then end the stream."""
    body = {"error": {"message": err.message, "type": err.type, "code": err.code, "param": err.param}}
    try:
        await stream.write(f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode())
        await stream.write_eof()
    except ConnectionError:
        pass
    return stream
