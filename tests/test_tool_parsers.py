"""Tool-call parsers: formats, malformed output staying content, streaming split invariance,
and structural tags whose grammars (compiled by xgrammar) accept exactly what parse() reads."""

from __future__ import annotations

import json
import random
import re

import pytest

from actorserve.http.tools.tool_parsers import (PARSERS, ContentDelta, ToolCall, ToolCallDelta, ToolParser,
                                          get_parser, parser_for_template)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, CLOCK]
PARIS = '{"city": "Paris", "days": 2}'


def calls_of(parsed: tuple[str, list[ToolCall]]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


def test_registry_and_choice_by_template() -> None:
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert all(get_parser(n).name == n for n in PARSERS)
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_parser("qwen")
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{% if m.role == 'ipython' %}") == "llama3_json"
    assert parser_for_template("<|python_tag|>") == "llama3_json"
    assert parser_for_template(None) == parser_for_template("<|im_start|>") == "hermes"


def test_call_ids_and_argument_text() -> None:
    content, calls = get_parser("hermes").parse(
        '<tool_call>\n{"name": "f", "arguments": {"q": "café", "n": [1, 2]}}\n</tool_call>')
    assert content == "" and len(calls) == 1
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert calls[0].arguments == '{"q": "café", "n": [1, 2]}'


def test_hermes_blocks_with_text() -> None:
    p = get_parser("hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name":"now","arguments":{}}</tool_call>\nDone.')
    content, calls = p.parse(text)
    assert content == "Let me check.\n\n\nDone."
    assert calls_of((content, calls)) == [("get_weather", {"city": "Paris"}), ("now", {})]
    # an unclosed block at the very end still parses when its JSON is whole
    assert calls_of(p.parse('<tool_call>\n{"name": "now", "arguments": {}}')) == [("now", {})]
    assert p.parse("no calls here") == ("no calls here", [])


def test_llama3_json_objects() -> None:
    p = get_parser("llama3_json")
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "arguments": {}}'
    assert p.parse(text)[0] == ""
    assert calls_of(p.parse(text)) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert calls_of(p.parse('{"name": "now", "parameters": {}}')) == [("now", {})]
    prose = 'Sets use {1, 2}; dicts use {"a": 1}; and {"name": "x"} has no parameters.'
    assert p.parse(prose) == (prose, [])


def test_mistral_arrays() -> None:
    p = get_parser("mistral")
    text = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}}]'
    content, calls = p.parse(text)
    assert content == "Sure."
    assert calls_of((content, calls)) == [("get_weather", {"city": "Rome"}), ("now", {})]
    assert calls_of(p.parse('[TOOL_CALLS] {"name": "now", "arguments": {}}')) == [("now", {})]


MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',        # bad JSON
               '<tool_call>{"name": 3, "arguments": {}}</tool_call>',                   # name not str
               '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',                # args not object
               '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',          # not JSON
               '<tool_call>\n{"name": "f", "arguments": {"a": 1'],                      # unfinished
    "llama3_json": ['{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": {"a": }',
                    '<|python_tag|>print("hi")', '{"parameters": {}}', '{"name": "f", "parameters": {'],
    "mistral": ['[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g"}]', '[TOOL_CALLS] hello',
                '[TOOL_CALLS][{"name": "f", "arguments": {}}', '[TOOL_CALLS]["f"]'],
}


@pytest.mark.parametrize("fmt,text", [(f, t) for f, ts in MALFORMED.items() for t in ts])
def test_malformed_calls_stay_content(fmt: str, text: str) -> None:
    assert get_parser(fmt).parse("Hi " + text) == (("Hi " + text).strip(), [])


