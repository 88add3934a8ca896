"""LoRA adapters on the recording: the adapter a request ran under is on its ``generate`` input
and in `actorserve replay --rid`; ``--reexecute`` reloads each adapter from its recorded folder
(one that is gone is a `RecordingError` naming it) and reproduces every step and transition."""

from __future__ import annotations

import json
import shutil

import pytest

from actorserve.actors.clock import ManualClock
from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import LoadLoraAdapter, PauseGeneration, ContinueGeneration, UnloadLoraAdapter
from actorserve.replay.recorder import FlightRecorder, read_recording
from actorserve.replay.reexec import RecordingError, reexecute
from actorserve.replay.replay_cli import timeline
from actorserve.statemachines import LIFECYCLES


def folder(tmp_path, name: str) -> str:
    f = tmp_path / name
    f.mkdir(exist_ok=True)
    (f / "adapter_config.json").write_text(json.dumps({"r": 4, "name": name}))
    return str(f)


async def record(tmp_path, in_thread: bool):
    path = tmp_path / "run.jsonl"
    clock = ManualClock()
    rec = FlightRecorder(path=path, clock=clock, capacity=200_000, lifecycles=LIFECYCLES.values())
    rt = Runtime(FakeEngine(num_blocks=256, block_size=4, loras=2), clock=clock, recorder=rec,
                 config=SchedulerConfig(batch=BatchConfig(max_num_seqs=8, max_loras=1), step_in_thread=in_thread))
    await rt.start()
    assert (await rt.control(LoadLoraAdapter("a1", folder(tmp_path, "a1")))).ok
    assert (await rt.control(LoadLoraAdapter("a2", folder(tmp_path, "a2")))).ok
    hs = [rt.generate([i + 1, 2, 3], SamplingParams(max_new_tokens=3 + i % 4), rid=f"r{i}",
                      lora=[None, "a1", "a2"][i % 3]) for i in range(12)]
    bad = rt.control(LoadLoraAdapter("bad", str(tmp_path / "missing")))
    assert not (await bad).ok
    assert (await rt.control(PauseGeneration("retract"))).ok
    late = rt.generate([9, 9], SamplingParams(max_new_tokens=2), rid="late", lora="a2")
    unload = rt.control(UnloadLoraAdapter("a2"))
    assert (await rt.control(ContinueGeneration())).ok
    assert (await unload).ok
    outs = [await h.stream.final() for h in hs + [late]]
    assert {o.finish_reason for o in outs} == {"length"}, [(o.rid, o.error) for o in outs if o.error]
    await rt.quiesce()
    await rt.shutdown()
    return path


@pytest.mark.parametrize("in_thread", [False, True])
async def test_reexecution_reloads_adapters_from_their_folders(tmp_path, in_thread):
    path = await record(tmp_path, in_thread)
    _, events = read_recording(path)
    assert any(e.event == "lora_read" for e in events)
    lines = timeline(events, "r1")
    assert lines[0] == "LoRA adapter: a1"
    assert timeline(events, "r0")[0] != "LoRA adapter: a1"
    rx = await reexecute(events)
    assert rx.ok and rx.drift == 0, rx.format()
    assert any("a2" in note and "reloaded" in note for note in rx.weights), rx.weights
    shutil.rmtree(tmp_path / "a2")
    with pytest.raises(RecordingError, match="'a2' cannot be reloaded"):
        await reexecute(events)
