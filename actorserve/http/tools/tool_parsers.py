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
from typing import Any, ClassVar

# the calls, deltas and the scanner every format shares (imported here by name for callers)
from .tool_scan import (ContentDelta, ToolCall, ToolCallDelta, ToolStream, _call_of,  # noqa: F401
                        _json_region, _JsonScan, _loads, _Region, _skip_ws)


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
