"""Weight routes in SGLang's wire shape: `/update_weights_from_disk`, `/update_weights_from_tensor`,
`/update_weight_version`,
`/get_weight_version` (older SGLang's; `/model_info` says it too), `/get_weights_by_name` (GET or POST).

`/update_weights_from_disk` answers SGLang's ``{success, message, num_paused_requests}``: 200
when the new weights serve, 400 when they could not be loaded (the old weights go on serving);
the 400 also carries the OpenAI-shaped ``error`` (``param: model_path``). The update itself is
the control actor's (`actors.weights_control`): at a step barrier, with the prefix cache flushed.

`/update_weights_from_tensor` takes SGLang's body in two kinds of form. The plain one:
``load_format: "safetensors"`` with ``serialized_named_tensors`` a list of base64 strings, each
a safetensors file's bytes; together they name any subset of the served parameters. SGLang's
own forms (``load_format`` null / ``direct`` / ``flattened_bucket``) are pickles of tensors in
shared memory, one per tensor-parallel rank (this server is one): accepted from the same host
only (a loopback peer), and read by `engine.weights.refit_shm`'s allow-listed unpickler, which builds
torch's shared-memory tensors and nothing else (any other global in the pickle is a 400 before
anything runs). Answers ``{success, message}`` plus ``weight_version``; a refused or failed update
is a 400 and the old weights serve on.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from typing import Any, Literal

from aiohttp import web
from pydantic import Field, StrictBool, StrictInt, StrictStr

from ...engine.weights.refit_shm import SHARED_FORMATS     # SGLang's pickles of shared-memory tensors
from ...messages import GetWeightsByName, UpdateWeightVersion, UpdateWeightsFromDisk, UpdateWeightsFromTensor
from ..edge.errors import APIError, error_body
from ..edge.schemas import INT32_MAX, Id, _Body, read_json
from ..edge.state import CTX

Path = StrictStr


class UpdateFromDiskBody(_Body):
    model_path: Path = Field(min_length=1, max_length=4096)
    load_format: Literal["auto", "safetensors", "pt"] | None = None
    abort_all_requests: StrictBool = False
    abort_all_request: StrictBool | None = None   # AReaL's spelling: honoured as abort_all_requests
    weight_version: Id | None = None
    flush_cache: StrictBool = True      # the load always flushes: old KV is never reused
    # SGLang's other fields, as its clients serialise them: what has no meaning without CUDA is
    # accepted either way; what would change the update's semantics only at its default
    torch_empty_cache: StrictBool = False     # no CUDA cache to empty
    recapture_cuda_graph: StrictBool = False  # no CUDA graphs to recapture
    is_async: Literal[False] = False          # the update answers once the new weights serve
    keep_pause: Literal[False] = False        # the update never pauses the server itself
    token_step: StrictInt = Field(default=0, ge=0, le=INT32_MAX)   # recorded with the version
    manifest: None = None


class UpdateFromTensorBody(_Body):
    serialized_named_tensors: list[StrictStr] = Field(min_length=1, max_length=1024)
    load_format: StrictStr | None = None       # "safetensors", or SGLang's null / direct / flattened_bucket
    abort_all_requests: StrictBool = False
    weight_version: Id | None = None
    flush_cache: StrictBool = True             # the load always flushes: old KV is never reused
    disable_draft_model: StrictBool | None = None    # no draft model to update
    torch_empty_cache: StrictBool = False      # no CUDA cache to empty




def _same_host(request: web.Request) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
    except ValueError:
        return False


def _blobs(body: UpdateFromTensorBody, request: web.Request) -> tuple[bytes, ...]:
    """Decode each entry and check its framing: a safetensors file (an 8-byte little-endian
    header length, then a JSON object) or, for SGLang's forms, a pickle from this host; names,
    shapes and values are checked off the loop."""
    fmt = body.load_format
    if fmt != "safetensors" and fmt not in SHARED_FORMATS:
        raise APIError(400, f"load_format {fmt!r} is not accepted: use \"safetensors\" (base64 safetensors "
                            "bytes) or SGLang's null, \"direct\" or \"flattened_bucket\"", param="load_format")
    if fmt in SHARED_FORMATS and not _same_host(request):
        raise APIError(400, f"load_format {fmt!r} sends tensors in this host's shared memory: only a client "
                            "on the same host can send it; send load_format \"safetensors\" instead",
                       param="load_format")
    blobs = []
    for i, entry in enumerate(body.serialized_named_tensors):
        param = f"serialized_named_tensors.{i}"
        try:
            blob = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, "not base64", param=param) from None
        if fmt in SHARED_FORMATS:
            if blob[:1] != b"\x80":             # a pickle's PROTO opcode
                raise APIError(400, f"load_format {fmt!r} expects SGLang's serialized tensors (a pickle)",
                               param=param)
            blobs.append(blob)
            continue
        ok = len(blob) >= 8
        if ok:
            (n,) = struct.unpack("<Q", blob[:8])
            ok = 2 <= n <= len(blob) - 8
            if ok:
                try:
                    ok = isinstance(json.loads(blob[8:8 + n]), dict)
                except (ValueError, UnicodeDecodeError):
                    ok = False
        if not ok:
            raise APIError(400, "not a safetensors file (an 8-byte header length, then a JSON header)",
                           param=param)
        blobs.append(blob)
    return tuple(blobs)


class UpdateVersionBody(_Body):
    new_version: Id = Field(min_length=1)
    abort_all_requests: StrictBool = False


class WeightsByNameBody(_Body):
    name: StrictStr = Field(min_length=1, max_length=1024)
    truncate_size: StrictInt = Field(default=100, ge=1, le=INT32_MAX)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = UpdateFromDiskBody.model_validate(await read_json(request))
    res = await request.app[CTX].runtime.control(UpdateWeightsFromDisk(
        body.model_path, body.load_format, body.abort_all_requests or bool(body.abort_all_request),
        body.weight_version, body.token_step))
    paused = int(res.detail.get("waiting", 0)) if res.ok else 0
    answer: dict[str, Any] = {"success": res.ok, "message": res.message, "num_paused_requests": paused}
    if res.ok:
        answer["weight_version"] = res.detail.get("weight_version")
        request.app[CTX].extra["model_path"] = body.model_path       # /model_info's, as SGLang's
        return web.json_response(answer)
    answer.update(error_body(400, res.message or "rejected", code="rejected", param="model_path"))
    return web.json_response(answer, status=400)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    body = UpdateFromTensorBody.model_validate(await read_json(request))
    blobs = _blobs(body, request)
    res = await request.app[CTX].runtime.control(UpdateWeightsFromTensor(
        blobs, body.abort_all_requests, body.weight_version, body.load_format))
    answer: dict[str, Any] = {"success": res.ok, "message": res.message}
    if res.ok:
        answer["weight_version"] = res.detail.get("weight_version")
        return web.json_response(answer)
    answer.update(error_body(400, res.message or "rejected", code="rejected", param="serialized_named_tensors"))
    return web.json_response(answer, status=400)


async def update_weight_version(request: web.Request) -> web.Response:
    body = UpdateVersionBody.model_validate(await read_json(request))
    res = await request.app[CTX].runtime.control(UpdateWeightVersion(body.new_version, body.abort_all_requests))
    if not res.ok:
        raise APIError(400, res.message or "rejected", code="rejected", param="new_version")
    return web.json_response({"success": True, "message": res.message, "new_version": body.new_version})


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[CTX].runtime.weight_version})


async def get_weights_by_name(request: web.Request) -> web.Response:
    if request.method == "GET" and request.query:
        raw: Any = dict(request.query)
        if "truncate_size" in raw:
            try:
                raw["truncate_size"] = int(raw["truncate_size"])
            except ValueError:
                raise APIError(400, "truncate_size must be an integer", param="truncate_size") from None
    else:
        raw = await read_json(request)
    body = WeightsByNameBody.model_validate(raw)
    res = await request.app[CTX].runtime.control(GetWeightsByName(body.name, body.truncate_size))
    if not res.ok:
        raise APIError(400, res.message or "rejected", code="rejected", param="name")
    return web.json_response(res.detail["values"])


ROUTES = [
    web.post("/update_weights_from_disk", update_weights_from_disk),
    web.post("/update_weights_from_tensor", update_weights_from_tensor),
    web.post("/update_weight_version", update_weight_version),
    web.get("/get_weight_version", get_weight_version),
    web.get("/get_weights_by_name", get_weights_by_name),
    web.post("/get_weights_by_name", get_weights_by_name),
]
