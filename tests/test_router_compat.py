"""What sglang-router (0.3) sends a worker and parses back, over the in-process server: the
bodies it re-serialises (its no-op defaults accepted, any other value still a 400), `/get_load`
in SGLang's shape, rerank in SGLang's bare-list shape when the body is SGLang's form. The real
router binary is exercised in test_fleet.py."""

from __future__ import annotations

import pytest

from http_support import NAME, assert_error, load_tiny, serve


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


# Bodies as sglang-router 0.3.2 forwards them (captured on the wire; docs/fleet.md).
CHAT = {"messages": [{"role": "user", "content": "hi"}], "model": NAME, "logprobs": False, "stream": False,
        "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
        "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
        "return_hidden_states": False, "max_tokens": 2}
GENERATE = {"text": "hi", "model": None, "return_text_in_logprobs": False, "stream": False,
            "log_metrics": True, "return_hidden_states": False, "background": False, "no_logs": False,
            "return_bytes": False, "return_entropy": False, "rid": "router-r1",
            "sampling_params": {"max_new_tokens": 2}}
COMPLETION = {"model": NAME, "prompt": "hi", "stream": False, "echo": False, "no_stop_trim": False,
              "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
              "max_tokens": 2}
RERANK = {"query": "q", "documents": ["a", "b c", "d"], "model": "unknown", "return_documents": True,
          "rid": None, "user": None}


async def test_router_bodies_are_accepted_and_other_values_still_refused(tiny):
    async with serve(tiny) as (http, rt):
        for path, body in (("/v1/chat/completions", CHAT), ("/generate", GENERATE),
                           ("/v1/completions", COMPLETION)):
            r = await http.post(path, json=body)
            assert r.status == 200, (path, await r.text())
        for path, body, field in (("/v1/chat/completions", CHAT, "return_hidden_states"),
                                  ("/generate", GENERATE, "background")):
            r = await http.post(path, json={**body, field: not body[field]})
            assert r.status == 400
            err = await r.json()
            assert_error(err, "invalid_request_error")
            assert err["error"]["param"] == field


async def test_rerank_in_sglang_form_answers_the_bare_list_the_router_parses(tiny):
    async with serve(tiny) as (http, rt):
        rows = await (await http.post("/v1/rerank", json=RERANK)).json()
        assert isinstance(rows, list) and sorted(x["index"] for x in rows) == [0, 1, 2]
        assert [x["score"] for x in rows] == sorted((x["score"] for x in rows), reverse=True)
        assert all(set(x) == {"score", "index", "document", "meta_info"} for x in rows)
        assert {x["index"]: x["document"] for x in rows} == {0: "a", 1: "b c", 2: "d"}
        short = await (await http.post("/rerank", json={**RERANK, "top_k": 1, "return_documents": False})).json()
        assert len(short) == 1 and "document" not in short[0] and short[0]["index"] == rows[0]["index"]
        jina = await (await http.post("/v1/rerank", json={"query": "q", "documents": ["a"]})).json()
        assert set(jina) == {"id", "model", "results", "usage"}      # the other shape is unchanged


async def test_get_load_is_sglangs_per_rank_list(tiny):
    async with serve(tiny) as (http, rt):
        load = await (await http.get("/get_load")).json()
        assert isinstance(load, list) and len(load) == 1
        row = load[0]
        assert {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} <= set(row)
        assert row["dp_rank"] == 0 and row["num_reqs"] == 0 and row["num_tokens"] == 0
        assert 0.0 <= row["kv_cache_usage"] <= 1.0
