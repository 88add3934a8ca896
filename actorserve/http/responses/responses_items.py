"""The Responses API's items, as data: what a request's ``input`` means as chat messages, the
input items a response keeps (``GET .../input_items``), its output items, the response object.

``input`` is a string (one user message) or a list of items:

* messages ``{role, content}`` (``type: "message"`` optional), role ``user``, ``system``,
  ``developer`` (a system message to the chat template) or ``assistant``; content a string or
  parts ``input_text`` / ``output_text``;
* ``function_call`` ``{call_id, name, arguments}`` (consecutive ones become one assistant
  message with ``tool_calls``) and ``function_call_output`` ``{call_id, output}`` (a ``tool``
  message);
* ``reasoning`` items a client sends back from an earlier output: kept as input items, not
  shown to the model (reasoning models' templates drop past reasoning).

Anything else (images, files, other tools' calls) is a 400 naming the item: the models served
here are text models, and a field that is accepted has its effect.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from ..edge.errors import FieldError

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
_NAMED_ID = re.compile(r"resp_((?:[A-Za-z0-9-]|\.[0-9a-f]{2})+)_[0-9a-f]+")


def response_id(replica: str | None = None) -> str:
    """A new response id: ``resp_<hex>``, or with a replica id ``resp_<replica>_<hex>``, so a
    fleet's front can send what names the response to the replica that stores it. The replica
    is spelled URL-safe and without ``_``: letters, digits and ``-`` as they are, every other
    byte of its UTF-8 as ``.xx`` (``box.1`` -> ``box.2e1``); `replica_of` reads it back."""
    if not replica:
        return new_id("resp")
    name = "".join(chr(b) if b in _PLAIN else f".{b:02x}" for b in replica.encode())
    return f"resp_{name}_{uuid.uuid4().hex}"


def replica_of(rid: str) -> str | None:
    """The replica id in a `response_id` (None: it names none, or is not one of ours)."""
    m = _NAMED_ID.fullmatch(rid)
    if m is None:
        return None
    raw = re.sub(rb"\.([0-9a-f]{2})", lambda g: bytes.fromhex(g[1].decode()), m[1].encode())
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def _text_of(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise FieldError(at, "content must be a string or a non-empty list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise FieldError(f"{at}.{j}.type", f"content part type {kind!r} is not supported: this "
                                               "model takes text (input_text / output_text)")
        if not isinstance(part.get("text"), str):
            raise FieldError(f"{at}.{j}.text", "a text part needs a string text")
        texts.append(part["text"])
    return "".join(texts)


def read_input(raw: Any) -> list[dict[str, Any]]:
    """``input`` -> normalised input items (each with an ``id`` and ``status``), in order."""
    if isinstance(raw, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list) or not raw:
        raise FieldError("input", "input must be a string or a non-empty list of items")
    items = []
    for i, item in enumerate(raw):
        at = f"input.{i}"
        if not isinstance(item, dict):
            raise FieldError(at, "an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise FieldError(f"{at}.role", f"role must be one of {', '.join(ROLES)}, got {role!r}")
            text = _text_of(item.get("content"), f"{at}.content")
            part = "output_text" if role == "assistant" else "input_text"
            out = {"id": item.get("id") or new_id("msg"), "type": "message", "role": role,
                   "status": "completed", "content": [{"type": part, "text": text}]}
            if role == "assistant":
                out["content"][0]["annotations"] = []
            items.append(out)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise FieldError(f"{at}.{key}", f"a function_call item needs a string {key}")
            items.append({"id": item.get("id") or new_id("fc"), "type": "function_call",
                          "call_id": item["call_id"], "name": item["name"],
                          "arguments": item["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise FieldError(f"{at}.call_id", "a function_call_output item needs a string call_id")
            output = item.get("output")
            if not isinstance(output, str):
                output = _text_of(output, f"{at}.output")
            items.append({"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                          "call_id": item["call_id"], "output": output, "status": "completed"})
        elif kind == "reasoning":
            items.append(reasoning_item(_reasoning_text(item, at), "completed", item.get("id")))
        else:
            raise FieldError(f"{at}.type", f"input item type {kind!r} is not supported; use message, "
                                           "function_call, function_call_output or reasoning")
    return items


def _reasoning_text(item: dict[str, Any], at: str) -> str:
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                              for p in parts):
        raise FieldError(f"{at}.content", "a reasoning item's content is a list of reasoning_text parts")
    return "".join(p["text"] for p in parts)


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalised items (input or output) -> chat messages, as the chat template takes them."""
    msgs: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            msgs.append({"role": ROLES[item["role"]], "content": item["content"][0]["text"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return msgs


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses ``tools`` (flat function tools) -> chat ``tools`` (validated by `tool_prompt`)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise FieldError("tools", "tools must be a list of tool objects")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise FieldError(f"tools.{i}.type", f"tool type {kind!r} is not supported here; only "
                                                "function tools (the client runs them)")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def responses_param(param: str) -> str:
    """A chat-shaped field path from the tool validators, as the Responses request spells it."""
    return param.replace(".function.", ".").replace("tool_choice.function", "tool_choice")


def message_item(text: str, status: str, logprobs: list[Any] | None = None,
                 item_id: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [part]}


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    """A ``reasoning`` output item: the model's reasoning text as one ``reasoning_text`` part
    (no summary: nothing summarises it)."""
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
            "status": status}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}


def _text_config(body: Any) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None else None
    return {"format": fmt if fmt is not None else {"type": "text"}}


def response_object(rid: str, body: Any, model: str, *, status: str, created: float,
                    output: list[dict[str, Any]] | None = None, use: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
    """The response object (`openai.types.responses.Response`'s fields) for request `body`."""
    return {
        "id": rid, "object": "response", "created_at": created, "model": model, "status": status,
        "completed_at": time.time() if status not in ("queued", "in_progress") else None,
        "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions, "metadata": body.metadata or {},
        "max_output_tokens": body.max_output_tokens, "output": list(output or []),
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0, "top_logprobs": body.top_logprobs or 0,
        "tool_choice": (body.tool_choice if body.tool_choice is not None
                        else "auto" if body.tools else "none"),
        "tools": list(body.tools or []), "text": _text_config(body),
        "truncation": body.truncation, "store": body.store, "background": body.background,
        "reasoning": None, "service_tier": "default", "usage": use, "user": None,
    }
