"""Weight updates from a trainer process over torch.distributed, in SGLang's wire shape:
`/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`.

Each answers SGLang's ``{success, message}``: 200 when done, 400 when refused or failed, the
400 also carrying the OpenAI-shaped ``error`` naming the field (as the other weight routes do).
The group is gloo's: this server runs on CPU, so ``backend: "nccl"`` (SGLang's default) is a 400
naming ``backend``. The server joins as rank ``rank_offset`` (one engine process, tensor parallel
1); the trainer is rank 0 and hosts the TCP store. The work is the control actor's
(`actors.weights_distributed`) and the engine's (`engine.weights.weights_group`, which also holds the
trainer's side of the recipe).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator

from ...engine.weights.weights_group import BACKENDS, dtype_name
from ...messages import DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, UpdateWeightsFromDistributed
from ..edge.errors import APIError, error_body
from ..edge.schemas import INT32_MAX, Id, _Body, read_json
from ..edge.state import CTX

GROUP = "weight_update_group"
MAX_TENSORS = 65536
GroupName = StrictStr
Dim = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


class InitGroupBody(_Body):
    master_address: StrictStr = Field(min_length=1, max_length=253)
    master_port: StrictInt = Field(ge=1, le=65535)         # SGLang's own test sends it as a string
    rank_offset: StrictInt = Field(ge=0, le=INT32_MAX)
    world_size: StrictInt = Field(ge=2, le=INT32_MAX)
    group_name: GroupName = Field(default=GROUP, min_length=1, max_length=256)
    backend: StrictStr = "gloo"

    @field_validator("master_port", mode="before")
    @classmethod
    def _port_string(cls, v: Any) -> Any:
        return int(v) if isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 5 else v


class UpdateDistributedBody(_Body):
    names: list[StrictStr] = Field(min_length=1, max_length=MAX_TENSORS)
    dtypes: list[StrictStr] = Field(min_length=1, max_length=MAX_TENSORS)
    shapes: list[list[Dim]] = Field(min_length=1, max_length=MAX_TENSORS)
    group_name: GroupName = Field(default=GROUP, min_length=1, max_length=256)
    flush_cache: StrictBool = True             # the load always flushes: old KV is never reused
    abort_all_requests: StrictBool = False
    weight_version: Id | None = None
    load_format: StrictStr | None = None       # SGLang's "flattened_bucket" is refused (per tensor only)
    torch_empty_cache: StrictBool = False      # no CUDA cache to empty


class DestroyGroupBody(_Body):
    group_name: GroupName = Field(default=GROUP, min_length=1, max_length=256)


def _checked_update(body: UpdateDistributedBody) -> UpdateWeightsFromDistributed:
    """What can be told from the body alone; names and shapes against the served model are
    checked once the tensors are received (so the broadcasts stay paired)."""
    if body.load_format is not None:
        raise APIError(400, f"load_format {body.load_format!r} is not supported: the tensors must be "
                            "broadcast one by one, in the order of names (leave load_format out)",
                       param="load_format")
    n = len(body.names)
    for field, values in (("dtypes", body.dtypes), ("shapes", body.shapes)):
        if len(values) != n:
            raise APIError(400, f"{field} has {len(values)} entries, names has {n}: one per tensor", param=field)
    for i, name in enumerate(body.names):
        if not name or len(name) > 1024:
            raise APIError(400, "a parameter name of 1 to 1024 characters", param=f"names.{i}")
    dtypes = []
    for i, dt in enumerate(body.dtypes):
        canon = dtype_name(dt)
        if canon is None:
            raise APIError(400, f"{dt!r} is not a floating dtype (float32, bfloat16, float16 or float64)",
                           param=f"dtypes.{i}")
        dtypes.append(canon)
    for i, shape in enumerate(body.shapes):
        if len(shape) > 8:
            raise APIError(400, "a shape has at most 8 dimensions", param=f"shapes.{i}")
    return UpdateWeightsFromDistributed(tuple(body.names), tuple(dtypes), tuple(tuple(s) for s in body.shapes),
                                        body.group_name, body.abort_all_requests, body.weight_version)


def _param_of(message: str) -> str:
    """The field an update's refusal is about (its message says ``names[3]: ...`` and so on)."""
    m = re.match(r"(names|dtypes|shapes)(?:\[(\d+)\])?:", message)
    if m:
        return m[1] if m[2] is None else f"{m[1]}.{m[2]}"
    return "group_name" if message.startswith("no weight update group") else "names"


def _answer(res: Any, param: str, **extra: Any) -> web.Response:
    answer: dict[str, Any] = {"success": res.ok, "message": res.message, **extra}
    if res.ok:
        return web.json_response(answer)
    answer.update(error_body(400, res.message or "rejected", code="rejected", param=param))
    return web.json_response(answer, status=400)


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = InitGroupBody.model_validate(await read_json(request))
    if body.backend not in BACKENDS:
        why = ("nccl needs CUDA devices and this server runs on CPU" if body.backend == "nccl"
               else f"{body.backend!r} is not a backend this server has")
        raise APIError(400, f"backend {body.backend!r} is not available: {why}; use \"gloo\"", param="backend")
    if not 0 < body.rank_offset < body.world_size:
        raise APIError(400, f"rank_offset must be 1 to world_size - 1 ({body.world_size - 1}): rank 0 is "
                            "the trainer's", param="rank_offset")
    res = await request.app[CTX].runtime.control(InitWeightsUpdateGroup(
        body.master_address, body.master_port, body.rank_offset, body.world_size, body.group_name, body.backend))
    return _answer(res, "master_address")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = UpdateDistributedBody.model_validate(await read_json(request))
    res = await request.app[CTX].runtime.control(_checked_update(body))
    extra = {"weight_version": res.detail.get("weight_version")} if res.ok else {}
    return _answer(res, _param_of(res.message or ""), **extra)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = DestroyGroupBody.model_validate(await read_json(request))
    res = await request.app[CTX].runtime.control(DestroyWeightsUpdateGroup(body.group_name))
    return _answer(res, "group_name")


ROUTES = [
    web.post("/init_weights_update_group", init_weights_update_group),
    web.post("/update_weights_from_distributed", update_weights_from_distributed),
    web.post("/destroy_weights_update_group", destroy_weights_update_group),
]
