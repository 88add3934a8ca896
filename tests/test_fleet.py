"""`actorserve fleet`: two tiny replicas behind the real sglang-router binary (PyPI), as users
run it: mixed traffic through the one URL, a session's turns on one replica, abort by rid
reaching the replica that holds it, chained stored responses reaching the replica that stores
them under round-robin, a replica killed mid-run (every request ends, traffic after
succeeds, the fleet restarts it), and SIGTERM draining everything. One fleet for the module."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import uuid

import aiohttp
import pytest

from actorserve.cli import build_parser
from actorserve.fleet.fleet_cli import replica_argv
from actorserve.fleet.supervisor import Backoff, free_port
from actorserve.http.responses.responses_items import replica_of, response_id

from waiting import until

LONG = "the quick brown fox jumps over the lazy dog " * 12


def _router_runs() -> str | None:
    if importlib.util.find_spec("sglang_router") is None:
        return "sglang-router is not installed (pip install 'actorserve[fleet]')"
    r = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"],
                       capture_output=True, timeout=120)
    return None if r.returncode == 0 else f"the sglang-router binary does not run here: {r.stderr[-300:]!r}"


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    why = _router_runs()
    if why:
        pytest.skip(why)
    port = free_port()
    where = tmp_path_factory.mktemp("fleet")
    log = open(where / "fleet.log", "wb")
    rec = where / "rec"
    proc = subprocess.Popen([sys.executable, "-m", "actorserve.cli", "fleet", "--replicas", "2",
                             "--port", str(port), "--model", "tiny", "--threads", "1",
                             "--policy", "round_robin", "--record", f"{rec}/"],
                            stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    pids: set[int] = set()
    sel = selectors.DefaultSelector()
    try:
        sel.register(proc.stdout, selectors.EVENT_READ)
        end, line = time.monotonic() + 180, b""
        while b"actorserve fleet of" not in line:
            assert proc.poll() is None, f"fleet exited with {proc.returncode}; see {log.name}"
            assert time.monotonic() < end, "fleet not up in 180s"
            if sel.select(timeout=1):
                line = proc.stdout.readline()
        url = line.decode().split(" at ")[1].split()[0]
        assert url == f"http://127.0.0.1:{port}"
        yield {"url": url, "proc": proc, "pids": pids, "rec": rec}
    finally:
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in pids:                      # replicas run in their own process groups
            _kill_group(pid, signal.SIGKILL)
        sel.close()
        proc.stdout.close()
        log.close()


async def _status(http, url) -> dict:
    async with http.get(url + "/fleet") as r:
        return await r.json()


async def _note_pids(http, fleet) -> dict:
    st = await _status(http, fleet["url"])
    fleet["pids"].update(r["pid"] for r in st["replicas"] if r["pid"])
    return st


async def _one(http, url, kind: str, i: int) -> tuple[str, int, str]:
    """One request of `kind`; (kind, status, "ok" | what was wrong)."""
    if kind == "chat":
        body = {"model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": f"hi {i}"}]}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            doc = await r.json(content_type=None)
            ok = r.status == 200 and doc["choices"][0]["finish_reason"] in ("length", "stop")
    elif kind == "stream":
        body = {"model": "tiny-llama", "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": f"stream {i}"}]}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            text = (await r.read()).decode()
            ok = r.status == 200 and "data: [DONE]" in text
            if r.status == 200 and not ok:          # cut upstream: a clear error event, or silence
                return kind, r.status, "upstream_lost" if '"upstream_lost"' in text else "silent cut"
    elif kind == "generate":
        async with http.post(url + "/generate", json={"text": f"gen {i}", "sampling_params": {"max_new_tokens": 4}}) as r:
            doc = await r.json(content_type=None)
            ok = r.status == 200 and doc["meta_info"]["completion_tokens"] == 4
    elif kind == "embed":
        async with http.post(url + "/v1/embeddings", json={"model": "default-embedding", "input": [f"e {i}", "x"]}) as r:
            doc = await r.json(content_type=None)
            ok = r.status == 200 and len(doc["data"]) == 2 and len(doc["data"][0]["embedding"]) == 384
    elif kind == "rerank":
        async with http.post(url + "/v1/rerank", json={"query": f"q {i}", "documents": ["a", "b", "c"]}) as r:
            doc = await r.json(content_type=None)
            ok = r.status == 200 and sorted(x["index"] for x in doc["results"]) == [0, 1, 2]
    elif kind == "classify":
        async with http.post(url + "/v1/classify", json={"model": "tiny-llama", "input": [f"c {i}", "d"]}) as r:
            doc = await r.json(content_type=None)
            ok = r.status == 200 and [x["label"] in ("negative", "positive") for x in doc["data"]] == [True, True]
    else:
        async with http.post(url + "/v1/score", json={"query": f"s {i}", "items": ["a", "b"],
                                                      "label_token_ids": [1, 2]}) as r:
            doc = await r.json(content_type=None)
            ok = r.status == 200 and len(doc["scores"]) == 2
    return kind, r.status, "ok" if ok else json.dumps(doc)[:300]


KINDS = ("chat", "stream", "generate", "embed", "rerank", "score", "classify")


async def _mixed(http, url, n: int, concurrency: int = 6,
                 done: list | None = None) -> list[tuple[str, int, str]]:
    """``done``: each request's outcome is appended as it ends (to see a burst under way)."""
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int) -> tuple[str, int, str]:
        async with sem:
            try:
                out = await _one(http, url, KINDS[i % len(KINDS)], i)
            except (aiohttp.ClientError, ValueError) as exc:
                out = KINDS[i % len(KINDS)], 0, f"{exc.__class__.__name__}: {exc}"
            if done is not None:
                done.append(out)
            return out
    return list(await asyncio.gather(*(run(i) for i in range(n))))


