"""Output constraints as the routes accept them, turned into one ``SamplingParams.grammar``.

Each API spells a constraint its own way; all of them become ``(kind, spec)`` (see
`engine.scheduling.params.GRAMMAR_KINDS`), compiled by the runtime before the request is submitted:

=============================  =========================================  =================
field                          where                                      kind
=============================  =========================================  =================
``response_format``            OpenAI chat / completions                  ``text`` (none),
                                                                          ``json_object``,
                                                                          ``json_schema``,
                                                                          ``structural_tag``
``json_schema``                SGLang ``sampling_params`` (a JSON string)  ``json_schema``
``regex``                      SGLang ``sampling_params``; OpenAI extra    ``regex``
``ebnf``                       SGLang ``sampling_params``; OpenAI extra    ``ebnf``
``structural_tag``             SGLang ``sampling_params`` (a JSON string)  ``structural_tag``
``guided_json``                vLLM alias (an object or a JSON string)     ``json_schema``
``guided_regex``               vLLM alias                                  ``regex``
``guided_grammar``             vLLM alias                                  ``ebnf``
``guided_choice``              vLLM alias: one of these strings exactly    ``ebnf``
``structured_outputs``         vLLM's current form, an object with one of  as its member:
                               ``json`` | ``regex`` | ``choice`` |         ``json_schema``,
                               ``grammar`` | ``json_object`` |             ``regex``, ``ebnf``,
                               ``structural_tag``                          ``ebnf``, ...
=============================  =========================================  =================

A request carries at most one: two at once, an unknown ``response_format.type``, a
``response_format`` that is not an object, or a spec that does not compile is a 400 naming the
field (`FieldError`). ``response_format: {"type": "text"}`` is no constraint.
"""

from __future__ import annotations

import json
from typing import Any

from ...engine.scheduling.params import ParamError
from .errors import FieldError

__all__ = ["pick_constraint", "compile_constraint", "CONSTRAINT_FIELDS"]

CONSTRAINT_FIELDS = ("response_format", "json_schema", "regex", "ebnf", "structural_tag",
                     "guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs")
# vLLM's StructuredOutputsParams: its constraint members (one exactly), as the alias each is
STRUCTURED_MEMBERS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar", "structural_tag": "structural_tag"}
# and its options, accepted at the value that changes nothing here
STRUCTURED_NOOP = {"disable_any_whitespace": False, "disable_additional_properties": False,
                   "whitespace_pattern": None}
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 1024


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise FieldError(param, f"{param} must be a non-empty string")
    if len(value) > MAX_SPEC_CHARS:
        raise FieldError(param, f"{param} is longer than {MAX_SPEC_CHARS} characters")
    return value


