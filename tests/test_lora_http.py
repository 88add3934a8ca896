"""Multi-LoRA over HTTP on the tiny model, adapters built here with `peft` (non-zero B): the
official `openai` client's ``model: "<adapter>"`` (vLLM's) and ``"<base>:<adapter>"`` (SGLang's)
against PEFT's merged model; ``/generate``'s per-input ``lora_path``; base + 3 adapters in one
batch each as alone; the load/unload routes in both shapes and their refusals."""

from __future__ import annotations

import asyncio
import copy

import pytest

peft = pytest.importorskip("peft")

import openai
import torch
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI

from actorserve.actors.runtime import Runtime
from actorserve.config import ModelConfig, SchedulerConfig, ServerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.http.edge.app import build_app
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES

from http_support import NAME, assert_error, load_tiny, settle
from actor_access import actor_of

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a1": dict(r=8, lora_alpha=16, target_modules=ALL),
            "a2": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
            "a3": dict(r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"])}
PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705, 1750]
N = 8


def build_adapter(base, folder, seed: int, **fields):
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(lora_dropout=0.0, **fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:            # PEFT starts B at zero: the adapter would change nothing
                p.normal_(0, 2.0)
            elif "lora_A" in name:
                p.normal_(0, 2.0)
    model.save_pretrained(str(folder))
    return model.merge_and_unload().eval()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    model, hf_tok, tok = load_tiny()
    from transformers import LlamaForCausalLM
    base = LlamaForCausalLM(model.config)       # a plain copy (the served one holds packed weights)
    base.load_state_dict(model.state_dict())
    base.eval()
    root = tmp_path_factory.mktemp("lora_http")
    want = {None: greedy(base, PROMPT, N)}
    for i, (name, fields) in enumerate(ADAPTERS.items()):
        merged = build_adapter(base, root / name, seed=30 + i, **fields)
        want[name] = greedy(merged, PROMPT, N)
    assert len({tuple(v) for v in want.values()}) == 4, want     # each adapter changes the output
    return (model, hf_tok, tok), root, want


class serve:
    def __init__(self, world, *, lora_paths=(), max_loaded: int = 8, batch: BatchConfig | None = None):
        (model, hf_tok, tok), self.root, self.want = world
        from actorserve.engine.runners.runner import build_engine
        engine = build_engine(model, num_blocks=64, block_size=16, tokenizer=hf_tok, model_name=NAME,
                              max_loaded_loras=max_loaded)
        self.rt = Runtime(engine, config=SchedulerConfig(batch=batch or BatchConfig(), step_in_thread=True),
                          recorder=FlightRecorder(capacity=100_000, lifecycles=LIFECYCLES.values()))
        config = ServerConfig(model=ModelConfig(model="tiny", kv_blocks=64, lora_paths=tuple(
            (n, str(self.root / n), False) for n in lora_paths)))
        self.app = build_app(self.rt, tok, config, NAME)

    async def __aenter__(self):
        self.server = TestServer(self.app, host="127.0.0.1", port=0, handler_cancellation=True)
        await self.server.__aenter__()
        self.http = TestClient(self.server)
        await self.http.__aenter__()
        return self.http, self.rt

    async def __aexit__(self, *exc):
        await self.http.__aexit__(*exc)
        await self.server.__aexit__(*exc)


def client_for(http) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0, timeout=60)


async def ids_of(http, name: str | None, prompt=PROMPT) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}}
    if name is not None:
        body["lora_path"] = name
    r = await http.post("/generate", json=body)
    assert r.status == 200, await r.text()
    return (await r.json())["output_ids"]


