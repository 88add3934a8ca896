"""SGLang's own `/update_weights_from_tensor` forms (null/direct, LocalSerializedTensor,
slime's flattened_bucket): tensors shared by a real sender process through shared memory, read
by the allow-listed unpickler (`engine/weights/refit_shm.py`); anything else in the pickle refused
before it runs."""

from __future__ import annotations

import asyncio
import json
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from actorserve.replay.check import check

from http_support import assert_error, load_tiny, serve, settle
from test_weights import _ids, _subset, folders  # noqa: F401  (the fixture)

SENDER = str(Path(__file__).with_name("shm_sender.py"))


@asynccontextmanager
async def sender(form: str, strategy: str, path: Path):
    """The sender process: yields its `serialized_named_tensors` entry, keeps its shared tensors
    alive until the block ends, then is stopped."""
    proc = await asyncio.create_subprocess_exec(sys.executable, SENDER, form, strategy, str(path),
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line, "the sender printed nothing"
        yield json.loads(line)
    finally:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


@pytest.fixture(scope="module")
def subset_file(folders, tmp_path_factory):  # noqa: F811
    from safetensors.torch import save_file
    new, _ = folders
    subset = _subset(new)
    path = tmp_path_factory.mktemp("shm") / "subset.safetensors"
    save_file({k: v.contiguous() for k, v in subset.items()}, str(path))
    return path, subset


@pytest.mark.parametrize("form,load_format", [("direct", None), ("direct", "direct"), ("local", None),
                                              ("bucket", "flattened_bucket"), ("bytes_bucket", "flattened_bucket")])
async def test_sglang_shared_memory_forms_update_the_weights(subset_file, form, load_format):
    path, subset = subset_file
    async with serve(load_tiny()) as (http, rt), sender(form, "file_system", path) as entry:
        before, _ = await _ids(http)
        body = {"serialized_named_tensors": [entry], "flush_cache": False, "weight_version": f"shm-{form}"}
        if load_format is not None or form == "local":
            body["load_format"] = load_format
        r = await http.post("/update_weights_from_tensor", json=body)
        got = await r.json()
        assert r.status == 200, got
        assert got["success"] is True and got["weight_version"] == f"shm-{form}"
        assert f"loaded {len(subset)} tensors" in got["message"]
        from safetensors.torch import load_file
        order = list(load_file(str(path)))         # bytes_bucket sends every other tensor as bf16
        for name in ("model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
            want = subset[name][:2]
            if form == "bytes_bucket" and order.index(name) % 2:
                want = want.bfloat16().float()
            now = await (await http.post("/get_weights_by_name", json={"name": name, "truncate_size": 2})).json()
            assert now == want.tolist(), name
        after, meta = await _ids(http)
        assert after != before and meta["weight_version"] == f"shm-{form}"
        await settle(rt)
        assert check(rt.recorder.events()).ok


async def test_shared_memory_forms_refuse_what_is_not_a_tensor(subset_file, tmp_path):
    path, _ = subset_file
    marker = tmp_path / "evil"
    async with serve(load_tiny()) as (http, rt):
        before, _ = await _ids(http)
        async with sender("evil", "file_system", marker) as entry:
            r = await http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
            got = await r.json()
        assert r.status == 400 and got["success"] is False
        assert_error(got)
        assert "os" in got["message"] and "system" in got["message"] and "not a tensor" in got["message"]
        assert not Path(f"{marker}.pwned").exists()            # nothing the pickle named ran
        async with sender("direct", "file_descriptor", path) as entry:   # torch's default strategy
            r = await http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
            got = await r.json()
        assert r.status == 400 and "file_system" in got["message"], got
        async with sender("direct", "file_system", path) as entry:       # one entry per rank: one rank
            r = await http.post("/update_weights_from_tensor",
                                json={"serialized_named_tensors": [entry, entry], "load_format": "direct"})
            got = await r.json()
            assert r.status == 400 and "one per tensor-parallel rank" in got["message"], got
            r = await http.post("/update_weights_from_tensor",      # a bucket is not a list of pairs
                                json={"serialized_named_tensors": [entry], "load_format": "flattened_bucket"})
            got = await r.json()
            assert r.status == 400 and "flattened_bucket" in got["message"], got
        import base64
        r = await http.post("/update_weights_from_tensor", json={    # not a pickle at all
            "serialized_named_tensors": [base64.b64encode(b"hello").decode()], "load_format": "direct"})
        got = await r.json()
        assert r.status == 400 and got["error"]["param"] == "serialized_named_tensors.0", got
        r = await http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [base64.b64encode(b"x").decode()], "load_format": "torch_pickle"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "load_format"
        after, meta = await _ids(http)
        assert after == before and meta["weight_version"] == "default"
        await settle(rt)
        assert check(rt.recorder.events()).ok


def test_shared_memory_forms_only_from_this_host():
    from types import SimpleNamespace

    from actorserve.http.edge.errors import APIError
    from actorserve.http.native.weights_routes import UpdateFromTensorBody, _blobs
    body = UpdateFromTensorBody.model_validate({"serialized_named_tensors": ["gAQ="]})
    assert _blobs(body, SimpleNamespace(remote="127.0.0.1")) == (b"\x80\x04",)
    assert _blobs(body, SimpleNamespace(remote="::1")) == (b"\x80\x04",)
    for remote in ("10.1.2.3", None, "not-an-ip"):
        with pytest.raises(APIError) as err:
            _blobs(body, SimpleNamespace(remote=remote))
        assert err.value.param == "load_format" and "same host" in str(err.value)
