"""Background responses (``background: true``) with the official `openai` client: the create
answers ``queued`` at once and the request runs on in the runtime; ``retrieve`` follows the
stored status ``queued -> in_progress -> completed``; ``cancel`` aborts a queued or running one
(its KV freed, ``cancelled``), answers an ended one unchanged and refuses a synchronous one; a
background stream is resumed with ``retrieve(stream=True, starting_after=N)``; the store's
lifecycle is recorded and re-executes; the server's shutdown ends what still runs.

The engine is the fake one (deterministic tokens that are never EOS: a request runs to its
``max_output_tokens``) over the tiny model's tokenizer and chat template, and its steps can be
held on a gate (the step thread waits), so a response is held ``in_progress`` for exactly as
long as a test wants: no sleeps, no races with the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI

from actorserve.actors.runtime import Runtime
from actorserve.config import ModelConfig, RecorderConfig, SchedulerConfig, ServerConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.fleet.front import Front
from actorserve.fleet.supervisor import Fleet, ReplicaState
from actorserve.http.edge.app import build_app
from actorserve.http.edge.state import CTX
from actorserve.replay.check import check
from actorserve.replay.recorder import FlightRecorder, read_recording
from actorserve.replay.reexec import reexecute
from actorserve.statemachines import LIFECYCLES

from http_support import NAME, load_tiny, settle, until
from actor_access import actor_of, live_actors


@pytest.fixture(scope="module")
def tok():
    return load_tiny()[2]


class Gate:
    """Holds the engine's steps (in the step thread) while closed; counts the steps begun."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.steps = 0

    def __call__(self, batch) -> None:
        self.steps += 1
        assert self.open.wait(30), "a test left the gate closed"


@contextlib.asynccontextmanager
async def serving(tok, *, record_path=None, replica_id=None, responses_store=1000):
    gate = Gate()
    # EOS is id 0 here, which the fake engine never makes: every request runs to its length
    engine = FakeEngine(num_blocks=256, block_size=16, vocab_size=len(tok.hf), eos_token_id=0, fault=gate)
    rec = FlightRecorder(capacity=200_000, lifecycles=LIFECYCLES.values(), path=record_path)
    rt = Runtime(engine, config=SchedulerConfig(step_in_thread=True, responses_store=responses_store),
                 recorder=rec)
    config = ServerConfig(model=ModelConfig(model="tiny"), recorder=RecorderConfig(replica_id=replica_id))
    app = build_app(rt, tok, config, NAME)
    async with TestServer(app, host="127.0.0.1", port=0) as server:
        async with TestClient(server) as http:
            async with AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0,
                                   timeout=30) as oa:
                try:
                    yield http, rt, oa, gate
                finally:
                    gate.open.set()


def state(rt, rid: str) -> str:
    entry = actor_of(rt, "responses").entries.get(rid)
    return entry.state.name if entry is not None else "gone"


async def test_a_background_response_runs_on_and_is_retrieved(tok):
    async with serving(tok) as (http, rt, oa, gate):
        gate.open.clear()                       # the first step waits: the response is held
        r = await oa.responses.create(model=NAME, input="Tell me a story", background=True,
                                      max_output_tokens=12, temperature=0)
        assert r.status == "queued" and r.background is True and r.output == [] and r.usage is None
        await until(lambda: state(rt, r.id) == "in_progress")
        got = await oa.responses.retrieve(r.id)
        assert got.status == "in_progress" and got.background is True and got.completed_at is None
        assert rt.request_info(r.id)["state"] in ("prefill", "decode")   # an ordinary request actor
        with pytest.raises(openai.BadRequestError):      # still running: cannot be deleted yet
            await oa.responses.delete(r.id)
        gate.open.set()
        await until(lambda: state(rt, r.id) == "incomplete")
        done = await oa.responses.retrieve(r.id)
        assert done.status == "incomplete" and done.usage.output_tokens == 12 and done.output_text
        assert done.incomplete_details.reason == "max_output_tokens" and done.completed_at
        # the same request as a synchronous response gives the same output
        sync = await oa.responses.create(model=NAME, input="Tell me a story", max_output_tokens=12,
                                         temperature=0)
        assert sync.output_text == done.output_text and sync.background is False
        # a background response chains like any other
        more = await oa.responses.create(model=NAME, input="More", previous_response_id=r.id,
                                         background=True, max_output_tokens=3)
        await until(lambda: state(rt, more.id) == "incomplete")
        assert (await oa.responses.retrieve(more.id)).usage.input_tokens_details.cached_tokens > 0
        await settle(rt)
        # counted like any request: the two background ones and the synchronous one, by kind
        metrics = await (await http.get("/metrics")).text()
        line = next(ln for ln in metrics.splitlines() if ln.startswith("actorserve_requests_total{")
                    and 'kind="responses"' in ln and 'finish_reason="length"' in ln)
        assert float(line.rsplit(" ", 1)[1]) == 3.0, line


