"""Versioned outputs (issue 28 item 3): every token says which weights made it.

A request that a retract pause puts back in the queue, and that resumes after an update,
answers two spans (``meta_info.weight_versions``, SGLang's), the first made by the old weights
and the rest by the new ones (checked against the tokens each set of weights makes); a rename
mid-request splits at the step that was in flight; the recording shows the same spans
(`actorserve replay`), and re-execution reloads the folder or says why it cannot.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import html
import json
import shutil

import pytest

from actorserve.cli import main as cli
from actorserve.replay.check import check
from actorserve.replay.recorder import Event, read_recording
from actorserve.replay.reexec import RecordingError, reexecute
from actorserve.replay.render import to_html
from actorserve.replay.versions import ABSENT, token_versions

from http_support import load_tiny, serve, settle
from test_http_control import Stall
from test_weights import PROMPT, _gen, folders  # noqa: F401  (the module's fixture)
from waiting import until
from actor_access import actor_of


def _spans(meta):
    return [(s["version"], s["start"], s["end"]) for s in meta["weight_versions"]]


async def _generate(http, **kw):
    r = await http.post("/generate", json=_gen(**kw))
    assert r.status == 200, await r.text()
    return await r.json()


async def _stall_after(rt, stall, n: int) -> None:
    """Let the one running request make `n` tokens, then stall its next step."""
    def ready() -> bool:
        seq = next(iter(actor_of(rt, "scheduler").seqs.values()), None)
        if seq is not None and len(seq.output_ids) >= n:
            stall.armed = True
        return stall.armed
    await until(ready, timeout=30, poll=0.002)
    assert await asyncio.to_thread(stall.started.wait, 30)


async def _span_an_update(http, rt, folder: str, max_new: int = 24):
    """pause(retract) -> update_weights_from_disk(v5) -> continue around one running request;
    answers (its body, how many tokens it had when it was retracted)."""
    stall = Stall(rt.engine)
    running = asyncio.ensure_future(http.post("/generate", json=_gen(max_new=max_new)))
    await _stall_after(rt, stall, 3)
    pause = asyncio.ensure_future(http.post("/pause_generation", json={"mode": "retract"}))
    await until(lambda: actor_of(rt, "scheduler").state.name == "pausing", timeout=30)
    stall.release()
    r = await pause
    assert r.status == 200 and (await r.json())["affected"] == 1
    (seq,) = actor_of(rt, "scheduler").seqs.values()                 # back in the queue, its tokens kept
    k = len(seq.output_ids)
    r = await http.post("/update_weights_from_disk", json={"model_path": folder, "weight_version": "v5"})
    assert r.status == 200 and (await r.json())["num_paused_requests"] == 1
    assert (await http.post("/continue_generation", json={})).status == 200
    body = await (await running).json()
    return body, k


async def test_a_request_spanning_an_update_says_which_weights_made_which_tokens(folders, tmp_path):
    new, _ = folders
    path = tmp_path / "run.jsonl"
    async with serve(load_tiny(), record_path=str(path)) as (http, rt):
        plain = await _generate(http, max_new=24)
        ref_old = plain["output_ids"]
        assert _spans(plain["meta_info"]) == [("default", 0, 24)]          # one span, the served weights
        assert plain["meta_info"]["weight_version"] == "default"
        body, k = await _span_an_update(http, rt, str(new))
        meta, out = body["meta_info"], body["output_ids"]
        assert 3 <= k < 24 and len(out) == meta["completion_tokens"] == 24
        assert _spans(meta) == [("default", 0, k), ("v5", k, 24)]
        assert meta["weight_version"] == "v5"                               # the last token's
        assert out[:k] == ref_old[:k]                                      # the old weights' tokens
        cont = await http.post("/generate", json={"input_ids": PROMPT + out[:k], "sampling_params": {
            "max_new_tokens": 24 - k, "temperature": 0, "ignore_eos": True}})
        assert (await cont.json())["output_ids"] == out[k:]                # the new weights' tokens
        # OpenAI: metadata from the (first) choice, SGLang's place
        from openai import AsyncOpenAI
        async with AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0) as oai:
            chat = await oai.chat.completions.create(model="tiny-llama", max_tokens=3,
                                                     messages=[{"role": "user", "content": "hi"}])
            n = chat.usage.completion_tokens
            assert chat.metadata == {"weight_version": "v5",          # OpenAI's metadata: strings only
                                     "weight_versions": json.dumps([{"version": "v5", "start": 0, "end": n}],
                                                                   separators=(",", ":"))}
            comp = await oai.completions.create(model="tiny-llama", max_tokens=2, prompt="hi")
            assert json.loads(comp.model_extra["metadata"]["weight_versions"]) == [
                {"version": "v5", "start": 0, "end": comp.usage.completion_tokens}]
        # max_new_tokens 0: no token answered, one empty span of the weights that ran the prompt
        zero = await _generate(http, max_new=0)
        assert _spans(zero["meta_info"]) == [("v5", 0, 0)] and zero["meta_info"]["weight_version"] == "v5"
        await settle(rt)
        events = rt.recorder.events()
        assert check(events).ok
    # the recording says the same, per request
    _, events = read_recording(path)
    info = token_versions(events)
    assert info.known
    rid = meta["id"]
    assert info.spans[rid] == [["default", 0, k], ["v5", k, 24]]
    assert info.spanning() == [rid]
    assert [(c[2], c[3]) for c in info.changes] == [("v5", "load")]
    page = to_html(events)
    assert "<h2>Weights</h2>" in page and f"{rid}: default [0, {k}), v5 [{k}, 24)" in page


async def test_replay_shows_the_spans_and_reexecution_reloads_the_folder(folders, tmp_path, capsys):
    new, _ = folders
    copy = tmp_path / "tiny_v5"
    shutil.copytree(new, copy)
    path = tmp_path / "run.jsonl"
    async with serve(load_tiny(), record_path=str(path)) as (http, rt):
        body, k = await _span_an_update(http, rt, str(copy))
        await settle(rt)
    rid = body["meta_info"]["id"]
    assert cli(["replay", str(path), "--rid", rid]) == 0
    out = capsys.readouterr().out
    assert f"weights: its tokens came from 2 spans: default [0, {k}), v5 [{k}, 24)" in out
    assert cli(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{rid}: default [0, {k}), v5 [{k}, 24)" in out and "steps run with v5 from here (load)" in out
    assert cli(["replay", str(path), "--json"]) == 0
    weights = json.loads(capsys.readouterr().out)["weights"]
    assert weights["spanning"] == {rid: [["default", 0, k], ["v5", k, 24]]}
    # re-execution: the folder is still there, so it is read again at the same point
    _, events = read_recording(path)
    report = await reexecute(events)
    assert report.ok, report.format()
    assert report.weights == [f"seq {_update_seq(events)}: reloaded {copy} ({_tensors(events)} tensors, as recorded)"]
    # gone: the recorded outcome is played back, and the report says why
    shutil.rmtree(copy)
    report = await reexecute(events)
    assert report.ok, report.format()
    assert report.weights == [f"seq {_update_seq(events)}: update_weights_from_disk {copy} cannot be reloaded: "
                              f"the folder no longer exists; played back the recorded outcome "
                              f"({_tensors(events)} tensors)"]
    assert await asyncio.to_thread(cli, ["replay", "--reexecute", str(path)]) == 0
    assert "the folder no longer exists" in capsys.readouterr().out


def _update_seq(events: list[Event]) -> int:
    return next(e.seq for e in events if e.kind == "input" and e.event == "control"
                and e.data["op"] == "UpdateWeightsFromDisk")


def _tensors(events: list[Event]) -> int:
    return next(e.data["tensors"] for e in events if e.kind == "input" and e.event == "weights_read")


async def test_a_rename_mid_request_splits_at_the_step_in_flight(tmp_path):
    """The step running when `/update_weight_version` lands keeps its label; the next carry
    the new one. Streamed: every chunk's meta_info has the spans so far."""
    async with serve(load_tiny()) as (http, rt):
        stall = Stall(rt.engine)
        resp = asyncio.ensure_future(http.post("/generate", json={**_gen(max_new=12), "stream": True}))
        await _stall_after(rt, stall, 3)
        (seq,) = actor_of(rt, "scheduler").seqs.values()
        j = len(seq.output_ids)                      # the stalled step makes token j + 1
        r = await http.post("/update_weight_version", json={"new_version": "step-2"})
        assert r.status == 200
        await until(lambda: actor_of(rt, "scheduler").weight_version == "step-2")
        stall.release()
        r = await resp
        events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        metas = [e["meta_info"] for e in events]
        for m, e in zip(metas, events):              # cumulative, like the ids
            assert _spans(m)[-1][2] == len(e["output_ids"]) == m["completion_tokens"]
        assert _spans(metas[0])[0][0] == "default"
        assert _spans(metas[-1]) == [("default", 0, j + 1), ("step-2", j + 1, 12)]
        assert metas[-1]["weight_version"] == "step-2"
        await settle(rt)
        notes = [e.data for e in rt.recorder.events(kind="sched") if e.event == "weight_version"]
        assert notes == [{"sched": "scheduler", "version": "step-2", "cause": "rename"}]


