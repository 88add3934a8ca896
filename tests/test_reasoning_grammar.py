"""A constraint on a reasoning model starts after its reasoning: on the tiny random Qwen3 of
`test_reasoning_qwen3` (``<think>`` / ``</think>`` single tokens, a template that opens
``<think>``), a constrained request writes the model's own free text inside ``<think>`` ... and
the grammar masks and advances only from the token after ``</think>`` (`engine.sampling.thinking.
GrammarGate`); a thinking budget forces ``</think>`` and the grammar takes over; a pause,
a retraction and a re-execution see the same tokens; without a reasoning parser nothing
changes."""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import pytest
import torch

from actorserve.engine.scheduling.params import ParamError, SamplingParams
from actorserve.http.edge.schemas import ChatCompletionRequest
from actorserve.http.tools.tools import plan_tools
from actorserve.engine.scheduling.sequence import Sequence
from actorserve.engine.sampling.thinking import MAYBE, ON, THINK, GrammarGate, gate_state
from actorserve.messages import ContinueGeneration, PauseGeneration
from actorserve.replay.check import check
from actorserve.replay.recorder import read_recording
from actorserve.replay.reexec import reexecute

from http_support import serve, settle, until
from test_reasoning_qwen3 import ASK, NAME, qwen3  # noqa: F401  (the tiny Qwen3 fixture)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
GRAMMAR = ("json_schema", json.dumps(SCHEMA))


def _ids(qwen3):
    hf_tok = qwen3[1]
    return hf_tok.convert_tokens_to_ids("<think>"), hf_tok.convert_tokens_to_ids("</think>")


def _sp(think, **kw) -> SamplingParams:
    base = dict(temperature=0.0, max_new_tokens=40, ignore_eos=True, think_ids=think, think_open=True)
    return SamplingParams(**{**base, **kw})


async def _run(rt, prompt, sp):
    out = await rt.generate(prompt, sp).stream.final()
    return list(out.token_ids), out


def test_the_gate_follows_the_output_tokens():
    g = GrammarGate(5, 6, True)
    assert g.state == THINK and g.feed([1, 5, 2]).state == THINK and g.feed([6]).state == ON
    assert g.feed([5, 6, 1]).state == ON                  # a later tag is the grammar's business
    assert GrammarGate(5, 6, False).state == MAYBE
    assert GrammarGate(5, 6, False).feed([5]).state == THINK
    assert GrammarGate(5, 6, False).feed([1]).state == ON
    assert GrammarGate(5, 6, False).feed([6]).state == ON  # not inside reasoning: just a token
    seq = Sequence("r", [1, 2], sampling=SamplingParams(grammar=GRAMMAR, think_ids=(5, 6),
                                                        think_open=True, grammar_after_think=True))
    assert gate_state(seq) == THINK
    seq.output_ids += [3, 6]
    assert gate_state(seq) == ON
    seq.output_ids[:] = [3]                              # fewer tokens (a new output): recounted
    assert gate_state(seq) == THINK
    plain = Sequence("p", [1], sampling=SamplingParams(grammar=GRAMMAR, think_ids=(5, 6), think_open=True))
    assert gate_state(plain) == ON                      # not gated: the grammar from the first token
    for bad in ({"grammar": GRAMMAR}, {"think_ids": (5, 6)}):
        with pytest.raises(ParamError, match="grammar_after_think needs"):
            SamplingParams(grammar_after_think=True, **bad)