SAMPLES = {
    "hermes": ['Thinking <tool_c... not a tag. <tool_call>\n{"name": "a", "arguments": {"s": "</tool"}}\n'
               '</tool_call> mid <tool_call>{"name": "b", "arguments": {"x": [1, {"y": "}"}]}}</tool_call>',
               '<tool_call>{"name": 1, "arguments": {}}</tool_call> tail <tool_call>{"name": "c", '
               '"arguments": {}}</tool_call><tool_call>{"name": "d", "arguments": {}}'],
    "llama3_json": ['<|python_tag|>{"name": "a", "parameters": {"s": "};{"}};  {"name": "b", '
                    '"arguments": {}} ; and {"names": 1} {x} {"name": "c", "parameters": {"q": "\\"}"}}',
                    'text <|python_ta {"name": "a", "parameters": 5} ;{"name": "b", "parameters": {}}'
                    ' {"name": "x", "parameters": {'],
    "mistral": ['Intro [TOOL_CALLS][{"name": "a", "arguments": {"k": "]"}}, {"name": "b", "arguments": {}}]'
                ' outro [TOOL_CALL [TOOL_CALLS] nope [TOOL_CALLS]{"name": "c", "arguments": {}}',
                '[TOOL_CALLS][{"name": "a", "arguments": {}}] [TOOL_CALLS][{"name": "b", "arguments": {'],
}


def run_stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    stream = parser.streamer()
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.id is not None:
                assert d.index == len(calls) and d.name and d.arguments == ""
                calls[d.index] = [d.name, ""]
            else:
                assert d.name is None
                calls[d.index][1] += d.arguments
    assert [(c.name, c.arguments) for c in stream.calls] == [tuple(v) for v in calls.values()]
    return content, [tuple(v) for v in calls.values()], deltas   # type: ignore[misc]


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_stream_matches_parse_at_any_split(fmt: str) -> None:
    parser, rng = get_parser(fmt), random.Random(0)
    for text in SAMPLES[fmt]:
        content, calls = parser.parse(text)
        want = (content, [(c.name, c.arguments) for c in calls])
        assert calls, text
        for _ in range(150):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            got, got_calls, _ = run_stream(parser, pieces)
            assert (got.strip(), got_calls) == want, pieces
        got, got_calls, _ = run_stream(parser, list(text))           # one character at a time
        assert (got.strip(), got_calls) == want


def test_stream_releases_content_early() -> None:
    stream = get_parser("hermes").streamer()
    assert stream.feed("Hello <tool_c") == [ContentDelta("Hello ")]
    assert stream.feed("ould not") == [ContentDelta("<tool_could not")]
    assert stream.feed(' <tool_call>{"name": "f", "arguments": {}}') == [ContentDelta(" ")]
    first, second = stream.feed("</tool_call>")
    assert first == ToolCallDelta(0, stream.calls[0].id, "f", "")
    assert second == ToolCallDelta(0, None, None, "{}")
    assert stream.finish() == []
    prose = get_parser("llama3_json").streamer()
    assert prose.feed('a {"b": 1} and {"na') == [ContentDelta('a {"b": 1} and ')]
    assert prose.feed("ive") == [ContentDelta('{"naive')]


def test_unfinished_call_flushes_as_content() -> None:
    stream = get_parser("mistral").streamer()
    assert stream.feed('x [TOOL_CALLS][{"name": "f", "arg') == [ContentDelta("x ")]
    assert stream.finish() == [ContentDelta('[TOOL_CALLS][{"name": "f", "arg')]
    assert stream.calls == []


# -- structural tags --------------------------------------------------------------------------

def test_structural_tag_shapes() -> None:
    hermes = get_parser("hermes")
    auto = hermes.structural_tag(TOOLS)["format"]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"]
    assert auto["at_least_one"] is False and auto["stop_after_first"] is False
    assert auto["tags"][0] == {
        "type": "tag", "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
        "content": {"type": "json_schema", "json_schema": WEATHER["function"]["parameters"]},
        "end": "}\n</tool_call>"}
    assert auto["tags"][1]["content"]["json_schema"] == {"type": "object"}
    req = hermes.structural_tag(TOOLS, required=True, parallel=False)["format"]
    assert req["type"] == "tags_with_separator" and req["separator"] == ""
    assert req["at_least_one"] is True and req["stop_after_first"] is True
    named = hermes.structural_tag(TOOLS, name="now")["format"]
    assert len(named["tags"]) == 1 and named["stop_after_first"] is True
    llama = get_parser("llama3_json").structural_tag(TOOLS, required=True)["format"]
    assert llama["separator"] == "; " and llama["tags"][1]["begin"] == '{"name": "now", "parameters": '
    mistral = get_parser("mistral").structural_tag(TOOLS, required=True)["format"]
    assert mistral["type"] == "sequence" and mistral["elements"][1]["separator"] == ", "
    assert [e.get("value") for e in mistral["elements"]] == ["[TOOL_CALLS][", None, "]"]
    with pytest.raises(ValueError, match="no tool named"):
        hermes.structural_tag(TOOLS, name="missing")
    json.dumps(mistral)