async def test_a_tensor_update_cannot_be_reloaded_and_the_report_says_why(folders, tmp_path):
    new, _ = folders
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM
    import torch
    model = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32, local_files_only=True)
    name = "model.layers.0.mlp.down_proj.weight"
    blob = base64.b64encode(save({name: model.get_parameter(name).detach().contiguous()})).decode()
    path = tmp_path / "run.jsonl"
    async with serve(load_tiny(), record_path=str(path)) as (http, rt):
        before = await _generate(http, max_new=4)
        r = await http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [blob], "load_format": "safetensors", "weight_version": "t1"})
        assert r.status == 200, await r.text()
        after = await _generate(http, max_new=4)
        assert _spans(before["meta_info"]) == [("default", 0, 4)] and _spans(after["meta_info"]) == [("t1", 0, 4)]
        await settle(rt)
    _, events = read_recording(path)
    report = await reexecute(events)
    assert report.ok, report.format()
    seq = next(e.seq for e in events if e.kind == "input" and e.event == "control"
               and e.data["op"] == "UpdateWeightsFromTensor")
    assert report.weights == [f"seq {seq}: update_weights_from_tensor cannot be reloaded: the recording keeps "
                              "its tensors' sizes, never their bytes; played back the recorded outcome (1 tensors)"]
    # an older recording (no label in its set-up, no read input) replays with a note, and its
    # re-execution says exactly why the update cannot be placed
    old = [_older(e) for e in events if not (e.kind == "sched" and e.event == "weight_version")
           and not (e.kind == "input" and e.event in ("weights_read", "weights_applied"))]
    info = token_versions(old)
    assert not info.known and info.announced and "unknown" in ABSENT
    assert html.escape(ABSENT) in to_html(old)
    with pytest.raises(RecordingError, match="recorded before its read was an input"):
        await reexecute(old)


def _older(e: Event) -> Event:
    if e.kind == "input" and e.event == "runtime":
        d = {k: v for k, v in e.data.items() if k != "weight_version"}
        return dataclasses.replace(e, data=d)
    return e
