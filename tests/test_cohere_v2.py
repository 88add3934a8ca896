"""Cohere v2 `/v2/rerank` and `/v2/embed` through the official ``cohere`` client (and as plain
HTTP posts, as LiteLLM's Cohere provider sends them), over the tiny Llama, the embedded MiniLM
and a tiny BERT cross-encoder.

What is checked is values, not shapes alone: v2 rerank orders and scores as `/v1/rerank` does
(cross-encoder and decoder-only), v2 float vectors are `/v1/embeddings`' vectors, and every other
embedding type decodes to exactly the quantization of that float vector, computed here with
numpy (``packbits``; the fixed-range uint8 buckets) rather than with the server's code;
truncation keeps the model's special tokens and cuts the text's own tokens from either end.
"""

from __future__ import annotations

import base64
import math
import struct

import numpy as np
import pytest
from aiohttp import ClientSession

from http_support import assert_error, load_tiny, settle
from pooling_support import build_tiny_bert, pool_model, serve_pooling

cohere = pytest.importorskip("cohere")

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."]
ALL_TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
QUERY = "how many people live in berlin"
DOCS = ["berlin population", "new york city", "museum", "the people of berlin live well",
        "a horse is riding"]


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def minilm():
    return pool_model("embed", "embed")


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    return pool_model("rerank", str(build_tiny_bert(tmp_path_factory.mktemp("bert") / "cross", 1)))


def client(http):
    return cohere.AsyncClientV2(base_url=str(http.make_url("")).rstrip("/"), api_key="none",
                                max_retries=0)


async def v1_rerank(http, query, docs):
    r = await http.post("/v1/rerank", json={"query": query, "documents": docs, "return_documents": False})
    assert r.status == 200, await r.text()
    return [(x["index"], x["relevance_score"]) for x in (await r.json())["results"]]


async def v1_embed(http, inputs, **extra):
    r = await http.post("/v1/embeddings", json={"input": inputs, **extra})
    assert r.status == 200, await r.text()
    body = await r.json()
    return [d["embedding"] for d in body["data"]], body["usage"]["prompt_tokens"]


def close(a, b, tol=1e-6):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def assert_same_ranking(v2_results, v1):
    assert [r.index for r in v2_results] == [i for i, _ in v1]
    assert all(abs(r.relevance_score - s) < 1e-6 for r, (_, s) in zip(v2_results, v1))


# -- rerank ------------------------------------------------------------------------------------------
async def test_rerank_v2_scores_as_v1_with_the_cross_encoder(tiny, minilm, cross):
    async with serve_pooling(tiny, {"embed": minilm, "rerank": cross}) as (http, rt):
        async with client(http) as co:
            full = await co.rerank(model=cross.name, query=QUERY, documents=DOCS)
            top = await co.rerank(model="tiny-llama", query=QUERY, documents=DOCS, top_n=2)
            cut = await co.rerank(model=cross.name, query=QUERY, documents=DOCS, max_tokens_per_doc=2)
            many = await co.rerank(model=cross.name, query=QUERY, documents=[DOCS[0]] * 101, top_n=1)
        v1 = await v1_rerank(http, QUERY, DOCS)
        assert_same_ranking(full.results, v1)
        scores = [r.relevance_score for r in full.results]
        assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
        assert_same_ranking(top.results, v1[:2])
        # every word of DOCS is one token of the tiny BERT's vocabulary: two tokens = two words
        assert_same_ranking(cut.results, await v1_rerank(http, QUERY, [" ".join(d.split()[:2]) for d in DOCS]))
        by_doc = {r.index: r.relevance_score for r in full.results}
        assert {r.index: r.relevance_score for r in cut.results}[3] != by_doc[3]      # it was cut
        assert full.id and full.meta.api_version.version == "2"
        assert full.meta.billed_units.search_units == 1 and many.meta.billed_units.search_units == 2
        assert full.meta.tokens.input_tokens > 0 and len(many.results) == 1
        await settle(rt)
        assert rt.stats().steps == 0            # the cross-encoder scored it all