def grammar_texts(parser: ToolParser) -> dict[str, list[str]]:
    """Hand-written outputs of each grammar (mode -> texts), as the grammar spells calls."""
    weather, clock = parser.format_call("get_weather", PARIS), parser.format_call("now", "{}")
    if parser.name == "mistral":
        inner = lambda *cs: "[TOOL_CALLS][" + ", ".join(c[len("[TOOL_CALLS]["):-1] for c in cs) + "]"  # noqa: E731
        both = inner(weather, clock)
    else:
        both = weather + parser.structural_tag(TOOLS, required=True)["format"]["separator"] + clock
    return {"auto": ["Just text.", f"Checking. {weather} Then more.", both],
            "required": [weather, both], "named": [clock]}


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammar_texts_parse_back(fmt: str) -> None:
    parser = get_parser(fmt)
    texts = grammar_texts(parser)
    assert calls_of(parser.parse(texts["required"][1])) == [
        ("get_weather", json.loads(PARIS)), ("now", {})]
    assert parser.parse(texts["required"][1])[0] == ""
    assert calls_of(parser.parse(texts["auto"][1])) == [("get_weather", json.loads(PARIS))]
    assert parser.parse(texts["auto"][1])[0].split() == ["Checking.", "Then", "more."]
    assert calls_of(parser.parse(texts["named"][0])) == [("now", {})]


@pytest.fixture(scope="module")
def compiler():  # type: ignore[no-untyped-def]
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from actorserve.engine.weights.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("default")), local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152, stop_token_ids=[tok.eos_token_id])
    return xgr, tok, xgr.GrammarCompiler(info)


def accepts(compiler, tag: dict, text: str) -> bool:  # type: ignore[no-untyped-def]
    """Whether the grammar takes ``text`` token by token and may then stop."""
    xgr, tok, comp = compiler
    matcher = xgr.GrammarMatcher(comp.compile_structural_tag(json.dumps(tag)))
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.is_terminated() or matcher.accept_token(tok.eos_token_id)


@pytest.mark.model
@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_structural_tags_accept_what_parse_reads(compiler, fmt: str) -> None:  # type: ignore[no-untyped-def]
    parser = get_parser(fmt)
    tags = {"auto": parser.structural_tag(TOOLS), "required": parser.structural_tag(TOOLS, required=True),
            "named": parser.structural_tag(TOOLS, name="now")}
    texts = grammar_texts(parser)
    for mode, tag in tags.items():
        for text in texts[mode]:
            assert accepts(compiler, tag, text), (mode, text)
    weather = parser.format_call("get_weather", PARIS)
    assert not accepts(compiler, tags["required"], "Checking. " + weather)    # text outside a call
    assert accepts(compiler, tags["auto"], "Checking. " + weather)
    assert not accepts(compiler, tags["required"], parser.format_call("get_weather", '{"town": "X"}'))
    assert not accepts(compiler, tags["required"], parser.format_call("unknown", "{}"))
    assert not accepts(compiler, tags["auto"], "ok " + parser.format_call("get_weather", '{"days": 1}'))
    assert not accepts(compiler, tags["named"], parser.format_call("get_weather", PARIS))
    single = parser.structural_tag(TOOLS, required=True, parallel=False)
    assert accepts(compiler, single, weather)
    assert not accepts(compiler, single, texts["required"][1])
