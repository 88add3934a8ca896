"""The actor boundary (issue 31, item 1), pinned.

* Statically: no module of `actorserve` outside `actors/` imports an actor class or reaches an
  actor through the runtime (``runtime.scheduler``, ``.control_actor``, ``.stage``, ...); the
  HTTP layer imports only the runtime surface (`actors.runtime`, `actors.surface`).
* At run time: every message any actor receives in a mixed run (generation, pooling, stop
  strings, aborts of every kind, sessions, stored responses, pause / continue, flush, shutdown)
  carries rids, refs and plain data, never an `Actor` instance; the runtime's reads are what
  the actors published, so a read between two turns sees the last turn's state.
* The abort of a request in ``detok`` finds it through the registry, not by a scan.
* Stop is a message: it is handled after the mail already queued.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
from pathlib import Path

import pytest

import actorserve
from actorserve.actors import actor as actor_mod
from actorserve.actors.actor import Actor, ActorDeadError, ActorRef, handles
from actorserve.actors.system import ActorSystem
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.scheduling.params import PoolingParams, SamplingParams
from actorserve.messages import (
    AbortRequest, CloseSession, ContinueGeneration, FlushCache, OpenSession, PauseGeneration, ResponseBegin,
    ResponseEnd, SessionBegin,
)
from runtime_helpers import assert_nothing_held, make_runtime

PKG = Path(actorserve.__file__).parent
#: what outside `actors/` may import from it: the runtime (the one entry), the surface (handles,
#: snapshots, errors), the clock, and the trimmer (not an actor: it reads published data)
SURFACE = {"runtime", "surface", "clock", "rest"}
#: what the HTTP layer may import from `actors/`
HTTP_SURFACE = {"runtime", "surface", "rest"}
#: the names a runtime attribute that is an actor object had (gone: tests use `actor_access`)
ACTOR_ATTRS = {"scheduler", "control_actor", "stage", "sessions", "responses", "watchdog",
               "pool_schedulers", "live_actors"}


def _modules(sub: str | None = None):
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "actors":
            continue
        if sub is not None and rel.parts[0] != sub:
            continue
        yield rel, ast.parse(path.read_text(), str(path))


def _actors_imports(rel: Path, tree: ast.AST) -> list[str]:
    """The `actors` submodules a module imports (absolute or relative)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            parts = mod.split(".")
            if node.level == 0 and parts[:2] == ["actorserve", "actors"]:
                rest = parts[2:]
            elif node.level > 0:
                # resolve against the module's package
                base = list(rel.parts[:-1])[: len(rel.parts) - node.level]
                full = base + [p for p in parts if p]
                if full[:1] != ["actors"]:
                    continue
                rest = full[1:]
            else:
                continue
            if rest:
                out.append(rest[0])
            else:
                out.extend(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                p = a.name.split(".")
                if p[:2] == ["actorserve", "actors"]:
                    out.append(p[2] if len(p) > 2 else "")
    return out


def test_nothing_outside_actors_imports_an_actor_module() -> None:
    bad = [(str(rel), m) for rel, tree in _modules() for m in _actors_imports(rel, tree) if m not in SURFACE]
    assert bad == [], f"modules outside actors/ import actor internals: {bad}"


def test_http_imports_only_the_runtime_surface() -> None:
    bad = [(str(rel), m) for rel, tree in _modules("http") for m in _actors_imports(rel, tree)
           if m not in HTTP_SURFACE]
    assert bad == [], bad
    # and the import graph agrees: the HTTP package pulls in no actor module but the surface's
    # own dependencies (checked by name on what the surface modules import themselves)
    assert list(_modules("http")), "the http package was not found"


def test_nothing_outside_actors_reaches_an_actor_through_the_runtime() -> None:
    """``x.scheduler``, ``x.control_actor``, ... on anything named like a runtime (``runtime``,
    ``rt``, ``ctx.runtime``), and ``.actors`` / ``.get(`` on an actor system: none outside actors/."""
    bad = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in ACTOR_ATTRS:
                continue
            base = node.value
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
            if name in ("runtime", "rt"):
                bad.append(f"{rel}:{node.lineno} {name}.{node.attr}")
    assert bad == [], f"actor objects reached from outside actors/: {bad}"


def test_the_actor_module_does_not_import_the_system() -> None:
    """The circle actor <-> system is broken: `actor` knows the system by a protocol."""
    tree = ast.parse(Path(actor_mod.__file__).read_text())
    mods = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "system" not in mods and "actorserve.actors.system" not in mods, mods


# -- run time ---------------------------------------------------------------------------------------
def _actor_inside(value, depth: int = 0):
    if isinstance(value, Actor):
        return value
    if depth > 3:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            found = _actor_inside(getattr(value, f.name), depth + 1)
            if found is not None:
                return found
    elif isinstance(value, (tuple, list, set, frozenset)):
        for v in value:
            found = _actor_inside(v, depth + 1)
            if found is not None:
                return found
    elif isinstance(value, dict):
        for v in value.values():
            found = _actor_inside(v, depth + 1)
            if found is not None:
                return found
    return None


async def test_messages_carry_refs_never_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    bad: list[str] = []
    enqueue = Actor._enqueue

    def checked(self, env):  # type: ignore[no-untyped-def]
        msg = env[0]
        seen.append(type(msg).__name__)
        found = _actor_inside(msg)
        if found is not None:
            bad.append(f"{type(msg).__name__} to {self.name} carries {found!r}")
        return enqueue(self, env)

    monkeypatch.setattr(Actor, "_enqueue", checked)
    rt, engine, rec, clock = await make_runtime()
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    outs = [rt.generate([1, 2, 3], sp) for _ in range(3)]
    pooled = rt.pool([4, 5, 6], PoolingParams())
    gone = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True), rid="gone")
    await rt.abort("gone")                # before its first step (the abort is behind its Submit)
    for h in outs:
        assert (await h.stream.final()).finish_reason == "length"
    assert (await gone.stream.final()).finish_reason == "abort"
    assert (await pooled.stream.final()).pooled is not None
    # sessions, a stored response, control requests
    res = await rt.control(OpenSession(session_id="s1"))
    assert res.ok, res
    begin = await rt.session(SessionBegin("s1", "in-s1", (1, 2)))
    assert begin.ok, begin
    h = rt.generate(list(begin.detail["prompt_ids"]), sp, rid="in-s1", session="s1")
    await h.stream.final()
    assert (await rt.session(ResponseBegin("resp-1", body={"status": "queued"}))).ok
    await rt.session(ResponseEnd("resp-1", "completed", {"status": "completed"}, {"conversation": []}))
    await rt.quiesce()
    view = rt.response("resp-1")
    assert view is not None and view.state.name == "completed" and view.body == {"status": "completed"}
    await rt.control(CloseSession("s1"))
    assert (await rt.control(PauseGeneration("abort"))).ok
    assert rt.snapshot().paused
    assert (await rt.control(ContinueGeneration())).ok
    assert not rt.snapshot().paused
    await rt.control(FlushCache())
    await rt.control(AbortRequest(abort_all=True))
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()
    assert "Stop" in seen and "Submit" in seen and "Track" in seen and "TokenOut" in seen
    assert bad == [], bad


