"""Small endpoints clients expect: ``/version``, ``/ping`` (open like ``/health``, even with an
API key), vLLM's ``/v1/tokenize`` / ``/v1/detokenize`` aliases, and ``X-Request-Id`` echoed on
every response, errors and streams included."""

from __future__ import annotations

import pytest

from actorserve import __version__

from http_support import load_tiny, serve, settle


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


async def test_version_ping_aliases_and_request_id(tiny):
    async with serve(tiny, api_key="k") as (http, rt):
        r = await http.get("/version")
        assert r.status == 200 and (await r.json()) == {"version": __version__}
        for method in (http.get, http.post):
            r = await method("/ping")
            assert r.status == 200 and (await r.json())["status"] == "ok"
        auth = {"Authorization": "Bearer k"}
        assert (await http.post("/v1/tokenize", json={"text": "hi"})).status == 401
        a = await (await http.post("/tokenize", json={"text": "hello"}, headers=auth)).json()
        b = await (await http.post("/v1/tokenize", json={"text": "hello"}, headers=auth)).json()
        assert a == b and a["tokens"]
        d = await (await http.post("/v1/detokenize", json={"tokens": a["tokens"]}, headers=auth)).json()
        assert "hello" in d["text"]
        ok = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True},
                             headers={**auth, "X-Request-Id": "trace-7"})
        assert ok.status == 200 and ok.headers["X-Request-Id"] == "trace-7"
        await ok.read()
        bad = await http.post("/v1/completions", json={"prompt": "x", "bogus": 1},
                              headers={**auth, "X-Request-Id": "trace-8"})
        assert bad.status == 400 and bad.headers["X-Request-Id"] == "trace-8"
        assert "X-Request-Id" not in (await http.get("/health")).headers
        await settle(rt)
