"""Logprobs on the wire, field by field as SGLang's ``/generate`` and vLLM's OpenAI extras give
them, over the tiny model, checked against an independent HF forward; and re-execution of a
recording whose requests asked for prompt logprobs."""

from __future__ import annotations

import json

import pytest
import torch

from actorserve.actors.runtime import Runtime
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.engine.runners.runner import build_engine
from actorserve.messages import ContinueGeneration, PauseGeneration
from actorserve.replay.check import check
from actorserve.replay.recorder import FlightRecorder, read_recording
from actorserve.replay.reexec import reexecute, steps_of
from actorserve.statemachines import LIFECYCLES

from http_support import load_tiny, serve, settle

TEXT = "the quick brown fox jumps over the lazy dog and then it runs far away into the woods at night"


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def ids(tiny):
    return tiny[1].encode(TEXT)


@pytest.fixture(scope="module")
def ref(tiny, ids):
    """log_softmax at every prompt position, from the plain HF forward."""
    with torch.inference_mode():
        return torch.log_softmax(tiny[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def tok(tiny, t: int) -> str:
    return tiny[2].decode([t], skip_special_tokens=False)


async def post(http, path: str, body: dict, status: int = 200) -> dict:
    r = await http.post(path, json=body)
    data = await r.json()
    assert r.status == status, data
    return data


def generate(ids, **kw) -> dict:
    return {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            **kw}


# -- SGLang /generate ----------------------------------------------------------------------------


async def test_generate_input_and_output_logprobs(tiny, ids, ref):
    async with serve(tiny) as (http, rt):
        r = await post(http, "/generate", generate(ids, logprob_start_len=0, top_logprobs_num=3,
                                                   return_text_in_logprobs=True))
        await settle(rt)
    m = r["meta_info"]
    inp, top = m["input_token_logprobs"], m["input_top_logprobs"]
    assert len(inp) == len(top) == m["prompt_tokens"] == len(ids)
    assert inp[0] == [None, ids[0], tok(tiny, ids[0])] and top[0] is None      # the first: unscored
    assert [e[1] for e in inp] == ids and [e[2] for e in inp] == [tok(tiny, t) for t in ids]
    want = [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert [e[0] for e in inp[1:]] == pytest.approx(want, abs=1e-4)
    for p in range(1, len(ids)):
        assert len(top[p]) == 3 and [e[1] for e in top[p]] == ref[p - 1].topk(3).indices.tolist()
        vals = [e[0] for e in top[p]]
        assert vals == sorted(vals, reverse=True) and vals[0] >= inp[p][0]
    out, out_top = m["output_token_logprobs"], m["output_top_logprobs"]
    assert [e[1] for e in out] == r["output_ids"] and len(out) == len(out_top) == 4
    for e, t in zip(out, out_top):         # greedy: the chosen token is the most likely one
        assert len(t) == 3 and e[0] == pytest.approx(t[0][0]) and e[1] == t[0][1] and e[2] == tok(tiny, e[1])
    assert out[0][0] == pytest.approx(float(ref[-1].max()), abs=1e-4)


async def test_logprob_start_len_slices_and_default(tiny, ids, ref):
    async with serve(tiny) as (http, rt):
        whole = (await post(http, "/generate", generate(ids, logprob_start_len=0)))["meta_info"]
        part = (await post(http, "/generate", generate(ids, logprob_start_len=7)))["meta_info"]
        default = (await post(http, "/generate", generate(ids, top_logprobs_num=2, token_ids_logprob=[5])))
        off = await post(http, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        await settle(rt)
    assert part["prompt_tokens"] == 7 + len(part["input_token_logprobs"])       # SGLang's invariant
    assert part["input_token_logprobs"][0] == [None, ids[7], None]
    assert [e[0] for e in part["input_token_logprobs"][1:]] == pytest.approx(
        [e[0] for e in whole["input_token_logprobs"][8:]], abs=1e-5)
    assert "input_top_logprobs" not in whole                                    # top_logprobs_num 0
    m = default["meta_info"]                 # -1: the output only, the prompt's last token unscored
    assert m["input_token_logprobs"] == [[None, ids[-1], None]]
    assert m["input_top_logprobs"] == [None] and m["input_token_ids_logprobs"] == [None]
    assert [len(t) for t in m["output_top_logprobs"]] == [2] * 4
    assert [[e[1] for e in t] for t in m["output_token_ids_logprobs"]] == [[5]] * 4
    assert m["output_token_ids_logprobs"][0][0][0] == pytest.approx(float(ref[-1, 5]), abs=1e-4)
    assert not any(k.endswith("logprobs") for k in off["meta_info"])            # return_logprob false


async def test_token_ids_logprob_and_per_input_values(tiny, ids, ref):
    async with serve(tiny) as (http, rt):
        r = await post(http, "/generate", generate(ids, logprob_start_len=0, token_ids_logprob=[5, 7]))
        batch = await post(http, "/generate", {
            "input_ids": [ids, ids[:6]], "return_logprob": [True, False], "logprob_start_len": [3, -1],
            "top_logprobs_num": [1, 0], "token_ids_logprob": [[9], [9]], "sampling_params": {"max_new_tokens": 2}})
        await settle(rt)
    got = r["meta_info"]["input_token_ids_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        assert [e[1] for e in got[p]] == [5, 7]
        assert [e[0] for e in got[p]] == pytest.approx(ref[p - 1, [5, 7]].tolist(), abs=1e-4)
    first, second = (b["meta_info"] for b in batch)
    assert len(first["input_token_logprobs"]) == len(ids) - 3 and len(first["input_top_logprobs"][1]) == 1
    assert "input_token_logprobs" not in second


async def test_warm_prefix_cache_gives_the_cold_numbers(tiny, ids):
    async with serve(tiny) as (http, rt):
        cold = await post(http, "/generate", generate(ids, logprob_start_len=0, top_logprobs_num=2))
        await post(http, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
        warm = await post(http, "/generate", generate(ids, logprob_start_len=0, top_logprobs_num=2))
        part = await post(http, "/generate", generate(ids, logprob_start_len=17))
        await settle(rt)
    assert cold["meta_info"]["cached_tokens"] == warm["meta_info"]["cached_tokens"] == 0
    assert part["meta_info"]["cached_tokens"] == 16            # one block below position 17
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs"):
        a, b = cold["meta_info"][key], warm["meta_info"][key]
        assert json.dumps(a) == json.dumps(b) or a == pytest.approx(b), key
    assert [e[0] for e in part["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(
        [e[0] for e in cold["meta_info"]["input_token_logprobs"][18:]], abs=1e-5)


async def test_generate_stream_is_cumulative_and_ends_as_the_whole(tiny, ids):
    body = generate(ids, logprob_start_len=2, top_logprobs_num=2, return_text_in_logprobs=True)
    async with serve(tiny) as (http, rt):
        whole = await post(http, "/generate", body)
        r = await http.post("/generate", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        await settle(rt)
    outs = [len(e["meta_info"]["output_token_logprobs"]) for e in events]
    assert outs == sorted(outs) and outs[-1] == 4
    assert all(e["meta_info"]["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"] for e in events)
    last = events[-1]["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs", "input_top_logprobs"):
        assert last[key] == whole["meta_info"][key], key


async def test_generate_refuses_bad_values(tiny, ids):
    vocab = tiny[2].vocab_size
    cases = [({"top_logprobs_num": -1}, "top_logprobs_num"), ({"top_logprobs_num": 21}, "top_logprobs_num"),
             ({"logprob_start_len": len(ids)}, "logprob_start_len"), ({"logprob_start_len": -2}, "logprob_start_len"),
             ({"token_ids_logprob": [vocab]}, "token_ids_logprob.0"),
             ({"return_logprob": [True, True]}, "return_logprob")]
    async with serve(tiny) as (http, rt):
        for extra, param in cases:
            err = (await post(http, "/generate", generate(ids, **extra), 400))["error"]
            assert err["param"] == param, (extra, err)
        await settle(rt)


# -- vLLM / OpenAI -------------------------------------------------------------------------------


async def test_completions_prompt_logprobs_and_echo(tiny, ids, ref):
    prompt = tiny[2].decode(ids, skip_special_tokens=False)      # vLLM echoes a token prompt's specials
    async with serve(tiny) as (http, rt):
        r = await post(http, "/v1/completions", {"prompt": ids, "max_tokens": 3, "temperature": 0,
                                                 "prompt_logprobs": 2})
        e = await post(http, "/v1/completions", {"prompt": ids, "max_tokens": 3, "temperature": 0,
                                                 "echo": True, "logprobs": 1})
        await settle(rt)
    pl = r["choices"][0]["prompt_logprobs"]
    assert r["choices"][0]["logprobs"] is None and len(pl) == len(ids) and pl[0] is None
    for p in range(1, len(ids)):
        entry = pl[p]
        first, *rest = entry.items()                    # the prompt token first, then the top k
        assert first[0] == str(ids[p]) and first[1]["decoded_token"] == tok(tiny, ids[p])
        assert first[1]["logprob"] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        assert first[1]["rank"] == int((ref[p - 1] >= ref[p - 1, ids[p]]).sum())
        top = ref[p - 1].topk(2).indices.tolist()
        assert {int(k): v["rank"] for k, v in entry.items() if int(k) in top} == {top[0]: 1, top[1]: 2}
        assert len(entry) == 2 + (ids[p] not in top)
    choice = e["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt) and len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(
        [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))], abs=1e-4)
    offs = lp["text_offset"]
    assert offs == sorted(offs) and offs[len(ids)] == len(prompt)
    ends = offs[1:] + [len(choice["text"])]
    spans = list(zip(offs, ends, lp["tokens"]))
    assert [choice["text"][a:b].strip() for a, b, _ in spans] == [t.strip() for *_, t in spans]
    assert choice["text"][offs[0]:offs[1]] == tok(tiny, ids[0])   # the BOS is echoed and has its text
    assert [len(t) for t in lp["top_logprobs"][len(ids):]] == [1] * 3     # greedy: chosen = top 1
    assert len(choice["prompt_logprobs"]) == len(ids)          # echo with logprobs: vLLM sets them


async def test_completions_echo_stream_matches_the_whole(tiny, ids):
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    async with serve(tiny) as (http, rt):
        whole = (await post(http, "/v1/completions", body))["choices"][0]["logprobs"]
        r = await http.post("/v1/completions", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        await settle(rt)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == whole[key], key


async def test_completions_logprobs_zero_gives_the_chosen_token(tiny, ids):
    async with serve(tiny) as (http, rt):
        r = await post(http, "/v1/completions", {"prompt": ids, "max_tokens": 3, "logprobs": 0, "seed": 3})
        await settle(rt)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3
    for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {t: v}                  # OpenAI / vLLM: the sampled token, no others


async def test_chat_prompt_logprobs(tiny, ref):
    msgs = [{"role": "user", "content": "hello there"}]
    prompt_ids = tiny[2].apply_chat_template(msgs)
    async with serve(tiny) as (http, rt):
        r = await post(http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "prompt_logprobs": 0,
                                                      "n": 2, "seed": 1})
        await settle(rt)
    pl = r["prompt_logprobs"]                  # vLLM: top level, for the one prompt of every choice
    assert len(pl) == len(prompt_ids) and pl[0] is None
    assert all(list(d) == [str(t)] for d, t in zip(pl[1:], prompt_ids[1:]))   # 0: the token's own
    assert "prompt_logprobs" not in r["choices"][0]


async def test_openai_routes_refuse_bad_values(tiny):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}),
             ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}),
             ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}),
             ("/v1/chat/completions", {"messages": msgs, "prompt_logprobs": 21}),
             ("/v1/chat/completions", {"messages": msgs, "prompt_logprobs": 0, "stream": True})]
    async with serve(tiny) as (http, rt):
        for path, body in cases:
            err = (await post(http, path, body, 400))["error"]
            assert err["param"] == "prompt_logprobs", (path, body, err)
        await settle(rt)