def test_mask_and_accept_skip_reasoning_and_let_think_open_an_answer(qwen3):
    from actorserve.engine.sampling.grammar import GrammarBackend, accept, mask_rows
    model, hf_tok, _ = qwen3
    start, end = _ids(qwen3)
    vocab = model.get_output_embeddings().weight.shape[0]
    backend = GrammarBackend(hf_tok, vocab_size=vocab, stop_token_ids=(hf_tok.eos_token_id,))
    word = hf_tok.encode("hello", add_special_tokens=False)[0]

    def seq(open_: bool) -> Sequence:
        s = Sequence("s", [1], sampling=SamplingParams(grammar=GRAMMAR, think_ids=(start, end),
                                                       think_open=open_, grammar_after_think=True))
        backend.ensure([s])
        return s

    inside, first = seq(True), seq(False)
    logits = torch.zeros(2, vocab)
    mask_rows(logits, [inside, first])
    assert bool(torch.isfinite(logits[0]).all())                    # reasoning: nothing masked
    allowed = torch.isfinite(logits[1]).nonzero()[:, 0].tolist()
    assert start in allowed and word not in allowed and end not in allowed
    (brace, *_) = [t for t in allowed if t != start]         # a token of '{' (the grammar's)
    assert hf_tok.decode([brace]).strip() == "{"
    # inside reasoning the matcher does not move; </think> does not reach it either
    assert accept(inside, word) is None
    inside.output_ids.append(word)
    assert accept(inside, end) is None
    inside.output_ids.append(end)
    assert gate_state(inside) == ON
    assert accept(inside, word) == f"the grammar refused token {word}"   # now the grammar holds
    # the first token <think> opens reasoning (not the grammar's); another one is the grammar's
    assert accept(first, start) is None
    first.output_ids.append(start)
    assert gate_state(first) == THINK and accept(first, word) is None
    other = seq(False)
    assert accept(other, brace) is None
    other.output_ids.append(brace)
    assert gate_state(other) == ON and accept(other, word) is not None


async def test_free_reasoning_then_the_answer_follows_the_schema(qwen3):
    model, hf_tok, tok = qwen3
    think = _ids(qwen3)
    start, end = think
    prompt = tok.apply_chat_template(ASK)
    async with serve(qwen3, name=NAME, reasoning_parser="qwen3") as (http, rt):
        await rt.compile_grammar(GRAMMAR)
        free, _ = await _run(rt, prompt, _sp(think))
        assert end not in free
        # left alone inside reasoning: exactly the unconstrained tokens, no grammar error
        ids, out = await _run(rt, prompt, _sp(think, grammar=GRAMMAR, grammar_after_think=True))
        assert ids == free and out.finish_reason == "length", out
        # the same grammar from the first token (no reasoning parser's gate) changes them
        plain, _ = await _run(rt, prompt, _sp(think, grammar=GRAMMAR))
        assert plain[:len(free)] != free
        assert tok.decode(plain).startswith("{")
        # budget + grammar: free reasoning, </think> forced, then JSON that validates, `stop`
        for budget in (0, 3, 7):
            ids, out = await _run(rt, prompt, _sp(think, grammar=GRAMMAR, grammar_after_think=True,
                                                  thinking_budget=budget))
            assert ids[:budget] == free[:budget] and ids[budget] == end, ids
            assert out.finish_reason == "stop", out          # the grammar ended it (ignore_eos)
            answer = tok.decode(ids[budget + 1:])
            jsonschema.validate(json.loads(answer), SCHEMA)
            assert not tok.decode(free[:max(budget, 1)]).startswith("{")   # reasoning was free text
        await settle(rt)