async def test_rerank_v2_decoder_only_as_v1(tiny):
    docs = ["Paris is in France.", "Berlin has many people.", "Cats sleep."]
    async with serve_pooling(tiny, {}) as (http, rt):
        async with client(http) as co:
            res = await co.rerank(model="tiny-llama", query="Berlin?", documents=docs)
        assert_same_ranking(res.results, await v1_rerank(http, "Berlin?", docs))
        await settle(rt)


# -- embed -------------------------------------------------------------------------------------------
def expected_types(vec):
    """Every embedding type of one float vector, computed independently of the server."""
    x = np.asarray(vec, dtype=np.float64)
    uint8 = np.clip(np.floor((x + 1.0) * 127.5), 0, 255).astype(np.int64)
    ubinary = np.packbits(x > 0).astype(np.int64)
    return {"int8": (uint8 - 128).tolist(), "uint8": uint8.tolist(),
            "binary": (ubinary - 128).tolist(), "ubinary": ubinary.tolist()}


async def test_embed_v2_every_type_is_the_float_vector(tiny, minilm):
    async with serve_pooling(tiny, {"embed": minilm}) as (http, rt):
        async with client(http) as co:
            res = await co.embed(model="default-embedding", texts=SENTENCES, input_type="search_document",
                                 embedding_types=ALL_TYPES)
            plain = await co.embed(model="all-MiniLM-L6-v2", texts=SENTENCES[:1], input_type="search_query")
            small = await co.embed(model="default-embedding", texts=SENTENCES[:1], input_type="clustering",
                                   output_dimension=32, embedding_types=["float", "ubinary"])
            by_inputs = await co.embed(
                model="default-embedding", input_type="classification", embedding_types=["float"],
                inputs=[cohere.EmbedInput(content=[cohere.TextEmbedContent(text=t)]) for t in SENTENCES])
        v1, v1_tokens = await v1_embed(http, SENTENCES)
        emb = res.embeddings
        assert res.response_type == "embeddings_by_type" and res.texts == SENTENCES and res.id
        assert res.meta.api_version.version == "2" and res.meta.billed_units.input_tokens == v1_tokens
        assert all(close(a, b) for a, b in zip(emb.float_, v1)) and len(emb.float_) == 3
        assert len(emb.float_[0]) == 384 and len(emb.ubinary[0]) == 384 // 8
        for i, vec in enumerate(emb.float_):
            want = expected_types(vec)
            assert emb.int8[i] == want["int8"] and emb.uint8[i] == want["uint8"]
            assert emb.binary[i] == want["binary"] and emb.ubinary[i] == want["ubinary"]
            raw = base64.b64decode(emb.base64[i])
            assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vec
            assert all(-128 <= v <= 127 for v in emb.int8[i] + emb.binary[i])
        assert plain.embeddings.float_ is not None and plain.embeddings.int8 is None   # float by default
        assert close(plain.embeddings.float_[0], v1[0])
        short = small.embeddings.float_[0]
        assert len(short) == 32 and abs(math.sqrt(sum(v * v for v in short)) - 1) < 1e-5
        assert close(short, (await v1_embed(http, SENTENCES[0], dimensions=32))[0][0])
        assert small.embeddings.ubinary[0] == expected_types(short)["ubinary"]
        assert all(close(a, b) for a, b in zip(by_inputs.embeddings.float_, v1))
        await settle(rt)


