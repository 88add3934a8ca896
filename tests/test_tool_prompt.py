"""Tools in the prompt: rendering through SmolLM2's real (tool-less) chat template and through a
template that takes tools, and validation of ``tools`` / ``tool_choice`` naming the field."""

from __future__ import annotations

import copy
import json

import pytest

from actorserve.http.edge.errors import FieldError, to_api_error
from actorserve.http.tools.tool_parsers import get_parser
from actorserve.http.tools.tool_prompt import (prepare_messages, template_takes_tools, validate_tool_choice,
                                         validate_tools)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "now"}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C, sunny"},
]

TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}"
    "{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %}]{% endfor %}"
    "{{ '\\n' }}{% endfor %}")


@pytest.fixture(scope="module")
def smol_tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from actorserve.engine.weights.models import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model("default")), local_files_only=True)


def render(tok, msgs: list[dict], kwargs: dict, template: str | None = None) -> str:  # type: ignore[no-untyped-def]
    extra = {"chat_template": template} if template else {}
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs, **extra)


def test_template_takes_tools() -> None:
    assert template_takes_tools(TOOL_TEMPLATE)
    assert template_takes_tools("{%- if tools is defined and tools %}x{% endif %}")
    assert template_takes_tools("{{ tools | tojson }}")
    assert not template_takes_tools(None)
    assert not template_takes_tools("tools: {{ messages[0]['content'] }}")        # text, not a variable
    assert not template_takes_tools("{{ 'use tools wisely' }}{{ m.tools }}")       # a string, an attribute


@pytest.mark.model
def test_smollm2_template_renders_tools_and_history(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    parser = get_parser("hermes")
    assert not template_takes_tools(smol_tokenizer.chat_template)
    original = copy.deepcopy(HISTORY)
    msgs, kwargs = prepare_messages(HISTORY, TOOLS, parser, template_takes_tools=False)
    assert HISTORY == original and kwargs == {}
    text = render(smol_tokenizer, msgs, kwargs)
    assert text.startswith("<|im_start|>system\nYou can call the following functions")
    assert "- get_weather: Current weather for a city" in text
    assert json.dumps(WEATHER["function"]["parameters"]) in text
    assert '<tool_call>\n{"name": "<name>", "arguments": <arguments-json>}\n</tool_call>' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call><|im_end|>') in text
    assert "<|im_start|>tool\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert parser.parse(msgs[2]["content"])[1][0].arguments == '{"city": "Paris"}'


def test_tools_go_first_in_an_existing_system_message() -> None:
    parser = get_parser("llama3_json")
    history = [{"role": "system", "content": "Be brief."}, *HISTORY]
    history[2] = {**history[2], "content": "Let me look."}
    msgs, _ = prepare_messages(history, TOOLS, parser, template_takes_tools=False)
    assert len(msgs) == len(history) and msgs[0]["role"] == "system"
    assert msgs[0]["content"].startswith("You can call") and msgs[0]["content"].endswith("\n\nBe brief.")
    assert '{"name": "<name>", "parameters": <arguments-json>}' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant",
                       "content": 'Let me look.\n{"name": "get_weather", "parameters": {"city": "Paris"}}'}
    assert msgs[3] == {"role": "tool", "content": "18C, sunny"}       # no wrapping outside hermes
    assert history[0]["content"] == "Be brief."


def test_history_without_tools_still_renders_as_text() -> None:
    msgs, kwargs = prepare_messages(HISTORY, None, get_parser("mistral"), template_takes_tools=False)
    assert kwargs == {} and [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["content"] == '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.mark.model
def test_template_that_takes_tools(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    original = copy.deepcopy(HISTORY)
    msgs, kwargs = prepare_messages(HISTORY, TOOLS, get_parser("hermes"), template_takes_tools=True)
    assert kwargs == {"tools": TOOLS} and HISTORY == original
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[2]["tool_call_id"] == "call_1"
    text = render(smol_tokenizer, msgs, kwargs, TOOL_TEMPLATE)
    assert text.startswith("TOOLS: get_weather now\n")
    assert "assistant: [get_weather city=Paris]\ntool: 18C, sunny\n" in text


def field_error(fn, *args) -> FieldError:  # type: ignore[no-untyped-def]
    with pytest.raises(FieldError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("tools,param", [
    ({"type": "function"}, "tools"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "tools"),
    (["get_weather"], "tools.0"),
    ([WEATHER, {"type": "code", "function": {"name": "x"}}], "tools.1.type"),
    ([WEATHER, {"type": "function"}], "tools.1.function"),
    ([WEATHER, {"type": "function", "function": {"name": "has space"}}], "tools.1.function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "x" * 65}}], "tools.1.function.name"),
    ([WEATHER, {"type": "function", "function": {"name": 7}}], "tools.1.function.name"),
    ([WEATHER, WEATHER], "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "description": 1}}], "tools.0.function.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools.0.function.strict"),
])
def test_validate_tools_names_the_field(tools: object, param: str) -> None:
    err = field_error(validate_tools, tools)
    assert err.param == param and str(err).startswith(param)
    api = to_api_error(err)
    assert api is not None and api.status == 400 and api.param == param


def test_validate_tools_normalises() -> None:
    assert validate_tools(None) == [] and validate_tools([]) == []
    assert len(validate_tools([{"type": "function", "function": {"name": f"f{i}"}} for i in range(128)])) == 128
    given = [{"type": "function", "function": {"name": "a-b_1", "description": None, "strict": True,
                                               "extra": 1}}, WEATHER]
    out = validate_tools(given)
    assert out == [{"type": "function", "function": {"name": "a-b_1", "strict": True}}, WEATHER]
    assert out[1] is not WEATHER and out[1]["function"]["parameters"] is not WEATHER["function"]["parameters"]


def test_validate_tool_choice() -> None:
    assert validate_tool_choice(None, TOOLS) == ("auto", None)
    assert validate_tool_choice(None, []) == ("none", None)
    assert validate_tool_choice("none", []) == ("none", None)
    assert validate_tool_choice("auto", TOOLS) == ("auto", None)
    assert validate_tool_choice("required", TOOLS) == ("required", None)
    named = {"type": "function", "function": {"name": "now"}}
    assert validate_tool_choice(named, TOOLS) == ("named", "now")
    assert field_error(validate_tool_choice, "auto", []).param == "tool_choice"
    assert field_error(validate_tool_choice, named, []).param == "tool_choice"
    assert field_error(validate_tool_choice, "always", TOOLS).param == "tool_choice"
    assert field_error(validate_tool_choice, {"type": "function"}, TOOLS).param == "tool_choice"
    missing = {"type": "function", "function": {"name": "nope"}}
    err = field_error(validate_tool_choice, missing, TOOLS)
    assert err.param == "tool_choice.function.name" and "get_weather, now" in str(err)
