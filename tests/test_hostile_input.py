"""Hostile request bodies over every POST route: each is a 4xx in the OpenAI error shape, naming
the offending field in ``param`` where there is one, never a 5xx; none of them reaches the engine
(no request is created), and afterwards the server still answers a normal request exactly as
before and, settled, holds no live request and no KV block.

Two tables: body kinds that no route may accept (too deep, NaN, lone surrogates, huge numbers,
not JSON, not an object, the wrong Content-Type, too large), sent to every POST route; and field
values out of range, per route (seed, token ids, n, logprobs, stop lists, batch sizes, ...). One
module-scoped server: the tiny model with the embedded MiniLM, a 1 MiB body limit.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from actorserve.actors.runtime import Runtime
from actorserve.config import ModelConfig, SchedulerConfig, ServerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.http.edge.app import build_app
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES
from http_support import assert_error, load_tiny, settle
from pooling_support import pool_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMIT = 1 << 20                  # the server's body limit
VOCAB = 32000                    # tiny-llama's vocabulary (checked by the fixture)
EMBED_VOCAB = 30522              # all-MiniLM-L6-v2's
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GREEDY = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0}

# Every POST route and a body it accepts; those whose body is optional take none as {}.
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2, "store": False},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/tokenize": {"text": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/tokenize": {"text": "hi"},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/v1/embeddings": {"input": "hi"},
    "/encode": {"text": "hi"},
    "/v1/score": {"query": "Is it good? ", "items": ["yes"], "label_token_ids": [1, 2]},
    "/score": {"text_1": "q", "text_2": ["d"]},
    "/v1/rerank": {"query": "q", "documents": ["d"]},
    "/rerank": {"query": "q", "documents": ["d"]},
    "/v1/classify": {"input": "good"},
    "/classify": {"input": "good"},
    "/pooling": {"input": "hi"},
    "/v1/pooling": {"input": [[101, 102]], "task": "embed"},
    "/invocations": CHAT,
    "/separate_reasoning": {"text": "<think>a</think>b", "reasoning_parser": "qwen3"},
    "/v2/rerank": {"model": "tiny-llama", "query": "q", "documents": ["d"]},
    "/v2/embed": {"model": "default-embedding", "texts": ["hi"], "input_type": "search_query",
                  "embedding_types": ["float", "int8"]},
    "/abort_request": {"rid": "nobody"},
    "/pause_generation": {"mode": "abort"},
    "/continue_generation": {},
    "/flush_cache": {},
    "/open_session": {},
    "/close_session": {"session_id": "nobody"},
    "/start_profile": {"num_steps": 1},
    "/update_weights_from_disk": {"model_path": "tiny"},        # the served weights again
    "/update_weights_from_tensor": {"load_format": "safetensors",      # the served norm again (set below)
                                    "serialized_named_tensors": []},
    "/update_weight_version": {"new_version": "v1"},
    "/get_weights_by_name": {"name": "model.norm.weight", "truncate_size": 1},
    "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                   "world_size": 2, "backend": "gloo"},
    "/update_weights_from_distributed": {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]},
    "/destroy_weights_update_group": {"group_name": "weight_update_group"},
    "/release_memory_occupation": {"tags": ["kv_cache"]},          # released, then resumed
    "/resume_memory_occupation": {"tags": ["kv_cache"]},
    # a LoRA adapter (a folder made below), loaded and unloaded in both shapes
    "/load_lora_adapter": {"lora_name": "h1", "lora_path": "(set below)", "pinned": False},
    "/unload_lora_adapter": {"lora_name": "h1"},
    "/v1/load_lora_adapter": {"lora_name": "h2", "lora_path": "(set below)"},
    "/v1/unload_lora_adapter": {"lora_name": "h2"},
}
# well-formed, but no trainer listens and no group is open: a 400 {"success": false} from the
# control actor (the routes with a trainer: test_weights_distributed)
NO_TRAINER = {"/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"}
OPTIONAL_BODY = {"/pause_generation", "/continue_generation", "/flush_cache", "/open_session", "/start_profile",
                 "/release_memory_occupation", "/resume_memory_occupation"}
# a probe, a liveness check, a stop, a cancel: the body is never read (-> what they answer here)
# (vLLM's /pause, /resume, /reset_prefix_cache, /sleep and /wake_up take query parameters only:
# paused, then resumed; asleep, then awake)
IGNORES_BODY = {"/health_generate": 200, "/ping": 200, "/stop_profile": 400,
                "/v1/responses/{response_id}/cancel": 404,
                "/pause": 200, "/resume": 200, "/reset_prefix_cache": 200, "/sleep": 200, "/wake_up": 200}

MULTIPART = (b'--xyz\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--xyz--\r\n',
             "multipart/form-data; boundary=xyz")

# kind -> (body, headers, status, param): param None = no field to name; ... = not checked
HOSTILE: dict[str, tuple[bytes, dict[str, str], int, Any]] = {
    "deep_array": (b"[" * 50_000, {}, 400, None),
    "deep_object": (b'{"a":' * 50_000, {}, 400, None),
    "deep_but_valid": (b'{"x": ' + b"[" * 64 + b"]" * 64 + b"}", {}, 400, None),      # 65 levels
    "nan": (b'{"temperature": NaN, "max_tokens": 2}', {}, 400, "temperature"),
    "infinity": (b'{"x": [1, Infinity]}', {}, 400, "x.1"),
    "minus_infinity": (b'{"x": {"y": -Infinity}}', {}, 400, "x.y"),
    "float_overflow": (b'{"x": 1e400}', {}, 400, "x"),
    "int_5000_digits": (b'{"seed": ' + b"9" * 5000 + b"}", {}, 400, "seed"),
    "lone_surrogate": (b'{"user": "a\\ud800b"}', {}, 400, "user"),
    "lone_low_surrogate_key": (b'{"\\udc00": 1}', {}, 400, ...),
    "invalid_utf8": (b'{"x": "\xff\xfe"}', {}, 400, None),
    "truncated": (b'{"x": "abc', {}, 400, None),
    "array": (b"[1, 2]", {}, 400, None),
    "string": (b'"hi"', {}, 400, None),
    "null": (b"null", {}, 400, None),
    "empty": (b"", {}, 400, None),
    "whitespace": (b" \n\t ", {}, 400, None),
    "form_urlencoded": (b"a=1&b=2", {"Content-Type": "application/x-www-form-urlencoded"}, 415, None),
    "form_urlencoded_json": (b'{"text": "hi"}', {"Content-Type": "application/x-www-form-urlencoded"}, 415, None),
    "text_plain_json": (b'{"text": "hi"}', {"Content-Type": "text/plain"}, 415, None),
    "binary": (bytes(range(256)), {"Content-Type": "application/octet-stream"}, 415, None),
    "multipart": (MULTIPART[0], {"Content-Type": MULTIPART[1]}, 415, None),
    "image": (b"\x89PNG\r\n\x1a\n", {"Content-Type": "image/png"}, 415, None),
    "utf16": ('{"text": "hi"}'.encode("utf-16"), {"Content-Type": "application/json; charset=utf-16"}, 415, None),
    "broken_gzip": (b"not gzip at all", {"Content-Encoding": "gzip", "Content-Type": "application/json"}, 400, None),
    "too_large": (b'{"x": "' + b"a" * LIMIT + b'"}', {}, 413, None),
}
EMPTY_KINDS = {"empty", "whitespace"}        # an optional-body route takes these as {}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny):
    from actorserve.engine.runners.runner import build_engine

    model, hf_tok, tok = tiny
    minilm = pool_model("embed", "embed")
    engine = build_engine(model, num_blocks=128, block_size=16, tokenizer=hf_tok, model_name="tiny-llama")
    rt = Runtime(engine, config=SchedulerConfig(batch=BatchConfig(), step_in_thread=True),
                 recorder=FlightRecorder(capacity=200_000, lifecycles=LIFECYCLES.values()),
                 pooling_engines={"embed": minilm.engine})
    config = ServerConfig(max_body_bytes=LIMIT, model=ModelConfig(model="tiny", kv_blocks=128))
    app = build_app(rt, tok, config, "tiny-llama", pool_models={"embed": minilm})
    async with TestServer(app, host="127.0.0.1", port=0, handler_cancellation=True) as srv:
        async with TestClient(srv) as http:
            assert rt.engine_info.vocab_size == VOCAB and minilm.engine.info.vocab_size == EMBED_VOCAB
            r = await http.post("/v1/chat/completions", json=GREEDY)
            assert r.status == 200, await r.text()
            baseline = (await r.json())["choices"][0]["message"]["content"]
            yield http, rt, app, baseline


def _created(rt: Runtime) -> int:
    """Requests that reached the runtime: generation and pooling requests created so far."""
    return sum(1 for kind in ("generation", "pooling") for e in rt.recorder.events(kind=kind)
               if e.event == "create")


async def _check_error(r: Any, status: int, param: Any, what: str) -> dict[str, Any]:
    text = await r.text()
    assert r.status == status, (what, r.status, text[:300])
    assert r.content_type == "application/json", (what, r.content_type)
    body = json.loads(text)
    assert_error(body, "invalid_request_error")
    assert body["error"]["code"] is not None, (what, body)
    if param is not ...:
        assert body["error"]["param"] == param, (what, body)
    return body


async def _still_serving(http: TestClient, rt: Runtime, baseline: str) -> None:
    """A normal request answers as before the hostile ones; then nothing is held."""
    r = await http.post("/v1/chat/completions", json=GREEDY)
    assert r.status == 200, await r.text()
    assert (await r.json())["choices"][0]["message"]["content"] == baseline
    await settle(rt)


def _lora_folder(rt, tmp_path) -> str:
    """A rank-1 PEFT LoRA folder on the served model's first q_proj (B zero: changes nothing)."""
    import json

    import torch
    from safetensors.torch import save_file
    out_f, in_f = rt.engine.lora.shapes[(0, "q_proj")]
    folder = tmp_path / "lora"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.ones(1, in_f), key.format("B"): torch.zeros(out_f, 1)},
              str(folder / "adapter_model.safetensors"))
    return str(folder)