async def test_embed_v2_truncate_and_max_tokens(tiny, minilm):
    tok = minilm.tokenizer
    long_text = " ".join(["berlin"] * 150 + ["museum"] * 150)        # one token per word, 300 of them
    words = tok(long_text, add_special_tokens=False)["input_ids"]
    cls, sep = tok.cls_token_id, tok.sep_token_id
    room = minilm.max_tokens - 2
    assert len(words) == 300 > room
    async with serve_pooling(tiny, {"embed": minilm}) as (http, rt):
        async with client(http) as co:
            end = await co.embed(model="default-embedding", texts=[long_text], input_type="search_document")
            start = await co.embed(model="default-embedding", texts=[long_text], input_type="search_document",
                                   truncate="START")
            three = await co.embed(model="default-embedding", texts=[SENTENCES[0]], input_type="search_query",
                                   max_tokens=3, truncate="END")
            with pytest.raises(cohere.BadRequestError) as err:
                await co.embed(model="default-embedding", texts=["ok", long_text], input_type="search_query",
                               truncate="NONE")
        assert err.value.status_code == 400 and err.value.body["error"]["param"] == "texts.1"
        assert err.value.body["error"]["code"] == "context_length_exceeded"
        (want_end,), _ = await v1_embed(http, [[cls] + words[:room] + [sep]])
        (want_start,), _ = await v1_embed(http, [[cls] + words[-room:] + [sep]])
        assert close(end.embeddings.float_[0], want_end) and close(start.embeddings.float_[0], want_start)
        assert not close(want_end, want_start, 1e-3)
        assert close(end.embeddings.float_[0], (await v1_embed(http, long_text))[0][0])   # /v1 cuts the end too
        first3 = tok(SENTENCES[0], add_special_tokens=False)["input_ids"][:3]
        (want3,), n = await v1_embed(http, [[cls] + first3 + [sep]])
        assert close(three.embeddings.float_[0], want3) and three.meta.billed_units.input_tokens == n == 5
        await settle(rt)


