"""Native, control, metrics and lifecycle routes over the tiny model; one real-model test."""

from __future__ import annotations

import asyncio
import json

import pytest

from http_support import NAME, assert_error, load_tiny, serve, settle, until

SP = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def sse_events(raw: str) -> list:
    out = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_generate_single_batch_ids_stream(tiny):
    async with serve(tiny) as (http, rt):
        r = await http.post("/generate", json={"text": "hello", "sampling_params": SP, "rid": "g1"})
        assert r.status == 200, await r.text()
        one = await r.json()
        assert len(one["output_ids"]) == 5 and isinstance(one["text"], str)
        meta = one["meta_info"]
        assert meta["id"] == "g1" and meta["finish_reason"]["type"] == "length"
        assert meta["completion_tokens"] == 5 and meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0
        assert "cached_tokens" in meta
        batch = await (await http.post("/generate", json={"text": ["hello", "a b c"], "sampling_params": SP})).json()
        assert isinstance(batch, list) and len(batch) == 2 and batch[0]["output_ids"] == one["output_ids"]
        ids = (await (await http.post("/tokenize", json={"text": "hello"})).json())["tokens"]
        by_ids = await (await http.post("/generate", json={"input_ids": ids, "sampling_params": SP})).json()
        assert by_ids["output_ids"] == one["output_ids"]
        many = await (await http.post("/generate", json={"input_ids": [ids, ids], "sampling_params": SP})).json()
        assert [m["output_ids"] for m in many] == [one["output_ids"]] * 2
        assert ids == [1, 22172]                                # BOS, "▁hello" in the tiny vocabulary
        sentence = "one two three, hello world"
        known = [1, 697, 1023, 2211, 29892, 22172, 3186]
        assert (await (await http.post("/tokenize", json={"text": sentence})).json())["tokens"] == known

        async def detok(tokens, **kw):
            r = await http.post("/detokenize", json={"tokens": tokens, **kw})
            assert r.status == 200, await r.text()
            return (await r.json())["text"]

        assert await detok(known) == "<s> " + sentence           # special tokens kept by default
        assert await detok(known, skip_special_tokens=True) == sentence
        assert await detok(known[1:4]) == "one two three"
        # the generated ids decode to exactly the text /generate returned
        assert await detok(one["output_ids"], skip_special_tokens=True) == one["text"]
        resp = await http.post("/generate", json={"text": "hello", "sampling_params": SP, "stream": True})
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert last["output_ids"] == one["output_ids"] and last["text"] == one["text"]
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])
        for bad in ({}, {"text": "x", "input_ids": [1]}, {"text": "x", "sampling_params": {"top_p": 0}},
                    {"text": "x", "sampling_params": {"max_new_tokens": "many"}}, {"input_ids": [10**9]}):
            r = await http.post("/generate", json=bad)
            assert r.status == 400, (bad, await r.text())
            assert_error(await r.json(), "invalid_request_error")
        info = await (await http.get("/model_info")).json()
        assert info["served_model_name"] == NAME and info["max_model_len"] > 0
        sinfo = await (await http.get("/server_info")).json()
        assert sinfo["server_state"] == "serving" and "kv_used_blocks" in sinfo["scheduler"]
        assert sinfo["recorder"]["capacity"] == 100_000 and sinfo["recorder"]["events"] > 20
        assert 0 <= sinfo["recorder"]["ring_bytes"] < 100 * sinfo["recorder"]["events"]   # sealed chunks only
        from actorserve.engine.kernels import cbuild
        want = "inplace (paged_decode-" if cbuild.compiler() else "gather+sdpa (the in-place"
        assert sinfo["decode_attention"].startswith(want)        # what runs, and why
        await settle(rt)


async def test_duplicate_rid_is_400(tiny):
    async with serve(tiny) as (http, rt):
        long_sp = {"max_new_tokens": 900, "ignore_eos": True}
        task = asyncio.ensure_future(http.post("/generate", json={"text": "x", "sampling_params": long_sp,
                                                                  "rid": "dup"}))
        await until(lambda: rt.stats().live_requests > 0)
        r = await http.post("/generate", json={"text": "x", "sampling_params": SP, "rid": "dup"})
        assert r.status == 400
        assert_error(await r.json(), "invalid_request_error")
        res = await (await http.post("/abort_request", json={"rid": "dup"})).json()
        assert res["success"] is True
        first = await (await task).json()
        assert first["meta_info"]["finish_reason"]["type"] == "abort"
        await settle(rt)


