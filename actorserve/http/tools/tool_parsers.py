"""Tool-call parsers: find OpenAI-style function calls in generated text, one format per model.

Formats (`PARSERS`): ``hermes`` (Hermes/Qwen ``<tool_call>\\n{json}\\n</tool_call>`` blocks),
``llama3_json`` (bare ``{"name", "parameters"}`` objects, optionally after ``<|python_tag|>``,
several joined by ``;``) and ``mistral`` (``[TOOL_CALLS][{...}, ...]``).

One scanner serves both the whole-output `ToolParser.parse` and the incremental `ToolStream`,
so the two cannot disagree. A format names its *triggers* (strings that may open a call) and a
``_region`` function that, given the buffer from a trigger on, answers: not decided yet (more
text could change the answer), a call region ending at ``end``, or not a call (content up to
``end``). Every answer is a function of the text seen so far and is never revised by more text,
which is what makes the stream split-invariant. The scanner emits text as content as soon as
no trigger can start in it (holding back only a suffix that is a prefix of a trigger, such as
``<tool_c``), and holds an open region until it decides. At the end of the text (``eof``)
every region decides; one that never completed is content.

JSON regions are delimited by `_JsonScan`, a lax, resumable JSON scanner: it finds where a
value closes and rejects a prefix that cannot begin valid JSON as early as it can tell, so a
stray ``{`` in prose is released quickly; `json.loads` has the final word. A call is an object
with a string ``name`` and an object of arguments (``arguments``; llama3 also ``parameters``).

`ToolParser.structural_tag` builds the xgrammar structural tag that constrains generation to
the format, and `ToolParser.format_call` renders a call as the model writes it; text those
produce parses back into the same calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar


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


class ToolParser:
    """Base: a format sets its triggers and call shape and implements ``_region``."""

    name: ClassVar[str] = ""
    triggers: ClassVar[tuple[str, ...]] = ()
    grammar_trigger: ClassVar[str] = ""        # the trigger of the "auto" grammar
    separator: ClassVar[str | None] = None     # dropped (with whitespace) right after a call
    # Between calls in the calls-only grammar ("required", no other text allowed). Not a bare
    # newline: a chat model's habit after a call is a newline, and where the newline is the
    # separator that habit commits it to another call, and another, until max_tokens (SmolLM2:
    # "\n" -0.57 against its end of turn -0.95 after "</tool_call>"). With none, what follows a
    # call is the next call's own first character or the end, and the model chooses.
    grammar_separator: ClassVar[str] = ""
    call_begin: ClassVar[str] = ""             # a call is call_begin.format(name=<json>) + args + call_end
    call_end: ClassVar[str] = "}"

    def _region(self, buf: str, trigger: str, eof: bool, scan: _JsonScan) -> _Region | None:
        raise NotImplementedError

    def format_call(self, name: str, arguments: str) -> str:
        """One call as the model writes it (to render assistant history)."""
        return self.call_begin.format(name=_dumps(name)) + arguments + self.call_end

    def format_response(self, content: str) -> str:
        """A tool result as the model expects to read it in the prompt."""
        return content

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Whole output -> (content outside the calls, stripped; the calls in order)."""
        stream = self.streamer()
        deltas = stream.feed(text) + stream.finish()
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        return content.strip(), list(stream.calls)

    def streamer(self) -> ToolStream:
        return ToolStream(self)

    # -- grammars ------------------------------------------------------------------------------

    def _tags(self, tools: list[dict], name: str | None) -> list[dict[str, Any]]:
        tags = []
        for tool in tools:
            fn = tool.get("function") or {}
            if name is not None and fn.get("name") != name:
                continue
            schema = dict(fn.get("parameters") or {})
            schema.setdefault("type", "object")
            tags.append({"type": "tag", "begin": self.call_begin.format(name=_dumps(fn["name"])),
                         "content": {"type": "json_schema", "json_schema": schema},
                         "end": self.call_end})
        if not tags:
            raise ValueError(f"no tool named {name!r}" if name else "no tools given")
        return tags

    def _calls_only(self, tags: list[dict], at_most_one: bool) -> dict[str, Any]:
        return {"type": "tags_with_separator", "tags": tags, "separator": self.grammar_separator,
                "at_least_one": True, "stop_after_first": at_most_one}

    def _auto(self, tags: list[dict], at_most_one: bool) -> dict[str, Any]:
        trigger = self.grammar_trigger or self.triggers[0]
        return {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                "at_least_one": False, "stop_after_first": at_most_one}

    def structural_tag(self, tools: list[dict], *, name: str | None = None, required: bool = False,
                       parallel: bool = True) -> dict[str, Any]:
        """xgrammar structural tag for ``tool_choice``: "auto" (default), "required"
        (``required=True``) or one named tool (``name``: exactly one call, no other text)."""
        tags = self._tags(tools, name)
        if name is None and not required:
            fmt = self._auto(tags, not parallel)
        else:
            fmt = self._calls_only(tags, name is not None or not parallel)
        return {"type": "structural_tag", "format": fmt}


