"""/metrics parity with vLLM and SGLang: every metric labelled with the model, exact counts after
known requests, the lifecycle's per-state timings, preemptions, prefix-cache counters in tokens,
the vLLM and SGLang naming schemes checked against names copied from their sources, and
--metrics-auth."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.http.edge.metric_names import BY_KEY, TABLE, exported
from actorserve.messages import ContinueGeneration, PauseGeneration
from http_support import NAME, load_tiny, serve, settle, until
from runtime_helpers import assert_nothing_held, make_runtime
from actor_access import actor_of

# Copied from vLLM's sources (name -> type). vllm/v1/metrics/loggers.py, PrometheusStatLogger, at
# commit 005a810bc40faa25b8870fbc8559c3462581eee3, and docs/design/metrics.md ("v1 Metrics") at
# f7e3a0879e633f9924d477b85a3775cb1ae2a2e5 (vllm:inter_token_latency_seconds). Counters are
# family names: prometheus_client exposes vllm:prompt_tokens as vllm:prompt_tokens_total.
VLLM = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_prefix_cache_queries": "counter", "vllm:gpu_prefix_cache_hits": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram", "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram", "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_prefill_token_request_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    # vllm/v1/spec_decode/metrics.py (SpecDecodingProm): the speculative decoding counters
    "vllm:spec_decode_num_drafts": "counter", "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
}
# What vLLM's dashboard queries: examples/online_serving/prometheus_grafana/grafana.json at
# e88892c9080b29aa3dbc1d1096ba719ab0886163 (family names), and what of it actorserve leaves out
# (docs/api.md#metrics says why: no swapping, no CPU cache, n is not one request here).
VLLM_DASHBOARD = {
    "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:time_per_output_token_seconds", "vllm:num_requests_running", "vllm:num_requests_swapped",
    "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds", "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm:request_success", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_max_num_generation_tokens",
}
VLLM_LEFT_OUT = {"vllm:num_requests_swapped", "vllm:cpu_cache_usage_perc",
                 "vllm:request_max_num_generation_tokens"}
# Copied from SGLang's python/sglang/srt/metrics/collector.py at
# 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538 (SchedulerMetricsCollector, TokenizerMetricsCollector);
# a counter declared as "sglang:x_total" is the family "sglang:x".
SGLANG = {
    "sglang:num_running_reqs": "gauge", "sglang:num_used_tokens": "gauge", "sglang:token_usage": "gauge",
    "sglang:gen_throughput": "gauge", "sglang:num_queue_reqs": "gauge", "sglang:cache_hit_rate": "gauge",
    "sglang:max_total_num_tokens": "gauge", "sglang:num_retracted_reqs": "gauge",
    "sglang:num_retracted_requests": "counter", "sglang:queue_time_seconds": "histogram",
    "sglang:prompt_tokens": "counter", "sglang:generation_tokens": "counter",
    "sglang:prompt_tokens_histogram": "histogram", "sglang:generation_tokens_histogram": "histogram",
    "sglang:cached_tokens": "counter", "sglang:num_requests": "counter",
    "sglang:num_aborted_requests": "counter", "sglang:time_to_first_token_seconds": "histogram",
    "sglang:inter_token_latency_seconds": "histogram", "sglang:e2e_request_latency_seconds": "histogram",
    "sglang:num_retractions": "histogram",
}
# What SGLang's dashboard queries: examples/monitoring/grafana/dashboards/json/sglang-dashboard.json
# at bac2cc6711e0342e25d27bbcdef773555ad402eb.
SGLANG_DASHBOARD = {
    "sglang:e2e_request_latency_seconds", "sglang:time_to_first_token_seconds", "sglang:num_running_reqs",
    "sglang:gen_throughput", "sglang:cache_hit_rate", "sglang:num_queue_reqs",
}
SOURCES = {"vllm": VLLM, "sglang": SGLANG}
DASHBOARDS = {"vllm": (VLLM_DASHBOARD, VLLM_LEFT_OUT), "sglang": (SGLANG_DASHBOARD, set())}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


async def scrape(http, **kw) -> dict:
    """The families of `/metrics`, less prometheus_client's ``*_created`` timestamps (which the
    text-format parser reads as gauges of their own)."""
    r = await http.get("/metrics", **kw)
    assert r.status == 200, await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
    return {n: f for n, f in fams.items() if not (n.endswith("_created") and n[:-8] in fams)}


def expected(scheme: str) -> list:
    """What `scheme` exports on a server with no pooling engine."""
    return [ex for ex in exported(scheme) if not ex.metric.feed.startswith("pool_")]


def value(fams: dict, family: str, sample: str | None = None, **labels) -> float:
    """The one sample of `family` named `sample` (default: the family's own) whose labels
    include `labels`; summed over the others' values when several match."""
    want = sample or family
    got = [s.value for s in fams[family].samples
           if s.name == want and all(s.labels.get(k) == v for k, v in labels.items())]
    assert got, (family, want, labels, fams[family].samples)
    return sum(got)


def gen(ids: list[int], n: int) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


# -- the lifecycle's timings (fake engine, manual clock, steps held and released by the test) ----
class Steps:
    """Holds every model step; `run(dt)` lets the actors settle, moves the clock, completes one."""

    def __init__(self, rt, clock) -> None:
        self.rt, self.clock, self.held = rt, clock, []
        actor_of(rt, "scheduler").runner = lambda target, fn, batch, *, wrap: self.held.append((target, fn, batch, wrap))

    async def run(self, dt: float) -> None:
        await self.rt.quiesce()
        self.clock.advance(dt)
        target, fn, batch, wrap = self.held.pop(0)
        target.tell(wrap(fn(batch), None))

    async def drain(self) -> None:
        await self.rt.quiesce()
        while self.held:
            await self.run(0.0)
            await self.rt.quiesce()


async def test_timings_are_the_lifecycles_seconds_per_state():
    rt, _, _, clock = await make_runtime(batch=BatchConfig(max_prefill_chunk=4))
    steps = Steps(rt, clock)
    assert (await rt.control(PauseGeneration("in_place"))).ok
    h = rt.generate(list(range(1, 9)), SamplingParams(max_new_tokens=3))
    await rt.quiesce()
    clock.advance(1.0)                          # queued for a second while paused
    assert (await rt.control(ContinueGeneration())).ok
    await steps.run(0.5)                        # prefill chunk 1 (4 tokens)
    await steps.run(0.25)                       # chunk 2: the first token
    await steps.run(0.25)                       # decode
    await steps.run(0.25)                       # decode: the third token, length
    out = await h.stream.final()
    assert out.finish_reason == "length"
    assert out.timings == {"queued": 1.0, "prefill": 0.75, "decode": 0.5}
    await rt.quiesce()
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_an_aborted_request_has_no_timings_and_pooling_times_its_forward():
    from actorserve.engine.scheduling.params import PoolingParams

    rt, _, _, clock = await make_runtime()
    steps = Steps(rt, clock)
    a = rt.generate([1, 2, 3], SamplingParams(max_new_tokens=5))
    assert (await rt.abort(a.rid)).ok                 # in the held step: it leaves at once
    assert (await a.stream.final()).timings is None
    p = rt.pool([4, 5, 6], PoolingParams())
    await steps.run(0.0)                              # the aborted request's step comes back
    await steps.run(0.125)                            # the pooling forward
    out = await p.stream.final()
    assert out.finish_reason == "stop" and out.timings == {"queued": 0.0, "forward": 0.125}
    await steps.drain()
    assert_nothing_held(rt)
    await rt.shutdown()


async def test_retractions_are_counted_by_cause():
    # KV pressure: the scheduler retracts the youngest; every retraction is one recorded transition
    rt, _, rec, _ = await make_runtime(num_blocks=24, block_size=4)
    hs = [rt.generate([i] * 6, SamplingParams(max_new_tokens=20)) for i in range(1, 9)]
    await asyncio.gather(*(h.stream.final() for h in hs))
    await rt.quiesce()
    retracts = sum(e.event == "retract" and e.ok for e in rec.events(kind="generation"))
    st = rt.stats()
    assert st.preemptions == retracts > 0 and st.pause_retractions == 0
    await rt.shutdown()
    # pause(retract) with two requests running: counted apart, not as preemptions
    rt, _, _, clock = await make_runtime()
    steps = Steps(rt, clock)
    hs = [rt.generate([i, i + 1], SamplingParams(max_new_tokens=4)) for i in (1, 5)]
    await rt.quiesce()
    assert rt.stats().running == 2 and len(steps.held) == 1
    pause = asyncio.ensure_future(rt.control(PauseGeneration("retract")))   # waits for the step
    await steps.run(0.0)
    assert (await pause).ok
    assert (rt.stats().pause_retractions, rt.stats().preemptions) == (2, 0)
    assert (await rt.control(ContinueGeneration())).ok
    await steps.drain()
    assert [(await h.stream.final()).finish_reason for h in hs] == ["length", "length"]
    await rt.shutdown()


# -- over HTTP, the tiny model ---------------------------------------------------------------------
async def test_every_metric_has_the_model_label_and_counts_are_exact(tiny):
    prompts = [[10 + i] + [20 + i] * (4 + 3 * i) for i in range(3)]      # 5, 8, 11 tokens
    max_tokens = [3, 5, 7]
    async with serve(tiny) as (http, rt):
        for ids, n in zip(prompts, max_tokens):
            r = await http.post("/generate", json=gen(ids, n))
            assert r.status == 200, await r.text()
        await settle(rt)
        fams = await scrape(http)
    assert set(fams) == {ex.name for ex in expected("actorserve")}
    for fam in fams.values():
        for s in fam.samples:
            assert s.labels.get("model_name") == NAME, (fam.name, s)
    sent, made = sum(map(len, prompts)), sum(max_tokens)
    assert value(fams, "actorserve_prompt_tokens", "actorserve_prompt_tokens_total") == sent
    assert value(fams, "actorserve_generation_tokens", "actorserve_generation_tokens_total") == made
    assert value(fams, "actorserve_request_prompt_tokens", "actorserve_request_prompt_tokens_sum") == sent
    assert value(fams, "actorserve_request_generation_tokens",
                 "actorserve_request_generation_tokens_sum") == made
    assert value(fams, "actorserve_requests", "actorserve_requests_total",
                 kind="generate", finish_reason="length") == 3
    for h in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_prompt_tokens", "request_generation_tokens"):
        assert value(fams, f"actorserve_{h}", f"actorserve_{h}_count") == 3, h
        assert value(fams, f"actorserve_{h}", f"actorserve_{h}_sum") >= 0, h
    # one decode gap per token after the first
    assert value(fams, "actorserve_inter_token_latency_seconds",
                 "actorserve_inter_token_latency_seconds_count") == made - 3
    inference = value(fams, "actorserve_request_inference_time_seconds",
                      "actorserve_request_inference_time_seconds_sum")
    parts = sum(value(fams, f"actorserve_request_{p}_time_seconds", f"actorserve_request_{p}_time_seconds_sum")
                for p in ("prefill", "decode"))
    assert inference == pytest.approx(parts)
    # every prompt looked up once, none shares a full block with another
    assert value(fams, "actorserve_prefix_cache_queries", "actorserve_prefix_cache_queries_total") == sent
    assert value(fams, "actorserve_prefix_cache_hits", "actorserve_prefix_cache_hits_total") == 0
    assert value(fams, "actorserve_num_preemptions", "actorserve_num_preemptions_total") == 0


async def test_a_repeated_prompt_grows_the_prefix_cache_counters_by_its_cached_tokens(tiny):
    ids = [30 + i % 7 for i in range(40)]
    async with serve(tiny, metrics_names="vllm") as (http, rt):
        for _ in range(2):
            r = await http.post("/generate", json=gen(ids, 2))
            assert r.status == 200
        cached = (await r.json())["meta_info"]["cached_tokens"]
        await settle(rt)
        fams = await scrape(http)
    assert cached == 32                                  # 2 full blocks of 16; the last token is computed
    assert value(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 80
    assert value(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 32


async def test_a_forced_retraction_counts_a_preemption(tiny):
    async with serve(tiny, kv_blocks=4, metrics_names="sglang") as (http, rt):   # 4 blocks of 16
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status == 200
        # two requests of 45 tokens need 6 blocks: admitted together, one is retracted to grow
        reqs = [asyncio.ensure_future(http.post("/generate", json=gen([40 + i] * 5, 40))) for i in range(2)]
        await until(lambda: rt.stats().waiting == 2)
        assert (await http.post("/continue_generation", json={})).status == 200
        for r in await asyncio.gather(*reqs):
            assert (await r.json())["meta_info"]["finish_reason"]["type"] == "length"
        await settle(rt)
        fams = await scrape(http)
        retracts = sum(e.event == "retract" and e.ok for e in rt.recorder.events(kind="generation"))
    assert retracts >= 1
    assert value(fams, "sglang:num_retracted_requests", "sglang:num_retracted_requests_total") == retracts
    assert value(fams, "actorserve_pause_retractions", "actorserve_pause_retractions_total") == 0


@pytest.mark.parametrize("scheme", ["vllm", "sglang"])
async def test_a_scheme_exports_its_names_with_their_types(tiny, scheme):
    async with serve(tiny, metrics_names=scheme) as (http, rt):
        r = await http.post("/generate", json=gen([11, 12, 13], 3))
        assert r.status == 200
        await settle(rt)
        fams = await scrape(http)
    source = SOURCES[scheme]
    table = expected(scheme)
    for ex in table:
        assert ex.name in fams, ex.name
        assert fams[ex.name].type == ex.metric.type, ex.name
        if not ex.name.startswith("actorserve_"):   # a scheme name: as the source spells and types it
            assert source.get(ex.name) == ex.metric.type, ex.name
    assert {n for n in fams if not n.startswith("actorserve_")} == {ex.name for ex in table
                                                                    if not ex.name.startswith("actorserve_")}
    queried, left_out = DASHBOARDS[scheme]
    assert queried - left_out <= set(fams) and not left_out & set(fams)
    for fam in fams.values():
        assert all(s.labels.get("model_name") == NAME for s in fam.samples), fam.name
    if scheme == "vllm":
        success = [s for s in fams["vllm:request_success"].samples if s.name.endswith("_total")]
        assert [s.labels for s in success] == [{"model_name": NAME, "finished_reason": "length"}]
        assert value(fams, "vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_count") == 1
    else:
        assert value(fams, "sglang:num_requests", "sglang:num_requests_total") == 1
        assert value(fams, "sglang:num_aborted_requests", "sglang:num_aborted_requests_total") == 0
        assert value(fams, "sglang:queue_time_seconds", "sglang:queue_time_seconds_count") == 1


def test_the_table_names_each_metric_once_per_scheme():
    assert len(BY_KEY) == len(TABLE)
    for scheme in ("actorserve", "vllm", "sglang"):
        names = [ex.name for ex in exported(scheme)]
        assert len(names) == len(set(names)), scheme
    with pytest.raises(ValueError):
        exported("tgi")


@pytest.mark.parametrize("auth", ["required", "open"])
async def test_metrics_auth(tiny, auth):
    key = {"Authorization": "Bearer k"}
    async with serve(tiny, api_key="k", metrics_auth=auth) as (http, rt):
        assert (await http.get("/metrics")).status == (401 if auth == "required" else 200)
        assert (await http.get("/metrics", headers=key)).status == 200
        assert (await http.get("/v1/models")).status == 401          # the rest stays behind the key
        doc = await (await http.get("/openapi.json")).json()
        open_ = doc["paths"]["/metrics"]["get"].get("security") == []
        assert open_ == (auth == "open")
