"""The fleet's one URL: a thin aiohttp front that passes traffic to sglang-router and takes the
routes the router does not handle (sglang-router 0.3.2 answers 404 to each of them; see
docs/fleet.md) to the right replicas itself:

* fan-out to every live replica: ``/abort_request`` (a rid lives on one replica; asking each is
  cheaper than tracking every rid, and the answer says which replica aborted it:
  ``replicas[i].aborted``), ``/pause_generation``, ``/continue_generation``, ``/flush_cache``
  (the router fans this one out too; here the answer is per replica), ``/is_paused``; the LoRA
  adapter loads and unloads (SGLang's and vLLM's routes), so every replica serves the same
  adapters;
* a generation request naming a LoRA adapter (``model: "<base>:<adapter>"``, ``lora_path``,
  or ``model: "<adapter>"`` for an adapter the replicas serve): to the replica chosen by
  (adapter, prompt prefix), cache-aware per adapter (`adapter_route`; the router's own tree
  keys by text only, and a replica's prefix cache by adapter);
* sessions: ``/open_session`` opens on the replica with the fewest sessions and remembers it;
  ``/close_session`` and every generation request naming the session (``session_params.id``,
  chat's ``session_id``) go straight to that replica, so a session's turns reuse its KV. A
  replica that restarts has lost its sessions: they are forgotten, and a turn naming one is a
  404 like an unknown session;
* stored responses: a replica's response ids name it (``resp_r1_<hex>``,
  `http.responses.responses_items.response_id`), so ``POST /v1/responses`` with ``previous_response_id``
  and ``GET``/``DELETE /v1/responses/{id}`` (and ``.../input_items``) go straight to the replica
  the id names, keeping no state here; an id naming no ready replica is a 404. A new response
  (no ``previous_response_id``) goes to a ready replica round-robin: sglang-router 0.3.2
  re-serialises a responses body with fields it refuses (``stream: null``, ``priority``,
  ``top_k``, ...; see docs/fleet.md);
* ``/v1/score``, ``/score``: to a live replica, round-robin (the router has no score route);
* ``GET /fleet``: the replicas, their state, pids and restarts, the router's URL.

Everything else is streamed through to the router unchanged. A replica or router that cannot
be reached is a 502 in the OpenAI error shape, never a hang: connecting is bounded, and so is
every read (`READ_TIMEOUT_S`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import aiohttp
from aiohttp import web

from ..http.responses.responses_items import replica_of
from .adapter_route import adapter_of, adapters_in_argv, pick, prefix_of
from .supervisor import Fleet, Replica

READ_TIMEOUT_S = 300.0
#: a body goes on with the client's own Content-Type or none: aiohttp must not add one (a
#: replica answers an untyped body by the route, an octet-stream one with a 415)
_NO_AUTO = ("Content-Type",)
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive",
                  "content-encoding"})
FANOUT = ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
          # LoRA adapters live on every replica, so the router may send a request naming one anywhere
          "/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
SESSION_ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")
LORA_LOADS = ("/load_lora_adapter", "/v1/load_lora_adapter")
LORA_UNLOADS = ("/unload_lora_adapter", "/v1/unload_lora_adapter")


def _error(status: int, message: str, code: str = "bad_gateway",
           param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "server_error" if status >= 500
                                        else "invalid_request_error", "code": code, "param": param}},
                             status=status)


def _session_of(body: Any) -> str | None:
    if not isinstance(body, dict):
        return None
    params = body.get("session_params")
    sid = params.get("id") if isinstance(params, dict) else body.get("session_id")
    return sid if isinstance(sid, str) else None


class Front:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.sessions: dict[str, int] = {}        # session id -> replica index
        # LoRA adapters the replicas serve (start-up flags, then the loads/unloads fanned out):
        # a request naming one is routed here, by adapter and prompt prefix (adapter_route)
        # adapter name -> the replicas serving it (their --lora-paths, then the loads and
        # unloads fanned out, per replica that accepted; a restarted replica keeps its flags' only)
        self.adapters: dict[str, set[int]] = {}
        for r in fleet.replicas:
            for name in adapters_in_argv(r.argv):
                self.adapters.setdefault(name, set()).add(r.index)
        self._rr = itertools.count()
        self.http: aiohttp.ClientSession | None = None
        fleet.on_restart.append(self._forget)

    def _forget(self, replica: Replica) -> None:
        for sid in [s for s, i in self.sessions.items() if i == replica.index]:
            del self.sessions[sid]
        flagged = adapters_in_argv(replica.argv)          # what it loads again at start-up
        for name, where in list(self.adapters.items()):
            if name not in flagged:
                where.discard(replica.index)
                if not where:
                    del self.adapters[name]

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/fleet", self.status)
        for path in FANOUT:
            app.router.add_post(path, self.fan_out)
        app.router.add_get("/is_paused", self.is_paused)
        app.router.add_post("/open_session", self.open_session)
        app.router.add_post("/close_session", self.close_session)
        app.router.add_post("/v1/responses", self.create_response)
        for path in ("/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"):
            app.router.add_get(path, self.stored_response)
        app.router.add_delete("/v1/responses/{response_id}", self.stored_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.stored_response)
        app.router.add_post("/v1/score", self.score)
        app.router.add_post("/score", self.score)
        app.router.add_route("*", "/{tail:.*}", self.through)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=5, sock_read=READ_TIMEOUT_S), auto_decompress=False)

    async def _close(self, app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()

    # -- pass-through ---------------------------------------------------------------------------
    async def _proxy(self, request: web.Request, base: str, body: bytes,
                     unreachable_ok: bool = False) -> web.StreamResponse | None:
        """Stream `request` to `base`; a 502 when it cannot be reached (None instead with
        `unreachable_ok`, so the caller can try another replica)."""
        assert self.http is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            async with self.http.request(request.method, base + request.path_qs, data=body or None,
                                         headers=headers, skip_auto_headers=_NO_AUTO) as up:
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in _HOP})
                await resp.prepare(request)
                sse = up.headers.get("content-type", "").startswith("text/event-stream")
                tail, why = b"", None
                try:
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                        tail = (tail + chunk)[-64:]
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    why = exc.__class__.__name__
                if why is None and request.path in SESSION_ROUTES and b"data: [DONE]" not in tail:
                    why = "the stream ended before [DONE]"     # these streams always end with it
                # a stream cut upstream (a replica died) ends with an error event, not silence
                if sse and up.status == 200 and why is not None:
                    err = {"error": {"message": f"replica lost mid-stream: {why}", "type": "server_error",
                                     "code": "upstream_lost", "param": None}}
                    await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                await resp.write_eof()
                return resp
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            if unreachable_ok:                  # failed before any byte went back
                return None
            return _error(502, f"upstream {base} unreachable: {exc.__class__.__name__}")
        except aiohttp.ClientError as exc:
            return _error(502, f"upstream {base} failed: {exc.__class__.__name__}")

    async def through(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST" and request.path in SESSION_ROUTES and body:
            doc = _loads(body)
            sid = _session_of(doc)
            if sid is not None and sid in self.sessions:
                return await self._proxy(request, self.fleet.replicas[self.sessions[sid]].url, body)
            adapter = adapter_of(doc, self.adapters.keys())
            if adapter is not None:
                where = self.adapters.get(adapter)
                serving = [r for r in self.fleet.live() if where is None or r.index in where]
                target = pick(serving, adapter, prefix_of(doc))
                if target is not None:
                    return await self._proxy(request, target.url, body)
        return await self._proxy(request, self.fleet.router_url, body)

    # -- stored responses: to the replica the id names ----------------------------------------
    def _owner(self, response_id: str) -> Replica | None:
        name = replica_of(response_id)
        return next((r for r in self.fleet.live() if r.name == name), None) if name else None

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        doc = _loads(body)
        prev = doc.get("previous_response_id") if isinstance(doc, dict) else None
        if not isinstance(prev, str):    # a new conversation: not through the router (see above)
            return await self._round_robin(request, body)
        owner = self._owner(prev)
        if owner is None:
            return _error(404, f"previous response {prev!r} names no ready replica of this fleet",
                          code="previous_response_not_found", param="previous_response_id")
        return await self._proxy(request, owner.url, body)

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        rid = request.match_info["response_id"]
        owner = self._owner(rid)
        if owner is None:
            return _error(404, f"response {rid!r} not found: its id names no ready replica of this fleet",
                          code="response_not_found", param="response_id")
        return await self._proxy(request, owner.url, await request.read())

    async def score(self, request: web.Request) -> web.StreamResponse:
        return await self._round_robin(request, await request.read())

    async def _round_robin(self, request: web.Request, body: bytes) -> web.StreamResponse:
        live, start = self.fleet.live(), next(self._rr)
        for k in range(len(live)):             # a replica that just died: the next one
            resp = await self._proxy(request, live[(start + k) % len(live)].url, body, unreachable_ok=True)
            if resp is not None:
                return resp
        return _error(503, "no replica is ready", code="no_replica")

    # -- fan-out --------------------------------------------------------------------------------
    async def _each(self, method: str, path: str, body: bytes,
                    headers: dict[str, str]) -> list[dict[str, Any]]:
        assert self.http is not None

        async def one(r: Replica) -> dict[str, Any]:
            try:
                async with self.http.request(method, r.url + path, data=body or None, headers=headers,
                                             skip_auto_headers=_NO_AUTO, timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    return {"replica": r.index, "status": resp.status, "body": _loads(await resp.read())}
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return {"replica": r.index, "status": 502, "body": exc.__class__.__name__}
        return list(await asyncio.gather(*(one(r) for r in self.fleet.live())))

    def _fwd_headers(self, request: web.Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in _HOP}

    async def fan_out(self, request: web.Request) -> web.Response:
        """One control request to every live replica; 200 when each accepted it, else the first
        refusal's status; the per-replica answers are in ``replicas``."""
        answers = await self._each("POST", request.path, await request.read(), self._fwd_headers(request))
        if not answers:
            return _error(503, "no replica is ready", code="no_replica")
        bad = [a for a in answers if a["status"] != 200]
        out: dict[str, Any] = {"success": not bad, "replicas": answers}
        if request.path in LORA_LOADS + LORA_UNLOADS:
            doc = _loads(await request.read())
            name = doc.get("lora_name") if isinstance(doc, dict) else None
            if isinstance(name, str):           # what each replica now serves
                where = self.adapters.setdefault(name, set())
                for a in answers:
                    if a["status"] == 200:
                        (where.add if request.path in LORA_LOADS else where.discard)(a["replica"])
                if not where:
                    del self.adapters[name]
        if request.path == "/abort_request":
            counts = {a["replica"]: a["body"].get("aborted", 0) for a in answers
                      if a["status"] == 200 and isinstance(a["body"], dict)}
            out["aborted"] = sum(counts.values())
            out["aborted_on"] = [i for i, n in counts.items() if n]
        return web.json_response(out, status=bad[0]["status"] if bad else 200)

    async def is_paused(self, request: web.Request) -> web.Response:
        answers = await self._each("GET", "/is_paused", b"", self._fwd_headers(request))
        paused = [a for a in answers if isinstance(a["body"], dict) and a["body"].get("is_paused")]
        return web.json_response({"is_paused": bool(paused), "paused_replicas": len(paused),
                                  "replicas": answers})

    # -- sessions -------------------------------------------------------------------------------
    async def open_session(self, request: web.Request) -> web.StreamResponse:
        live = self.fleet.live()
        if not live:
            return _error(503, "no replica is ready", code="no_replica")
        load = {r.index: 0 for r in live}
        for i in self.sessions.values():
            if i in load:
                load[i] += 1
        target = self.fleet.replicas[min(load, key=lambda i: (load[i], i))]
        assert self.http is not None
        try:
            async with self.http.post(target.url + "/open_session", data=await request.read() or None,
                                      headers=self._fwd_headers(request), skip_auto_headers=_NO_AUTO,
                                      timeout=aiohttp.ClientTimeout(total=60)) as up:
                raw, status = await up.read(), up.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return _error(502, f"replica {target.index} unreachable: {exc.__class__.__name__}")
        sid = _loads(raw)
        if status == 200 and isinstance(sid, str):
            self.sessions[sid] = target.index
        return web.Response(body=raw, status=status, content_type="application/json")

    async def close_session(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        doc = _loads(body)
        sid = doc.get("session_id") if isinstance(doc, dict) else None
        if not isinstance(sid, str) or sid not in self.sessions:
            return await self.fan_out(request)
        resp = await self._proxy(request, self.fleet.replicas[self.sessions[sid]].url, body)
        if resp.status == 200:
            self.sessions.pop(sid, None)
        return resp

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response({"router": self.fleet.router_url, "policy": self.fleet.policy,
                                  "replicas": [r.info() for r in self.fleet.replicas],
                                  "sessions": dict(self.sessions)})


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")[:500]