async def test_openai_client_adapter_output_equals_peft_merged(world):
    async with serve(world, lora_paths=("a1", "a2", "a3")) as (http, rt):
        _, _, tok = world[0]
        want = world[2]
        async with client_for(http) as client:
            models = await client.models.list()
            cards = {m.id: m for m in models.data}
            assert {"a1", "a2", "a3", NAME} <= set(cards)
            assert cards["a1"].parent == NAME and cards[NAME].parent is None
            for name in (None, "a1", "a2", "a3"):
                c = await client.completions.create(model=name or NAME, prompt=PROMPT, max_tokens=N,
                                                    temperature=0, extra_body={"ignore_eos": True})
                assert c.model == (name or NAME)
                assert c.choices[0].text == tok.decode(want[name]), name
                assert c.usage.completion_tokens == N
            sg = await client.completions.create(model=f"{NAME}:a2", prompt=PROMPT, max_tokens=N,
                                                 temperature=0, extra_body={"ignore_eos": True})
            assert sg.choices[0].text == tok.decode(want["a2"])       # SGLang's "<base>:<adapter>"
            chat = [{"role": "user", "content": "hello"}]
            a = await client.chat.completions.create(model="a3", messages=chat, max_tokens=6, temperature=0)
            b = await client.chat.completions.create(model=f"{NAME}:a3", messages=chat, max_tokens=6, temperature=0)
            base = await client.chat.completions.create(model=NAME, messages=chat, max_tokens=6, temperature=0)
            assert a.choices[0].message.content == b.choices[0].message.content != base.choices[0].message.content
            stream = await client.completions.create(model="a1", prompt=PROMPT, max_tokens=N, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == tok.decode(want["a1"])
            with pytest.raises(openai.NotFoundError) as nf:
                await client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
            assert nf.value.body["code"] == "model_not_found"
        for name in (None, "a1", "a2", "a3"):
            assert await ids_of(http, name) == want[name]
        await settle(rt)
        assert all(a["holders"] == 0 for a in rt.loras())


async def test_base_and_three_adapters_in_one_batch_each_as_alone(world):
    async with serve(world, lora_paths=("a1", "a2", "a3")) as (http, rt):
        want = world[2]
        names = [None, "a1", "a2", "a3", "a1", None]
        body = {"input_ids": [PROMPT] * len(names), "lora_path": names,
                "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}}
        r = await http.post("/generate", json=body)
        assert r.status == 200, await r.text()
        outs = [o["output_ids"] for o in await r.json()]
        assert outs == [want[n] for n in names]
        # concurrent requests from separate clients too
        got = await asyncio.gather(*(ids_of(http, n) for n in names))
        assert got == [want[n] for n in names]
        mixed = [s for s in rt.recorder.events(kind="step") if len({m[0] for m in s.data["batch"]}) >= 4]
        assert mixed, "no step mixed the base and the adapters"
        await settle(rt)


async def test_load_unload_routes_in_both_shapes_and_their_refusals(world):
    async with serve(world, max_loaded=2) as (http, rt):
        root, want = world[1], world[2]
        r = await http.post("/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(root / "a1")})
        body = await r.json()
        assert r.status == 200 and body["success"] is True and body["loaded_adapters"] == {"a1": str(root / "a1")}
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")})
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'a2' added successfully."
        assert await ids_of(http, "a2") == want["a2"]
        # already loaded (vLLM's 400), a bad folder (names lora_path), missing field, bad name
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")})
        assert r.status == 400 and "already been loaded" in (await r.json())["error"]["message"]
        r = await http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(root / "nowhere")})
        body = await r.json()
        assert r.status == 400 and body["success"] is False and body["error"]["param"] == "lora_path"
        assert "not a folder" in body["error_message"]
        r = await http.post("/load_lora_adapter", json={"lora_name": "x"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "lora_path"
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a b", "lora_path": "/tmp"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "lora_name"
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "/tmp", "x": 1})
        assert r.status == 400 and (await r.json())["error"]["param"] == "x"
        # a third adapter evicts the least recently used (a1: a2 ran last)
        r = await http.post("/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(root / "a3"), "pinned": True})
        assert r.status == 200 and set((await r.json())["loaded_adapters"]) == {"a2", "a3"}
        # requests naming what is not loaded: 400 on /generate (SGLang), 404 on OpenAI routes (vLLM)
        r = await http.post("/generate", json={"input_ids": PROMPT, "lora_path": "a1"})
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "lora_path", body
        r = await http.post("/generate", json={"input_ids": [PROMPT, PROMPT], "lora_path": ["a2"]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "lora_path"
        r = await http.post("/v1/completions", json={"model": "a1", "prompt": "hi", "max_tokens": 1})
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        # unloads: vLLM's 404 for an unknown name, SGLang's 400; then the adapter is gone
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
        assert r.status == 404
        assert_error(await r.json())
        r = await http.post("/unload_lora_adapter", json={"lora_name": "a1"})
        assert r.status == 400 and (await r.json())["success"] is False
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'a2' removed successfully."
        r = await http.post("/unload_lora_adapter", json={"lora_name": "a3"})
        assert r.status == 200 and (await r.json())["loaded_adapters"] == {}
        r = await http.get("/v1/models")
        assert [m["id"] for m in (await r.json())["data"] if m["parent"]] == []
        assert await ids_of(http, None) == want[None]            # still serving
        await settle(rt)
        ops = [(e.data or {}).get("op") for e in rt.recorder.events(kind="control") if e.event == "create"]
        assert ops.count("load_lora_adapter") == 5 and ops.count("unload_lora_adapter") == 4


async def test_adapters_survive_an_update_of_the_base_and_apply_to_the_new_weights(world, tmp_path):
    """A base weight update with an adapter loaded: the adapter stays, its deltas now apply on
    the new base (PEFT's merge of the same adapter onto the new weights), the prefix cache is
    flushed."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    (_, hf_tok, tok), root, _ = world
    fresh, _, _ = load_tiny()               # the update changes the served model in place
    new_base = LlamaForCausalLM(fresh.config)
    new_base.load_state_dict(fresh.state_dict())
    gen = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for p in new_base.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (float(p.float().std()) or 0.02) * 0.5)
    new_base.eval()
    new_base.save_pretrained(str(tmp_path / "new"))
    want_base = greedy(new_base, PROMPT, N)
    merged = PeftModel.from_pretrained(copy.deepcopy(new_base), str(root / "a1")).merge_and_unload().eval()
    want_a1 = greedy(merged, PROMPT, N)
    assert want_a1 != want_base
    async with serve(((fresh, hf_tok, tok), root, world[2]), lora_paths=("a1",)) as (http, rt):
        assert await ids_of(http, "a1") == world[2]["a1"]
        r = await http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "new"),
                                                               "weight_version": "v2"})
        assert r.status == 200, await r.text()
        assert await ids_of(http, None) == want_base
        assert await ids_of(http, "a1") == want_a1
        r = await http.post("/generate", json={"input_ids": PROMPT, "lora_path": "a1",
                                               "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
        meta = (await r.json())["meta_info"]
        assert meta["weight_version"] == "v2"
        await settle(rt)


async def test_adapters_compose_with_n_structured_output_tools_sessions_responses_and_retract(world):
    """An adapter request through the other features: n>1 (each choice the adapter's greedy
    tokens), a JSON schema and a required tool call (valid under the adapter's weights), a
    session's turns (KV reused within the adapter), a stored response chained under the adapter,
    and a retract pause mid-request (it resumes under the same adapter, the same tokens)."""
    import json as _json

    import jsonschema
    (_, _, tok), _, want = world
    async with serve(world, lora_paths=("a1", "a2")) as (http, rt):
        async with client_for(http) as client:
            c = await client.completions.create(model="a1", prompt=PROMPT, max_tokens=N, temperature=0, n=2,
                                                extra_body={"ignore_eos": True})
            assert [ch.text for ch in c.choices] == [tok.decode(want["a1"])] * 2
            schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                      "required": ["city"], "additionalProperties": False}
            out = await client.chat.completions.create(
                model="a2", messages=[{"role": "user", "content": "city?"}], max_tokens=40, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
            jsonschema.validate(_json.loads(out.choices[0].message.content), schema)
            tools = [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"x": {"enum": ["yes", "no"]}}, "required": ["x"],
                "additionalProperties": False}}}]
            call = await client.chat.completions.create(
                model="a1", messages=[{"role": "user", "content": "call f"}], tools=tools, tool_choice="required",
                max_tokens=60, temperature=0)
            got = call.choices[0].message.tool_calls or []
            # the tiny random model may spend its budget on the JSON's free whitespace; whatever
            # calls it finished are the tool's and valid (the grammar runs under the adapter)
            assert call.choices[0].finish_reason in ("tool_calls", "length")
            assert all(g.function.name == "f" and _json.loads(g.function.arguments) in ({"x": "yes"}, {"x": "no"})
                       for g in got)
            assert call.choices[0].message.content in ("", None)        # calls only, as required
            first = await client.responses.create(model="a1", input="hello there", max_output_tokens=4, store=True)
            second = await client.responses.create(model="a1", input="and then?", max_output_tokens=4,
                                                   previous_response_id=first.id, store=True)
            assert second.status in ("completed", "incomplete") and second.model == "a1"   # 4 tokens: may cut
            assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
        sid = await (await http.post("/open_session", json={})).json()
        cached = []
        for text in ("The quick brown fox jumps over the lazy dog. " * 3, " And then?"):
            r = await http.post("/generate", json={"text": text, "lora_path": "a1", "session_params": {"id": sid},
                                                   "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
            assert r.status == 200, await r.text()
            cached.append((await r.json())["meta_info"]["cached_tokens"])
        assert cached[1] > cached[0]                       # the adapter's own KV, reused in its session
        assert (await http.post("/close_session", json={"session_id": sid})).status == 200
        # a retract pause while an adapter request runs: it resumes under its adapter, same tokens
        long = {"input_ids": PROMPT, "lora_path": "a2",
                "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}
        alone = (await (await http.post("/generate", json=long)).json())["output_ids"]
        running = asyncio.ensure_future(http.post("/generate", json=long))
        from waiting import until
        await until(lambda: any(len(s.output_ids) >= 2 for s in actor_of(rt, "scheduler").seqs.values()), timeout=30,
                    poll=0.001)
        r = await http.post("/pause_generation", json={"mode": "retract"})
        assert r.status == 200, await r.text()
        assert (await http.post("/continue_generation")).status == 200
        body = await (await running).json()
        assert body["output_ids"] == alone and body["meta_info"]["finish_reason"]["type"] == "length"
        await settle(rt)
        assert not actor_of(rt, "scheduler").lora_slots.holders("a2") and not actor_of(rt, "scheduler").lora_slots.holders("a1")


async def test_an_adapter_gone_after_the_route_checked_it_is_a_404_not_a_500(world, monkeypatch):
    """The narrow race: the route saw the adapter, the scheduler no longer has it (an unload got
    there first). Played here by a route that believes any adapter name: the scheduler's refusal
    comes back as the OpenAI 404 (completions and chat; /v1/responses maps it the same way)."""
    from actorserve.http.edge import prepare
    from actorserve.messages_lora import is_lora_refusal, lora_refusal

    async def believes(ctx, model):
        return None if model is None or model in ctx.model_names() else model
    monkeypatch.setattr(prepare, "is_adapter", lambda ctx, model: model not in ctx.model_names())
    monkeypatch.setattr(prepare, "lora_for_model", believes)      # every generation route's preamble
    assert is_lora_refusal(lora_refusal("x", "is being unloaded")) and not is_lora_refusal("boom")
    async with serve(world) as (http, rt):
        r = await http.post("/v1/completions", json={"model": "gone", "prompt": "hi", "max_tokens": 2})
        body = await r.json()
        assert r.status == 404 and body["error"]["code"] == "model_not_found", body
        assert "LoRA adapter 'gone' is not loaded" in body["error"]["message"]
        r = await http.post("/v1/chat/completions", json={"model": "gone", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 404
        assert_error(await r.json())
        r = await http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status == 200                      # the server serves on
        await settle(rt)


async def test_models_route_answers_an_adapter_only_while_it_is_ready(world):
    async with serve(world, lora_paths=("a1",)) as (http, rt):
        card = await (await http.get("/v1/models/a1")).json()
        assert card["id"] == "a1" and card["parent"] == NAME
        assert (await http.post("/pause_generation", json={"mode": "retract"})).status == 200
        held = asyncio.ensure_future(http.post("/generate", json={           # queued: holds a1
            "input_ids": PROMPT, "lora_path": "a1", "sampling_params": {"max_new_tokens": 2}}))
        from waiting import until
        await until(lambda: actor_of(rt, "scheduler").seqs)
        unload = asyncio.ensure_future(http.post("/unload_lora_adapter", json={"lora_name": "a1"}))
        await until(lambda: rt.lora_state("a1") == "unloading")
        r = await http.get("/v1/models/a1")
        assert r.status == 404, await r.text()            # being unloaded: not a model to use
        assert_error(await r.json())
        assert (await http.post("/continue_generation")).status == 200
        assert (await held).status == 200 and (await unload).status == 200
        assert (await http.get("/v1/models/a1")).status == 404
        await settle(rt)


async def test_unload_refuses_a_lora_int_id_it_cannot_honour(world):
    async with serve(world, lora_paths=("a1",)) as (http, rt):
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a1", "lora_int_id": 3})
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "lora_int_id", body
        assert rt.lora_state("a1") == "ready"                          # nothing was unloaded
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a1", "lora_int_id": None})
        assert r.status == 200, await r.text()
        await settle(rt)
