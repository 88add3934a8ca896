"""The scanner under every tool-call format (`tool_parsers`): what a call and a delta are, the
resumable JSON scan that finds where a call's object ends, and `ToolStream`, which turns text,
fed as it is generated, into content and calls through a format's triggers and ``_region``
(`tool_parsers` has the formats and the rules every answer obeys)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str        # JSON text of the arguments object
    id: str               # "call_" + 24 hex chars


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int            # position of the call in this choice
    id: str | None        # first delta of a call only
    name: str | None      # first delta of a call only
    arguments: str        # a fragment of the arguments JSON text


Delta = ContentDelta | ToolCallDelta


@dataclass(frozen=True, slots=True)
class _Region:
    end: int                                    # where the region stops in the buffer
    calls: list[tuple[str, str]] | None         # (name, arguments JSON); None: it is content


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constant)      # no NaN / Infinity


_STRING_STOP = re.compile(r'["\\]')


class _JsonScan:
    """Finds where the JSON object or array opening at ``s[start]`` ends, resumably: a region
    held open across feeds is scanned once in all, not once per feed. ``end`` answers the end
    index, None while the text may still grow into one, or raises ValueError once it cannot.
    Lax on scalars (json.loads has the final word on those)."""

    __slots__ = ("start", "pos", "stack", "in_string")

    def __init__(self) -> None:
        self.start, self.pos = -1, 0

    def end(self, s: str, start: int) -> int | None:
        if start != self.start:
            self.start, self.pos, self.stack, self.in_string = start, start, [], False
        j, n, stack = self.pos, len(s), self.stack
        while j < n:
            if self.in_string:
                m = _STRING_STOP.search(s, j)
                if m is None or m.group() == "\\" and m.end() == n:
                    j = m.start() if m else n        # wait for the rest of the string / escape
                    break
                j = m.end() + (m.group() == "\\")
                self.in_string = m.group() == "\\"
                continue
            ch = s[j]
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                stack.append("}" if ch == "{" else "]")
            elif ch in "}]":
                if not stack or stack.pop() != ch:
                    raise ValueError("unbalanced")
                if not stack:
                    return j + 1
            elif not stack or not (ch in " \t\r\n,:-+.eE" or ch.isalnum()):
                raise ValueError(f"unexpected {ch!r}")
            j += 1
        self.pos = j
        return None


def _call_of(obj: Any, keys: tuple[str, ...]) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in keys if k in obj), None)
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i].isspace():
        i += 1
    return i


def _json_region(buf: str, start: int, eof: bool, scan: _JsonScan, keys: tuple[str, ...],
                 many: bool = False) -> _Region | None:
    """A call object (or with ``many``, also an array of them) opening at ``buf[start]``."""
    try:
        end = scan.end(buf, start)
    except ValueError:
        return _Region(start + 1, None)
    if end is None:
        return _Region(len(buf), None) if eof else None
    try:
        obj = _loads(buf[start:end])
    except ValueError:
        return _Region(end, None)
    calls = [_call_of(o, keys) for o in (obj if many and isinstance(obj, list) else [obj])]
    ok = [c for c in calls if c is not None]
    return _Region(end, ok if ok and len(ok) == len(calls) else None)


class ToolStream:
    """Incremental `ToolParser.parse`: feed text as it is generated, get content and calls."""

    def __init__(self, parser: Any) -> None:       # a `tool_parsers.ToolParser`
        self.parser = parser
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._after_call = False      # a separator (with whitespace before it) may follow
        self._json = _JsonScan()       # the open region's scan, kept across feeds
        self._open: str | None = None  # the trigger of the region held open
        self._window = max((len(t) for t in parser.triggers), default=1)

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._scan(eof=False)

    def finish(self) -> list[Delta]:
        """Flush what is held: an unfinished call that never parsed comes out as content."""
        return self._scan(eof=True)

    def _next_trigger(self, buf: str) -> tuple[int, str] | None:
        """The earliest trigger in ``buf`` (the longest one where two start together)."""
        hits = [(buf.find(t), -len(t), t) for t in self.parser.triggers if t in buf]
        return (min(hits)[0], min(hits)[2]) if hits else None

    def _partial_trigger(self, buf: str) -> int:
        """Where the longest suffix of ``buf`` that is a proper prefix of a trigger begins."""
        for q in range(max(0, len(buf) - self._window + 1), len(buf)):
            tail = buf[q:]
            if any(t != tail and t.startswith(tail) for t in self.parser.triggers):
                return q
        return len(buf)

    def _scan(self, eof: bool) -> list[Delta]:
        out: list[Delta] = []

        def emit(text: str) -> None:
            if not text:
                return
            if out and isinstance(out[-1], ContentDelta):
                out[-1] = ContentDelta(out[-1].text + text)
            else:
                out.append(ContentDelta(text))

        buf, sep = self._buf, self.parser.separator
        while buf:
            if self._after_call:
                ws = len(buf) - len(buf.lstrip())
                if ws == len(buf) and not eof:
                    break
                self._after_call = False
                if sep and buf.startswith(sep, ws):
                    buf = buf[ws + len(sep):]
                continue
            found = (0, self._open) if self._open else self._next_trigger(buf)
            hold = len(buf) if eof or self._open else self._partial_trigger(buf)
            if found is None or hold < found[0]:
                emit(buf[:hold])
                buf = buf[hold:]
                break
            pos, trigger = found
            emit(buf[:pos])
            buf = buf[pos:]
            region = self.parser._region(buf, trigger, eof, self._json)
            if region is None:
                self._open = trigger
                break
            if region.calls is None:
                emit(buf[:region.end])
            else:
                for name, arguments in region.calls:
                    call = ToolCall(name, arguments, new_call_id())
                    index = len(self.calls)
                    self.calls.append(call)
                    out.append(ToolCallDelta(index, call.id, name, ""))
                    out.append(ToolCallDelta(index, None, None, arguments))
                self._after_call = sep is not None
            buf = buf[region.end:]
            self._json, self._open = _JsonScan(), None
        self._buf = buf
        return out
