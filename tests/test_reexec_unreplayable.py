"""A recording with a control operation the re-execution cannot replay says exactly why."""

from __future__ import annotations

import pytest

from actorserve.replay.recorder import read_recording
from actorserve.replay.reexec import UNREPLAYABLE, RecordingError, reexecute

from http_support import load_tiny, serve, settle


async def test_a_memory_release_is_named_with_its_reason(tmp_path):
    path = tmp_path / "run.jsonl"
    async with serve(load_tiny(), record_path=str(path)) as (http, rt):
        r = await http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
        assert r.status == 200
        for route in ("/release_memory_occupation", "/resume_memory_occupation"):
            r = await http.post(route, json={"tags": ["kv_cache"]})
            assert r.status == 200, await r.text()
        await settle(rt)
    _, events = read_recording(path)
    with pytest.raises(RecordingError) as err:
        await reexecute(events)
    assert "ReleaseMemory cannot be re-executed" in str(err.value)
    assert UNREPLAYABLE["ReleaseMemory"] in str(err.value)
