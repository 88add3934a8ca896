"""Reading a request body as JSON without trusting it.

`json.loads` is a recursive-descent parser: ``[`` × 50,000 exhausts the interpreter's stack
(a RecursionError, so a 500, before any handler code runs). It also accepts ``NaN`` and
``Infinity`` (not JSON), overflows ``1e400`` to ``inf``, hands lone UTF-16 surrogates
(``"\\ud800"``) through as a ``str`` that every tokenizer then refuses with a TypeError, and an
integer literal of 5,000 digits trips Python's int-conversion limit. Each of these is the
client's mistake, so each must be a 400 that says what is wrong, and none may reach the engine.

So a body is read in four steps, each linear in its size:

1. **decode** strict UTF-8 (a leading BOM is skipped), as RFC 8259 asks of JSON on the wire;
2. **depth scan**, before the parser runs: one regex cuts out the string literals (a string that
   never closes runs to the end of the text, so the scan never backtracks), the brackets left
   are mapped to +1 / -1, and the running sum of those is the nesting depth, all in C loops.
   Deeper than `MAX_DEPTH` is refused; the parser then never recurses further than that. For
   valid JSON the scan agrees with the parser exactly; for invalid JSON it agrees on the
   prefix the parser reads before it fails, so it can only refuse earlier, never later;
3. **parse** with hooks: ``NaN`` / ``Infinity`` / ``-Infinity``, a float that overflows and an
   integer of more than `MAX_INT_DIGITS` digits become `_Rejected` markers instead of values;
4. **audit**, only when a marker was made or the text holds a surrogate escape
   (``\\uD800``-``\\uDFFF``): walk the tree, now at most `MAX_DEPTH` deep, to the first bad value
   and name its path (``messages.0.content``, pydantic's dotted style) in the error's ``param``.

`read_json` wraps this for aiohttp: the Content-Type policy (below), the size limit (413 from
aiohttp), an unreadable body (a broken ``Content-Encoding``: 400) and "the body is an object".

Content-Type policy, as vLLM's and SGLang's (FastAPI's) routes have it. A body is JSON when it
says so: ``application/json`` or an ``application/*+json`` type, with any parameters, in UTF-8
(no charset, or ``utf-8`` / ``ascii``). Any other declared type is a 415 in the OpenAI error
shape, before the body is read: ``text/plain``, ``application/x-www-form-urlencoded`` (what
``curl -d`` sends), ``application/octet-stream`` (aiohttp's ``data=bytes``), ``multipart/*``, an
image, XML, another charset. vLLM answers all of these 415 (its ``validate_json_request``),
SGLang 400 ("Unsupported Media Type") on its OpenAI routes and a validation error elsewhere.

A body with **no** Content-Type splits the peers by route, and so does it here:

* the OpenAI-compatible, vLLM and Cohere routes (``/v1/*``, ``/v2/*``, ``/tokenize``,
  ``/detokenize``, ``/score``, ``/rerank``) refuse it with a 415, as vLLM does (SGLang: 400);
* SGLang's native routes (`UNTYPED_JSON_PATHS`: ``/generate``, ``/encode``, ``/classify``, the
  control routes, ``/start_profile``) parse it as JSON, as SGLang does there: FastAPI reads an
  untyped body as JSON, and SGLang checks the type only on its OpenAI routes.

A route whose body is optional takes no body (and so no Content-Type) as ``{}``.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from aiohttp import hdrs, web

from .errors import APIError

MAX_DEPTH = 64                # nested arrays / objects in one body
MAX_INT_DIGITS = 40           # an int64 has 19; longer literals are no count or id of anything

_STRING = re.compile(r'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.S)   # possessive: linear, no backtracking
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_STEP = [0] * 256                # byte -> depth change
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
_CHUNK = 1 << 16
_LONG_DIGITS = re.compile(r"\d{%d}" % (MAX_INT_DIGITS + 1))
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")

#: SGLang's native routes: there an untyped body is read as JSON (see the module doc)
UNTYPED_JSON_PATHS = frozenset({
    "/generate", "/encode", "/classify", "/abort_request", "/pause_generation", "/continue_generation",
    "/flush_cache", "/open_session", "/close_session", "/start_profile"})
UTF8_NAMES = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})


class _Rejected:
    """A value the parser met but must not hand on (why says what it was)."""
    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _bad_json(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, code="invalid_json", param=param)


def decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _bad_json(f"request body is not valid UTF-8 (byte {exc.start}); JSON must be "
                        "sent as UTF-8") from None


def check_depth(text: str, max_depth: int = MAX_DEPTH) -> None:
    """Refuse ``text`` when its arrays / objects nest deeper than ``max_depth``."""
    if text.count("[") + text.count("{") <= max_depth:
        return
    outside = _STRING.sub("", text).encode("utf-8", "replace")
    brackets = outside.translate(None, _NOT_BRACKETS)
    level = 0
    for start in range(0, len(brackets), _CHUNK):      # chunks: a deep body stops early
        sums = list(accumulate(map(_STEP.__getitem__, brackets[start:start + _CHUNK]), initial=level))
        if max(sums) > max_depth:
            raise _bad_json(f"request body nests arrays/objects deeper than {max_depth} levels")
        level = sums[-1]


def _find_rejected(value: Any, path: str) -> tuple[str, str] | None:
    """The path of the first marker or lone-surrogate string under ``value``, and why."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            return path, "contains a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape)"
        return None
    if isinstance(value, _Rejected):
        return path, value.why
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        name = _SURROGATE.sub("\ufffd", str(key))
        where = f"{path}.{name}" if path else name
        if isinstance(key, str) and name != key:
            return where, "is a key with a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape)"
        found = _find_rejected(item, where)
        if found is not None:
            return found
    return None


