"""The edge of structured outputs on the tiny model: every way to ask for a constraint that is
wrong is a 400 naming the field, and the server keeps serving; an unknown field is a 400 while
a harmless vendor extra is not; ``logit_bias`` does what OpenAI says it does."""

from __future__ import annotations

import pytest

from http_support import assert_error, load_tiny, serve, settle
from actor_access import live_actors

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


BAD_CHAT = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "bogus"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "[a-z]+"}, "guided_regex"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"audio": {"voice": "x"}}, "audio"),
]


@pytest.mark.parametrize("extra,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
async def test_a_bad_constraint_is_a_400_naming_the_field(tiny, extra, param):
    async with serve(tiny) as (http, rt):
        r = await http.post("/v1/chat/completions", json={**CHAT, **extra})
        body = await r.json()
        assert r.status == 400, body
        assert_error(body, "invalid_request_error")
        assert body["error"]["param"] == param, body
        ok = await http.post("/v1/chat/completions", json=CHAT)       # and it keeps serving
        assert ok.status == 200
        await settle(rt)


async def test_native_and_completion_constraints_are_checked_too(tiny):
    async with serve(tiny) as (http, rt):
        cases = [
            ("/generate", {"text": "x", "sampling_params": {"regex": "(", "max_new_tokens": 2}},
             "sampling_params.regex"),
            ("/generate", {"text": ["x", "y"], "sampling_params": [{"max_new_tokens": 2},
                                                                   {"json_schema": "[1]"}]},
             "sampling_params.1.json_schema"),
            ("/generate", {"text": "x", "sampling_params": {"structural_tag": {"structures": []}}},
             "sampling_params.structural_tag"),
            ("/generate", {"text": "x", "sampling_params": {"min_new_tokens": -1}}, "sampling_params.min_new_tokens"),
            ("/generate", {"text": "x", "lora_path": "a"}, "lora_path"),
            ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
            ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
        ]
        for route, body, param in cases:
            r = await http.post(route, json=body)
            got = await r.json()
            assert r.status == 400 and got["error"]["param"] == param, (route, body, got)
        # vendor extras that change nothing are accepted
        r = await http.post("/v1/chat/completions", json={**CHAT, "user": "u", "metadata": {"k": "v"},
                                                          "store": False, "service_tier": "auto"})
        assert r.status == 200, await r.text()
        await settle(rt)


async def test_constraints_are_honoured_on_the_tiny_model_too(tiny):
    async with serve(tiny) as (http, rt):
        r = await http.post("/generate", json={"text": "x", "sampling_params": {
            "json_schema": '{"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}}, '
                           '"required": ["a"], "additionalProperties": false}',
            "max_new_tokens": 40, "temperature": 0}})
        body = await r.json()
        assert r.status == 200, body
        if body["meta_info"]["finish_reason"]["type"] == "stop":
            import json
            assert set(json.loads(body["text"])) == {"a"}
        else:
            assert body["text"].startswith('{"a": ')
        r = await http.post("/generate", json={"text": "x", "sampling_params": {
            "guided_choice": ["alpha", "beta"], "max_new_tokens": 10, "temperature": 1.0, "seed": 1, "n": 4}})
        outs = await r.json()
        assert [o["text"] in ("alpha", "beta") for o in outs] == [True] * 4
        await settle(rt)


async def test_logit_bias_bans_and_forces_tokens(tiny):
    async with serve(tiny) as (http, rt):
        tok = tiny[2]
        base = await (await http.post("/generate", json={"text": "once upon a time", "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})).json()
        seen = sorted(set(base["output_ids"]))
        assert seen
        banned = await (await http.post("/generate", json={"text": "once upon a time", "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(t): -100 for t in seen}}})).json()
        assert not set(banned["output_ids"]) & set(seen), (seen, banned["output_ids"])
        forced_id = tok.encode("zebra", add_special_tokens=False)[0]
        forced = await (await http.post("/v1/completions", json={
            "prompt": "once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True,
            "logit_bias": {str(forced_id): 100}})).json()
        ids = tok.encode(forced["choices"][0]["text"], add_special_tokens=False)
        assert set(ids) == {forced_id}, forced
        # logprobs still report the model's own distribution, not the biased one
        lp = await (await http.post("/v1/completions", json={
            "prompt": "once upon a time", "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "logit_bias": {str(forced_id): 100}})).json()
        assert lp["choices"][0]["logprobs"]["token_logprobs"][0] < -0.01
        await settle(rt)


async def test_a_token_the_grammar_refuses_fails_that_request_alone(tiny):
    """A sampler that ignores the mask (a bug, or a custom sampler) cannot smuggle a token past
    the grammar: the matcher refuses it, that request fails, its neighbour in the step goes on."""
    from actorserve.actors.runtime import Runtime
    from actorserve.config import SchedulerConfig
    from actorserve.engine.scheduling.params import SamplingParams
    from actorserve.engine.runners.runner import build_engine
    from actorserve.engine.sampling.sampling import sample
    from actorserve.replay.check import check
    from actorserve.replay.recorder import FlightRecorder
    from actorserve.statemachines import LIFECYCLES

    model, hf_tok, tok = tiny
    digit = tok.encode("7", add_special_tokens=False)[-1]

    def careless(logits, seqs):        # greedy on the raw logits, then a digit for everyone
        return [(digit, None, None) for _ in sample(logits, seqs)]

    engine = build_engine(model, num_blocks=64, block_size=16, tokenizer=hf_tok, sampler=careless)
    rt = Runtime(engine, config=SchedulerConfig(), detokenizer=tok.detokenizer_for,
                 recorder=FlightRecorder(lifecycles=LIFECYCLES.values()))
    await rt.start()
    letters = SamplingParams(max_new_tokens=4, grammar=("regex", "[a-z]+"))
    await rt.compile_grammar(letters.grammar)
    bad = rt.generate(tok.encode("x"), letters)
    free = rt.generate(tok.encode("y"), SamplingParams(max_new_tokens=4, ignore_eos=True))
    out = await bad.stream.final()
    assert out.finish_reason == "error" and "refused token" in out.error and out.token_ids == []
    ok = await free.stream.final()
    assert ok.finish_reason == "length" and ok.token_ids == [digit] * 4
    await rt.quiesce()
    assert rt.stats().kv_used_blocks == 0 and live_actors(rt) == []
    assert check(rt.recorder.events()).ok
    await rt.shutdown()


async def test_a_constrained_turn_in_a_session(tiny):
    async with serve(tiny) as (http, rt):
        assert (await http.post("/open_session", json={"session_id": "s"})).status == 200
        texts = []
        for i in range(2):
            r = await http.post("/generate", json={"text": f"turn {i}", "session_params": {"id": "s"},
                                                   "sampling_params": {"regex": "[0-9]{2}", "max_new_tokens": 5}})
            body = await r.json()
            assert r.status == 200, body
            texts.append(body["text"])
        assert all(len(t) == 2 and t.isdigit() for t in texts), texts
        assert (await http.post("/close_session", json={"session_id": "s"})).status == 200
        await settle(rt)


BAD_TAGS = [      # (structural_tag, what the 400's message must say)
    ({"type": "structural_tag"}, "must have a format field"),
    ({"type": "structural_tag", "format": {"type": "bogus"}}, "Format type not recognized: bogus"),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": 5, "end": "</a>",
                                           "content": {"type": "any_text"}}}, "begin field must be a string"),
    ({"structures": []}, "structural_tag.structures must be a non-empty list"),
    ({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": "<a"},
     "structural_tag.triggers must be a non-empty list"),
    ({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b"]},
     "structural_tag.structures[0].begin '<a>' does not start with any of the triggers ['<b']"),
]


async def test_a_bad_structural_tag_says_what_is_wrong_in_the_requests_terms(tiny):
    """xgrammar's internal assertion text (``Check failed: (...) is false``) never reaches the client."""
    async with serve(tiny) as (http, rt):
        for tag, says in BAD_TAGS:
            r = await http.post("/generate", json={"text": "x", "sampling_params": {"structural_tag": tag}})
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "sampling_params.structural_tag", body
            msg = body["error"]["message"]
            assert says in msg, (tag, msg)
            assert "Check failed" not in msg and "holds_alternative" not in msg and ".cc" not in msg, msg
            assert "Invalid structural tag error" not in msg, msg
        await settle(rt)