async def test_reads_are_published_snapshots_between_turns() -> None:
    """A read between a tell and the turn that handles it shows the last turn's state."""
    rt, engine, rec, clock = await make_runtime()
    assert rt.stats().live_requests == 0
    h = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert rt.stats().live_requests == 0          # the Submit is still in the mailbox
    assert rt.request_info(h.rid)["state"] == "queued"
    await rt.quiesce()
    assert rt.request_info(h.rid)["state"] == "detok"   # result known, client has not taken it
    assert rt.stats().live_requests == 0 and rt.stats().generated_tokens == 2
    await h.stream.final()
    await rt.quiesce()
    assert rt.request_info(h.rid) is None
    await rt.shutdown()


async def test_the_runtime_holds_no_actor_object() -> None:
    """Once begun, no attribute of the runtime is an actor (or holds one): it has their refs and
    reads what they publish; tests reach an actor's insides through `actor_access` only."""
    from actorserve.actors.runtime import Runtime
    from actorserve.config import SchedulerConfig
    from actorserve.engine.runners.fake import FakeEngine
    rt = Runtime(FakeEngine(), config=SchedulerConfig(step_in_thread=False, watchdog_timeout_s=5.0),
                 pooling_engines={"embed": FakeEngine()})
    await rt.start()
    for cls in type(rt).__mro__:
        for name in vars(cls):
            assert name not in ACTOR_ATTRS, name

    def actors_in(value: object, depth: int = 0) -> bool:
        if isinstance(value, Actor):
            return True
        if depth < 2 and isinstance(value, dict):
            return any(actors_in(v, depth + 1) for v in value.values())
        if depth < 2 and isinstance(value, (list, tuple, set)):
            return any(actors_in(v, depth + 1) for v in value)
        return False
    held = [name for name, value in vars(rt).items() if actors_in(value)]
    assert held == [], held
    assert all(isinstance(getattr(rt, n), ActorRef) for n in ("sched_ref", "control_ref", "stage_ref",
                                                               "sessions_ref", "responses_ref", "watchdog_ref"))
    await rt.shutdown()


