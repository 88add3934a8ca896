"""Response ids that name their replica (issue 14): the id format and its parse, a server with a
replica id minting them (and chaining on them), and the fleet front sending what names a stored
response to the replica the id names and a new one round-robin to a ready replica, against stub
replicas (no router binary needed; the real router is in tests/test_fleet.py)."""

from __future__ import annotations

import contextlib
import re
from typing import Any, AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from actorserve.cli import build_parser
from actorserve.config import RecorderConfig
from actorserve.fleet.front import Front
from actorserve.fleet.supervisor import Fleet, ReplicaState
from actorserve.http.responses.responses_items import replica_of, response_id
from actorserve.http.edge.serve_cli import config_from_args

from http_support import NAME, load_tiny, serve

URL_SAFE = re.compile(r"^[A-Za-z0-9._~-]+$")


@pytest.mark.parametrize("replica", ["r0", "r12", "box-r1", "a-b-r3", "my_box.eu-r0", "x_", "_", "-",
                                     ".", "..2e", "a/b c", "ünï-r0", "a%2e"])
def test_a_replica_id_is_carried_url_safe_and_read_back(replica):
    rid = response_id(replica)
    assert rid.startswith("resp_") and URL_SAFE.match(rid), rid
    assert replica_of(rid) == replica
    assert rid.rsplit("_", 1)[1] != response_id(replica).rsplit("_", 1)[1]     # unique tails


def test_readable_ids_and_ids_naming_no_replica():
    assert re.fullmatch(r"resp_box-r1_[0-9a-f]{32}", response_id("box-r1"))
    assert response_id("my.box").startswith("resp_my.2ebox_")
    plain = response_id(None)
    assert re.fullmatch(r"resp_[0-9a-f]{32}", plain) and response_id("").count("_") == 1
    assert replica_of(plain) is None
    for bad in ("", "resp_", "resp__abc", "resp_r0_", "resp_r0_XYZ", "msg_r0_abc", "resp_r.zz_abc",
                "resp_r.2_abc", "resp_a_b_abc", "resp_r0", "resp_\u00fc_abc", "resp_.ff_abc"):
        assert replica_of(bad) is None, bad


def test_serve_replica_id_reaches_the_config():
    args = build_parser().parse_args(["serve", "--model", "tiny", "--replica-id", "box-r1"])
    assert config_from_args(args).recorder.replica_id == "box-r1"


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


async def test_a_server_with_a_replica_id_mints_and_chains_its_ids(tiny):
    async with serve(tiny, recorder=RecorderConfig(replica_id="box_1-r0")) as (http, _rt):
        body = {"model": NAME, "input": "Hello", "max_output_tokens": 3, "temperature": 0}
        r = await http.post("/v1/responses", json=body)
        first = await r.json()
        assert r.status == 200 and replica_of(first["id"]) == "box_1-r0", first
        r = await http.post("/v1/responses", json={**body, "input": "more",
                                                   "previous_response_id": first["id"]})
        second = await r.json()
        assert r.status == 200 and replica_of(second["id"]) == "box_1-r0"
        assert second["previous_response_id"] == first["id"]
        r = await http.get(f"/v1/responses/{second['id']}/input_items")
        assert r.status == 200 and (await r.json())["data"][0]["content"][0]["text"] == "more"


# -- the front, over stub replicas ---------------------------------------------------------------
def _stub(name: str, seen: list[tuple[str, str, str, Any]]) -> web.Application:
    async def any_route(request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        seen.append((name, request.method, request.path_qs, body))
        if isinstance(body, dict) and body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"event: e\ndata: {{\"n\": {i}, \"at\": \"{name}\"}}\n\n".encode())
            await resp.write_eof()
            return resp
        return web.json_response({"at": name})
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_route)
    return app


@contextlib.asynccontextmanager
async def _front() -> AsyncIterator[tuple[TestClient, Fleet, list[tuple[str, str, str, Any]]]]:
    """A front over two stub replicas named box-r0 and box-r1 and a stub router."""
    seen: list[tuple[str, str, str, Any]] = []
    fleet = Fleet(lambda i, port: ["unused"], 2, "round_robin", name_of=lambda i: f"box-r{i}")
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(TestServer(_stub(n, seen), host="127.0.0.1"))
                   for n in ("box-r0", "box-r1", "router")]
        for r, server in zip(fleet.replicas, servers):
            r.port, r.state = server.port, ReplicaState.ready
        fleet.router_port = servers[2].port
        client = await stack.enter_async_context(TestClient(TestServer(Front(fleet).app(), host="127.0.0.1")))
        yield client, fleet, seen


async def test_front_sends_what_names_a_stored_response_to_its_replica():
    async with _front() as (http, fleet, seen):
        for expect in ("box-r0", "box-r1"):                    # new conversations: round-robin
            r = await http.post("/v1/responses", json={"input": "hi"})
            assert (await r.json())["at"] == expect
        r1 = response_id("box-r1")
        r = await http.post("/v1/responses", json={"input": "more", "previous_response_id": r1})
        assert r.status == 200 and (await r.json())["at"] == "box-r1"
        assert seen[-1][3] == {"input": "more", "previous_response_id": r1}       # body unchanged
        r = await http.post("/v1/responses", json={"input": "s", "stream": True,
                                                   "previous_response_id": response_id("box-r0")})
        text = await r.text()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        assert text.count("data: ") == 3 and '"at": "box-r0"' in text and "upstream_lost" not in text
        r0 = response_id("box-r0")
        for method, path in (("GET", f"/v1/responses/{r0}"), ("DELETE", f"/v1/responses/{r1}"),
                             ("GET", f"/v1/responses/{r1}/input_items?order=asc&limit=2")):
            r = await http.request(method, path)
            assert r.status == 200 and (await r.json())["at"] == replica_of(path.split("/")[3].split("?")[0])
            assert seen[-1][1:3] == (method, path)
        assert [s[0] for s in seen] == ["box-r0", "box-r1", "box-r1", "box-r0", "box-r0", "box-r1", "box-r1"]


async def test_front_404s_an_id_naming_no_ready_replica():
    async with _front() as (http, fleet, seen):
        fleet.replicas[1].state = ReplicaState.dead
        for prev in (response_id("box-r7"), response_id("r0"), response_id("box-r1"), "resp_nope",
                     response_id(None)):
            r = await http.post("/v1/responses", json={"input": "x", "previous_response_id": prev})
            err = (await r.json())["error"]
            assert r.status == 404 and err["type"] == "invalid_request_error", err
            assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
            assert prev in err["message"]
            for method, path in (("GET", f"/v1/responses/{prev}"), ("DELETE", f"/v1/responses/{prev}"),
                                 ("GET", f"/v1/responses/{prev}/input_items")):
                r = await http.request(method, path)
                err = (await r.json())["error"]
                assert r.status == 404 and err["code"] == "response_not_found", (method, path, err)
        assert seen == []                                        # none reached a replica
        r = await http.post("/v1/responses", json={"input": "x", "previous_response_id": None})
        assert (await r.json())["at"] == "box-r0"               # null: a new one, on a ready replica