def _json_text(value: Any, param: str, what: str) -> str:
    """An object, or a JSON string of one, as canonical JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(_text(value, param))
        except json.JSONDecodeError as exc:
            raise FieldError(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise FieldError(param, f"{param} must be {what} (a JSON object)")
    return json.dumps(value, ensure_ascii=False)      # key order kept: it is the output order


def _response_format(rf: Any, param: str) -> tuple[str, str] | None:
    if not isinstance(rf, dict):
        raise FieldError(param, f"{param} must be an object such as {{\"type\": \"json_object\"}}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise FieldError(f"{param}.json_schema", "response_format json_schema needs a json_schema "
                                                     "object {name, schema, strict}")
        name = js.get("name")
        if name is not None and not (isinstance(name, str) and 0 < len(name) <= 64):
            raise FieldError(f"{param}.json_schema.name", "json_schema.name must be a string of 1-64 characters")
        if "strict" in js and not isinstance(js["strict"], bool):
            raise FieldError(f"{param}.json_schema.strict", "json_schema.strict must be a boolean")
        schema = js.get("schema")
        if schema is None:
            return ("json_object", "")
        return ("json_schema", _json_text(schema, f"{param}.json_schema.schema", "a JSON schema"))
    if kind == "structural_tag":
        return ("structural_tag", _json_text(rf, param, "a structural tag"))
    raise FieldError(f"{param}.type", f"unknown response_format type {kind!r}; use text, json_object, "
                                      "json_schema or structural_tag")


def _choice(value: Any, param: str) -> tuple[str, str]:
    if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)):
        raise FieldError(param, f"{param} must be a list of 1-{MAX_CHOICES} non-empty strings")
    return ("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))


def _structured_outputs(value: Any, param: str) -> tuple[str, str]:
    """vLLM's ``structured_outputs``: exactly one constraint member (vLLM's rule), options at
    their defaults only (whitespace control is xgrammar's default here)."""
    if not isinstance(value, dict):
        raise FieldError(param, f"{param} must be an object such as {{\"json\": {{...}}}}")
    members = [k for k in (*STRUCTURED_MEMBERS, "json_object") if value.get(k) is not None]
    for key, v in value.items():
        if key in STRUCTURED_MEMBERS or key == "json_object":
            continue
        if key not in STRUCTURED_NOOP:
            raise FieldError(f"{param}.{key}", f"unknown structured_outputs field {key!r}; use one of "
                                               f"{', '.join((*STRUCTURED_MEMBERS, 'json_object'))}")
        if v is not None and v != STRUCTURED_NOOP[key]:
            raise FieldError(f"{param}.{key}", f"{param}.{key} is not supported by this server "
                                               f"(leave it {json.dumps(STRUCTURED_NOOP[key])})")
    if len(members) != 1:
        raise FieldError(param, "You can only use one kind of structured outputs constraint but multiple are "
                                f"specified: {', '.join(members)}" if members else
                                "You must use one kind of structured outputs constraint but none are specified")
    key = members[0]
    if key == "json_object":
        if value[key] is not True:
            raise FieldError(f"{param}.json_object", "structured_outputs.json_object must be true")
        return ("json_object", "")
    grammar = _one(STRUCTURED_MEMBERS[key], value[key], f"{param}.{key}")
    assert grammar is not None
    return grammar


def _one(name: str, value: Any, param: str) -> tuple[str, str] | None:
    if name == "structured_outputs":
        return _structured_outputs(value, param)
    if name == "response_format":
        return _response_format(value, param)
    if name in ("json_schema", "guided_json"):
        return ("json_schema", _json_text(value, param, "a JSON schema"))
    if name == "structural_tag":
        return ("structural_tag", _json_text(value, param, "a structural tag"))
    if name in ("regex", "guided_regex"):
        return ("regex", _text(value, param))
    if name in ("ebnf", "guided_grammar"):
        return ("ebnf", _text(value, param))
    if name == "guided_choice":
        return _choice(value, param)
    raise AssertionError(name)


def pick_constraint(body: Any, prefix: str = "") -> tuple[tuple[str, str], str] | None:
    """The one constraint `body` carries, with the field it came from (``param``), or None.
    `body` is a request model: any of `CONSTRAINT_FIELDS` it has is looked at."""
    found: list[tuple[tuple[str, str], str]] = []
    named: list[str] = []
    for name in CONSTRAINT_FIELDS:
        value = getattr(body, name, None)
        if value is None:
            continue
        param = prefix + name
        grammar = _one(name, value, param)
        if grammar is None:
            continue
        named.append(param)
        if name == "response_format" and grammar[0] == "json_schema":
            param = f"{param}.json_schema.schema"       # where a schema that does not compile is
        found.append((grammar, param))
    if len(found) > 1:
        raise FieldError(named[1], f"a request takes one output constraint; got {named[0]} and {named[1]}")
    return found[0] if found else None


async def compile_constraint(runtime: Any, grammar: tuple[str, str], param: str) -> None:
    """Compile on the runtime's worker thread; a spec that does not compile is a 400 on `param`."""
    try:
        await runtime.compile_grammar(grammar)
    except FieldError:
        raise
    except ParamError as exc:
        raise FieldError(param, f"{param}: {exc}") from None