async def test_the_tables_cover_every_post_route(server, monkeypatch, tmp_path):
    from actorserve.engine.weights import weights_group
    monkeypatch.setattr(weights_group, "INIT_TIMEOUT_S", 0.5)        # nobody listens on port 1
    http, rt, app, baseline = server
    posts = {r.resource.canonical for r in app.router.routes() if r.method == "POST"}
    assert posts == set(ROUTES) | set(IGNORES_BODY)
    for route, body in ROUTES.items():        # each route's good body is good
        if route in ("/pause_generation", "/start_profile"):
            continue                          # it would pause the server / profile (checked elsewhere)
        if route == "/close_session":
            body = {"session_id": await (await http.post("/open_session", json={})).json()}
        if route == "/update_weights_from_tensor":
            import base64

            from safetensors.torch import save
            norm = rt.engine.model.get_parameter("model.norm.weight").detach().clone()
            body = {**body, "serialized_named_tensors": [
                base64.b64encode(save({"model.norm.weight": norm})).decode()]}
        if route.endswith("/load_lora_adapter"):
            body = {**body, "lora_path": _lora_folder(rt, tmp_path)}
        r = await http.post(route, json=body)
        if route in NO_TRAINER:
            assert r.status == 400 and (await r.json())["success"] is False, (route, await r.text())
            continue
        assert r.status == 200, (route, await r.text())
    await _still_serving(http, rt, baseline)


