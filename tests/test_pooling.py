"""Pooling routes over a runtime that hosts a generation model (tiny) and pooling engines
(the embedded MiniLM; tiny BERT classifiers built in the test): embeddings (also through the
official openai client), score, rerank (cross-encoder and decoder-only), classify, the pooling
lifecycle, abort, and embeddings under concurrent generation. One real-model rerank test."""

from __future__ import annotations

import asyncio
import base64
import math
import struct

import pytest

from http_support import assert_error, load_tiny, settle, until
from pooling_support import build_tiny_bert, pool_model, serve_pooling

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."]


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def minilm():
    return pool_model("embed", "embed")


@pytest.fixture(scope="module")
def berts(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    return {"classify": pool_model("classify", str(build_tiny_bert(root / "clf", 2, ["bad", "good"]))),
            "rerank": pool_model("rerank", str(build_tiny_bert(root / "cross", 1)))}


def _dot(a, b):
    return sum(x * y for x, y in zip(a, b))


async def test_embeddings_routes_and_lifecycle(tiny, minilm):
    async with serve_pooling(tiny, {"embed": minilm}) as (http, rt):
        r = await http.post("/v1/embeddings", json={"input": SENTENCES, "model": "default-embedding"})
        assert r.status == 200, await r.text()
        body = await r.json()
        assert body["object"] == "list" and body["model"] == "default-embedding"
        vecs = [d["embedding"] for d in body["data"]]
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and len(vecs[0]) == 384
        assert _dot(vecs[0], vecs[1]) > _dot(vecs[0], vecs[2]) + 0.3
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        one = await (await http.post("/v1/embeddings", json={"input": SENTENCES[0],
                                                             "model": "all-MiniLM-L6-v2"})).json()
        assert max(abs(a - b) for a, b in zip(one["data"][0]["embedding"], vecs[0])) < 1e-5
        ids = minilm.encode(SENTENCES[0])
        by_ids = await (await http.post("/v1/embeddings", json={"input": [ids, ids]})).json()
        assert len(by_ids["data"]) == 2
        assert max(abs(a - b) for a, b in zip(by_ids["data"][1]["embedding"], vecs[0])) < 1e-5
        b64 = await (await http.post("/v1/embeddings", json={"input": SENTENCES[0], "encoding_format": "base64",
                                                             "dimensions": 32})).json()
        raw = base64.b64decode(b64["data"][0]["embedding"])
        small = struct.unpack("<32f", raw)
        assert abs(math.sqrt(_dot(small, small)) - 1) < 1e-5
        enc = await (await http.post("/encode", json={"text": SENTENCES[0]})).json()
        assert max(abs(a - b) for a, b in zip(enc["embedding"], vecs[0])) < 1e-5
        assert len(await (await http.post("/encode", json={"text": SENTENCES})).json()) == 3
        for bad, status in (({"input": "x", "model": "gpt-4"}, 404), ({"input": []}, 400),
                            ({"input": "x", "dimensions": 0}, 400), ({"input": [10**9]}, 400),
                            ({"input": "x", "encoding_format": "int8"}, 400)):
            r = await http.post("/v1/embeddings", json=bad)
            assert r.status == status, (bad, await r.text())
            assert_error(await r.json())
        metrics = await (await http.get("/metrics")).text()
        embed = f'model_name="{minilm.name}"'
        assert f'actorserve_requests_total{{finish_reason="stop",kind="embeddings",{embed}}}' in metrics
        steps = rt.pool_stats()["embed"].steps
        assert f'actorserve_pool_steps{{engine="embed",{embed}}} {float(steps)}' in metrics and steps > 0
        assert f'actorserve_pool_num_requests_waiting{{engine="embed",{embed}}} 0.0' in metrics
        info = await (await http.get("/server_info")).json()
        assert info["pooling"]["embed"]["steps"] == steps and info["scheduler"]["steps"] == 0
        models = [m["id"] for m in (await (await http.get("/v1/models")).json())["data"]]
        assert "all-MiniLM-L6-v2" in models and "tiny-llama" in models
        await settle(rt)
        # every pooling request walked queued -> forward -> pool -> done on its own machine
        rec = rt.recorder
        rids = {e.rid for e in rec.events(kind="pooling")}
        assert len(rids) >= 10
        for rid in rids:
            path = [(e.event, e.dst) for e in rec.events(rid=rid, kind="pooling")]
            assert path == [("create", "queued"), ("schedule", "forward"), ("forward_done", "pool"),
                            ("deliver", "done")], path
        assert not rec.events(kind="generation")
        assert rt.pool_stats()["embed"].steps > 0 and rt.stats().steps == 0


async def test_openai_client_embeddings(tiny, minilm):
    openai = pytest.importorskip("openai")
    async with serve_pooling(tiny, {"embed": minilm}) as (http, rt):
        client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0)
        try:
            f = await client.embeddings.create(model="default-embedding", input=SENTENCES,
                                               encoding_format="float")
            b = await client.embeddings.create(model="default-embedding", input=SENTENCES,
                                               encoding_format="base64")
            d = await client.embeddings.create(model="all-MiniLM-L6-v2", input="hello", dimensions=128)
            auto = await client.embeddings.create(model="default-embedding", input=SENTENCES)  # base64 on the wire
        finally:
            await client.close()
        assert len(f.data) == 3 and len(f.data[0].embedding) == 384
        raw = base64.b64decode(b.data[2].embedding)         # asked explicitly: the client keeps the string
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert max(abs(x - y) for x, y in zip(f.data[2].embedding, decoded)) < 1e-6
        assert max(abs(x - y) for x, y in zip(f.data[2].embedding, auto.data[2].embedding)) < 1e-6
        assert len(d.data[0].embedding) == 128 and f.usage.prompt_tokens > 0
        await settle(rt)


