"""Tool calling for `/v1/chat/completions`: what a request's ``tools`` / ``tool_choice`` mean
for its prompt, its grammar and its answer.

`plan_tools` reads the request once and returns a `ToolPlan`:

* the **prompt**: the messages as the chat template should see them (`tool_prompt`: a template
  that takes ``tools`` gets them; another one gets them described in the system message, and
  assistant ``tool_calls`` / ``tool`` results in the history rendered in the model's format);
* the **grammar** (`tool_parsers.ToolParser.structural_tag`): ``required`` and a named choice
  allow only calls, to the named function or any of them, with arguments that match the
  function's JSON schema, so they always parse (even on a 135M model); ``auto`` leaves text
  free but constrains a call once the model starts one; ``none`` constrains nothing and the
  tools are not shown to the model;
* the **answer**: `message` turns a choice's whole text into ``content`` + ``tool_calls`` with
  ``finish_reason: tool_calls``; `DeltaStream` does the same incrementally for a stream, in
  OpenAI's delta shape (the first delta of a call carries its index, id, type and name, then
  argument fragments follow under the same index).

The parser is the server's ``--tool-call-parser``, else the one the chat template suggests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..edge.errors import FieldError
from .tool_parsers import ContentDelta, ToolCall, ToolCallDelta, ToolParser, get_parser, parser_for_template
from .tool_prompt import prepare_messages, template_takes_tools, validate_tool_choice, validate_tools

__all__ = ["ToolPlan", "plan_tools", "DeltaStream"]


@dataclass(slots=True)
class ToolPlan:
    mode: str                                   # none | auto | required | named
    parser: ToolParser | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    grammar: tuple[str, str] | None = None      # the structural tag the calls must follow

    @property
    def parses(self) -> bool:
        return self.parser is not None and self.mode != "none"

    @property
    def calls_only(self) -> bool:
        """"required" or a named tool: the grammar admits calls and nothing else, so text that
        does not parse as a call is an unfinished one (cut by max_tokens), never content."""
        return self.mode in ("required", "named")

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A choice's assistant message from its whole text, and its finish reason."""
        if not self.parses:
            return {"role": "assistant", "content": text}, finish_reason
        assert self.parser is not None
        content, calls = self.parser.parse(text)
        if self.calls_only:
            content = ""
        if not calls:
            return {"role": "assistant", "content": content if self.calls_only else text}, finish_reason
        msg = {"role": "assistant", "content": content or None, "tool_calls": [_call(c) for c in calls]}
        return msg, ("tool_calls" if finish_reason == "stop" else finish_reason)


def _call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _chat_template(tokenizer: Any) -> str | None:
    return tokenizer.chat_template or getattr(getattr(tokenizer, "hf", None), "chat_template", None)


def plan_tools(body: Any, tokenizer: Any, parser_name: str | None) -> ToolPlan:
    """The `ToolPlan` of a chat request (`ChatCompletionRequest`)."""
    tools = validate_tools(body.tools) if body.tools is not None else []
    mode, name = validate_tool_choice(body.tool_choice, tools)
    template = _chat_template(tokenizer)
    if mode == "none" or not tools:
        # History may still hold tool calls and results: render them in the model's format.
        has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in body.messages)
        if not has_history:
            return ToolPlan("none", messages=list(body.messages))
        parser = _parser(parser_name, template)
        msgs, kwargs = prepare_messages(list(body.messages), None, parser,
                                        template_takes_tools=template_takes_tools(template))
        return ToolPlan("none", None, msgs, kwargs)
    parser = _parser(parser_name, template)
    msgs, kwargs = prepare_messages(list(body.messages), tools, parser,
                                    template_takes_tools=template_takes_tools(template))
    tag = parser.structural_tag(tools, name=name, required=mode in ("required", "named"),
                                parallel=body.parallel_tool_calls and mode != "named")
    return ToolPlan(mode, parser, msgs, kwargs, ("structural_tag", json.dumps(tag, ensure_ascii=False)))


def _parser(name: str | None, template: str | None) -> ToolParser:
    try:
        return get_parser(name or parser_for_template(template))
    except ValueError as exc:          # a server flag: checked at start-up, so this is a bug
        raise FieldError("tools", str(exc)) from None


class DeltaStream:
    """One streamed choice's text -> OpenAI ``delta`` objects (content and tool-call deltas)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._stream = plan.parser.streamer() if plan.parses and plan.parser is not None else None

    @property
    def called(self) -> bool:
        """Whether this choice has made a tool call (its finish reason becomes ``tool_calls``)."""
        return bool(self._stream is not None and self._stream.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._stream is None:
            return [{"content": text}] if text else []
        return self._deltas(self._stream.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        if self._stream is None:
            return []
        return self._deltas(self._stream.finish())

    def _deltas(self, found: list[ContentDelta | ToolCallDelta]) -> list[dict[str, Any]]:
        return [_delta(d) for d in found if not (self.plan.calls_only and isinstance(d, ContentDelta))]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.called and reason == "stop" else reason


def _delta(d: ContentDelta | ToolCallDelta) -> dict[str, Any]:
    if isinstance(d, ContentDelta):
        return {"content": d.text}
    call: dict[str, Any] = {"index": d.index}
    if d.id is not None:
        call.update(id=d.id, type="function", function={"name": d.name, "arguments": d.arguments})
    else:
        call["function"] = {"arguments": d.arguments}
    return {"tool_calls": [call]}
