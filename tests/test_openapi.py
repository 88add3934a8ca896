"""`/openapi.json`: a valid OpenAPI 3.1 document, generated from the router and the request
models, with every route, one error schema and the API key marked. Over the fake engine; the
live fuzz run against it is `test_fuzz_http`."""

from __future__ import annotations

import json
from typing import Annotated, Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import OpenAPIV31SpecValidator
from pydantic import BaseModel, Field

from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig, ServerConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.http.edge import openapi
from actorserve.http.edge.app import build_app
from actorserve.http.edge.auth import OPEN_PATHS
from actorserve.http.edge.schemas import ChatCompletionRequest

KEY = "sekrit"


def make_app(*, api_key: str | None = None, debug_routes: bool = False) -> Any:
    rt = Runtime(FakeEngine(), config=SchedulerConfig())
    return build_app(rt, None, ServerConfig(api_key=api_key, debug_routes=debug_routes), "fake",
                     own_runtime=False)


def routes(app: Any) -> set[tuple[str, str]]:
    return {(r.method.lower(), r.resource.canonical) for r in app.router.routes()}


def operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m, p): op for p, ops in doc["paths"].items() for m, op in ops.items()}


@pytest.mark.parametrize("debug_routes", [False, True])
@pytest.mark.parametrize("api_key", [None, KEY])
def test_valid_openapi_31_with_every_route_and_nothing_else(api_key, debug_routes):
    app = make_app(api_key=api_key, debug_routes=debug_routes)
    doc = openapi.build_openapi(app, OPEN_PATHS)
    OpenAPIV31SpecValidator(doc).validate()
    assert doc["openapi"] == "3.1.0"
    assert set(operations(doc)) == routes(app)
    assert ("post", "/v1/chat/completions") in operations(doc) and ("head", "/health") in operations(doc)
    assert (("get", "/debug/events") in operations(doc)) == debug_routes
    ids = [op["operationId"] for op in operations(doc).values()]
    assert len(ids) == len(set(ids))
    assert json.loads(json.dumps(doc)) == doc


def test_bodies_are_the_models_the_handlers_validate_with():
    """The body schema of each route is pydantic's schema of the model its handler names, so a
    handler that starts validating with another model fails here until the table follows."""
    app = make_app(debug_routes=True)
    doc = openapi.build_openapi(app, OPEN_PATHS)
    schemas = doc["components"]["schemas"]
    ops = operations(doc)
    described = 0
    for route in app.router.routes():
        handler = route.handler
        assert handler in openapi.OPERATIONS, f"{route.method} {route.resource.canonical} is not in OPERATIONS"
        named = {n for n in handler.__code__.co_names
                 if isinstance(handler.__globals__.get(n), type)
                 and issubclass(handler.__globals__[n], BaseModel)}
        body = openapi.OPERATIONS[handler].body
        reachable = {body.__name__} | set(body.model_json_schema().get("$defs", {})) if body else set()
        op = openapi.OPERATIONS[handler]
        reachable |= {m.__name__ for m in (op.query, op.path) if m is not None}   # its query, its path
        assert named <= reachable, (route.resource.canonical, named, body)
        if route.method != "POST":
            assert "requestBody" not in ops[(route.method.lower(), route.resource.canonical)]
            continue
        req = ops[("post", route.resource.canonical)]["requestBody"]
        schema = req["content"]["application/json"]["schema"]
        if body is None:
            assert schema == {"type": "object"} and not req["required"]
            continue
        described += 1
        assert schema == {"$ref": f"#/components/schemas/{body.__name__}"}
        own = body.model_json_schema(ref_template="#/components/schemas/{model}")
        own.pop("$defs", None)
        assert schemas[body.__name__] == openapi._standard(own)
    assert described >= 17       # every POST route but /continue_generation and /health_generate


def test_optional_bodies_and_parameters():
    doc = openapi.build_openapi(make_app(debug_routes=True), OPEN_PATHS)
    ops = operations(doc)
    assert ops[("post", "/v1/chat/completions")]["requestBody"]["required"] is True
    assert ops[("post", "/pause_generation")]["requestBody"]["required"] is False
    assert ops[("post", "/abort_request")]["requestBody"]["required"] is True
    (model,) = ops[("get", "/v1/models/{model}")]["parameters"]
    assert model["in"] == "path" and model["required"] and model["schema"]["type"] == "string"
    (timeout,) = ops[("get", "/health_generate")]["parameters"]
    assert timeout["in"] == "query" and not timeout["required"]
    assert timeout["schema"]["exclusiveMinimum"] == 0 and timeout["schema"]["maximum"] == 300
    params = {p["name"]: p for p in ops[("get", "/debug/diagram/{kind}")]["parameters"]}
    assert params["kind"]["in"] == "path" and "generation" in params["kind"]["schema"]["enum"]
    assert params["format"]["schema"]["enum"] == ["mermaid", "svg"]
    assert params["rid"]["schema"] == {"type": "string"}          # a query value is never null
    assert set(ops[("post", "/v1/chat/completions")]["responses"]["200"]["content"]) \
        == {"application/json", "text/event-stream"}
    assert set(ops[("get", "/metrics")]["responses"]["200"]["content"]) == {"text/plain"}