async def test_the_set_up_and_a_steps_stage_are_data_not_reads_of_an_actor() -> None:
    """The recording's set-up is the configuration the runtime built its schedulers with (the
    same data each publishes in its view), and a step's stage (what the profiler splits by) is
    in the recorder's ``step`` note: the runtime has no look into a scheduler's sequences."""
    from actorserve.actors.runtime import Runtime
    assert not hasattr(Runtime, "step_seqs") and not hasattr(Runtime, "step_members")
    rt, engine, rec, clock = await make_runtime(batch=BatchConfig(max_num_seqs=7))
    setup = rt.setup()
    view = rt.system.published("scheduler").setup
    assert setup["generation"] == {k: view[k] for k in setup["generation"]}
    assert setup["generation"]["batch"]["max_num_seqs"] == 7 and setup["weight_version"] == view["weight_version"]
    assert rec.events(kind="input")[0].data == setup     # what the recording starts with
    h = rt.generate(list(range(1, 20)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    await rt.quiesce()
    await h.stream.final()
    await rt.quiesce()
    stages = [e.data["stage"] for e in rec.events(kind="step")]
    assert stages == ["prefill", "decode", "decode"], stages
    await rt.shutdown()


async def test_abort_of_a_request_in_detok_uses_the_registry() -> None:
    rt, engine, rec, clock = await make_runtime()
    hs = [rt.generate([1, 2, 3], SamplingParams(max_new_tokens=1, ignore_eos=True), rid=f"r{i}") for i in range(5)]
    await rt.quiesce()
    reg = rt.system.requests
    assert sorted(reg.delivering) == [f"r{i}" for i in range(5)]       # all in detok
    res = await rt.abort("r3")
    assert res.detail["aborted"] == 1
    await rt.quiesce()
    assert "r3" not in reg.delivering and "r3" not in reg
    aborted = [e.src for e in rec.events(rid="r3", kind="generation") if e.dst == "aborted"]
    assert aborted == ["detok"]          # its result was already on the stream: the client keeps it
    res = await rt.control(AbortRequest(rid="r", prefix=True))
    assert res.detail["aborted"] == 4
    for h in hs:
        await h.stream.final()
    await rt.quiesce()
    assert len(reg) == 0 and reg.delivering == {}
    await rt.shutdown()


class _Echo(Actor):
    def __init__(self) -> None:
        super().__init__("echo")
        self.got: list[int] = []
        self.stopped_after: list[int] | None = None

    @handles(int)
    def _int(self, n: int) -> int:
        self.got.append(n)
        return n

    def on_stop(self) -> None:
        self.stopped_after = list(self.got)


async def test_stop_is_a_message_after_the_mail_already_sent() -> None:
    system = ActorSystem()
    a = system.spawn(_Echo())
    ref = a.ref
    assert isinstance(ref, ActorRef) and ref == a.ref and ref.name == "echo"
    ref.tell(1)
    ref.tell(2)
    stopped = ref.stop()
    ref.tell(3)                          # queued behind the Stop: never handled
    await stopped
    assert a.stopped_after == [1, 2] and not ref.alive
    with pytest.raises(ActorDeadError):
        ref.tell(4)
    assert not ref.tell_if_alive(5)
    await ref.stop()                     # stopping a stopped actor is a no-op
    await system.shutdown()


async def test_shutdown_ends_every_request_by_messages() -> None:
    """Stop messages only: a queued, a running and a delivering request all end, aborted."""
    rt, engine, rec, clock = await make_runtime()
    done = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=1, ignore_eos=True))
    await rt.quiesce()
    await rt.control(PauseGeneration("in_place"))
    queued = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True))
    await rt.quiesce()
    await rt.shutdown()
    assert (await queued.stream.final()).error == "server shutting down"
    assert (await done.stream.final()).finish_reason == "length"     # it had its result
    assert [e.src for e in rec.events(rid=done.rid, kind="generation") if e.dst == "aborted"] == ["detok"]
    assert rt.system.actors == {} and len(rt.system.requests) == 0
    await asyncio.sleep(0)       # sleep-ok: one loop turn, so the stopped actors' tasks finish before the test's loop closes