def _dumps(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


class HermesParser(ToolParser):
    name = "hermes"
    triggers = ("<tool_call>",)
    call_begin = '<tool_call>\n{{"name": {name}, "arguments": '
    call_end = "}\n</tool_call>"
    _END = "</tool_call>"

    def _region(self, buf: str, trigger: str, eof: bool, scan: _JsonScan) -> _Region | None:
        close = buf.find(self._END, max(len(trigger), scan.pos - len(self._END)))
        if close < 0 and not eof:      # at the end, an unclosed block may still be a whole call
            scan.pos = len(buf)        # (resume the search there)
            return None
        body = buf[len(trigger):close if close >= 0 else len(buf)]
        try:
            call = _call_of(_loads(body.strip()), ("arguments", "parameters"))
        except ValueError:
            call = None
        return _Region(close + len(self._END) if close >= 0 else len(buf), [call] if call else None)

    def format_response(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    triggers = ("{", "<|python_tag|>")
    grammar_trigger = '{"name": '
    separator = ";"
    grammar_separator = "; "
    call_begin = '{{"name": {name}, "parameters": '
    _KEYS = ("parameters", "arguments")
    _FIRST = ("name", "parameters", "arguments")

    def _first_key_ok(self, buf: str, start: int) -> bool | None:
        """Can the object opening at ``buf[start]`` be a call, by its first key? None: not known yet."""
        j = _skip_ws(buf, start + 1)
        if j == len(buf):
            return None
        if buf[j] != '"':
            return False
        close = buf.find('"', j + 1)
        if close >= 0:
            return buf[j + 1:close] in self._FIRST
        return None if any(k.startswith(buf[j + 1:]) for k in self._FIRST) else False

    def _region(self, buf: str, trigger: str, eof: bool, scan: _JsonScan) -> _Region | None:
        start = 0
        if trigger == "<|python_tag|>":
            start = _skip_ws(buf, len(trigger))
            if start == len(buf):
                return _Region(start, None) if eof else None
            if buf[start] != "{":
                return _Region(len(trigger), None)
        ok = self._first_key_ok(buf, start)     # a "{" in prose is released early
        if ok is False:
            return _Region(start + 1, None)
        if ok is None and not eof:
            return None
        return _json_region(buf, start, eof, scan, self._KEYS)


class MistralParser(ToolParser):
    name = "mistral"
    triggers = ("[TOOL_CALLS]",)
    grammar_separator = ", "
    call_begin = '{{"name": {name}, "arguments": '

    def _region(self, buf: str, trigger: str, eof: bool, scan: _JsonScan) -> _Region | None:
        start = _skip_ws(buf, len(trigger))
        if start == len(buf):
            return _Region(start, None) if eof else None
        if buf[start] not in "[{":
            return _Region(len(trigger), None)
        return _json_region(buf, start, eof, scan, ("arguments",), many=True)

    def _calls_only(self, tags: list[dict], at_most_one: bool) -> dict[str, Any]:
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": "[TOOL_CALLS]["}, super()._calls_only(tags, at_most_one),
            {"type": "const_string", "value": "]"}]}

    def _auto(self, tags: list[dict], at_most_one: bool) -> dict[str, Any]:
        tag = {"type": "tag", "begin": "[TOOL_CALLS][", "content": super()._calls_only(tags, at_most_one),
               "end": "]"}
        return {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "tags": [tag],
                "at_least_one": False, "stop_after_first": at_most_one}

    def format_call(self, name: str, arguments: str) -> str:
        return f"[TOOL_CALLS][{super().format_call(name, arguments)}]"


class ToolStream:
    """Incremental `ToolParser.parse`: feed text as it is generated, get content and calls."""

    def __init__(self, parser: ToolParser) -> None:
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


PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool parser {name!r}; choose one of: {', '.join(PARSERS)}")
    return cls()


def parser_for_template(chat_template: str | None) -> str:
    """The parser a chat template's model most likely speaks."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"