@pytest.mark.parametrize("kind", list(HOSTILE))
async def test_hostile_body_kind_on_every_route(server, kind):
    http, rt, app, baseline = server
    data, headers, status, param = HOSTILE[kind]
    before = _created(rt)
    for route in ROUTES:
        if kind in EMPTY_KINDS and route in OPTIONAL_BODY:
            continue
        body = io.BytesIO(data) if len(data) > LIMIT // 2 else data     # (aiohttp warns of big bytes)
        r = await http.post(route, data=body, headers={"Content-Type": "application/json", **headers})
        await _check_error(r, status, param, f"{kind} -> {route}")
    for route in IGNORES_BODY:      # a body it never reads is aiohttp's to drain: a fresh connection
        body = io.BytesIO(data) if len(data) > LIMIT // 2 else data
        r = await http.post(route, data=body, headers={"Content-Type": "application/json", **headers,
                                                       "Connection": "close"})
        assert r.status in (IGNORES_BODY[route], status), (kind, route, r.status)
        r.release()
    assert _created(rt) - before <= len(IGNORES_BODY), "a hostile body reached the runtime"
    await _still_serving(http, rt, baseline)


def _many(n: int, item: Any) -> list[Any]:
    return [item] * n


# (route, body, param): each a 400 naming param, before anything is submitted
FIELD_CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "chat_seed_2_80": ("/v1/chat/completions", {**CHAT, "seed": 2**80}, "seed"),
    "chat_seed_below_int64": ("/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1}, "seed"),
    "chat_n_0": ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    "chat_n_65": ("/v1/chat/completions", {**CHAT, "n": 65}, "n"),
    "chat_top_logprobs_21": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "chat_top_logprobs_alone": ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    "chat_max_tokens_0": ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    "chat_max_tokens_negative": ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens"),
    "chat_max_tokens_2_40": ("/v1/chat/completions", {**CHAT, "max_tokens": 2**40}, "max_tokens"),
    "chat_max_completion_tokens_0": ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0},
                                     "max_completion_tokens"),
    "chat_temperature_negative": ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, "temperature"),
    "chat_temperature_1000": ("/v1/chat/completions", {**CHAT, "temperature": 1000}, "temperature"),
    "chat_top_p_0": ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    "chat_top_p_1_5": ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p"),
    "chat_top_k_0": ("/v1/chat/completions", {**CHAT, "top_k": 0}, "top_k"),
    "chat_top_k_2_40": ("/v1/chat/completions", {**CHAT, "top_k": 2**40}, "top_k"),
    "chat_min_p": ("/v1/chat/completions", {**CHAT, "min_p": 1.5}, "min_p"),
    "chat_repetition_penalty_0": ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    "chat_frequency_penalty": ("/v1/chat/completions", {**CHAT, "frequency_penalty": 2.5}, "frequency_penalty"),
    "chat_presence_penalty": ("/v1/chat/completions", {**CHAT, "presence_penalty": -3}, "presence_penalty"),
    "chat_stop_17": ("/v1/chat/completions", {**CHAT, "stop": _many(17, "x")}, "stop"),
    "chat_stop_string_513": ("/v1/chat/completions", {**CHAT, "stop": "a" * 513}, "stop"),
    "chat_stop_token_out_of_vocab": ("/v1/chat/completions", {**CHAT, "stop_token_ids": [5, VOCAB]},
                                     "stop_token_ids.1"),
    "chat_stop_token_negative": ("/v1/chat/completions", {**CHAT, "stop_token_ids": [-1]}, "stop_token_ids.0"),
    "chat_logit_bias_key_out_of_vocab": ("/v1/chat/completions", {**CHAT, "logit_bias": {str(VOCAB): 1}},
                                         "logit_bias"),
    "chat_logit_bias_key_not_an_id": ("/v1/chat/completions", {**CHAT, "logit_bias": {"hello": 1}}, "logit_bias"),
    "chat_logit_bias_value_101": ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, "logit_bias.5"),
    "chat_messages_empty": ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    "chat_messages_2049": ("/v1/chat/completions", {**CHAT, "messages": _many(2049, {"role": "user", "content": ""})},
                           "messages"),
    "chat_message_not_object": ("/v1/chat/completions", {**CHAT, "messages": ["hi"]}, "messages.0"),
    "chat_message_role": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "", "content": "x"}]},
                          "messages.0.role"),
    "chat_message_surrogate": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
                               "messages.0.content"),
    "chat_message_part_surrogate": ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a\udbff"}]}]}, "messages.0.content.0.text"),
    "chat_context_exceeded": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi " * 3000}]},
                              "messages"),
    "chat_rid_257": ("/v1/chat/completions", {**CHAT, "rid": "r" * 257}, "rid"),
    "completion_token_out_of_vocab": ("/v1/completions", {"prompt": [1, VOCAB]}, "prompt.1"),
    "completion_batch_token_out_of_vocab": ("/v1/completions", {"prompt": [[1, 2], [3, VOCAB]]}, "prompt.1.1"),
    "completion_token_negative": ("/v1/completions", {"prompt": [-1]}, "prompt.0"),
    "completion_batch_1025": ("/v1/completions", {"prompt": _many(1025, "a")}, "prompt"),
    "completion_empty_list": ("/v1/completions", {"prompt": []}, "prompt"),
    "completion_empty_ids": ("/v1/completions", {"prompt": [[]]}, "prompt"),
    "completion_surrogate": ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    "completion_logprobs_21": ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    "completion_seed_2_80": ("/v1/completions", {"prompt": "hi", "seed": 2**80}, "seed"),
    "completion_fanout": ("/v1/completions", {"prompt": _many(17, "a"), "n": 64, "max_tokens": 1}, "n"),
    "generate_token_out_of_vocab": ("/generate", {"input_ids": [VOCAB]}, "input_ids.0"),
    "generate_batch_token_out_of_vocab": ("/generate", {"input_ids": [[1], [2, VOCAB]]}, "input_ids.1.1"),
    "generate_surrogate": ("/generate", {"text": "\udc00"}, "text"),
    "generate_batch_surrogate": ("/generate", {"text": ["ok", "\udc00"]}, "text.1"),
    "generate_batch_1025": ("/generate", {"text": _many(1025, "a")}, "text"),
    "generate_seed_2_80": ("/generate", {"text": "hi", "sampling_params": {"seed": 2**80}}, "sampling_params.seed"),
    "generate_per_input_seed": ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"seed": 2**80}]},
                                "sampling_params.1.seed"),
    "generate_max_new_tokens_neg": ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
                                    "sampling_params.max_new_tokens"),
    "generate_stop_token_out_of_vocab": ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [VOCAB]}},
                                         "sampling_params.stop_token_ids.0"),
    "generate_logit_bias": ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"99999": 1}}},
                            "sampling_params.logit_bias"),
    "generate_top_logprobs_num_21": ("/generate", {"text": "hi", "top_logprobs_num": 21}, "top_logprobs_num"),
    "generate_rid_257": ("/generate", {"text": "hi", "rid": "r" * 257}, "rid"),
    "generate_fanout": ("/generate", {"text": _many(17, "a"), "sampling_params": {"n": 64}}, "sampling_params.n"),
    "generate_text_and_ids": ("/generate", {"text": "a", "input_ids": [1]}, "text"),
    "tokenize_surrogate": ("/tokenize", {"text": "\ud800"}, "text"),
    "tokenize_prompt_surrogate": ("/tokenize", {"prompt": "x\udfff"}, "prompt"),
    "tokenize_messages_surrogate": ("/tokenize", {"messages": [{"role": "user", "content": "\udc00x"}]},
                                    "messages.0.content"),
    "tokenize_messages_2049": ("/tokenize", {"messages": _many(2049, {"role": "user", "content": ""})}, "messages"),
    "tokenize_nothing": ("/tokenize", {}, "text"),
    "detokenize_out_of_vocab": ("/detokenize", {"tokens": [VOCAB]}, "tokens.0"),
    "detokenize_negative": ("/detokenize", {"tokens": [1, -1]}, "tokens.1"),
    "detokenize_input_ids_out_of_vocab": ("/detokenize", {"input_ids": [1, 2, VOCAB]}, "input_ids.2"),
    "embeddings_empty_string": ("/v1/embeddings", {"input": ""}, "input"),
    "embeddings_empty_string_in_list": ("/v1/embeddings", {"input": ["a", ""]}, "input.1"),
    "embeddings_empty_ids": ("/v1/embeddings", {"input": [[]]}, "input.0"),
    "embeddings_surrogate": ("/v1/embeddings", {"input": "\ud800"}, "input"),
    "embeddings_token_out_of_vocab": ("/v1/embeddings", {"input": [101, EMBED_VOCAB]}, "input.1"),
    "embeddings_batch_2049": ("/v1/embeddings", {"input": _many(2049, "a")}, "input"),
    "embeddings_dimensions_0": ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
    "encode_empty_string": ("/encode", {"text": ""}, "text"),
    "score_label_out_of_vocab": ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [VOCAB]},
                                 "label_token_ids.0"),
    "score_no_labels": ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
    "score_items_2049": ("/v1/score", {"query": "q", "items": _many(2049, "a"), "label_token_ids": [1]}, "items"),
    "score_item_token_out_of_vocab": ("/v1/score", {"query": "q", "items": [[1, VOCAB]], "label_token_ids": [1]},
                                      "items.0.1"),
    "score_query_surrogate": ("/v1/score", {"query": "\ud800", "items": ["a"], "label_token_ids": [1]}, "query"),
    "rerank_documents_2049": ("/v1/rerank", {"query": "q", "documents": _many(2049, "d")}, "documents"),
    "rerank_document_surrogate": ("/rerank", {"query": "q", "documents": ["ok", "\ud800"]}, "documents.1"),
    "rerank_document_without_text": ("/v1/rerank", {"query": "q", "documents": [{"title": "x"}]}, "documents.0"),
    "rerank_top_n_negative": ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    "classify_surrogate": ("/v1/classify", {"input": "\ud800"}, "input"),
    "classify_empty_string": ("/classify", {"input": ""}, "input"),
    "classify_truncate_past_the_model": ("/classify", {"input": "x", "truncate_prompt_tokens": 2**20},
                                         "truncate_prompt_tokens"),
    "pooling_token_out_of_vocab": ("/pooling", {"input": [101, EMBED_VOCAB]}, "input.1"),
    "pooling_token_task": ("/pooling", {"input": "x", "task": "token_embed"}, "task"),
    "embeddings_truncate_below_minus_1": ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": -2},
                                          "truncate_prompt_tokens"),
    "classify_labels_1025": ("/classify", {"input": "x", "labels": _many(1025, "a")}, "labels"),
    "classify_one_label": ("/v1/classify", {"input": "x", "labels": ["good"]}, "labels"),
    "abort_rid_surrogate": ("/abort_request", {"rid": "\ud800"}, "rid"),
    "abort_rid_257": ("/abort_request", {"rid": "r" * 257}, "rid"),
    "pause_mode": ("/pause_generation", {"mode": "nap"}, "mode"),
    "flush_timeout_negative": ("/flush_cache", {"timeout_s": -1}, "timeout_s"),
    "open_session_timeout_1e9": ("/open_session", {"timeout": 1e9}, "timeout"),
    "open_session_timeout_0": ("/open_session", {"timeout": 0}, "timeout"),
    "close_session_id_257": ("/close_session", {"session_id": "s" * 257}, "session_id"),
    "update_weights_load_format": ("/update_weights_from_disk", {"model_path": "tiny", "load_format": "gguf"},
                                   "load_format"),
    "update_weights_model_path_empty": ("/update_weights_from_disk", {"model_path": ""}, "model_path"),
    "update_weights_abort_not_bool": ("/update_weights_from_disk", {"model_path": "tiny",
                                                                    "abort_all_requests": "yes"},
                                      "abort_all_requests"),
    "weight_version_empty": ("/update_weight_version", {"new_version": ""}, "new_version"),
    "weights_truncate_0": ("/get_weights_by_name", {"name": "x", "truncate_size": 0}, "truncate_size"),
}