async def test_client_disconnect_aborts_and_frees_kv(tiny):
    async with serve(tiny) as (http, rt):
        for path, body in (
            ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "go"}],
                                      "max_tokens": 900, "ignore_eos": True, "stream": True}),
            ("/generate", {"text": "go", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
                           "stream": True}),
            ("/v1/completions", {"model": NAME, "prompt": "go", "max_tokens": 900, "n": 2,
                                 "ignore_eos": True, "stream": True}),
        ):
            resp = await http.post(path, json=body)
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
            assert rt.stats().live_requests == body.get("n", 1) and rt.stats().kv_used_blocks > 0
            resp.close()   # the client goes away mid-stream
            await settle(rt, timeout=5)
        # a non-streaming client that gives up also aborts its request
        gone = asyncio.ensure_future(http.post("/generate", json={
            "text": "go", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}))
        await until(lambda: rt.stats().live_requests == 1)      # running, then the client leaves
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        await settle(rt, timeout=5)
        metrics = await (await http.get("/metrics")).text()
        assert 'finish_reason="abort"' in metrics
        aborted = [ln for ln in metrics.splitlines()
                   if ln.startswith("actorserve_requests_total") and 'finish_reason="abort"' in ln]
        assert sum(float(ln.rsplit(" ", 1)[1]) for ln in aborted) == 5
        # the server goes on serving
        r = await http.post("/generate", json={"text": "after", "sampling_params": SP})
        assert (await r.json())["meta_info"]["finish_reason"]["type"] == "length"


async def test_pause_continue_flush_abort(tiny):
    async with serve(tiny, debug_routes=True) as (http, rt):
        assert (await (await http.get("/is_paused")).json())["is_paused"] is False
        r = await http.post("/pause_generation", json={"mode": "in_place"})
        assert r.status == 200, await r.text()
        paused = await r.json()
        assert paused["status"] == "ok" and paused["success"] is True, paused     # SGLang's status
        st = await (await http.get("/is_paused")).json()
        assert st["is_paused"] is True and st["mode"] == "in_place"
        assert (await http.get("/health")).status == 200
        flush = await http.post("/flush_cache", json={})
        assert flush.status == 400 and "paused" in (await flush.json())["error"]["message"]
        before = rt.stats()
        waiting = asyncio.ensure_future(http.post("/generate", json={"text": "wait", "sampling_params": SP,
                                                                     "rid": "held"}))
        await until(lambda: rt.request_info("held") is not None)   # it reached the runtime
        await rt.quiesce()              # every message handled: what is true now stays true
        st = rt.stats()
        assert (st.waiting, st.running, st.live_requests) == (1, 0, 1), st
        assert (st.steps, st.generated_tokens) == (before.steps, before.generated_tokens)
        assert rt.request_info("held")["state"] == "queued"
        assert not waiting.done()
        cont = await http.post("/continue_generation")
        assert cont.status == 200 and (await cont.json())["status"] == "ok"
        out = await (await waiting).json()
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert (await (await http.get("/is_paused")).json())["is_paused"] is False
        await settle(rt)
        assert (await http.post("/flush_cache", json={"timeout_s": 1})).status == 200
        assert (await http.post("/pause_generation", json={"mode": "sideways"})).status == 400
        r = await http.post("/abort_request", json={})
        assert r.status == 400
        assert_error(await r.json())
        r = await http.post("/abort_request", json={"abort_all": True})
        assert r.status == 200
        for kind, fmt, needle in (("generation", "mermaid", "stateDiagram"), ("server", "svg", "<svg")):
            d = await http.get(f"/debug/diagram/{kind}", params={"format": fmt})
            assert d.status == 200 and needle in await d.text()
        assert (await http.get("/debug/diagram/nope")).status == 404


async def test_metrics_count_requests(tiny):
    async with serve(tiny) as (http, rt):
        for _ in range(2):
            await http.post("/generate", json={"text": "m", "sampling_params": SP})
        await http.post("/v1/completions", json={"model": NAME, "prompt": "m", "max_tokens": 3,
                                                  "ignore_eos": True})
        text = await (await http.get("/metrics")).text()
        for name in ("actorserve_time_to_first_token_seconds", "actorserve_inter_token_latency_seconds",
                     "actorserve_e2e_request_latency_seconds", "actorserve_prompt_tokens_total",
                     "actorserve_generation_tokens_total", "actorserve_requests_total",
                     "actorserve_num_requests_running", "actorserve_num_requests_waiting",
                     "actorserve_kv_cache_usage_perc", "actorserve_prefix_cache_hit_rate"):
            assert name in text, name
        model = f'model_name="{NAME}"'
        assert f'actorserve_requests_total{{finish_reason="length",kind="generate",{model}}} 2.0' in text
        assert f'actorserve_requests_total{{finish_reason="length",kind="completion",{model}}} 1.0' in text
        assert f"actorserve_generation_tokens_total{{{model}}} 13.0" in text
        assert f"actorserve_e2e_request_latency_seconds_count{{{model}}} 3.0" in text


