"""SGLang's `/start_profile` and `/stop_profile` (``sglang.bench_serving --profile``).

``/start_profile`` (GET or POST; the body is optional) starts torch's profiler on the thread
that runs the model steps (`engine.profiler.StepProfiler`) and begins collecting the flight
recorder's events; ``/stop_profile`` stops both and writes **one** Chrome-trace file that
Perfetto and chrome://tracing load, with both on one timeline:

* processes 1 and 2: the server's lifecycle tracks (`replay.chrome_trace`: the server, its
  schedulers and their model steps, one track per request, a slice per state);
* process 3, ``torch (model step thread)``: torch's operator spans (``aten::mm``, ...).

The file is ``<output_dir>/[<profile_prefix>-]<profile_id>-TP-0.trace.json.gz`` (SGLang's name;
``profile_id`` is the start's unix time unless given), gzipped JSON. ``output_dir``: the body's,
else ``--profile-dir``, else ``SGLANG_TORCH_PROFILER_DIR``, else ``/tmp`` (SGLang's order, with
the server flag before the environment).

Body fields (SGLang's ``ProfileReqInput``): ``output_dir``, ``num_steps`` (stop by itself after
that many model steps: the file is written then, and a later ``/stop_profile`` is the
not-in-progress 400), ``activities`` (``CPU``; ``GPU`` adds CUDA where there is one),
``with_stack``, ``record_shapes``, ``profile_prefix``, ``profile_id``, ``merge_profiles`` (one
file is always written: there is one rank), ``profile_by_stage: false``, ``start_step: null``,
``profile_stages: null``; a value this server cannot honour is a 400 naming the field.

Answers are SGLang's: 200 ``Start profiling.`` / ``Stop profiling. This will take some time.``
(text), and a 400 (OpenAI error shape) with SGLang's message for a start while one runs and a
stop with none running.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import Field

from ..engine.profiler import ACTIVITIES, StepProfiler
from ..replay.chrome_trace import to_chrome_trace
from .errors import APIError, FieldError
from .schemas import _Body, read_json
from .state import CTX, ServerContext

log = logging.getLogger(__name__)
TORCH_PID = 3
ALREADY = "Profiling is already in progress. Call /stop_profile first."
NOT_RUNNING = "Profiling is not in progress. Call /start_profile first."


class ProfileBody(_Body):
    output_dir: str | None = Field(default=None, min_length=1, max_length=4096)
    num_steps: int | None = Field(default=None, ge=1, le=1_000_000)
    activities: list[Literal["CPU", "GPU"]] | None = Field(default=None, min_length=1, max_length=2)
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_prefix: str | None = Field(default=None, max_length=128, pattern=r"^[\w.-]*$")
    profile_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[\w.-]+$")
    merge_profiles: bool = False
    profile_by_stage: Literal[False] = False
    start_step: None = None
    profile_stages: None = None


class Profile:
    """One running profile: torch on the step thread, the recorder's events, where to write."""

    def __init__(self, ctx: ServerContext, body: ProfileBody, out_dir: Path) -> None:
        rt = ctx.runtime
        self.ctx = ctx
        pid = body.profile_id or f"{time.time():.6f}"
        name = (f"{body.profile_prefix}-" if body.profile_prefix else "") + f"{pid}-TP-0.trace.json.gz"
        self.path = out_dir / name
        self.torch = StepProfiler(activities=body.activities or ACTIVITIES, with_stack=body.with_stack,
                                  record_shapes=body.record_shapes, now_ns=rt.system.clock.now_ns)
        self.events: list[Any] = []
        self.num_steps = body.num_steps
        self.steps = 0
        self.t0 = rt.system.clock.now_ns()
        self.unsubscribe = rt.recorder.subscribe(self._event) if rt.recorder is not None else None
        self.auto_stop: asyncio.Task[Any] | None = None

    def _event(self, e: Any) -> None:
        self.events.append(e)
        if e.kind == "input" and e.event == "step_end" and self.num_steps is not None:
            self.steps += 1
            if self.steps >= self.num_steps and self.auto_stop is None:
                self.auto_stop = asyncio.get_running_loop().create_task(_auto_stop(self.ctx))

    def trace(self, torch_events: list[dict[str, Any]]) -> dict[str, Any]:
        """The lifecycle tracks and torch's spans, one timeline from the start of the profile."""
        doc = to_chrome_trace(self.events, t0=self.t0)
        shift = self.t0 / 1000
        doc["traceEvents"] += [
            {"ph": "M", "name": "process_name", "pid": TORCH_PID, "tid": 0,
             "args": {"name": "torch (model step thread)"}},
            {"ph": "M", "name": "process_sort_index", "pid": TORCH_PID, "tid": 0, "args": {"sort_index": 2}}]
        for e in torch_events:
            e = {**e, "pid": TORCH_PID}
            if "ts" in e:
                e["ts"] = round(e["ts"] - shift, 3)
            doc["traceEvents"].append(e)
        doc["otherData"] = {**doc.get("otherData", {}), "torch_events": len(torch_events),
                            "lifecycle_events": len(self.events)}
        return doc


