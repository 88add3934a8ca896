"""Tools in the prompt: validating OpenAI ``tools``/``tool_choice`` and rendering tool history.

A chat template either knows tools (it reads a ``tools`` variable and renders assistant
``tool_calls`` and ``tool`` messages itself) or does not (SmolLM2's ChatML template renders
only role and content). `prepare_messages` bridges both:

* a template that takes tools gets the messages as they are and ``tools=`` as a keyword for
  ``apply_chat_template``; the one change is that each call's ``function.arguments`` (a JSON
  string on the wire) is handed over as a dict, since HF templates iterate it as a mapping;
* a template that does not gets everything as plain text: a description of the tools (names,
  descriptions, JSON schemas, and the exact call format of the model's `ToolParser`) put
  first in the system message; assistant calls rendered inline with ``parser.format_call``;
  tool results as ``tool`` messages in the parser's response wrapping.

The input messages are never mutated. Validation raises `FieldError` naming the offending field
(``tools.1.function.name``) so the HTTP layer answers 400 with ``param`` set.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from ..edge.errors import FieldError
from .tool_parsers import ToolParser

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_JINJA_BLOCK = re.compile(r"\{[{%](.*?)[%}]\}", re.S)
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)
_TOOLS_VAR = re.compile(r"(?<![\w.])tools\b")


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether ``tools`` is used as a variable inside a jinja tag of the template."""
    for block in _JINJA_BLOCK.findall(chat_template or ""):
        if _TOOLS_VAR.search(_STRING.sub("''", block)):
            return True
    return False


def _text(content: Any) -> str:
    """Message content as text: a string, None, or a list of OpenAI text parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def tools_description(tools: list[dict], parser: ToolParser) -> str:
    lines = ["You can call the following functions (tools):"]
    for tool in tools:
        fn = tool["function"]
        lines.append(f"- {fn['name']}" + (f": {fn['description']}" if fn.get("description") else ""))
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        lines.append(f"  parameters (JSON schema): {json.dumps(schema, ensure_ascii=False)}")
    lines += ["", "To call a function, answer with exactly this format, one block per call, where "
              "<arguments-json> is a JSON object matching the function's parameters:",
              parser.format_call("<name>", "<arguments-json>")]
    return "\n".join(lines)


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [{"type": "text", "text": text + "\n\n"}, *content]
        else:
            first["content"] = text + ("\n\n" + content if content else "")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _as_text(msg: dict, parser: ToolParser) -> dict:
    """One message for a template that renders only role and content."""
    role = msg.get("role")
    if role == "assistant" and msg.get("tool_calls"):
        out = {k: v for k, v in msg.items() if k != "tool_calls"}
        parts = [_text(msg.get("content"))] if _text(msg.get("content")) else []
        for call in msg["tool_calls"]:
            fn = call.get("function") or {}
            parts.append(parser.format_call(str(fn.get("name", "")),
                                            _arguments_text(fn.get("arguments", "{}"))))
        out["content"] = "\n".join(parts)
        return out
    if role == "tool":
        out = {k: v for k, v in msg.items() if k not in ("tool_call_id", "name")}
        out["content"] = parser.format_response(_text(msg.get("content")))
        return out
    return copy.deepcopy(msg)


def _for_tool_template(msg: dict) -> dict:
    """A deep copy whose tool calls carry their arguments as a mapping where they parse."""
    out = copy.deepcopy(msg)
    for call in out.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                continue
            if isinstance(args, dict):
                fn["arguments"] = args
    return out


def prepare_messages(messages: list[dict], tools: list[dict] | None, parser: ToolParser,
                     *, template_takes_tools: bool) -> tuple[list[dict], dict]:
    """(messages to render, extra keyword arguments for ``apply_chat_template``)."""
    if template_takes_tools:
        msgs = [_for_tool_template(m) for m in messages]
        return msgs, ({"tools": copy.deepcopy(tools)} if tools else {})
    msgs = [_as_text(m, parser) for m in messages]
    if tools:
        msgs = _with_system(msgs, tools_description(tools, parser))
    return msgs, {}


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise FieldError(param, f"{param} {message}")


def validate_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools``: a list of function tools; returns normalised copies ([] for None)."""
    if tools is None:
        return []
    _require(isinstance(tools, list), "tools", "must be a list of tool objects")
    _require(len(tools) <= MAX_TOOLS, "tools", f"must have at most {MAX_TOOLS} entries")
    out: list[dict] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"tools.{i}"
        _require(isinstance(tool, dict), at, "must be an object")
        _require(tool.get("type") == "function", f"{at}.type", "must be 'function'")
        fn = tool.get("function")
        _require(isinstance(fn, dict), f"{at}.function", "must be an object")
        name = fn.get("name")
        _require(isinstance(name, str) and _NAME.fullmatch(name) is not None, f"{at}.function.name",
                 "must be a string of 1 to 64 letters, digits, '_' or '-'")
        _require(name not in seen, f"{at}.function.name", f"duplicates the tool name {name!r}")
        seen.add(name)
        clean: dict[str, Any] = {"name": name}
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                ("strict", bool, "a boolean")):
            if fn.get(key) is not None:
                _require(isinstance(fn[key], kind), f"{at}.function.{key}", f"must be {what}")
                clean[key] = copy.deepcopy(fn[key])
        out.append({"type": "function", "function": clean})
    return out


def validate_tool_choice(choice: Any, tools: list[dict]) -> tuple[str, str | None]:
    """OpenAI ``tool_choice`` -> (mode, name): mode is none | auto | required | named."""
    if choice is None:
        return ("auto", None) if tools else ("none", None)
    if choice == "none":
        return "none", None
    _require(bool(tools), "tool_choice", "requires tools to be given")
    if choice in ("auto", "required"):
        return choice, None
    _require(isinstance(choice, dict) and choice.get("type") == "function"
             and isinstance(choice.get("function"), dict), "tool_choice",
             "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    name = choice["function"].get("name")
    names = [t["function"]["name"] for t in tools]
    _require(name in names, "tool_choice.function.name", f"must name one of the tools: {', '.join(names)}")
    return "named", name