async def test_chat_with_response_format_and_a_thinking_budget(qwen3):
    _, _, tok = qwen3
    fmt = {"type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA}}
    body = {"model": NAME, "messages": ASK, "temperature": 0, "max_tokens": 40, "ignore_eos": True,
            "response_format": fmt, "max_thinking_tokens": 4}
    async with serve(qwen3, name=NAME, reasoning_parser="qwen3") as (http, rt):
        r = await http.post("/v1/chat/completions", json=body)
        out = await r.json()
        assert r.status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", out
        msg = choice["message"]
        assert msg["reasoning_content"] and not msg["reasoning_content"].lstrip().startswith("{")
        jsonschema.validate(json.loads(msg["content"]), SCHEMA)
        assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
        # streamed: the same split, the same answer
        r = await http.post("/v1/chat/completions", json={**body, "stream": True})
        deltas = []
        async for line in r.content:
            text = line.decode().strip()
            if text.startswith("data: {") and json.loads(text[6:])["choices"]:
                deltas.append(json.loads(text[6:])["choices"][0]["delta"])
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
        # the budget alone, with no room for the answer's grammar: cut by max_tokens, no error
        r = await http.post("/v1/chat/completions", json={**body, "max_tokens": 3})
        out = await r.json()
        assert r.status == 200 and out["choices"][0]["finish_reason"] == "length", out
        assert out["choices"][0]["message"]["content"] == ""
        await settle(rt)


async def test_tool_choice_required_calls_after_reasoning(qwen3):
    _, hf_tok, tok = qwen3
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}}]
    # the tool grammar lets JSON have whitespace, which a random model would write forever
    blank = {str(t): -100 for t in range(len(hf_tok)) if not hf_tok.decode([t]).strip()}
    body = {"model": NAME, "messages": ASK, "temperature": 0, "max_tokens": 60, "ignore_eos": True,
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
            "max_thinking_tokens": 3, "logit_bias": blank}
    async with serve(qwen3, name=NAME, reasoning_parser="qwen3") as (http, rt):
        # the same prompt (tools described in it), unconstrained: the model's own reasoning
        plan = plan_tools(ChatCompletionRequest.model_validate(body), tok, None)
        prompt = tok.apply_chat_template(plan.messages, **plan.template_kwargs)
        free, _ = await _run(rt, prompt, SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True,
                                                        logit_bias=tuple((int(t), -100.0) for t in blank)))
        r = await http.post("/v1/chat/completions", json=body)
        out = await r.json()
        assert r.status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        msg = choice["message"]
        # the reasoning is the model's own (the tool grammar did not touch it), the call parses
        assert msg["reasoning_content"] == tok.decode(free) != ""
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "pick"
        jsonschema.validate(json.loads(call["function"]["arguments"]), tools[0]["function"]["parameters"])
        # streamed: reasoning deltas, then the call's deltas from the answer only
        r = await http.post("/v1/chat/completions", json={**body, "stream": True})
        deltas = []
        async for line in r.content:
            text = line.decode().strip()
            if text.startswith("data: {") and json.loads(text[6:])["choices"]:
                deltas.append(json.loads(text[6:])["choices"][0])
        assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
        calls = [c for d in deltas for c in d["delta"].get("tool_calls") or ()]
        assert calls[0]["function"]["name"] == "pick"
        assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
        assert deltas[-1]["finish_reason"] == "tool_calls"
        await settle(rt)


class _HoldAt:
    """The engine's sampler, held (on the step thread) at the step that draws a sequence's
    output token number `at` until the test lets it go: a pause lands exactly there."""

    def __init__(self, sampler, at: int) -> None:
        self.sampler, self.at = sampler, at
        self.hit, self.go = threading.Event(), threading.Event()

    def __call__(self, logits, seqs):
        if not self.go.is_set() and any(len(s.output_ids) == self.at for s in seqs):
            self.hit.set()
            self.go.wait(30)
        return self.sampler(logits, seqs)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_a_pause_mid_reasoning_or_mid_answer_keeps_the_tokens(qwen3, mode):
    _, _, tok = qwen3
    think = _ids(qwen3)
    prompt = tok.apply_chat_template(ASK)
    sp = _sp(think, grammar=GRAMMAR, grammar_after_think=True, thinking_budget=6, max_new_tokens=40)
    async with serve(qwen3, name=NAME, reasoning_parser="qwen3") as (http, rt):
        await rt.compile_grammar(GRAMMAR)
        expected, _ = await _run(rt, prompt, sp)
        assert expected[6] == think[1] and len(expected) > 12
        sampler = rt.engine.sampler
        for at in (3, 6, 9):          # inside the reasoning, at </think>, inside the answer
            hold = rt.engine._sampler = _HoldAt(sampler, at)
            handle = rt.generate(prompt, sp)
            await until(hold.hit.is_set, 30.0)
            pausing = asyncio.ensure_future(rt.control(PauseGeneration(mode)))
            hold.go.set()
            assert (await pausing).ok
            assert rt.stats().live_requests == 1           # paused mid-output
            if mode == "retract":
                assert rt.stats().kv_used_blocks == 0      # recomputed on continue; the gate holds
            assert (await rt.control(ContinueGeneration())).ok
            out = await handle.stream.final()
            assert list(out.token_ids) == expected and out.finish_reason == "stop", out
        rt.engine._sampler = sampler
        await settle(rt)


