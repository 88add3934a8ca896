"""RL frameworks' weight-update sequences, played with their own request bodies (read from
their sources): AReaL's rollout loop (pause_generation with no body, update_weights_from_disk
with its `abort_all_request` spelling, continue_generation, and each aborted rollout resubmitted
with input_ids + output_ids and a smaller max_new_tokens) and slime's tensor refit (pause `{}`,
flush_cache until 200, update_weights_from_tensor `flush_cache: false` + `weight_version`,
continue)."""

from __future__ import annotations

import asyncio
import io
import json

from actorserve.replay.check import check

from http_support import load_tiny, serve, settle
from test_http_control import Stall
from test_weights import _safetensors_b64, folders  # noqa: F401  (the fixture)
from waiting import until
from actor_access import actor_of

PROMPTS = [[5 + (7 * i + j) % 300 for j in range(12 + 3 * i)] for i in range(4)]


async def areal_generate(http, input_ids: list[int], max_new_tokens: int, segments: list) -> list[int]:
    """AReaL's `RemoteSGLangEngine.agenerate` loop, its payload as it sends it (greedy)."""
    sample_params = {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": max_new_tokens,
                     "temperature": 0.0, "stop_token_ids": [], "frequency_penalty": 0.0}
    payload = {"input_ids": list(input_ids), "image_data": None, "sampling_params": sample_params,
               "return_logprob": True, "stream": False}
    tokens: list[int] = []
    stop_reason = None
    for _ in range(50):                          # bounded: AReaL loops until stop or length
        if stop_reason in ("stop", "tool_calls", "length") or len(tokens) >= max_new_tokens:
            break
        r = await http.post("/generate", json=payload)
        assert r.status == 200, await r.text()
        meta = (await r.json())["meta_info"]
        stop_reason = meta["finish_reason"]["type"]
        out = [x[1] for x in meta["output_token_logprobs"]]
        assert all(isinstance(x[0], float) for x in meta["output_token_logprobs"])   # logprobs too
        segments.append((stop_reason, len(out), meta["weight_version"], list(payload["input_ids"])))
        tokens.extend(out)
        payload["input_ids"] += out
        sample_params["max_new_tokens"] -= len(out)
    else:
        raise AssertionError("the rollout never finished")
    return tokens


async def test_areal_disk_update_sequence_resumes_each_rollout_under_the_new_weights(folders):  # noqa: F811
    new, _ = folders
    async with serve(load_tiny()) as (http, rt):
        stall = Stall(rt.engine)
        segments: list[list] = [[] for _ in PROMPTS]
        rollouts = [asyncio.ensure_future(areal_generate(http, p, 40, segments[i])) for i, p in enumerate(PROMPTS)]

        def all_started() -> bool:              # every rollout has tokens out: then hold a step
            seqs = list(actor_of(rt, "scheduler").seqs.values())
            if len(seqs) == len(PROMPTS) and all(len(s.output_ids) >= 2 for s in seqs):
                stall.armed = True
            return stall.armed
        await until(all_started, timeout=60, poll=0.002)
        assert await asyncio.to_thread(stall.started.wait, 30)
        pause = asyncio.ensure_future(http.post("/pause_generation"))      # AReaL sends no body
        await until(lambda: actor_of(rt, "scheduler").state.name != "running", timeout=30)
        stall.release()
        r = await pause
        assert r.status == 200, await r.text()
        r = await http.post("/update_weights_from_disk", json=dict(model_path=str(new), abort_all_request=True))
        body = await r.json()
        assert r.status == 200 and body["success"] is True, body
        r = await http.post("/continue_generation")
        assert r.status == 200, await r.text()
        results = await asyncio.wait_for(asyncio.gather(*rollouts), 120)
        for prompt, tokens, segs in zip(PROMPTS, results, segments):
            first = segs[0]
            assert first[0] == "abort" and first[1] >= 2, segs          # the partial output came back
            assert segs[-1][0] in ("stop", "length") and len(tokens) <= 40
            assert sum(s[1] for s in segs) == len(tokens)
            resumed = segs[1]                                        # under the new weights: as a
            fresh = await http.post("/generate", json={              # fresh request from there
                "input_ids": resumed[3], "sampling_params": {"max_new_tokens": resumed[1], "temperature": 0}})
            assert (await fresh.json())["output_ids"] == tokens[first[1]:first[1] + resumed[1]]
        await settle(rt)
        assert check(rt.recorder.events()).ok


async def test_slime_tensor_refit_sequence(folders):  # noqa: F811
    import torch
    from transformers import AutoModelForCausalLM
    new, _ = folders
    ref = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32, local_files_only=True)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    names = sorted(state)
    buckets = [names[i:i + 8] for i in range(0, len(names), 8)]
    async with serve(load_tiny()) as (http, rt):
        before = await (await http.post("/generate", json={
            "input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}})).json()
        r = await http.post("/pause_generation", json={})
        assert r.status == 200, await r.text()
        for _ in range(60):                                  # slime retries flush_cache until 200
            r = await http.post("/flush_cache")
            if r.status == 200:
                break
        assert r.status == 200, await r.text()
        for bucket in buckets:
            payload = json.dumps({                           # a large body: streamed, not raw bytes
                "serialized_named_tensors": [_safetensors_b64({k: state[k] for k in bucket})],
                "load_format": "safetensors", "flush_cache": False, "weight_version": "3"}).encode()
            r = await http.post("/update_weights_from_tensor", data=io.BytesIO(payload),
                                headers={"Content-Type": "application/json"})
            body = await r.json()
            assert r.status == 200 and body["success"] is True, body
        r = await http.post("/continue_generation", json={})
        assert r.status == 200
        after = await (await http.post("/generate", json={
            "input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}})).json()
        assert after["meta_info"]["weight_version"] == "3" and after["output_ids"] != before["output_ids"]
    from actorserve.engine.weights.models import load_model
    from actorserve.engine.text.tokenizer import TextTokenizer
    from actorserve.http.edge.server import FALLBACK_CHAT_TEMPLATE
    model, hf_tok, _ = load_model(str(new), threads=1)                 # a fresh server on those weights
    async with serve((model, hf_tok, TextTokenizer(hf_tok, chat_template=FALLBACK_CHAT_TEMPLATE))) as (http, rt):
        fresh = await (await http.post("/generate", json={
            "input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}})).json()
        assert fresh["output_ids"] == after["output_ids"]
        await settle(rt)
