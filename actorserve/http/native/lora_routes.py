"""LoRA adapters on the wire, in both peers' shapes.

Routes (each a control record, `actors.lora_control`; the adapter's lifecycle is the
scheduler's, `actors.scheduler_lora`):

* SGLang: ``POST /load_lora_adapter`` ``{lora_name, lora_path, pinned}`` and ``POST
  /unload_lora_adapter`` ``{lora_name}``, answered ``{success, error_message, loaded_adapters}``
  (``loaded_adapters``: name -> path of the adapters ready after the call), 400 when refused
  (with the OpenAI-shaped ``error`` too, naming the field).
* vLLM: ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` and ``POST
  /v1/unload_lora_adapter`` ``{lora_name}``, answered with vLLM's plain-text ``Success: ...``;
  refused with an OpenAI-shaped 400, or 404 for an unload of an adapter that is not loaded.

Both unloads take actorserve's ``abort: true`` (abort the requests still holding the adapter
instead of waiting for them). An unload answers once the adapter is gone: its holders have ended.

Which adapter a request runs under (`lora_for_model`, `lora_for_paths`): an OpenAI route's
``model`` is the served model, an adapter's name (vLLM's) or ``"<served model>:<adapter>"``
(SGLang's); ``/generate``'s ``lora_path`` is an adapter's name, or a list of them with one
entry (or null, the base) per input. An adapter still loading is waited for (the request
shares its one load); one that is not loaded, or is being unloaded, is a 404
``model_not_found`` on the OpenAI routes (vLLM's) and a 400 naming ``lora_path`` on /generate
(SGLang's).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import Field, StrictBool, StrictStr

from ...messages import LoadLoraAdapter, UnloadLoraAdapter
from ..edge.errors import APIError, FieldError, error_body
from ..edge.schemas import _Body, read_json
from ..edge.state import CTX, ServerContext

LoraName = StrictStr
MAX_NAME = 256


class LoadLoraBody(_Body):
    lora_name: LoraName = Field(min_length=1, max_length=MAX_NAME)
    lora_path: StrictStr = Field(min_length=1, max_length=4096)
    pinned: StrictBool = False          # SGLang's: never evicted
    load_inplace: StrictBool = False    # vLLM's: replace an adapter of that name (not supported)


class UnloadLoraBody(_Body):
    lora_name: LoraName = Field(min_length=1, max_length=MAX_NAME)
    lora_int_id: None = None            # vLLM's; adapters have no int ids here (only null, else a 400)
    abort: StrictBool = False           # actorserve's: abort the requests holding it, do not wait


def check_name(name: str, param: str = "lora_name") -> None:
    if not name.isprintable() or any(c.isspace() for c in name) or ":" in name:
        raise FieldError(param, f"a LoRA adapter name must be printable, without spaces or ':' "
                                f"(the model field's '<base>:<adapter>' separator), got {name[:60]!r}")


async def _load(request: web.Request) -> tuple[ServerContext, LoadLoraBody, Any]:
    ctx = request.app[CTX]
    body = LoadLoraBody.model_validate(await read_json(request))
    check_name(body.lora_name)
    if body.load_inplace:
        raise FieldError("load_inplace", "load_inplace is not supported: unload the adapter, then load it")
    if body.lora_name in ctx.model_names():
        raise FieldError("lora_name", f"{body.lora_name!r} is the served model's name")
    _check_enabled(ctx)
    res = await ctx.runtime.control(LoadLoraAdapter(body.lora_name, body.lora_path, body.pinned))
    return ctx, body, res


def _check_enabled(ctx: ServerContext) -> None:
    if not ctx.runtime.lora_enabled:
        raise APIError(400, "LoRA adapters are off on this server (the model runs on the HF fallback, "
                            "or --max-loaded-loras 0)", param="lora_name")


def _loaded(ctx: ServerContext) -> dict[str, str]:
    return {a["name"]: a["path"] for a in ctx.runtime.loras() if a["state"] == "ready"}


def _param_of(res: Any) -> str:
    return str(res.detail.get("param", "lora_name"))


async def sglang_load(request: web.Request) -> web.Response:
    ctx, body, res = await _load(request)
    answer = {"success": res.ok, "error_message": None if res.ok else res.message,
              "loaded_adapters": _loaded(ctx)}
    if res.ok:
        return web.json_response(answer)
    answer.update(error_body(400, res.message, param=_param_of(res)))
    return web.json_response(answer, status=400)


async def sglang_unload(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = UnloadLoraBody.model_validate(await read_json(request))
    res = await ctx.runtime.control(UnloadLoraAdapter(body.lora_name, body.abort))
    answer = {"success": res.ok, "error_message": None if res.ok else res.message,
              "loaded_adapters": _loaded(ctx)}
    if res.ok:
        return web.json_response(answer)
    answer.update(error_body(400, res.message, param="lora_name"))
    return web.json_response(answer, status=400)


async def vllm_load(request: web.Request) -> web.Response:
    ctx, body, res = await _load(request)
    if not res.ok:
        raise APIError(int(res.detail.get("status", 400)), res.message, param=_param_of(res))
    return web.Response(text=res.message)


async def vllm_unload(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = UnloadLoraBody.model_validate(await read_json(request))
    res = await ctx.runtime.control(UnloadLoraAdapter(body.lora_name, body.abort))
    if not res.ok:
        status = int(res.detail.get("status", 400))
        raise APIError(status, res.message, param="lora_name",
                       type="NotFoundError" if status == 404 else None)
    return web.Response(text=res.message)


# -- which adapter a request runs under ------------------------------------------------------------


async def _ready(ctx: ServerContext, name: str) -> str | None:
    """The adapter's state once it is not loading (a request shares a load in flight)."""
    state = ctx.runtime.lora_state(name)
    if state == "loading":
        state = await ctx.runtime.lora_wait(name)
    return state