def _client(total: float = 60) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total))


async def test_mixed_traffic_and_router_probes(fleet):
    url = fleet["url"]
    async with _client() as http:
        st = await _note_pids(http, fleet)
        assert [r["state"] for r in st["replicas"]] == ["ready", "ready"]
        results = await _mixed(http, url, 42)
        assert [r for r in results if r[2] != "ok"] == []
        async with http.get(st["router"] + "/get_loads") as r:     # the router's view of /get_load
            loads = (await r.json())["workers"]
        assert len(loads) == 2 and all(w["load"] >= 0 for w in loads), loads
        async with http.post(url + "/flush_cache") as r:
            flush = await r.json()
        assert r.status == 200 and [a["status"] for a in flush["replicas"]] == [200, 200]
        async with http.post(st["router"] + "/flush_cache") as r:    # the router's own fan-out
            assert r.status == 200 and (await r.json())["workers_flushed"] == 2


async def test_session_turns_stay_on_one_replica(fleet):
    url = fleet["url"]
    async with _client() as http:
        async with http.post(url + "/open_session", json={"capacity_of_str_len": 4096}) as r:
            sid = await r.json()
        assert r.status == 200 and isinstance(sid, str)
        owner = (await _status(http, url))["sessions"][sid]
        cached, rid = [], None
        for turn in range(3):
            params = {"id": sid, **({"rid": rid} if rid else {})}
            body = {"text": LONG if turn == 0 else f" and then {turn}", "session_params": params,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            async with http.post(url + "/generate", json=body) as r:
                doc = await r.json()
            assert r.status == 200, doc
            rid = doc["meta_info"]["id"]
            cached.append(doc["meta_info"]["cached_tokens"])
        assert cached[0] == 0 and 0 < cached[1] < cached[2], cached
        assert (await _status(http, url))["sessions"][sid] == owner
        async with http.post(url + "/close_session", json={"session_id": sid}) as r:
            assert r.status == 200


async def test_chained_responses_reach_the_replica_that_stores_them(fleet):
    """Round-robin alternates the replicas, and stored responses live on one: each turn naming
    its parent goes to the replica the parent's id names, as do GET, input_items and DELETE."""
    url = fleet["url"]
    async with _client() as http:
        st = await _status(http, url)
        assert st["policy"] == "round_robin"
        urls = {r["name"]: r["url"] for r in st["replicas"]}
        assert sorted(urls) == ["r0", "r1"]
        body = {"model": "tiny-llama", "max_output_tokens": 3, "temperature": 0}
        async with http.post(url + "/v1/responses", json={**body, "input": "hello"}) as r:
            doc = await r.json()
        assert r.status == 200, doc
        chain, owner = [doc["id"]], replica_of(doc["id"])
        assert owner in urls
        for turn in range(4):
            stream = turn == 2                     # a streamed turn passes through as it is
            async with http.post(url + "/v1/responses", json={
                    **body, "input": f"and {turn}", "previous_response_id": chain[-1], "stream": stream}) as r:
                raw = await r.read()
            assert r.status == 200, raw[:300]
            if stream:
                events = [json.loads(x[5:]) for x in raw.decode().split("\n") if x.startswith("data:")]
                assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
                doc = events[-1]["response"]
            else:
                doc = json.loads(raw)
            assert doc["status"] in ("completed", "incomplete") and doc["previous_response_id"] == chain[-1]
            chain.append(doc["id"])
        assert {replica_of(rid) for rid in chain} == {owner}
        for parent, rid in zip([None] + chain, chain):
            async with http.get(f"{url}/v1/responses/{rid}") as r:
                got = await r.json()
            assert r.status == 200 and got["id"] == rid and got["previous_response_id"] == parent, got
        async with http.get(f"{url}/v1/responses/{chain[-1]}/input_items") as r:
            items = await r.json()
        assert r.status == 200 and items["data"][0]["content"][0]["text"] == "and 3", items
        other = next(u for name, u in urls.items() if name != owner)
        async with http.get(f"{other}/v1/responses/{chain[0]}") as r:
            assert r.status == 404                 # the other replica never stored it
        async with http.get(f"{url}/v1/responses/{response_id('r9')}") as r:
            err = (await r.json())["error"]
        assert r.status == 404 and err["code"] == "response_not_found", err
        async with http.post(url + "/v1/responses", json={
                **body, "input": "x", "previous_response_id": response_id("r9")}) as r:
            err = (await r.json())["error"]
        assert r.status == 404 and err["param"] == "previous_response_id", err
        async with http.delete(f"{url}/v1/responses/{chain[-1]}") as r:
            assert r.status == 200 and (await r.json())["deleted"] is True
        async with http.get(f"{url}/v1/responses/{chain[-1]}") as r:
            assert r.status == 404


async def test_abort_by_rid_reaches_the_replica_that_holds_it(fleet):
    url, rid = fleet["url"], f"fleet-abort-{uuid.uuid4().hex}"
    async with _client() as http:
        body = {"text": "count", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        async with http.post(url + "/generate", json=body) as stream:
            assert stream.status == 200
            first = await stream.content.readline()
            assert first.startswith(b"data:")
            router = (await _status(http, url))["router"]

            async def loaded() -> bool:               # the router sees the tokens in the KV
                async with http.get(router + "/get_loads") as r:
                    return any(w["load"] > 0 for w in (await r.json())["workers"])
            await until(loaded, 10, poll=0.05, what="a load above 0 in the router's /get_loads")
            async with http.post(url + "/abort_request", json={"rid": rid}) as r:
                answer = await r.json()
            assert r.status == 200 and answer["aborted"] == 1 and len(answer["aborted_on"]) == 1, answer
            events = [json.loads(x[5:]) for x in (await stream.read()).decode().split("\n")
                      if x.startswith("data:") and x.strip() != "data: [DONE]"]
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert events[-1]["meta_info"]["completion_tokens"] < 2000


async def test_killed_replica_requests_end_traffic_continues_fleet_restarts_it(fleet):
    url = fleet["url"]
    async with _client() as http:
        st = await _note_pids(http, fleet)
        victim = st["replicas"][0]
        ended: list = []
        burst = asyncio.ensure_future(_mixed(http, url, 200, done=ended))
        await until(lambda: len(ended) >= 12, 60, what="the burst under way")   # mid-burst: 188 to go
        t_kill = time.monotonic()
        _kill_group(victim["pid"], signal.SIGKILL)

        async def router_dropped() -> bool:
            async with http.get(st["router"] + "/workers") as r:
                ws = {w["url"]: w["is_healthy"] for w in (await r.json())["workers"]}
            return ws.get(victim["url"]) is False
        await until(router_dropped, 30, poll=0.05, what="the router marking the killed replica unhealthy")
        dropped_s = time.monotonic() - t_kill
        results = await asyncio.wait_for(burst, 120)        # every request ends: no hang
        failed = [r for r in results if r[2] != "ok"]
        assert [r for r in failed if r[2] == "silent cut"] == []      # a cut stream says so
        assert len(failed) <= 12, failed                    # only those caught on the victim
        assert len(results) == 200 and len(failed) < len(results)
        after = await _mixed(http, url, 12)
        assert [r for r in after if r[2] != "ok"] == []     # traffic after the kill succeeds

        async def back() -> bool:
            rep = (await _status(http, url))["replicas"][0]
            return rep["state"] == "ready" and rep["restarts"] == 1
        await until(back, 120, poll=0.05, what="the fleet restarting the killed replica")
        back_s = time.monotonic() - t_kill
        await _note_pids(http, fleet)

        async def rejoined() -> bool:
            async with http.get(st["router"] + "/workers") as r:
                return all(w["is_healthy"] for w in (await r.json())["workers"])
        await until(rejoined, 30, poll=0.05, what="the router taking the restarted replica back")
        rejoin_s = time.monotonic() - t_kill
        print(f"\nfleet kill: router dropped the replica after {dropped_s:.2f}s; "
              f"replica ready again {back_s:.1f}s after the kill (restarts=1); "
              f"router healthy on it {rejoin_s:.1f}s after; {len(failed)}/200 requests of the burst "
              f"failed: {sorted(set((k, s) for k, s, _ in failed))}")
        assert [r for r in await _mixed(http, url, 12) if r[2] != "ok"] == []


async def test_sigterm_drains_and_stops_every_process(fleet):
    """A stream in flight when the fleet gets SIGTERM is answered to its end (the front and
    then each replica drain before they stop); then every process is gone."""
    proc = fleet["proc"]
    body = {"text": "drain me", "stream": True, "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
    async with _client() as http:
        async with http.post(fleet["url"] + "/generate", json=body) as r:
            assert r.status == 200
            first = await r.content.readline()             # the request is in flight
            assert first.startswith(b"data: ")
            os.killpg(proc.pid, signal.SIGTERM)
            rest = (await r.read()).decode()
    events = [json.loads(line[6:]) for line in (first.decode() + rest).splitlines()
              if line.startswith("data: {")]
    assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
    assert events[-1]["meta_info"]["completion_tokens"] == 48
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert await asyncio.to_thread(proc.wait, 60) == 0
    for pid in fleet["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_replica_command_lines_and_backoff():
    args = build_parser().parse_args(["fleet", "--replicas", "2", "--port", "9", "--model", "tiny",
                                      "--record", "/tmp/run.jsonl", "--debug-routes", "--policy", "round_robin"])
    argv = replica_argv(args, 1, 4242)
    tail = argv[argv.index("serve") + 1:]
    assert tail[:4] == ["--host", "127.0.0.1", "--port", "4242"]
    assert "--policy" not in tail and "--replicas" not in tail and "--debug-routes" in tail
    assert tail[tail.index("--record") + 1] == "/tmp/run.r1.jsonl"
    assert tail[tail.index("--model") + 1] == "tiny" and tail[-2:] == ["--replica-id", "r1"]
    folder = build_parser().parse_args(["fleet", "--record", "/tmp/runs/", "--replica-id", "box"])
    tail = replica_argv(folder, 0, 1)
    assert tail[tail.index("--record") + 1] == "/tmp/runs/" and tail[-1] == "box-r0"
    b = Backoff(base=0.5, cap=4.0)
    assert [b.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_merged_recording_of_the_run_is_clean(fleet):
    """After the run (the kill, the restart, SIGTERM): `actorserve replay DIR` merges the three
    recordings (r0 before and after its restart, r1) on one clock and finds no violation; what
    was lost is only what r0's first incarnation held when it was killed."""
    assert fleet["proc"].poll() is not None                 # after the SIGTERM test
    names = sorted(p.name for p in fleet["rec"].iterdir())
    assert names == ["r0.jsonl", "r0.prev-1.jsonl", "r1.jsonl"], names
    r = subprocess.run([sys.executable, "-m", "actorserve.cli", "replay", str(fleet["rec"]), "--json"],
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(r.stdout)
    parts = {p["replica"]: p for p in report["replicas"]}
    assert report["ok"] is True and sorted(parts) == ["r0#1", "r0#2", "r1"]
    assert report["cross_replica"] == [] and all(p["violations"] == [] for p in parts.values())
    assert parts["r0#1"]["cut"] is True                               # killed
    assert parts["r0#2"]["ended_in_order"] and parts["r1"]["ended_in_order"]     # drained
    lost = report["lost_with_process"]
    assert {x["replica"] for x in lost} <= {"r0#1"}, lost
    assert sum(p["requests"].get("generation", 0) for p in parts.values()) >= 100
    r = subprocess.run([sys.executable, "-m", "actorserve.cli", "replay", str(fleet["rec"]),
                        "--reexecute", "--json"], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [x["ok"] for x in json.loads(r.stdout)["replicas"]] == [True, True, True]