def test_every_error_refers_to_the_one_openai_error_schema():
    doc = openapi.build_openapi(make_app(api_key=KEY, debug_routes=True), OPEN_PATHS)
    error = doc["components"]["responses"]["Error"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    shape = doc["components"]["schemas"]["ErrorResponse"]
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert shape["required"] == ["error"] and shape["properties"]["error"]["$ref"].endswith("/ErrorDetail")
    assert set(detail["required"]) == {"message", "type", "code", "param"}
    for (method, path), op in operations(doc).items():
        assert op["responses"]["default"] == {"$ref": "#/components/responses/Error"}
        for status, resp in op["responses"].items():
            if status in ("200", "default"):
                continue
            if status == "503" and path in ("/health", "/ping", "/health_generate"):
                assert resp["content"]["application/json"]["schema"]["$ref"].endswith("/Unavailable")
            else:
                assert resp == {"$ref": "#/components/responses/Error"}, (method, path, status)
    ops = operations(doc)
    assert "400" in ops[("post", "/generate")]["responses"] and "413" in ops[("post", "/generate")]["responses"]
    assert "503" in ops[("post", "/v1/embeddings")]["responses"]
    assert "404" in ops[("post", "/v1/completions")]["responses"]      # an unknown model
    assert "400" not in ops[("get", "/v1/models")]["responses"]


def test_api_key_marks_the_guarded_operations():
    doc = openapi.build_openapi(make_app(api_key=KEY), OPEN_PATHS)
    assert doc["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer", "description": "the server's --api-key"}
    assert doc["security"] == [{"apiKey": []}]
    for (method, path), op in operations(doc).items():
        if path in OPEN_PATHS:
            assert op["security"] == [] and "401" not in op["responses"], (method, path)
        else:
            assert "security" not in op and "401" in op["responses"], (method, path)
    open_doc = openapi.build_openapi(make_app(), OPEN_PATHS)
    assert "security" not in open_doc and "securitySchemes" not in open_doc["components"]
    assert not any("401" in op["responses"] or "security" in op for op in operations(open_doc).values())


class _Bounded(BaseModel):
    x: Annotated[int | float, Field(ge=-2, le=2)]
    y: Annotated[int | float, Field(gt=0, lt=1)] = 0.5
    ge: int = 3                      # a field named like a keyword stays a field


def test_pydantic_constraint_names_become_json_schema_keywords():
    raw = _Bounded.model_json_schema()
    assert raw["properties"]["x"]["ge"] == -2            # what pydantic writes for a union
    fixed = openapi._standard(raw)
    assert fixed["properties"]["x"]["minimum"] == -2 and fixed["properties"]["x"]["maximum"] == 2
    assert fixed["properties"]["y"]["exclusiveMinimum"] == 0 and fixed["properties"]["y"]["exclusiveMaximum"] == 1
    assert "ge" not in fixed["properties"]["x"] and fixed["properties"]["ge"]["default"] == 3
    doc = json.dumps(openapi.build_openapi(make_app(debug_routes=True), OPEN_PATHS))
    for pydantic_name in ('"ge":', '"le":', '"gt":', '"lt":'):
        assert pydantic_name not in doc


async def test_served_without_the_key_and_built_once(monkeypatch):
    app = make_app(api_key=KEY)
    built = []
    real = openapi.build_openapi
    monkeypatch.setattr(openapi, "build_openapi", lambda *a: built.append(1) or real(*a))
    async with TestServer(app, host="127.0.0.1", port=0) as server:
        async with TestClient(server) as http:
            r = await http.get("/openapi.json")
            assert r.status == 200 and r.content_type == "application/json"
            doc = await r.json()
            assert doc == real(app, OPEN_PATHS)
            assert doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
                "application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
            assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]
            assert (await http.get("/v1/models")).status == 401
            ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status == 200
            assert (await (await http.get("/openapi.json")).json()) == doc
    assert built == [1]
    assert ChatCompletionRequest.__name__ in doc["components"]["schemas"]