async def test_out_of_range_fields_are_400s_naming_the_field(server):
    http, rt, app, baseline = server
    before = _created(rt)
    for name, (route, body, param) in FIELD_CASES.items():
        r = await http.post(route, json=body)
        await _check_error(r, 400, param, name)
    assert _created(rt) == before, "a refused request reached the runtime"
    await _still_serving(http, rt, baseline)


async def test_content_type_policy(server):
    """A declared non-JSON type is a 415 everywhere, before anything is generated; no
    Content-Type is a 415 on the OpenAI / vLLM routes (vLLM's answer) and JSON on SGLang's
    native routes (FastAPI's reading there)."""
    http, rt, app, baseline = server
    before = _created(rt)
    gen = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}}).encode()
    cmpl = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for route, data in (("/v1/completions", cmpl), ("/generate", gen), ("/tokenize", b'{"text": "hi"}')):
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "text/json", "application/xml"):
            r = await http.post(route, data=data, headers={"Content-Type": ctype})
            body = await _check_error(r, 415, None, f"{ctype} -> {route}")
            assert body["error"]["code"] == "unsupported_media_type" and ctype in body["error"]["message"]
    for route, data in (("/v1/completions", cmpl), ("/tokenize", b'{"text": "hi"}'), ("/v1/embeddings", b"{}")):
        r = await http.post(route, data=data, skip_auto_headers=["Content-Type"])
        body = await _check_error(r, 415, None, f"untyped -> {route}")
        assert "no Content-Type" in body["error"]["message"]
    assert _created(rt) == before, "a refused body was generated from"
    r = await http.post("/generate", data=gen, skip_auto_headers=["Content-Type"])     # SGLang's native route
    assert r.status == 200, await r.text()
    assert (await r.json())["meta_info"]["completion_tokens"] == 1
    await _still_serving(http, rt, baseline)