async def test_unknown_route_and_method(tiny):
    async with serve(tiny) as (http, rt):
        r = await http.get("/nope")
        assert r.status == 404
        assert_error(await r.json())
        r = await http.get("/generate")
        assert r.status == 405
        assert_error(await r.json())


@pytest.mark.model
async def test_real_model_knows_paris():
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer

    model, hf_tok, _ = load_model("default", threads=2)
    tok = TextTokenizer(hf_tok, generation_config=model.generation_config)
    async with serve((model, hf_tok, tok), kv_blocks=128, name="SmolLM2-135M-Instruct") as (http, rt):
        r = await http.post("/v1/chat/completions", json={
            "model": "default", "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]})
        body = await r.json()
        assert r.status == 200, body
        assert "Paris" in body["choices"][0]["message"]["content"]
        assert body["choices"][0]["finish_reason"] == "stop"


async def test_draining_server_answers_503(tiny):
    from actorserve.messages import ServerEvent

    async with serve(tiny) as (http, rt):
        tok = await (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
        assert tok["count"] == len(tok["tokens"]) > 0
        assert (await http.get("/v1/models/default")).status == 200
        assert (await http.get("/v1/models/other")).status == 404
        assert (await rt.control(ServerEvent("drain", "test"))).ok
        h = await http.get("/health")
        assert h.status == 503
        for path, body in (("/generate", {"text": "x"}),
                           ("/v1/completions", {"model": NAME, "prompt": "x"})):
            r = await http.post(path, json=body)
            assert r.status == 503
            assert_error(await r.json(), "service_unavailable")


async def test_serve_async_graceful_stop(tiny):
    from actorserve.config import ModelConfig, ServerConfig
    from actorserve.http.edge.server import Built, serve_async
    from actorserve.actors.runtime import Runtime
    from actorserve.engine.runners.runner import build_engine

    model, hf_tok, tok = tiny
    rt = Runtime(build_engine(model, num_blocks=64, block_size=16, model_name=NAME))
    config = ServerConfig(host="127.0.0.1", port=0, model=ModelConfig(model="tiny", kv_blocks=64))
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(serve_async(config, built=Built(rt, tok, NAME, "tiny"), stop=stop,
                                               on_ready=ready.set_result))
    url = await asyncio.wait_for(ready, 30)
    assert url.startswith("http://127.0.0.1:")
    import aiohttp

    async with aiohttp.ClientSession() as s:
        long = asyncio.ensure_future(s.post(url + "/generate", json={
            "text": "x", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}))
        await until(lambda: rt.stats().live_requests > 0)
        stop.set()                      # like SIGTERM: in-flight work still finishes
        resp = await long
        body = await resp.json()
        assert body["meta_info"]["finish_reason"]["type"] == "length"
        assert body["meta_info"]["completion_tokens"] == 200
    assert await asyncio.wait_for(server, 30) == 0
    assert rt.server_state == "stopped"


def test_kv_sizing_and_cli_config(tiny):
    import argparse

    from actorserve.http.edge import serve_cli
    from actorserve.http.edge.server import kv_bytes_per_block, num_kv_blocks

    cfg = tiny[0].config
    heads = cfg.num_attention_heads
    per = 2 * cfg.num_hidden_layers * 16 * (cfg.num_key_value_heads or heads) * (cfg.hidden_size // heads) * 4
    assert kv_bytes_per_block(cfg, 16) == per
    assert num_kv_blocks(cfg, kv_blocks=None, kv_memory_gb=1.0, block_size=16) == (1 << 30) // per
    assert num_kv_blocks(cfg, kv_blocks=7, kv_memory_gb=1.0, block_size=16) == 7
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    c = serve_cli.config_from_args(p.parse_args(["--model", "tiny", "--port", "0", "--api-key", "k",
                                                 "--max-num-seqs", "8", "--record", "/tmp/x.jsonl"]))
    assert (c.host, c.port, c.api_key, c.model.model) == ("127.0.0.1", 0, "k", "tiny")
    assert c.scheduler.batch.max_num_seqs == 8 and c.recorder.path == "/tmp/x.jsonl"