async def test_cancel_aborts_a_running_background_response(tok):
    async with serving(tok) as (http, rt, oa, gate):
        gate.open.clear()
        r = await oa.responses.create(model=NAME, input="Hi", background=True, max_output_tokens=200)
        await until(lambda: state(rt, r.id) == "in_progress")
        assert rt.stats().kv_used_blocks > 0
        cancelled = await oa.responses.cancel(r.id)        # answered once the request has ended
        assert cancelled.id == r.id and cancelled.status == "cancelled"
        assert rt.request_info(r.id) is None and rt.stats().live_requests == 0      # aborted
        assert (await oa.responses.retrieve(r.id)).status == "cancelled"
        again = await oa.responses.cancel(r.id)              # idempotent: the final object again
        assert again.model_dump() == cancelled.model_dump()
        aborts = [c for c in actor_of(rt, "control").history if c.op == "abort_request"]
        assert [c.result.detail["aborted"] for c in aborts] == [1]       # one abort, through control
        gate.open.set()
        await settle(rt)                      # the held step ends: its KV is freed (none used)
        with pytest.raises(openai.BadRequestError) as exc:   # cancelled: not continuable
            await oa.responses.create(model=NAME, input="x", previous_response_id=r.id)
        assert exc.value.body["param"] == "previous_response_id"
        await oa.responses.delete(r.id)
        assert set(actor_of(rt, "sessions").sessions) == set()            # its session closed with it