async def test_lenient_inputs_are_accepted(server):
    """What the limits leave in: edge values, careless Content-Types, a surrogate pair."""
    http, rt, app, baseline = server
    tok = rt.engine_info.vocab_size
    # 64 levels with the body, its list and the message (a message's extra keys are the template's)
    nested = {"messages": [{"role": "user", "content": "hi", "x": json.loads("[" * 61 + "]" * 61)}]}
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    expected = (await (await http.post("/tokenize", json=plain)).json())["tokens"]
    for headers in ({"Content-Type": "application/json; charset=utf-8"}, {"Content-Type": "application/vnd.a+json"},
                    {"Content-Type": "Application/JSON"}, {"Content-Type": "application/json; charset=UTF-8; x=y"}):
        r = await http.post("/tokenize", data=json.dumps(nested).encode(), headers=headers, skip_auto_headers=["Content-Type"])
        assert r.status == 200, (headers, await r.text())
        assert (await r.json())["tokens"] == expected
    json_h = {"Content-Type": "application/json"}
    pair = await http.post("/tokenize", data=b'{"text": "\\ud83d\\ude00"}', headers=json_h)     # an escaped pair is fine
    raw = await http.post("/tokenize", data='{"text": "\U0001F600"}'.encode(), headers=json_h)
    assert pair.status == raw.status == 200
    assert (await pair.json())["tokens"] == (await raw.json())["tokens"]
    for body in ({**CHAT, "seed": -5}, {**CHAT, "seed": 2**63 - 1, "n": 2}, {**CHAT, "seed": -(2**63)},
                 {**CHAT, "stop": _many(16, "zz"), "stop_token_ids": [tok - 1]},
                 {**CHAT, "logit_bias": {"5": -100, str(tok - 1): 100}}, {**CHAT, "logprobs": True, "top_logprobs": 20},
                 {**CHAT, "n": 64, "max_tokens": 1}):
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status == 200, (body, await r.text())
        assert len((await r.json())["choices"]) == body.get("n", 1)
    r = await http.post("/v1/embeddings", json={"input": " "})     # whitespace is an input, "" is not
    assert r.status == 200, await r.text()
    await _still_serving(http, rt, baseline)


async def test_openai_client_gets_400_for_a_2_80_seed(server):
    openai = pytest.importorskip("openai")
    http, rt, app, baseline = server
    client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="tiny-llama", messages=CHAT["messages"], max_tokens=2,
                                                 seed=2**80)
        assert caught.value.status_code == 400 and caught.value.param == "seed"
        assert caught.value.type == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model="default-embedding", input="")
        assert caught.value.param == "input"
        ok = await client.chat.completions.create(model="tiny-llama", messages=GREEDY["messages"], max_tokens=6,
                                                  temperature=0)
    finally:
        await client.close()
    assert ok.choices[0].message.content == baseline
    await settle(rt)
