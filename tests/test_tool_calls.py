"""Tool calling on the real SmolLM2-135M-Instruct through the official `openai` client: a named
or required choice is grammar-constrained so its arguments always validate; a streamed call's
deltas reassemble to the non-streamed call; tool history renders in the model's format; bad
tools and choices are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from http_support import load_smol, serve, settle

pytestmark = pytest.mark.model
NAME = "smollm2"

WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit", "days"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                      "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}},
]
ASK = [{"role": "user", "content": "What will the weather be in Lisbon for the next 3 days?"}]


@pytest.fixture(scope="module")
def smol():
    return load_smol()


def client(http) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0, timeout=120)


async def test_named_and_required_calls_validate_and_stream_the_same(smol):
    async with serve(smol, name=NAME) as (http, rt):
        oa = client(http)
        named = {"type": "function", "function": {"name": "get_weather"}}
        out = await oa.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=named,
                                               temperature=0, max_tokens=120)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)

        stream = await oa.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=named,
                                                  temperature=0, max_tokens=120, stream=True)
        calls: dict[int, dict] = {}
        finish, content = None, ""
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or ():
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = c["id"] or d.id
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [("get_weather", json.loads(call.function.arguments))]
        assert calls[0]["id"].startswith("call_")

        req = await oa.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "What time is it in Oslo, and the weather?"}],
            tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200)
        got = req.choices[0].message.tool_calls
        assert req.choices[0].finish_reason == "tool_calls" and got
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for c in got:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
        # parallel_tool_calls false: exactly one call
        one = await oa.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Time and weather in Oslo?"}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
        assert len(one.choices[0].message.tool_calls) == 1

        # auto: free text or a call, and whichever it is parses
        auto = await oa.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
        msg = auto.choices[0].message
        assert msg.content or msg.tool_calls
        # none: the model never sees the tools and no call is parsed
        none = await oa.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="none",
                                                temperature=0, max_tokens=20)
        assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
        await oa.close()
        await settle(rt)


async def test_required_call_ends_the_turn_and_a_cut_call_is_not_content(smol):
    """Issue 29's defect: after a call the model's habit is a newline; when the newline was the
    grammar's separator it committed the model to a second call, and a third, until max_tokens
    ("length", the cut call's raw text in content). Now the turn ends after the call."""
    paris = [{"role": "user", "content": "What is the weather in Paris?"}]
    city = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                             "required": ["city"]}}}]
    async with serve(smol, name=NAME) as (http, rt):
        oa = client(http)
        out = await oa.chat.completions.create(model=NAME, messages=paris, tools=city, tool_choice="required",
                                               temperature=0, max_tokens=60)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
        assert out.usage.completion_tokens < 60
        # cut inside the call by max_tokens: "length", and the unfinished call is not content
        for stream in (False, True):
            cut = await oa.chat.completions.create(model=NAME, messages=paris, tools=city, tool_choice="required",
                                                   temperature=0, max_tokens=8, stream=stream)
            if stream:
                content, finish = "", None
                async for chunk in cut:
                    if chunk.choices:
                        content += chunk.choices[0].delta.content or ""
                        finish = chunk.choices[0].finish_reason or finish
            else:
                content, finish = cut.choices[0].message.content or "", cut.choices[0].finish_reason
            assert finish == "length" and "<tool_call>" not in content, (stream, content)
        await oa.close()
        await settle(rt)


async def test_tool_history_renders_in_the_models_format(smol):
    async with serve(smol, name=NAME) as (http, rt):
        oa = client(http)
        history = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lisbon", "unit": "celsius", "days": 3}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 24C"}'}]
        out = await oa.chat.completions.create(model=NAME, messages=history, tools=TOOLS, temperature=0, max_tokens=30)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        [arrival] = [e for e in rt.recorder.events() if e.kind == "input" and e.event == "generate"]
        prompt = smol[2].decode(arrival.data["prompt"], skip_special_tokens=False)
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"' in prompt
        assert "<tool_response>\n{\"forecast\": \"sunny, 24C\"}\n</tool_response>" in prompt
        assert "get_time" in prompt            # the tools are described to a template that cannot take them
        await oa.close()
        await settle(rt)


async def test_bad_tools_and_choices_are_400s_naming_the_field(smol):
    async with serve(smol, name=NAME) as (http, rt):
        oa = client(http)
        cases = [
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
            ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
             "response_format"),
        ]
        for extra, param in cases:
            with pytest.raises(openai.BadRequestError) as err:
                await oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=5, extra_body=extra)
            assert err.value.body["param"].startswith(param), (extra, err.value.body)
        await oa.close()
        await settle(rt)