def _lock(ctx: ServerContext) -> asyncio.Lock:
    return ctx.extra.setdefault("profile_lock", asyncio.Lock())


def _on_step_thread(ctx: ServerContext, fn: Any) -> Any:
    """Where the model steps run: their worker thread, or the loop (steps run inline)."""
    if ctx.runtime.scheduler.step_in_thread:
        return ctx.runtime.system.call_on_step_thread(fn)
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(fn())
    return fut


def _out_dir(ctx: ServerContext, body: ProfileBody) -> Path:
    raw = (body.output_dir or getattr(ctx.config, "profile_dir", None)
           or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp")
    out = Path(raw).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FieldError("output_dir", f"output_dir {raw!r} cannot be made: {exc.strerror}") from None
    if not os.access(out, os.W_OK):
        raise FieldError("output_dir", f"output_dir {raw!r} is not writable")
    return out


async def start(ctx: ServerContext, body: ProfileBody) -> Profile:
    async with _lock(ctx):
        if ctx.extra.get("profile") is not None:
            raise APIError(400, ALREADY, code="profile_in_progress")
        try:
            prof = Profile(ctx, body, _out_dir(ctx, body))
        except ValueError as exc:
            raise FieldError("activities", str(exc)) from None
        await _on_step_thread(ctx, prof.torch.start)
        ctx.extra["profile"] = prof
        return prof


async def stop(ctx: ServerContext, *, auto: bool = False) -> Path:
    """Stop the running profile and write its trace; `auto`: its ``num_steps`` were reached."""
    async with _lock(ctx):
        prof = ctx.extra.get("profile")
        if prof is None or (auto and prof.auto_stop is not asyncio.current_task()):
            raise APIError(400, NOT_RUNNING, code="profile_not_running")
        ctx.extra["profile"] = None
        if prof.unsubscribe is not None:
            prof.unsubscribe()
        torch_events = await _on_step_thread(ctx, prof.torch.stop)
        doc = prof.trace(torch_events)
        data = json.dumps(doc, separators=(",", ":")).encode()
        await asyncio.get_running_loop().run_in_executor(None, _write, prof.path, data)
        log.info("profile written: %s (%d torch events, %d lifecycle events)", prof.path,
                 len(torch_events), len(prof.events))
        ctx.extra["profile_last"] = str(prof.path)
        return prof.path


async def _auto_stop(ctx: ServerContext) -> None:
    try:
        await stop(ctx, auto=True)
    except APIError:            # stopped by hand first: nothing left to do
        pass
    except Exception:           # a trace that could not be written must not go unseen
        log.exception("the profile's automatic stop failed")


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    with gzip.open(tmp, "wb", compresslevel=6) as f:
        f.write(data)
    os.replace(tmp, path)


async def start_profile(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    raw = await read_json(request, optional=True) if request.method == "POST" else {}
    await start(ctx, ProfileBody.model_validate(raw))
    return web.Response(text="Start profiling.\n")


async def stop_profile(request: web.Request) -> web.Response:
    await stop(request.app[CTX])
    return web.Response(text="Stop profiling. This will take some time.\n")


ROUTES = [
    web.post("/start_profile", start_profile), web.get("/start_profile", start_profile),
    web.post("/stop_profile", stop_profile), web.get("/stop_profile", stop_profile),
]