async def test_a_recorded_run_reexecutes_with_its_gate(qwen3, tmp_path):
    path = tmp_path / "reasoning-grammar.jsonl"
    fmt = {"type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA}}
    async with serve(qwen3, name=NAME, reasoning_parser="qwen3", record_path=path) as (http, rt):
        r = await http.post("/v1/chat/completions", json={
            "model": NAME, "messages": ASK, "temperature": 0, "max_tokens": 40, "ignore_eos": True,
            "response_format": fmt, "max_thinking_tokens": 2})
        assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "stop"
        await settle(rt)
        await rt.shutdown()
    _, events = read_recording(path)
    (arrival,) = [e.data for e in events if e.kind == "input" and e.event == "generate"]
    assert arrival["grammar_after_think"] is True and arrival["think_open"] is True
    assert check(events).ok
    report = await reexecute(events)
    assert report.ok and report.drift == 0 and report.fillers == 0, report.format()


def test_the_plan_gates_a_constraint_unless_the_prompt_closed_reasoning(qwen3):
    from types import SimpleNamespace

    from actorserve.http.openai.reasoning_plan import plan_reasoning
    _, _, tok = qwen3
    think = _ids(qwen3)
    body = SimpleNamespace(max_thinking_tokens=None, thinking_token_budget=None, thinking_budget=None)

    def plan(prompt: str, parser: str = "qwen3"):
        ctx = SimpleNamespace(config=SimpleNamespace(reasoning_parser=parser), tokenizer=tok, extra={})
        return plan_reasoning(ctx, body, tok.encode(prompt))

    cases = [("user: hi\nassistant:\n<think>\n", "qwen3", True, True),       # the template opened it
             ("user: hi\nassistant:\n", "qwen3", False, True),                 # the model may open it
             ("user: hi\nassistant:\n<think>\n\n</think>\n\n", "qwen3", False, False),   # closed
             ("user: hi\nassistant:\n<think>\n\n</think>\n\n", "deepseek-r1", True, True)]
    for prompt, parser, opened, gated in cases:
        sp = plan(prompt, parser).sampling(SamplingParams(grammar=GRAMMAR))
        assert (sp.grammar_after_think, sp.think_open) == (gated, opened), (prompt, parser)
        assert sp.think_ids == (think if gated else None)
        free = plan(prompt, parser).sampling(SamplingParams())
        assert free == SamplingParams()                   # no constraint, no budget: untouched


async def test_responses_text_format_after_reasoning(qwen3):
    fmt = {"type": "json_schema", "name": "count", "schema": SCHEMA}
    async with serve(qwen3, name=NAME, reasoning_parser="qwen3") as (http, rt):
        r = await http.post("/v1/responses", json={
            "model": NAME, "input": ASK[0]["content"], "temperature": 0, "max_output_tokens": 40,
            "max_thinking_tokens": 3, "text": {"format": fmt}})
        out = await r.json()
        assert r.status == 200 and out["status"] == "completed", out
        kinds = [item["type"] for item in out["output"]]
        assert kinds == ["reasoning", "message"], out
        assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
        jsonschema.validate(json.loads(out["output"][1]["content"][0]["text"]), SCHEMA)
        await settle(rt)