def loads(raw: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a request body; every hostile input is an `APIError` 400 (code ``invalid_json``)."""
    text = decode(raw) if isinstance(raw, (bytes, bytearray)) else raw
    if not text.strip():
        raise _bad_json("request body is empty; expected a JSON object")
    check_depth(text, max_depth)
    rejected: list[_Rejected] = []

    def mark(why: str) -> _Rejected:
        marker = _Rejected(why)
        rejected.append(marker)
        return marker

    def constant(name: str) -> Any:
        return mark(f"is {name}, which is not valid JSON (numbers must be finite)")

    def floating(literal: str) -> Any:
        value = float(literal)
        return value if math.isfinite(value) else mark(f"is {literal[:40]}, which overflows a float")

    def integer(literal: str) -> Any:
        digits = len(literal) - literal.startswith("-")
        if digits > MAX_INT_DIGITS:
            return mark(f"is an integer of {digits} digits (at most {MAX_INT_DIGITS})")
        return int(literal)

    hooks: dict[str, Any] = {"parse_constant": constant, "parse_float": floating}
    if _LONG_DIGITS.search(text):        # only then: the hook costs the C fast path for ints
        hooks["parse_int"] = integer
    try:
        value = json.loads(text, **hooks)
    except json.JSONDecodeError as exc:
        raise _bad_json(f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, "
                        f"column {exc.colno})") from None
    if rejected or _SURROGATE_ESCAPE.search(text):
        found = _find_rejected(value, "")
        if found is not None:
            path, why = found
            raise _bad_json(f"{path or 'the body'} {why}", param=path or None)
    return value


def _unsupported(message: str) -> APIError:
    return APIError(415, message, code="unsupported_media_type")


def is_json_type(ctype: str) -> bool:
    """``application/json`` or ``application/*+json`` (a lower-cased media type, no parameters)."""
    return ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))


def check_content_type(request: web.Request) -> None:
    """415 unless the body is declared UTF-8 JSON, or undeclared on a route of
    `UNTYPED_JSON_PATHS` (see the module doc)."""
    if not request.headers.get(hdrs.CONTENT_TYPE, "").strip():
        if request.path in UNTYPED_JSON_PATHS:
            return
        raise _unsupported("the request has no Content-Type; send the body as JSON with "
                           "Content-Type: application/json")
    ctype = request.content_type
    if not is_json_type(ctype):
        raise _unsupported(f"Content-Type {ctype!r} is not supported; send the body as JSON "
                           "(Content-Type: application/json)")
    charset = request.charset
    if charset and charset.lower() not in UTF8_NAMES:
        raise _unsupported(f"charset {charset!r} is not supported; JSON bodies must be UTF-8")


async def read_json(request: web.Request, *, optional: bool = False) -> Any:
    """The request's body as a JSON object (a dict); with ``optional``, no body reads as ``{}``.
    Raises `APIError` 400 / 415, or aiohttp's 413 past the app's ``client_max_size``."""
    if optional and not request.can_read_body:
        return {}
    check_content_type(request)
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:     # e.g. a body that is not the gzip it claims
        raise APIError(400, f"the request body could not be read: {exc.__cause__ or exc}",
                       code="invalid_body", headers={"Connection": "close"}) from None
    if optional and not raw.strip():
        return {}
    value = loads(raw)
    if not isinstance(value, dict):
        kind = "null" if value is None else type(value).__name__
        kind = {"list": "an array", "str": "a string", "int": "a number", "float": "a number",
                "bool": "a boolean"}.get(kind, kind)
        raise _bad_json(f"request body must be a JSON object, got {kind}")
    return value