async def test_cancel_a_queued_one_and_the_answers_cancel_gives(tok):
    async with serving(tok) as (http, rt, oa, gate):
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status == 200
        r = await oa.responses.create(model=NAME, input="Hi", background=True, max_output_tokens=4)
        assert (await oa.responses.retrieve(r.id)).status == "queued"
        cancelled = await oa.responses.cancel(r.id)
        assert cancelled.status == "cancelled" and cancelled.output[0].content[0].text == ""
        assert state(rt, r.id) == "cancelled" and rt.request_info(r.id) is None
        assert (await http.post("/continue_generation", json={})).status == 200
        # ended: answered unchanged; synchronous: OpenAI's 400; unknown: 404
        done = await oa.responses.create(model=NAME, input="Hi", background=True, max_output_tokens=4)
        await until(lambda: state(rt, done.id) == "incomplete")
        stored = await oa.responses.retrieve(done.id)
        assert (await oa.responses.cancel(done.id)).model_dump() == stored.model_dump()
        sync = await oa.responses.create(model=NAME, input="Hi", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as exc:
            await oa.responses.cancel(sync.id)
        assert "Cannot cancel a synchronous response." in exc.value.message
        with pytest.raises(openai.NotFoundError):
            await oa.responses.cancel("resp_nope")
        with pytest.raises(openai.BadRequestError) as exc:
            await oa.responses.create(model=NAME, input="Hi", background=True, store=False)
        assert exc.value.body["param"] == "background"
        await settle(rt)


async def test_a_background_stream_is_resumed_after_any_event(tok):
    async with serving(tok) as (http, rt, oa, gate):
        stream = await oa.responses.create(model=NAME, input="Hi", background=True, stream=True,
                                           max_output_tokens=6, temperature=0)
        first = [e async for e in stream]
        types = [e.type for e in first]
        assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
        assert first[0].response.status == "queued" and types[-1] == "response.incomplete"
        assert [e.sequence_number for e in first] == list(range(len(first)))
        rid = first[0].response.id
        final = first[-1].response
        assert final.status == "incomplete" and (await oa.responses.retrieve(rid)).output_text == final.output_text
        for n in (-1, 0, 4, len(first) - 2, len(first) - 1):
            again = await oa.responses.retrieve(rid, stream=True, starting_after=n)
            got = [e async for e in again]
            assert [e.model_dump() for e in got] == [e.model_dump() for e in first[n + 1:]], n
        # a client that leaves a running background stream stops reading only; a reader that
        # comes later gets every event, up to the end
        gate.open.clear()
        stream = await oa.responses.create(model=NAME, input="Hi", background=True, stream=True,
                                           max_output_tokens=6, temperature=0)
        events = stream.__aiter__()
        created = await events.__anext__()
        await stream.close()
        rid2 = created.response.id
        follower = asyncio.ensure_future(_collect(oa, rid2, 0))
        await until(lambda: state(rt, rid2) == "in_progress")
        gate.open.set()
        rest = await follower
        assert [e.type for e in rest][0] == "response.queued" and rest[-1].type == "response.incomplete"
        assert rest[-1].response.output_text == final.output_text
        # only a background stream keeps its events
        plain = await oa.responses.create(model=NAME, input="Hi", background=True, max_output_tokens=2)
        await until(lambda: state(rt, plain.id) == "incomplete")
        for query, param in (("stream=true", "stream"), ("starting_after=2", "starting_after"),
                             ("stream=true&include_obfuscation=true", "include_obfuscation")):
            r = await http.get(f"/v1/responses/{plain.id}?{query}")
            assert r.status == 400 and (await r.json())["error"]["param"] == param, query
        await settle(rt)


async def _collect(oa, rid, after):
    return [e async for e in await oa.responses.retrieve(rid, stream=True, starting_after=after)]


async def test_the_lifecycle_is_recorded_and_reexecutes(tok, tmp_path):
    path = tmp_path / "bg.jsonl"
    async with serving(tok, record_path=path) as (http, rt, oa, gate):
        done = await oa.responses.create(model=NAME, input="a", background=True, max_output_tokens=3)
        await until(lambda: state(rt, done.id) == "incomplete")
        gate.open.clear()
        held = await oa.responses.create(model=NAME, input="b", background=True, max_output_tokens=50)
        await until(lambda: state(rt, held.id) == "in_progress")
        await oa.responses.cancel(held.id)
        gate.open.set()
        await settle(rt)
        events = rt.recorder.events()
    hist = {}
    for e in events:
        if e.kind == "response":
            hist.setdefault(e.rid, []).append(e.event)
    assert hist == {f"response:{done.id}": ["create", "start", "run_out"],
                    f"response:{held.id}": ["create", "start", "cancel"]}
    assert check(events).ok
    report = await reexecute(read_recording(path)[1])
    assert report.ok, report.format()
    assert report.drift == 0


async def test_shutdown_ends_a_running_background_response(tok):
    async with serving(tok) as (http, rt, oa, gate):
        gate.open.clear()
        r = await oa.responses.create(model=NAME, input="Hi", background=True, max_output_tokens=100)
        await until(lambda: state(rt, r.id) == "in_progress")
        runs = http.server.app[CTX].background
        assert list(runs.tasks) == [r.id]
        gate.open.set()
    # the app's cleanup shut the runtime down (aborting the request) and awaited its reader
    assert not live_actors(rt) and not runs.tasks
    assert rt.request_info(r.id) is None


async def test_background_get_and_cancel_through_the_fleet_front(tok):
    """The front sends a new background response to a replica, and GET (its stream too) and
    cancel to the replica its id names."""
    async with serving(tok, replica_id="box-r0") as (http, rt, oa, gate):
        fleet = Fleet(lambda i, port: ["unused"], 1, "round_robin", name_of=lambda i: f"box-r{i}")
        fleet.replicas[0].port, fleet.replicas[0].state = http.server.port, ReplicaState.ready
        fleet.router_port = http.server.port
        async with TestClient(TestServer(Front(fleet).app(), host="127.0.0.1")) as front:
            async with AsyncOpenAI(base_url=str(front.make_url("/v1")), api_key="none", max_retries=0,
                                   timeout=30) as via:
                gate.open.clear()
                r = await via.responses.create(model=NAME, input="Hi", background=True, max_output_tokens=100)
                assert r.id.startswith("resp_box-r0_") and r.status == "queued"
                await until(lambda: state(rt, r.id) == "in_progress")
                assert (await via.responses.retrieve(r.id)).status == "in_progress"
                assert (await via.responses.cancel(r.id)).status == "cancelled"
                gate.open.set()
                s = await via.responses.create(model=NAME, input="Hi", background=True, stream=True,
                                               max_output_tokens=4)
                first = [e async for e in s]
                again = [e async for e in await via.responses.retrieve(first[0].response.id, stream=True,
                                                                        starting_after=2)]
                assert [e.model_dump() for e in again] == [e.model_dump() for e in first[3:]]
                await settle(rt)
