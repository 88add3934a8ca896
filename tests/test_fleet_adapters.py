"""The fleet front routes a request naming a LoRA adapter by (adapter, prompt prefix), cache-aware
per adapter (`fleet/adapter_route.py`); base requests go through the router. Fake upstreams
(aiohttp servers that say who answered) stand in for the replicas and the router."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from actorserve.fleet.adapter_route import adapter_of, adapters_in_argv, pick, prefix_of
from actorserve.fleet.front import Front


@dataclass
class R:
    index: int
    name: str
    url: str = ""
    argv: list = field(default_factory=list)


def test_adapter_of_each_wire_form():
    known = {"a1"}
    assert adapter_of({"model": "base:a2"}, known) == "a2"                 # SGLang's
    assert adapter_of({"model": "a1"}, known) == "a1"                      # vLLM's, a known adapter
    assert adapter_of({"model": "base"}, known) is None
    assert adapter_of({"lora_path": "a3", "text": "x"}, known) == "a3"
    assert adapter_of({"lora_path": [None, "a4"], "text": ["x", "y"]}, known) == "a4"
    assert adapter_of({"model": "base:"}, known) is None and adapter_of([1], known) is None
    assert prefix_of({"prompt": "p" * 1000}) == "p" * 256
    assert prefix_of({"messages": [{"role": "user", "content": "hi"}]}).startswith('[{"role":"user"')
    assert adapters_in_argv(["serve", "--lora-paths", "a1=/x/a1", "/y/b2", "--port", "1"]) == {"a1", "/y/b2"}
    assert adapters_in_argv(["--lora-modules", '{"lora_name": "c", "lora_path": "/c"}']) == {"c"}


def test_pick_is_stable_spreads_and_moves_only_a_lost_replicas_keys():
    reps = [R(i, f"r{i}") for i in range(3)]
    keys = [(f"a{i % 5}", f"prompt {i}") for i in range(300)]
    first = {k: pick(reps, *k).name for k in keys}
    assert first == {k: pick(reps, *k).name for k in keys}                  # deterministic
    assert set(first.values()) == {"r0", "r1", "r2"}                        # spread
    assert pick(list(reversed(reps)), "a1", "p") is pick(reps, "a1", "p")  # the order of replicas aside
    without = {k: pick(reps[:2], *k).name for k in keys}
    assert all(without[k] == v for k, v in first.items() if v != "r2")      # only r2's keys move
    assert pick([], "a1", "x") is None


async def _upstream(name: str, refuse_loads: bool = False) -> TestServer:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        if refuse_loads and request.path in ("/load_lora_adapter", "/v1/load_lora_adapter"):
            return web.json_response({"served_by": name, "success": False}, status=400)
        return web.json_response({"served_by": name, "success": True})
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return server


class FakeFleet:
    def __init__(self, replicas: list[R], router_url: str) -> None:
        self.replicas, self.router_url, self.on_restart = replicas, router_url, []

    def live(self) -> list[R]:
        return self.replicas


async def test_front_routes_adapter_requests_by_adapter_and_prefix_and_learns_loads():
    ups = [await _upstream("r0"), await _upstream("r1", refuse_loads=True), await _upstream("router")]
    try:
        reps = [R(i, f"r{i}", str(ups[i].make_url("")).rstrip("/"), ["serve", "--lora-paths", "a1=/p/a1"])
                for i in range(2)]
        front = Front(FakeFleet(reps, str(ups[2].make_url("")).rstrip("/")))
        assert front.adapters == {"a1": {0, 1}}
        async with TestServer(front.app(), host="127.0.0.1", port=0) as srv, TestClient(srv) as http:
            async def who(path: str, body: dict) -> str:
                r = await http.post(path, json=body)
                assert r.status == 200
                return (await r.json())["served_by"]
            assert await who("/v1/completions", {"model": "base", "prompt": "hello"}) == "router"
            seen = set()
            for i in range(40):
                body = {"model": "a1", "prompt": f"shared context {i % 4} " * 20}
                got = await who("/v1/completions", body)
                assert got == pick(reps, "a1", prefix_of(body)).name != "router"
                assert got == await who("/v1/completions", body)            # the same key, the same replica
                seen.add(got)
            assert seen == {"r0", "r1"}                  # one adapter's distinct prefixes spread
            assert await who("/generate", {"text": "x", "lora_path": "a9"}) in ("r0", "r1")
            assert await who("/v1/chat/completions", {"model": "base:a7", "messages": []}) in ("r0", "r1")
            assert await who("/v1/completions", {"model": "a2", "prompt": "x"}) == "router"   # not known yet
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/p/a2"})
            assert r.status == 400 and front.adapters == {"a1": {0, 1}, "a2": {0}}   # r1 refused it
            assert {await who("/v1/completions", {"model": "a2", "prompt": f"x{i}"}) for i in range(12)} == {"r0"}
            front._forget(reps[0])               # r0 restarted: it has its --lora-paths (a1) only
            assert front.adapters == {"a1": {0, 1}}
            assert await who("/v1/completions", {"model": "a2", "prompt": "x"}) == "router"
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/p/a2"})
            r = await http.post("/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status == 200 and front.adapters == {"a1": {0, 1}}
    finally:
        for u in ups:
            await u.close()
