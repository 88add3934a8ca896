"""What vLLM's and SGLang's clients send to the pooling and scoring routes: token-id input,
``add_special_tokens`` and ``truncate_prompt_tokens`` on classify and embeddings (the official
openai client for embeddings), the answers' ``id`` and ``usage.completion_tokens``, SGLang's
score with no items, vLLM's `/pooling` and SageMaker's `/invocations` dispatch, and the 400s."""

from __future__ import annotations

import base64
import json
import math
import struct

import pytest

from http_support import assert_error, load_tiny, settle
from pooling_support import build_tiny_bert, pool_model, serve_pooling


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def minilm():
    return pool_model("embed", "embed")


@pytest.fixture(scope="module")
def clf(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    return pool_model("classify", str(build_tiny_bert(root / "clf", 2, ["bad", "good"])))


def _close(a, b, tol=1e-5):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


async def _post(http, path, body, status=200):
    r = await http.post(path, json=body)
    assert r.status == status, (path, body, await r.text())
    out = await r.json()
    if status != 200:
        assert_error(out, "invalid_request_error" if status == 400 else None)
    return out


async def _all_done(rt):
    await settle(rt)
    ends = {e.rid: e.dst for e in rt.recorder.events(kind="pooling") if e.event in ("deliver", "abort")}
    assert ends and set(ends.values()) == {"done"}


# -- /classify ------------------------------------------------------------------------------------
async def test_classify_token_ids_special_tokens_and_truncation(tiny, clf):
    tok = clf.tokenizer
    text = "good movie it was great"
    async with serve_pooling(tiny, {"classify": clf}) as (http, rt):
        by_text = await _post(http, "/classify", {"input": text})
        assert by_text["id"].startswith("classify-") and by_text["model"] == clf.name
        assert by_text["usage"] == {"prompt_tokens": len(clf.encode(text)), "total_tokens": len(clf.encode(text)),
                                    "completion_tokens": 0}
        probs = by_text["data"][0]["probs"]
        # a token-id list is one input; a list of them is a batch; both are the classifier's ids
        ids = clf.encode(text)
        assert _close((await _post(http, "/v1/classify", {"input": ids}))["data"][0]["probs"], probs)
        other = clf.encode("bad film")
        two = await _post(http, "/v1/classify", {"input": [ids, other]})
        assert [d["index"] for d in two["data"]] == [0, 1] and _close(two["data"][0]["probs"], probs)
        assert _close(two["data"][1]["probs"], (await _post(http, "/classify", {"input": "bad film"}))["data"][0]["probs"])
        # add_special_tokens: false tokenizes the text bare, as its bare ids classify
        bare = tok(text, add_special_tokens=False)["input_ids"]
        nospecial = await _post(http, "/classify", {"input": text, "add_special_tokens": False})
        assert nospecial["usage"]["prompt_tokens"] == len(bare) == len(ids) - 2
        assert _close(nospecial["data"][0]["probs"], (await _post(http, "/classify", {"input": bare}))["data"][0]["probs"])
        assert not _close(nospecial["data"][0]["probs"], probs, 1e-7)
        # truncate_prompt_tokens on a text: the last k tokens, [CLS] and [SEP] kept and counted
        cut = await _post(http, "/classify", {"input": text, "truncate_prompt_tokens": 4})
        kept = [ids[0]] + bare[-2:] + [ids[-1]]
        assert cut["usage"]["prompt_tokens"] == 4
        assert _close(cut["data"][0]["probs"], (await _post(http, "/classify", {"input": kept}))["data"][0]["probs"])
        # on token ids: the last k ids; -1 = the model's length (nothing cut here)
        last = await _post(http, "/classify", {"input": [ids], "truncate_prompt_tokens": 3})
        assert last["usage"]["prompt_tokens"] == 3
        assert _close(last["data"][0]["probs"], (await _post(http, "/classify", {"input": ids[-3:]}))["data"][0]["probs"])
        whole = await _post(http, "/classify", {"input": text, "truncate_prompt_tokens": -1})
        assert _close(whole["data"][0]["probs"], probs) and whole["usage"]["prompt_tokens"] == len(ids)
        # the 400s: past the model's length, no room beside the special tokens, empty inputs
        err = await _post(http, "/classify", {"input": text, "truncate_prompt_tokens": clf.max_tokens + 1}, 400)
        assert err["error"]["param"] == "truncate_prompt_tokens" and str(clf.max_tokens) in err["error"]["message"]
        for k in (0, 2):
            err = await _post(http, "/classify", {"input": text, "truncate_prompt_tokens": k}, 400)
            assert err["error"]["param"] == "truncate_prompt_tokens"
        for bad, param in (({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input.0"),
                           ({"input": ["good", ""]}, "input.1"), ({"input": [ids, []]}, "input.1"),
                           ({"input": [10**6]}, "input.0"), ({"input": ids, "truncate_prompt_tokens": -2},
                                                            "truncate_prompt_tokens"),
                           ({"input": "x", "add_special_tokens": "no"}, "add_special_tokens")):
            err = await _post(http, "/v1/classify", bad, 400)
            assert err["error"]["param"] == param, (bad, err)
        await _all_done(rt)


async def test_classify_label_tokens_on_the_generation_model(tiny):
    tok = tiny[2]
    text = "this film was bad but I love it"
    async with serve_pooling(tiny, {}) as (http, rt):
        by_text = await _post(http, "/classify", {"input": text})
        ids = tok.encode(text, add_special_tokens=False)
        by_ids = await _post(http, "/classify", {"input": ids})
        assert _close(by_ids["data"][0]["probs"], by_text["data"][0]["probs"])
        # truncation cuts the input's own tokens before the prompt wraps it
        cut = await _post(http, "/classify", {"input": text, "truncate_prompt_tokens": 3})
        tail = await _post(http, "/classify", {"input": ids[-3:]})
        assert _close(cut["data"][0]["probs"], tail["data"][0]["probs"])
        assert cut["usage"]["prompt_tokens"] < by_text["usage"]["prompt_tokens"]
        assert cut["usage"]["completion_tokens"] == 0
        for bad, param in (({"input": ""}, "input"), ({"input": [[]]}, "input.0"),
                           ({"input": [10**6]}, "input.0"),
                           ({"input": text, "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens")):
            assert (await _post(http, "/classify", bad, 400))["error"]["param"] == param
        await _all_done(rt)


# -- /v1/embeddings --------------------------------------------------------------------------------
async def test_embeddings_truncation_special_tokens_and_id_with_the_openai_client(tiny, minilm):
    openai = pytest.importorskip("openai")
    text = "A man is eating a piece of bread."
    ids = minilm.encode(text)
    bare = minilm.tokenizer(text, add_special_tokens=False)["input_ids"]
    async with serve_pooling(tiny, {"embed": minilm}) as (http, rt):
        client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0)
        try:
            plain = await client.embeddings.create(model="default-embedding", input=text)
            cut = await client.embeddings.create(model="default-embedding", input=text,
                                                 extra_body={"truncate_prompt_tokens": 5})
            kept = await client.embeddings.create(model="default-embedding",
                                                  input=[ids[0]] + bare[-3:] + [ids[-1]], encoding_format="float")
            whole = await client.embeddings.create(model="default-embedding", input=text,
                                                   extra_body={"truncate_prompt_tokens": -1})
            nospecial = await client.embeddings.create(model="default-embedding", input=text,
                                                       extra_body={"add_special_tokens": False})
            by_bare = await client.embeddings.create(model="default-embedding", input=bare)
            ids_cut = await client.embeddings.create(model="default-embedding", input=[ids, ids],
                                                     extra_body={"truncate_prompt_tokens": 4})
            with pytest.raises(openai.BadRequestError) as exc:
                await client.embeddings.create(model="default-embedding", input=text,
                                               extra_body={"truncate_prompt_tokens": minilm.max_tokens + 1})
        finally:
            await client.close()
        assert exc.value.body["param"] == "truncate_prompt_tokens"
        assert plain.id.startswith("embd-") and len(plain.id) == len("embd-") + 32 and plain.id != cut.id
        assert plain.usage.prompt_tokens == len(ids) and cut.usage.prompt_tokens == 5
        assert _close(cut.data[0].embedding, kept.data[0].embedding)
        assert not _close(cut.data[0].embedding, plain.data[0].embedding, 1e-3)
        assert _close(whole.data[0].embedding, plain.data[0].embedding)
        assert nospecial.usage.prompt_tokens == len(bare)
        assert _close(nospecial.data[0].embedding, by_bare.data[0].embedding)
        assert ids_cut.usage.prompt_tokens == 8
        body = await _post(http, "/v1/embeddings", {"input": [ids[-4:]]})
        assert _close(ids_cut.data[1].embedding, body["data"][0]["embedding"])
        assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0}
        assert set(body) == {"id", "object", "created", "model", "data", "usage"}
        for bad, param in (({"input": ""}, "input"), ({"input": [text, ""]}, "input.1"),
                           ({"input": text, "truncate_prompt_tokens": 1}, "truncate_prompt_tokens")):
            assert (await _post(http, "/v1/embeddings", bad, 400))["error"]["param"] == param
        await _all_done(rt)


# -- /v1/score --------------------------------------------------------------------------------------
async def test_score_usage_and_sglang_empty_items(tiny):
    ids = tiny[2].encode("yes no", add_special_tokens=False)
    async with serve_pooling(tiny, {}) as (http, rt):
        one = await _post(http, "/v1/score", {"query": "Is it good? ", "items": ["yes", "no"], "label_token_ids": ids})
        u = one["usage"]
        assert u["completion_tokens"] == 0 and u["prompt_tokens"] == u["total_tokens"] > 0 and len(one["scores"]) == 2
        empty = await _post(http, "/v1/score", {"query": "Is it good? ", "items": [], "label_token_ids": ids})
        assert empty["scores"] == [] and empty["object"] == "scoring"
        assert empty["usage"] == {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0}
        # SGLang takes no items only beside a text query; its label ids are checked all the same
        err = await _post(http, "/score", {"query": ids, "items": [], "label_token_ids": ids}, 400)
        assert err["error"]["param"] == "items"
        err = await _post(http, "/v1/score", {"query": "q", "items": [], "label_token_ids": [10**6]}, 400)
        assert err["error"]["param"] == "label_token_ids.0"
        pairs = await _post(http, "/v1/score", {"text_1": "q", "text_2": ["a", "b"]})
        assert pairs["usage"]["completion_tokens"] == 0 and len(pairs["data"]) == 2
        await _all_done(rt)


# -- /pooling ----------------------------------------------------------------------------------------
async def test_pooling_route_embed_and_classify(tiny, minilm, clf):
    texts = ["A man is eating food.", "A man is riding a horse."]
    async with serve_pooling(tiny, {"embed": minilm, "classify": clf}) as (http, rt):
        emb = await _post(http, "/v1/embeddings", {"input": texts})
        for path in ("/pooling", "/v1/pooling"):
            pooled = await _post(http, path, {"input": texts})
            assert set(pooled) == {"id", "object", "created", "model", "data", "usage"}
            assert pooled["id"].startswith("pool-") and pooled["object"] == "list"
            assert pooled["model"] == minilm.name and pooled["usage"] == emb["usage"]
            assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
            for d, e in zip(pooled["data"], emb["data"]):
                assert _close(d["data"], e["embedding"])
        b64 = await _post(http, "/pooling", {"input": texts[0], "task": "embed", "encoding_format": "base64"})
        raw = base64.b64decode(b64["data"][0]["data"])
        assert _close(struct.unpack(f"<{len(raw) // 4}f", raw), emb["data"][0]["embedding"])
        # use_activation false: the mean-pooled vector before normalisation
        unnorm = (await _post(http, "/pooling", {"input": texts[0], "use_activation": False}))["data"][0]["data"]
        norm = math.sqrt(sum(x * x for x in unnorm))
        assert abs(norm - 1) > 1e-3 and _close([x / norm for x in unnorm], emb["data"][0]["embedding"])
        cut = await _post(http, "/pooling", {"input": [minilm.encode(texts[0])], "truncate_prompt_tokens": 3})
        assert cut["usage"]["prompt_tokens"] == 3
        # task classify: the classifier's probabilities, as /classify answers them
        cl = await _post(http, "/pooling", {"input": ["good movie", "bad film"], "task": "classify"})
        ref = await _post(http, "/classify", {"input": ["good movie", "bad film"]})
        assert cl["model"] == clf.name
        assert len(cl["data"]) == len(ref["data"]) == 2
        assert all(_close(a["data"], b["probs"]) for a, b in zip(cl["data"], ref["data"]))
        for bad, param in (({"input": "x", "task": "token_embed"}, "task"), ({"input": "x", "task": "score"}, "task"),
                           ({"input": "x", "task": "encode"}, "task"), ({"input": "x", "dimensions": 8}, "dimensions"),
                           ({"input": ""}, "input"), ({"input": []}, "input"),
                           ({"input": "x", "task": "classify", "use_activation": False}, "use_activation"),
                           ({"input": "x", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens")):
            assert (await _post(http, "/pooling", bad, 400))["error"]["param"] == param, bad
        assert (await _post(http, "/pooling", {"input": "x", "model": "nope"}, 404))["error"]["param"] == "model"
        metrics = await (await http.get("/metrics")).text()
        assert f'actorserve_requests_total{{finish_reason="stop",kind="pooling",model_name="{minilm.name}"}}' in metrics
        assert f'actorserve_requests_total{{finish_reason="stop",kind="pooling",model_name="{clf.name}"}}' in metrics
        await _all_done(rt)


async def test_pooling_defaults_to_what_is_loaded(tiny, clf):
    async with serve_pooling(tiny, {"classify": clf}) as (http, rt):
        cl = await _post(http, "/pooling", {"input": "good movie"})       # no embedding model: classify
        assert cl["model"] == clf.name and abs(sum(cl["data"][0]["data"]) - 1) < 1e-5
        err = await _post(http, "/pooling", {"input": "x", "task": "embed"}, 400)
        assert err["error"]["code"] == "model_not_loaded" and "--embedding-model" in err["error"]["message"]
        await _all_done(rt)
    async with serve_pooling(tiny, {}) as (http, rt):
        err = await _post(http, "/pooling", {"input": "x"}, 400)
        assert err["error"]["code"] == "model_not_loaded"


# -- /invocations -------------------------------------------------------------------------------------
async def test_invocations_dispatch_by_body_shape(tiny, minilm, clf):
    async with serve_pooling(tiny, {"embed": minilm, "classify": clf}) as (http, rt):
        chat = await _post(http, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 2
        comp = await _post(http, "/invocations", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert comp["object"] == "text_completion"
        ref = await _post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert comp["choices"][0]["text"] == ref["choices"][0]["text"]
        emb = await _post(http, "/invocations", {"input": "A man is eating food."})
        assert emb["id"].startswith("embd-") and emb["data"][0]["object"] == "embedding"
        cl = await _post(http, "/invocations", {"input": "good movie", "labels": ["bad", "good"]})
        assert cl["id"].startswith("classify-") and cl["data"][0]["num_classes"] == 2
        rr = await _post(http, "/invocations", {"query": "berlin", "documents": ["berlin city", "bread"]})
        assert rr["id"].startswith("rerank-") and len(rr["results"]) == 2
        sc = await _post(http, "/invocations", {"text_1": "berlin", "text_2": ["berlin city", "bread"]})
        assert [d["object"] for d in sc["data"]] == ["score", "score"]
        pooled = await _post(http, "/invocations", {"input": "good movie", "task": "classify"})
        assert pooled["id"].startswith("pool-") and pooled["model"] == clf.name
        # a streamed chat through /invocations is the route's own stream
        r = await http.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2, "stream": True})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = [ln for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["object"] == "chat.completion.chunk"
        # nothing takes it: vLLM's 400, naming what was expected
        for bad in ({"foo": 1}, {"messages": "hi"}, {"model": "tiny-llama"}):
            err = await _post(http, "/invocations", bad, 400)
            msg = err["error"]["message"]
            assert msg.startswith("Cannot find suitable handler for request. Expected one of: ")
            assert "ChatCompletionRequest" in msg and "PoolingRequest" in msg
        r = await http.post("/invocations", data=b"{", headers={"Content-Type": "application/json"})
        assert r.status == 400
        assert (await http.get("/ping")).status == 200
        await settle(rt)
    async with serve_pooling(tiny, {}) as (http, rt):           # no embedding model: input classifies
        cl = await _post(http, "/invocations", {"input": "I love it"})
        assert cl["id"].startswith("classify-") and cl["data"][0]["label"] in ("negative", "positive")
        msg = (await _post(http, "/invocations", {"foo": 1}, 400))["error"]["message"]
        assert "EmbeddingRequest" not in msg and "PoolingRequest" not in msg and "ClassifyRequest" in msg
        await settle(rt)
