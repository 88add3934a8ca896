"""SGLang's `/start_profile` and `/stop_profile` (``sglang.bench_serving --profile``).

``/start_profile`` (GET or POST; the body is optional) sets up a profile: torch's profiler on the
thread that runs the model steps (`engine.runners.profiler.StepProfiler`), around the steps that
`profile_plan.StepPlan` picks (``start_step``, ``num_steps``, ``profile_by_stage``,
``profile_stages``), and the flight recorder's events. Each target (the run, or one stage) is
written to one Chrome-trace file that Perfetto and chrome://tracing load, with both on one
timeline (`profile_plan.target_trace`):

* processes 1 and 2: the server's lifecycle tracks (`replay.chrome_trace`: the server, its
  schedulers and their model steps, one track per request, a slice per state), those that
  overlap the target's windows;
* process 3, ``torch (model step thread)``: torch's operator spans (``aten::mm``, ...).

The file is ``<output_dir>/[<profile_prefix>-]<profile_id>-TP-0[-<stage>].trace.json.gz``
(SGLang's names; ``profile_id`` is the start's unix time unless given), gzipped JSON; a target
is written when its ``num_steps`` are in, the rest at ``/stop_profile``. ``output_dir``: the
body's, else ``--profile-dir``, else ``SGLANG_TORCH_PROFILER_DIR``, else ``/tmp`` (SGLang's order,
with the server flag before the environment).

``activities``: SGLang's set; what this machine cannot record is skipped, logged and listed in
the trace's ``otherData`` (`engine.runners.profiler.resolve_activities`). ``num_steps`` and
``start_step`` take an int or its digits as a string (bench_serving sends strings).

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
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BeforeValidator, Field

from ...engine.runners.profiler import ACTIVITIES, DEFAULT_ACTIVITIES, StepProfiler, resolve_activities
from ..edge.errors import APIError, FieldError
from .profile_plan import STAGES, TORCH_PID, StepPlan, Target, Window, target_trace
from ..edge.schemas import _Body, read_json
from ..edge.state import CTX, ServerContext

log = logging.getLogger(__name__)
__all__ = ["ALREADY", "NOT_RUNNING", "TORCH_PID", "ProfileBody", "start", "stop", "ROUTES"]
ALREADY = "Profiling is already in progress. Call /stop_profile first."
NOT_RUNNING = "Profiling is not in progress. Call /start_profile first."


def _count(v: Any) -> Any:
    """A step count as bench_serving sends it: an int, or its digits in a string (lax)."""
    if isinstance(v, bool):
        raise ValueError("must be an integer, not a boolean")
    if isinstance(v, str):
        if not v.strip().isdigit() or not v.strip().isascii():
            raise ValueError(f"must be a non-negative integer, got {v[:32]!r}")
        return int(v.strip())
    return v


Count = Annotated[int | None, BeforeValidator(_count)]


class ProfileBody(_Body):
    output_dir: str | None = Field(default=None, min_length=1, max_length=4096)
    num_steps: Count = Field(default=None, ge=1, le=1_000_000)
    start_step: Count = Field(default=None, ge=0, le=1_000_000)
    activities: list[Literal[ACTIVITIES]] | None = Field(default=None, max_length=16)  # type: ignore[valid-type]
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_prefix: str | None = Field(default=None, max_length=128, pattern=r"^[\w.-]*$")
    profile_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[\w.-]+$")
    merge_profiles: bool | None = None
    profile_by_stage: bool | None = None
    profile_stages: list[Literal[STAGES]] | None = Field(default=None, min_length=1, max_length=4)  # type: ignore[valid-type]


class Profile:
    """One profile: its `StepPlan`, the recorder's events, torch's windows, the files."""

    def __init__(self, ctx: ServerContext, body: ProfileBody, out_dir: Path) -> None:
        rt = ctx.runtime
        self.ctx, self.out_dir = ctx, out_dir
        self.now_ns = rt.system.clock.now_ns
        self.name = (f"{body.profile_prefix}-" if body.profile_prefix else "") + \
            f"{body.profile_id or f'{time.time():.6f}'}-TP-0"
        self.recorded, self.skipped = resolve_activities(
            body.activities if body.activities is not None else DEFAULT_ACTIVITIES)
        if self.skipped:
            log.warning("profile %s: activities not recorded on this machine: %s", self.name,
                        "; ".join(f"{a} ({why})" for a, why in self.skipped.items()))
        self.with_stack, self.record_shapes = body.with_stack, body.record_shapes
        self.by_stage = bool(body.profile_by_stage)
        self.rt = rt
        self.plan = StepPlan(
            start_step=body.start_step or 0, num_steps=body.num_steps,
            stages=list(dict.fromkeys(body.profile_stages or STAGES)) if self.by_stage else None,
            now_ns=self.now_ns, begin=self._begin, end=self._end, done=self._done)
        self.events: list[Any] = []
        self.stops: dict[int, asyncio.Future[Any]] = {}
        self.writes: list[asyncio.Task[Path | None]] = []
        self.auto_stop: asyncio.Task[Any] | None = None
        self.unsubscribe = rt.recorder.subscribe(self._event) if rt.recorder is not None else None

    # -- the plan's hooks: torch on the step thread, in order with the steps ----------------------
    def _begin(self, target: Target) -> tuple[StepProfiler, asyncio.Future[Any]]:
        mem = None
        if "MEM" in self.recorded:         # SGLang's name for the CUDA memory snapshot
            stage = f"-{target.stage}" if target.stage else ""
            mem = str(self.out_dir / f"{time.time()}-TP-0-memory{stage}.pickle")
        prof = StepProfiler(activities=self.recorded, with_stack=self.with_stack,
                            record_shapes=self.record_shapes, now_ns=self.now_ns, mem_path=mem)
        log.info("profiling starts%s (%s)", f" for {target.stage}" if target.stage else "", self.name)
        return prof, _on_step_thread(self.ctx, prof.start)

    def _end(self, w: Window) -> None:
        prof, started = w.handle
        self.stops[id(w)] = _on_step_thread(self.ctx, prof.stop)

    def _done(self, target: Target) -> None:
        self.writes.append(asyncio.get_running_loop().create_task(self._write(target)))

    def _event(self, e: Any) -> None:
        try:
            self.events.append(e)
            d = e.data or {}
            key = (d.get("sched", ""), d.get("step", 0))
            if e.kind == "step" and e.event == "step":
                self.plan.on_step(key, self._stage(d) if self.by_stage else None, e.t_ns)
            elif e.kind == "input" and e.event == "step_end":
                self.plan.on_step_end(key)
            if self.plan.finished and self.auto_stop is None:
                self.auto_stop = asyncio.get_running_loop().create_task(_auto_stop(self.ctx))
        except Exception:               # the recorder would drop a listener that raises
            log.exception("profile %s: a step event could not be handled", self.name)

    def _stage(self, d: dict[str, Any]) -> str:
        """The step's stage, as its scheduler noted it (`engine.scheduling.batching.step_stage`)."""
        return d.get("stage") or "prefill"

    # -- the files ------------------------------------------------------------------------------
    def path(self, stage: str | None) -> Path:
        return self.out_dir / (self.name + (f"-{stage}" if stage else "") + ".trace.json.gz")

    async def _write(self, target: Target) -> Path | None:
        torch_events: list[dict[str, Any]] = []
        errors: list[str] = []
        for w in target.windows:
            for fut in (w.handle[1], self.stops.get(id(w))):
                try:
                    res = await fut if fut is not None else None
                except Exception as exc:     # a profiler that failed: said in the file and the log
                    errors.append(f"{type(exc).__name__}: {exc}")
                    log.error("profile %s: torch's profiler failed: %s", self.name, exc)
                    continue
                if fut is not w.handle[1] and res:
                    torch_events += res
        other = {"activities_recorded": self.recorded, "activities_skipped": self.skipped}
        if errors:
            other["errors"] = errors
        doc = target_trace(target, list(self.events), torch_events, other)
        data = json.dumps(doc, separators=(",", ":")).encode()
        path = self.path(target.stage)
        await asyncio.get_running_loop().run_in_executor(None, _write, path, data)
        log.info("profile written: %s (%d steps, %d torch events, %d lifecycle events)", path,
                 target.count, len(torch_events), len(self.events))
        return path