# -- errors ------------------------------------------------------------------------------------------
OK_EMBED = {"model": "default-embedding", "texts": ["hi"], "input_type": "search_query"}
OK_RERANK = {"model": "tiny-llama", "query": "q", "documents": ["d"]}
BAD: list[tuple[str, dict, int, str]] = [
    ("/v2/embed", {**OK_EMBED, "texts": []}, 400, "texts"),
    ("/v2/embed", {**OK_EMBED, "texts": ["a", ""]}, 400, "texts.1"),
    ("/v2/embed", {"model": "default-embedding"}, 400, "texts"),
    ("/v2/embed", {**OK_EMBED, "embedding_types": ["float", "int4"]}, 400, "embedding_types.1"),
    ("/v2/embed", {**OK_EMBED, "embedding_types": []}, 400, "embedding_types"),
    ("/v2/embed", {**OK_EMBED, "input_type": "image"}, 400, "input_type"),
    ("/v2/embed", {**OK_EMBED, "input_type": "search"}, 400, "input_type"),
    ("/v2/embed", {"model": "default-embedding", "images": ["data:image/png;base64,AA=="]}, 400, "images"),
    ("/v2/embed", {**OK_EMBED, "model": "embed-v4.0"}, 404, "model"),
    ("/v2/embed", {**OK_EMBED, "model": "tiny-llama"}, 404, "model"),
    ("/v2/embed", {**OK_EMBED, "truncate": "MIDDLE"}, 400, "truncate"),
    ("/v2/embed", {**OK_EMBED, "max_tokens": 0}, 400, "max_tokens"),
    ("/v2/embed", {**OK_EMBED, "output_dimension": 0}, 400, "output_dimension"),
    ("/v2/embed", {**OK_EMBED, "priority": 3}, 400, "priority"),
    ("/v2/embed", {**OK_EMBED, "dimensions": 8}, 400, "dimensions"),
    ("/v2/embed", {**OK_EMBED, "inputs": [{"content": [{"type": "text", "text": "a"}]}]}, 400, "inputs"),
    ("/v2/embed", {"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     400, "inputs.0.content.0"),
    ("/v2/embed", {"inputs": [{"content": [{"type": "text"}]}]}, 400, "inputs.0.content.0.text"),
    ("/v2/embed", {"inputs": [{"content": []}]}, 400, "inputs.0.content"),
    ("/v2/rerank", {**OK_RERANK, "documents": []}, 400, "documents"),
    ("/v2/rerank", {**OK_RERANK, "query": ""}, 400, "query"),
    ("/v2/rerank", {**OK_RERANK, "model": "rerank-v3.5"}, 404, "model"),
    ("/v2/rerank", {**OK_RERANK, "top_n": 0}, 400, "top_n"),
    ("/v2/rerank", {**OK_RERANK, "max_tokens_per_doc": 0}, 400, "max_tokens_per_doc"),
    ("/v2/rerank", {**OK_RERANK, "documents": ["a", {"title": "x"}]}, 400, "documents.1"),
    ("/v2/rerank", {**OK_RERANK, "rank_fields": ["title"]}, 400, "rank_fields"),
    ("/v2/rerank", {**OK_RERANK, "relevant_spans": {"mode": "enabled"}}, 400, "relevant_spans.mode"),
    ("/v2/rerank", {**OK_RERANK, "priority": 1}, 400, "priority"),
    ("/v2/rerank", {**OK_RERANK, "max_chunks_per_doc": 10}, 400, "max_chunks_per_doc"),
]


async def test_bad_requests_are_4xx_naming_the_field(tiny, minilm):
    async with serve_pooling(tiny, {"embed": minilm}) as (http, rt):
        for path, body, status, param in BAD:
            r = await http.post(path, json=body)
            got = await r.json()
            assert r.status == status, (path, body, got)
            assert_error(got)
            assert got["error"]["param"] == param, (path, body, got)
        for path, body in (("/v2/embed", OK_EMBED), ("/v2/rerank", OK_RERANK)):    # still serving
            assert (await http.post(path, json=body)).status == 200
        async with client(http) as co:
            with pytest.raises(cohere.NotFoundError) as err:
                await co.rerank(model="rerank-v3.5", query="q", documents=["d"])
        assert err.value.status_code == 404 and err.value.body["error"]["param"] == "model"
        await settle(rt)


async def test_embed_v2_needs_an_embedding_model(tiny):
    async with serve_pooling(tiny, {}) as (http, rt):
        r = await http.post("/v2/embed", json=OK_EMBED)
        assert r.status == 400 and "--embedding-model" in (await r.json())["error"]["message"]


# -- LiteLLM-style raw posts --------------------------------------------------------------------------
async def test_litellm_style_raw_posts(tiny, minilm, cross):
    """What LiteLLM's Cohere provider posts: v1 leftovers (``return_documents``, ``rank_fields``)
    and explicit nulls on rerank, ``input_type`` and ``embedding_types`` on embed."""
    async with serve_pooling(tiny, {"embed": minilm, "rerank": cross}) as (http, rt):
        base = str(http.make_url("")).rstrip("/")
        async with ClientSession(headers={"Authorization": "Bearer none"}) as session:
            async with session.post(f"{base}/v2/rerank", json={
                    "model": cross.name, "query": QUERY, "documents": DOCS, "top_n": 3,
                    "return_documents": True, "rank_fields": None, "max_tokens_per_doc": None}) as r:
                assert r.status == 200, await r.text()
                rr = await r.json()
            async with session.post(f"{base}/v2/embed", json={
                    "model": "default-embedding", "texts": SENTENCES, "input_type": "search_document",
                    "embedding_types": ["float"], "truncate": None}) as r:
                assert r.status == 200, await r.text()
                em = await r.json()
        v1 = await v1_rerank(http, QUERY, DOCS)
        assert [(x["index"], x["document"]["text"]) for x in rr["results"]] == [(i, DOCS[i]) for i, _ in v1[:3]]
        assert rr["meta"]["billed_units"] == {"search_units": 1}
        assert set(em) == {"id", "embeddings", "texts", "meta", "response_type"}
        assert set(em["embeddings"]) == {"float"}
        assert all(close(a, b) for a, b in zip(em["embeddings"]["float"], (await v1_embed(http, SENTENCES))[0]))
        await settle(rt)