async def lora_for_model(ctx: ServerContext, model: str | None) -> str | None:
    """The adapter an OpenAI route's ``model`` names (None: the base), else the 404."""
    if model is None or model in ctx.model_names():
        return None
    name = model
    base, sep, tail = model.partition(":")
    if sep and base in ctx.model_names() and tail:
        name = tail                           # SGLang's "<base>:<adapter>"
    state = await _ready(ctx, name)
    if state != "ready":          # gone since the route's `resolve_model`, or never an adapter
        why = "is being unloaded" if state == "unloading" else "is not loaded" if state is None else f"is {state}"
        raise APIError(404, f"The model `{model}` does not exist: LoRA adapter {name!r} {why}",
                       type="invalid_request_error", code="model_not_found", param="model")
    return name


def is_adapter(ctx: ServerContext, model: str | None) -> bool:
    if model is None:
        return False
    base, sep, tail = model.partition(":")
    name = tail if sep and base in ctx.model_names() else model
    return ctx.runtime.lora_state(name) is not None


async def lora_for_paths(ctx: ServerContext, lora_path: Any, n_items: int) -> list[str | None]:
    """``/generate``'s ``lora_path``: one adapter name (or null) per input, each ready."""
    if lora_path is None:
        return [None] * n_items
    names = lora_path if isinstance(lora_path, list) else [lora_path] * n_items
    if len(names) != n_items:
        raise FieldError("lora_path", f"lora_path has {len(names)} entries for {n_items} inputs")
    for i, name in enumerate(names):
        if name is None:
            continue
        where = f"lora_path.{i}" if isinstance(lora_path, list) else "lora_path"
        state = await _ready(ctx, name)
        if state != "ready":
            why = "is being unloaded" if state == "unloading" else "is not loaded"
            raise FieldError(where, f"LoRA adapter {name!r} {why}; loaded: {sorted(_loaded(ctx)) or 'none'}")
    return list(names)


def adapter_cards(ctx: ServerContext) -> list[dict[str, Any]]:
    """`/v1/models` entries of the ready adapters, vLLM's shape (``parent``: the base model)."""
    info = ctx.runtime.engine_info
    return [{"id": a["name"], "object": "model", "created": ctx.created, "owned_by": "actorserve",
             "root": a["path"], "parent": ctx.served_name, "max_model_len": info.max_model_len}
            for a in ctx.runtime.loras() if a["state"] == "ready"]


async def load_at_startup(app: web.Application) -> None:
    """``--lora-paths``: load each adapter before serving; a failure stops the start (vLLM's)."""
    ctx = app[CTX]
    for name, path, pinned in ctx.config.model.lora_paths:
        res = await ctx.runtime.control(LoadLoraAdapter(name, path, pinned))
        if not res.ok:
            raise RuntimeError(f"--lora-paths {name}={path}: {res.message}")


ROUTES = [
    web.post("/load_lora_adapter", sglang_load),
    web.post("/unload_lora_adapter", sglang_unload),
    web.post("/v1/load_lora_adapter", vllm_load),
    web.post("/v1/unload_lora_adapter", vllm_unload),
]