# -- re-execution ----------------------------------------------------------------------------------


async def test_a_recording_with_prompt_logprobs_reexecutes_exactly(tiny, ids, tmp_path):
    """Prompt-logprob requests change the batches (no prefix-cache hit below their start, chunked
    prefill of the whole prompt): re-execution follows the same rule from the recorded params."""
    path = tmp_path / "lp.jsonl"
    engine = build_engine(tiny[0], num_blocks=64, block_size=16, tokenizer=tiny[1])
    rt = Runtime(engine, config=SchedulerConfig(batch=BatchConfig(max_prefill_chunk=8), step_in_thread=True),
                 recorder=FlightRecorder(path=path, capacity=100_000, lifecycles=LIFECYCLES.values()))
    await rt.start()
    await rt.generate(ids, SamplingParams(max_new_tokens=2)).stream.final()        # warms the cache
    hs = [rt.generate(ids, SamplingParams(max_new_tokens=3, logprobs=True, prompt_logprobs=k,
                                          logprob_start_len=start), rid=f"lp{k}-{start}")
          for k, start in ((2, 0), (0, 17), (1, len(ids) - 1))]
    await rt.control(PauseGeneration("retract"))          # recomputed later: no second delivery
    await rt.control(ContinueGeneration())
    outs = [await h.stream.final() for h in hs]
    await rt.quiesce()
    await rt.shutdown()
    assert [o.prompt_logprobs.start for o in outs] == [0, 17, len(ids) - 1]    # once each, retracted or not
    _, events = read_recording(path)
    assert check(events).ok
    arrivals = {e.rid: e.data for e in events if e.kind == "input" and e.event == "generate"}
    assert arrivals["lp0-17"]["prompt_logprobs"] == 0 and arrivals["lp0-17"]["logprob_start_len"] == 17
    report = await reexecute(events)
    assert report.ok, report.format()
    assert report.drift == 0 and report.fillers == 0
    assert report.steps["scheduler"][0] == len(steps_of(events)["scheduler"])