def _lock(ctx: ServerContext) -> asyncio.Lock:
    return ctx.extra.setdefault("profile_lock", asyncio.Lock())


def _on_step_thread(ctx: ServerContext, fn: Any) -> "asyncio.Future[Any]":
    """Run `fn` where the model steps run: their worker thread (queued behind the steps already
    handed to it), or now, on the loop (steps run inline); its outcome in a future."""
    if ctx.runtime.steps_in_thread:
        return ctx.runtime.call_on_step_thread(fn)
    fut = asyncio.get_running_loop().create_future()
    try:
        fut.set_result(fn())
    except Exception as exc:
        fut.set_exception(exc)
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
        if body.profile_stages and not body.profile_by_stage:      # it would pick nothing
            raise FieldError("profile_stages", "profile_stages picks the stages of profile_by_stage: true")
        if ctx.runtime.recorder is None:           # the steps are seen through the recorder
            for name in ("num_steps", "start_step", "profile_by_stage"):
                if getattr(body, name):
                    raise FieldError(name, f"{name} needs the flight recorder, which is off")
        prof = Profile(ctx, body, _out_dir(ctx, body))
        if not prof.by_stage and not body.start_step:   # from now: torch starts before any next step
            prof.plan.begin(prof.plan.targets[None])
            try:
                await prof.plan.open.handle[1]         # type: ignore[union-attr]
            except Exception:
                if prof.unsubscribe is not None:
                    prof.unsubscribe()
                prof.plan.stop()
                raise
        ctx.extra["profile"] = prof
        return prof


async def stop(ctx: ServerContext, *, auto: bool = False) -> list[Path]:
    """End the running profile and write what it has not written yet; `auto`: every target's
    ``num_steps`` were reached. Returns every file the profile wrote."""
    async with _lock(ctx):
        prof = ctx.extra.get("profile")
        if prof is None or (auto and prof.auto_stop is not asyncio.current_task()):
            raise APIError(400, NOT_RUNNING, code="profile_not_running")
        ctx.extra["profile"] = None
        if prof.unsubscribe is not None:
            prof.unsubscribe()
        for target in prof.plan.stop():
            prof._done(target)
        paths = [p for p in await asyncio.gather(*prof.writes) if p is not None]
        if not paths:
            log.warning("profile %s ended before any step it was to record: no trace written", prof.name)
        else:
            ctx.extra["profile_last"] = str(paths[-1])
        ctx.extra["profile_paths"] = [str(p) for p in paths]
        return paths


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
