"""Structured outputs on the real SmolLM2-135M-Instruct: JSON schema, regex, EBNF, choices and
the official `openai` client's `parse`, over HTTP; a constrained request under pause (in place
and retract), abort, n > 1, logprobs and stop strings; and re-execution of a recorded
constrained run. Greedy decoding throughout, so every run is the same run."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import AbortRequest, ContinueGeneration, PauseGeneration
from actorserve.replay.check import check
from actorserve.replay.recorder import FlightRecorder, read_recording
from actorserve.replay.reexec import reexecute
from actorserve.statemachines import LIFECYCLES

from http_support import load_smol, serve, settle, until
from actor_access import live_actors

pytestmark = pytest.mark.model
NAME = "smollm2"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "skills", "address"],
}
TOPICS = ["a baker", "a pilot", "a painter", "a nurse", "a chess player", "a farmer", "a poet",
          "a sailor", "a coder", "a singer", "a teacher", "a judge", "a miner", "a chef", "a clown",
          "a monk", "a diver", "a tailor", "a potter", "a driver"]


@pytest.fixture(scope="module")
def smol():
    return load_smol()


def client(http) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0, timeout=120)


def chat(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe {topic} as a JSON person record."}]


async def test_json_schema_validates_on_20_prompts_and_parse_fills_a_pydantic_model(smol):
    async with serve(smol, name=NAME, kv_blocks=512) as (http, rt):
        oa = client(http)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        outs = await asyncio.gather(*(oa.chat.completions.create(
            model=NAME, messages=chat(t), response_format=fmt, temperature=0, max_tokens=160)
            for t in TOPICS))
        for out in outs:
            choice = out.choices[0]
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        # the same constraint unconstrained is prose, not a record: the grammar did the work
        free = await oa.chat.completions.create(model=NAME, messages=chat(TOPICS[0]), temperature=0,
                                                max_tokens=40)
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(free.choices[0].message.content), PERSON)

        class City(BaseModel):
            name: str = Field(max_length=20)
            country: str = Field(max_length=20)
            population: int = Field(ge=0, le=100_000_000)

        parsed = await oa.chat.completions.parse(
            model=NAME, messages=[{"role": "user", "content": "Tell me about Paris."}],
            response_format=City, temperature=0, max_tokens=80)
        city = parsed.choices[0].message.parsed
        assert isinstance(city, City) and city.name
        await oa.close()
        await settle(rt)


async def test_regex_ebnf_choice_and_json_object_on_every_route(smol):
    phone = re.compile(r"[0-9]{3}-[0-9]{4}")
    async with serve(smol, name=NAME) as (http, rt):
        r = await http.post("/generate", json={"text": "My phone number is", "sampling_params": {
            "regex": phone.pattern, "temperature": 0, "max_new_tokens": 20}})
        body = await r.json()
        assert r.status == 200, body
        assert phone.fullmatch(body["text"]) and body["meta_info"]["finish_reason"]["type"] == "stop"
        for route, key in (("/v1/completions", "guided_regex"), ("/v1/completions", "regex")):
            r = await http.post(route, json={"prompt": "Call me at", key: phone.pattern, "temperature": 0.9,
                                             "seed": 3, "max_tokens": 20, "n": 3})
            body = await r.json()
            assert r.status == 200, body
            assert len(body["choices"]) == 3
            assert all(phone.fullmatch(c["text"]) for c in body["choices"]), body
        r = await http.post("/generate", json={"text": "Is the sky blue? Answer:", "sampling_params": {
            "ebnf": 'root ::= "yes" | "no"', "temperature": 0, "max_new_tokens": 10}})
        assert (await r.json())["text"] in ("yes", "no")
        oa = client(http)
        choice = await oa.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Pick a color."}], temperature=0, max_tokens=10,
            extra_body={"guided_choice": ["red", "green", "blue"]})
        assert choice.choices[0].message.content in ("red", "green", "blue")
        obj = await oa.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
            response_format={"type": "json_object"}, temperature=0, max_tokens=200, frequency_penalty=0.5)
        assert obj.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
        # xgrammar's structural tag, in response_format: a tagged JSON answer
        tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
               "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": {
                   "capital": {"type": "string", "maxLength": 20}}, "required": ["capital"]}}}}
        tagged = await oa.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
            response_format=tag, temperature=0, max_tokens=40)
        text = tagged.choices[0].message.content
        assert text.startswith("<answer>") and text.endswith("</answer>"), text
        assert set(json.loads(text[len("<answer>"):-len("</answer>")])) == {"capital"}
        # a streamed constrained run, with logprobs: the same text, and a logprob per token
        stream = await oa.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Pick a color."}], temperature=0, max_tokens=10,
            extra_body={"guided_choice": ["red", "green", "blue"]}, stream=True, logprobs=True)
        text, lps = "", []
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                lps += (c.choices[0].logprobs.content or []) if c.choices[0].logprobs else []
        assert text == choice.choices[0].message.content and len(lps) >= 1
        await oa.close()
        await settle(rt)


async def test_a_stop_string_inside_a_grammar_ends_the_request(smol):
    async with serve(smol, name=NAME) as (http, rt):
        r = await http.post("/generate", json={"text": "Numbers:", "sampling_params": {
            "regex": "(1|2|3)+,(4|5|6)+", "stop": [","], "temperature": 0, "max_new_tokens": 30}})
        body = await r.json()
        assert r.status == 200, body
        assert re.fullmatch("[123]+", body["text"]) and body["meta_info"]["finish_reason"]["type"] == "stop"
        await settle(rt)


async def runtime(smol, **kw) -> Runtime:
    from actorserve.engine.runners.runner import build_engine
    model, hf_tok, tok = smol
    engine = build_engine(model, num_blocks=512, block_size=16, tokenizer=hf_tok, model_name=NAME)
    rt = Runtime(engine, config=SchedulerConfig(batch=BatchConfig(max_num_seqs=16), step_in_thread=True),
                 recorder=FlightRecorder(lifecycles=LIFECYCLES.values(), **kw),
                 detokenizer=tok.detokenizer_for)
    await rt.start()
    return rt


def person_params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=160, grammar=("json_schema", json.dumps(PERSON)), **kw)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_mid_grammar_keeps_the_matcher(smol, mode):
    tok = smol[2]
    rt = await runtime(smol)
    prompts = [tok.apply_chat_template(chat(t)) for t in TOPICS[:4]]
    sp = person_params()
    await rt.compile_grammar(sp.grammar)
    expected = [(await rt.generate(p, sp).stream.final()).text for p in prompts]
    hs = [rt.generate(p, sp) for p in prompts]
    base = rt.stats().generated_tokens
    await until(lambda: rt.stats().generated_tokens >= base + 40, 60.0)       # inside the records
    assert (await rt.control(PauseGeneration(mode))).ok
    if mode == "retract":
        assert rt.stats().kv_used_blocks == 0      # recomputed on continue; the matcher stays
    assert (await rt.control(ContinueGeneration())).ok
    got = [(await h.stream.final()) for h in hs]
    assert [o.text for o in got] == expected
    for o in got:
        jsonschema.validate(json.loads(o.text), PERSON)
    await rt.quiesce()
    assert rt.stats().kv_used_blocks == 0 and live_actors(rt) == []
    assert check(rt.recorder.events()).ok
    await rt.shutdown()


async def test_abort_mid_grammar_ends_once_and_frees_everything(smol):
    tok = smol[2]
    rt = await runtime(smol)
    sp = person_params()
    await rt.compile_grammar(sp.grammar)
    h = rt.generate(tok.apply_chat_template(chat("a miner")), sp, rid="g")
    await until(lambda: rt.stats().generated_tokens >= 8, 60.0)
    assert (await rt.control(AbortRequest(rid="g"))).detail["aborted"] == 1
    out = await h.stream.final()
    assert out.finish_reason == "abort" and 0 < out.completion_tokens < 160
    assert out.text.startswith("{")
    await rt.quiesce()
    assert rt.stats().kv_used_blocks == 0 and live_actors(rt) == []
    await rt.shutdown()


async def test_a_recorded_constrained_run_reexecutes_exactly(smol, tmp_path):
    path = tmp_path / "structured.jsonl"
    async with serve(smol, name=NAME, record_path=path) as (http, rt):
        oa = client(http)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

        async def one(i: int) -> str:
            out = await oa.chat.completions.create(model=NAME, messages=chat(TOPICS[i]), response_format=fmt,
                                                   temperature=0.7, seed=i, max_tokens=160,
                                                   extra_body={"ignore_eos": True})
            return out.choices[0].finish_reason

        assert await asyncio.gather(*(one(i) for i in range(4))) == ["stop"] * 4
        await oa.close()
        await settle(rt)
        await rt.shutdown()
    _, events = read_recording(path)
    compiles = [e.data for e in events if e.kind == "input" and e.event == "grammar"]
    assert len(compiles) == 4 and [c["cached"] for c in compiles].count(False) == 1
    assert all(c["compile_ms"] >= 0 and c["kind"] == "json_schema" for c in compiles)
    # ignore_eos: only the engine's own verdict (the grammar ended) stops these requests
    verdicts = [m for e in events if e.kind == "input" and e.event == "step_end"
                for m in e.data["out"] or () if len(m) > 2]
    assert [v[2] for v in verdicts] == ["stop"] * 4
    assert check(events).ok
    report = await reexecute(events)
    assert report.ok, report.format()
    assert report.drift == 0 and report.fillers == 0