async def test_score_classify_rerank_decoder_only(tiny):
    async with serve_pooling(tiny, {}) as (http, rt):
        ids = tiny[2].encode("yes no maybe", add_special_tokens=False)
        r = await http.post("/v1/score", json={"query": "Is it good? ", "items": ["yes", "no", "fine"],
                                              "label_token_ids": ids[:3], "apply_softmax": True})
        assert r.status == 200, await r.text()
        scores = (await r.json())["scores"]
        assert len(scores) == 3 and all(abs(sum(s) - 1) < 1e-6 and len(s) == 3 for s in scores)
        raw = (await (await http.post("/v1/score", json={"query": "Q", "items": "A", "item_first": True,
                                                          "label_token_ids": ids[:2]})).json())["scores"]
        assert len(raw) == 1 and 0 < sum(raw[0]) <= 1 + 1e-6
        cl = await (await http.post("/v1/classify", json={"input": ["I love it", "I hate it"]})).json()
        assert [d["index"] for d in cl["data"]] == [0, 1]
        for d in cl["data"]:
            assert d["num_classes"] == 2 and d["label"] in ("negative", "positive") and abs(sum(d["probs"]) - 1) < 1e-6
        one = await (await http.post("/classify", json={"input": "ok", "labels": ["yes", "no", "maybe"]})).json()
        assert one["data"][0]["num_classes"] == 3
        docs = ["Paris is in France.", "Berlin has many people.", "Cats sleep."]
        rr = await (await http.post("/v1/rerank", json={"query": "Berlin?", "documents": docs, "top_n": 2})).json()
        assert len(rr["results"]) == 2 and rr["results"][0]["relevance_score"] >= rr["results"][1]["relevance_score"]
        assert rr["results"][0]["document"]["text"] in docs and rr["id"].startswith("rerank-")
        rr2 = await (await http.post("/rerank", json={"query": "Berlin?", "documents": docs,
                                                      "return_documents": False})).json()
        assert len(rr2["results"]) == 3 and "document" not in rr2["results"][0]
        r = await http.post("/v1/embeddings", json={"input": "x"})
        assert r.status == 400
        body = await r.json()
        assert_error(body, "invalid_request_error")
        assert "--embedding-model" in body["error"]["message"]
        for path, bad in (("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [10**9]}),
                          ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": []}),
                          ("/v1/rerank", {"query": "q", "documents": []}),
                          ("/v1/classify", {"input": []})):
            r = await http.post(path, json=bad)
            assert r.status == 400, (path, await r.text())
        await settle(rt)
        kinds = {e.rid: e.dst for e in rt.recorder.events(kind="pooling") if e.event == "deliver"}
        assert len(kinds) >= 12 and set(kinds.values()) == {"done"}
        assert not rt.recorder.events(kind="generation")


async def test_cross_encoder_and_classifier_models(tiny, berts):
    async with serve_pooling(tiny, berts) as (http, rt):
        docs = ["berlin population", "new york city", "museum"]
        rr = await (await http.post("/v1/rerank", json={"query": "how many people live in berlin",
                                                        "documents": docs})).json()
        scores = [x["relevance_score"] for x in rr["results"]]
        assert sorted(x["index"] for x in rr["results"]) == [0, 1, 2] and scores == sorted(scores, reverse=True)
        assert all(0 < s < 1 for s in scores) and rr["model"] == berts["rerank"].name
        cl = await (await http.post("/v1/classify", json={"input": ["good movie", "bad film", "it was"]})).json()
        assert cl["model"] == berts["classify"].name
        for d in cl["data"]:
            assert d["num_classes"] == 2 and d["label"] in ("bad", "good") and abs(sum(d["probs"]) - 1) < 1e-5
        await settle(rt)
        assert rt.pool_stats()["rerank"].steps > 0 and rt.pool_stats()["classify"].steps > 0
        assert rt.stats().steps == 0            # nothing went to the generation model


def pool_aborts(rt) -> list:
    return [e for e in rt.recorder.events(kind="pooling") if e.event == "abort"]


async def test_abort_reaches_pooling_requests(tiny, minilm):
    import threading

    gate = threading.Event()
    async with serve_pooling(tiny, {"embed": minilm}) as (http, rt):
        real = minilm.engine.execute

        def blocked(batch):
            gate.wait(10)
            return real(batch)

        minilm.engine.execute = blocked
        try:
            first = asyncio.ensure_future(http.post("/v1/embeddings", json={"input": "held"}))
            await until(lambda: rt.pool_stats()["embed"].step_in_flight)
            h = rt.pool([1, 2, 3], target="embed", rid="pool-abort")     # queued behind the step
            res = await (await http.post("/abort_request", json={"rid": "pool-abort"})).json()
            assert res["success"] is True and res["aborted"] == 1
            out = await h.stream.final()
            assert out.finish_reason == "abort"
            res = await (await http.post("/abort_request", json={"abort_all": True})).json()
            assert res["success"] is True and res["aborted"] == 1       # the one inside the step
            held = await first
            assert held.status == 503 and (await held.json())["error"]["code"] == "request_aborted"
            gate.set()
        finally:
            gate.set()
            minilm.engine.execute = real
        # a client that disconnects aborts its embedding requests
        gate.clear()
        minilm.engine.execute = blocked
        try:
            task = asyncio.ensure_future(http.post("/v1/embeddings", json={"input": ["a", "b", "c"]}))
            await until(lambda: rt.pool_stats()["embed"].live_requests >= 3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The step is still held: the three can only end by the disconnect's aborts.
            await until(lambda: len(pool_aborts(rt)) >= 2 + 3)
            gate.set()
            await settle(rt)
        finally:
            gate.set()
            minilm.engine.execute = real
        path = [e.event for e in rt.recorder.events(rid="pool-abort", kind="pooling")]
        assert path == ["create", "abort"]
        # pool-abort, the request held inside the step, the three of the client that left
        assert len(pool_aborts(rt)) == 5 and len({e.rid for e in pool_aborts(rt)}) == 5
        assert rt.pool_stats()["embed"].live_requests == 0


async def test_embeddings_under_generation_load(tiny, minilm):
    async with serve_pooling(tiny, {"embed": minilm}) as (http, rt):
        sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
        gens = [asyncio.ensure_future(http.post("/generate", json={"text": f"stream {i}", "sampling_params": sp,
                                                                   "stream": True})) for i in range(4)]
        await until(lambda: rt.stats().generated_tokens > 0)
        before = rt.stats().generated_tokens
        embeds = [http.post("/v1/embeddings", json={"input": f"sentence number {i} about food"})
                  for i in range(64)]
        results = await asyncio.gather(*embeds)
        during = rt.stats().generated_tokens
        assert all(r.status == 200 for r in results)
        for r in results:
            assert len((await r.json())["data"][0]["embedding"]) == 384
        for g in gens:
            text = await (await g).text()
            assert text.rstrip().endswith("[DONE]")
        assert rt.stats().generated_tokens == 4 * 40
        assert during > before                 # generation kept going while embeddings ran
        await settle(rt)


@pytest.mark.model
async def test_decoder_only_rerank_berlin_smollm2():
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer

    model, hf_tok, _ = load_model("default", threads=2)
    tok = TextTokenizer(hf_tok)
    docs = ["Berlin is well known for its museums.",
            "New York City is the most populous city in the United States.",
            "Berlin has a population of 3,520,031 registered inhabitants in an area of 891.82 square kilometers."]
    async with serve_pooling((model, hf_tok, tok), {}, name="SmolLM2-135M-Instruct") as (http, rt):
        r = await http.post("/v1/rerank", json={"query": "How many people live in Berlin?", "documents": docs})
        assert r.status == 200, await r.text()
        res = (await r.json())["results"]
        rank = [x["index"] for x in res]
        assert rank.index(2) < rank.index(0) and rank.index(2) < rank.index(1), res
        cl = await (await http.post("/v1/classify", json={"input": ["I loved this movie, it was wonderful!",
                                                                    "Terrible film, I hated every minute."]})).json()
        assert [d["label"] for d in cl["data"]] == ["positive", "negative"], cl
        await settle(rt)


async def test_cli_flags_and_built_server(tmp_path):
    import argparse

    from aiohttp.test_utils import TestClient, TestServer

    from actorserve.engine.runners import dense
    from actorserve.http.edge import serve_cli
    from actorserve.http.edge.server import build_runtime, make_app

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli.config_from_args(p.parse_args([])).model.embedding_model == "embed"
    assert serve_cli.config_from_args(p.parse_args(["--embedding-model", "none"])).model.embedding_model is None
    clf = build_tiny_bert(tmp_path / "clf", 2, ["bad", "good"])
    cfg = serve_cli.config_from_args(p.parse_args(["--model", "tiny", "--kv-blocks", "64", "--threads", "1",
                                                   "--classify-model", str(clf)]))
    assert cfg.model.classify_model == str(clf) and cfg.model.rerank_model is None
    built = build_runtime(cfg)
    assert set(built.pool_models) == {"embed", "classify"}
    app = make_app(cfg, built)
    async with TestServer(app, host="127.0.0.1", port=0) as server, TestClient(server) as http:
        gen = await http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
        emb = await http.post("/v1/embeddings", json={"input": "hi"})
        cl = await http.post("/classify", json={"input": "good"})
        assert (gen.status, emb.status, cl.status) == (200, 200, 200)
        assert (await cl.json())["data"][0]["label"] in ("bad", "good")
        info = await (await http.get("/server_info")).json()
        # the tiny model's random weights are not 4-bit blocks: auto keeps every step dense
        assert cfg.model.quantization == "auto" and info["quantization"] is None
        paths = info["engine_paths"]
        assert set(paths) == {"decode", "prefill", "prefill attention"} and "not exact 4-bit blocks" in paths["decode"]
        assert ("weights packed at load" in paths["prefill"]) == dense._ops_available()
    bad = serve_cli.config_from_args(p.parse_args(["--model", "tiny", "--kv-blocks", "8",
                                                   "--embedding-model", str(clf)]))
    with pytest.raises(ValueError, match="classifier"):
        build_runtime(bad)
