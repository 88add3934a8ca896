"""Prometheus metrics, one `CollectorRegistry` per app (so tests and apps never share state).

What is exported, and under which names, is `metric_names.TABLE` in the scheme that
``--metrics-names`` picks (actorserve, vllm or sglang); this module feeds that table:

* sampled at scrape time by a custom collector (so never stale): from the generation
  scheduler's `SchedulerStats` (running / queued requests, KV usage, the prefix cache's hit rate
  and its query / hit counters in tokens, preemptions, step isolations), from the server
  snapshot (paused, requests shed), and per pooling engine (label ``engine``) its running /
  queued requests and model steps;
* observed per request by `RequestTimer` as its outputs stream: time to first token, inter-token
  latency and end-to-end latency, measured here at the edge as a client sees them; token
  counters and length histograms; requests by kind and finish reason; and the time the request
  spent queued, in prefill and in decode, which are not measured here: its lifecycle measured
  them (the finished output's `RequestOutput.timings`, its seconds per state).

Every sample has ``model_name``: the served model for generation (and for the pooling requests
the generation model serves), a pooling engine's model name for its own requests.

`/metrics` answers in the text exposition format.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ...messages import RequestOutput
from .metric_names import TABLE, Exported, exported

# Sampled metrics: feed -> its value from (generation stats, server snapshot, gen_throughput).
_FROM_STATS: dict[str, Callable[[Any, Any, float], float]] = {
    "num_requests_running": lambda st, snap, tput: st.running,
    "num_requests_waiting": lambda st, snap, tput: st.waiting,
    "kv_cache_usage_perc": lambda st, snap, tput: st.kv_usage,
    "prefix_cache_hit_rate": lambda st, snap, tput: st.prefix_hit_rate,
    "prefix_cache_queries": lambda st, snap, tput: st.prefix_queries,
    "prefix_cache_hits": lambda st, snap, tput: st.prefix_hits,
    "num_preemptions": lambda st, snap, tput: st.preemptions,
    "pause_retractions": lambda st, snap, tput: st.pause_retractions,
    "spec_decode_num_drafts": lambda st, snap, tput: st.spec_steps,
    "spec_decode_num_draft_tokens": lambda st, snap, tput: st.spec_draft_tokens,
    "spec_decode_num_accepted_tokens": lambda st, snap, tput: st.spec_accepted_tokens,
    "gen_throughput": lambda st, snap, tput: tput,
    "server_paused": lambda st, snap, tput: 1.0 if snap.paused else 0.0,
    "requests_shed": lambda st, snap, tput: snap.shed,
    "step_isolations": lambda st, snap, tput: st.isolations,
    "isolated_failures": lambda st, snap, tput: st.isolated_failures,
    "queue_timeouts": lambda st, snap, tput: st.queue_timeouts,
    "lora_adapters_loaded": lambda st, snap, tput: st.loras_loaded,
}
# Sampled with a label beside model_name: feed -> [(label value, value)] from the stats.
_FROM_STATS_LABELLED: dict[str, Callable[[Any], list[tuple[str, float]]]] = {
    "preemptions_by_priority": lambda st: [(str(p), n) for p, n in st.preempted_by_priority],
    "lora_requests": lambda st: list(st.lora_requests),
}
# Sampled per pooling engine: feed -> the `SchedulerStats` field.
_FROM_POOL = {"pool_num_requests_running": "running", "pool_num_requests_waiting": "waiting",
              "pool_steps": "steps"}
# Observed by `RequestTimer`.
OBSERVED = frozenset({
    "prompt_tokens", "generation_tokens", "cached_tokens", "requests", "aborted_requests",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
    "priority_queue_time_seconds",
})
_unfed = {m.feed for m in TABLE} - _FROM_STATS.keys() - _FROM_STATS_LABELLED.keys() - _FROM_POOL.keys() - OBSERVED
assert not _unfed, f"metrics in the table that nothing feeds: {sorted(_unfed)}"
ABORTED = ("abort", "timeout")        # finish reasons SGLang's num_aborted_requests counts


def _family(ex: Exported) -> GaugeMetricFamily | CounterMetricFamily:
    cls = CounterMetricFamily if ex.metric.type == "counter" else GaugeMetricFamily
    return cls(ex.name, ex.metric.doc, labels=list(ex.label_names))


class _Sampled(Collector):
    def __init__(self, m: "Metrics", metrics: list[Exported]) -> None:
        self.m = m
        self.stats = [ex for ex in metrics if ex.metric.feed in _FROM_STATS]
        self.pooled = [ex for ex in metrics if ex.metric.feed in _FROM_POOL]
        self.labelled = [ex for ex in metrics if ex.metric.feed in _FROM_STATS_LABELLED]
        self._t_last = time.monotonic()
        self._tokens_last = 0

    def _throughput(self, generated: int) -> float:
        """Tokens generated per second since the previous scrape (SGLang's gen_throughput is
        over its last logging interval; a scrape is ours)."""
        now = time.monotonic()
        dt, self._t_last = now - self._t_last, now
        tokens, self._tokens_last = generated - self._tokens_last, generated
        return tokens / dt if dt > 0 else 0.0

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        m = self.m
        st, snap = m.stats(), m.snapshot()
        tput = self._throughput(st.generated_tokens)
        for ex in self.stats:
            fam = _family(ex)
            fam.add_metric([m.model_name], _FROM_STATS[ex.metric.feed](st, snap, tput))
            yield fam
        for ex in self.labelled:
            fam = _family(ex)
            for label, value in _FROM_STATS_LABELLED[ex.metric.feed](st):
                fam.add_metric([m.model_name, label], value)
            yield fam
        pools = m.pool_stats() if m.pool_stats is not None else {}
        if not pools:
            return
        for ex in self.pooled:
            fam = _family(ex)
            field = _FROM_POOL[ex.metric.feed]
            for target, ps in sorted(pools.items()):
                fam.add_metric([m.pool_names.get(target, target), target], getattr(ps, field))
            yield fam

    def describe(self) -> list[Any]:
        return []


class Metrics:
    def __init__(self, stats: Callable[[], Any], snapshot: Callable[[], Any],
                 pool_stats: Callable[[], dict[str, Any]] | None = None, *, model_name: str = "",
                 scheme: str = "actorserve", pool_names: dict[str, str] | None = None) -> None:
        self.stats, self.snapshot, self.pool_stats = stats, snapshot, pool_stats
        self.model_name = model_name
        self.pool_names = dict(pool_names or {})      # pooling target -> its model's name
        self.scheme = scheme
        self.registry = CollectorRegistry(auto_describe=True)
        metrics = exported(scheme)
        # feed -> [(instrument, which of the feed's labels it keeps, is a counter)]
        self._fed: dict[str, list[tuple[Any, tuple[bool, ...], bool]]] = {}
        for ex in metrics:
            if ex.metric.feed not in OBSERVED:
                continue
            counter = ex.metric.type == "counter"
            kw = {} if counter else {"buckets": ex.metric.buckets}
            inst = (Counter if counter else Histogram)(ex.name, ex.metric.doc, list(ex.label_names),
                                                       registry=self.registry, **kw)
            if len(ex.label_names) == 1:
                inst.labels(model_name)                # exported at 0 from the start, as vLLM does
            keep = tuple(n is not None for n in ex.labels)
            self._fed.setdefault(ex.metric.feed, []).append((inst, keep, counter))
        self.registry.register(_Sampled(self, metrics))

    def observe(self, feed: str, value: float, model: str, labels: tuple[str, ...] = ()) -> None:
        """One observation (a histogram) or increment (a counter) of `feed`, into every metric
        it feeds in this scheme (none: the scheme does not export it)."""
        for inst, keep, counter in self._fed.get(feed, ()):
            child = inst.labels(model, *(v for v, k in zip(labels, keep) if k))
            if counter:
                child.inc(value)
            else:
                child.observe(value)

    def timer(self, kind: str, *, model: str | None = None, generates: bool = True,
              priority: int = 0) -> "RequestTimer":
        """A timer for one request of `kind` on `model` (default: the served model);
        ``generates=False`` for pooling requests (no generation length, no decode time);
        ``priority``: the request's, which labels its queue time by priority."""
        timer = RequestTimer(self, kind, self.model_name if model is None else model, generates)
        timer.priority = priority
        return timer

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's output stream: first token, gaps between tokens, the end."""

    __slots__ = ("m", "kind", "model", "generates", "t0", "t_last", "first", "done", "priority")

    def __init__(self, metrics: Metrics, kind: str, model: str, generates: bool = True) -> None:
        self.m = metrics
        self.kind = kind
        self.model = model
        self.generates = generates
        self.t0 = time.perf_counter()
        self.t_last = self.t0
        self.first = True
        self.done = False
        self.priority = 0

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        n = len(out.token_ids)
        if n:
            if self.first:
                self.m.observe("time_to_first_token_seconds", now - self.t0, self.model)
                self.first = False
            else:
                self.m.observe("inter_token_latency_seconds", (now - self.t_last) / n, self.model)
            self.t_last = now
        if out.finished and not self.done:
            self.done = True
            self._finished(out, now)

    def _finished(self, out: RequestOutput, now: float) -> None:
        m, model = self.m, self.model
        reason = out.finish_reason or "unknown"
        m.observe("e2e_request_latency_seconds", now - self.t0, model)
        m.observe("requests", 1, model, (self.kind, reason))
        if reason in ABORTED:
            m.observe("aborted_requests", 1, model)
        m.observe("prompt_tokens", out.prompt_tokens, model)
        m.observe("request_prompt_tokens", out.prompt_tokens, model)
        m.observe("cached_tokens", out.cached_tokens, model)
        if self.generates:
            m.observe("generation_tokens", out.completion_tokens, model)
            m.observe("request_generation_tokens", out.completion_tokens, model)
        t = out.timings                # the lifecycle's seconds per state (a request with a result)
        if t is None:
            return
        prefill = t.get("prefill", 0.0) if self.generates else t.get("forward", 0.0)
        decode = t.get("decode", 0.0)
        m.observe("request_queue_time_seconds", t.get("queued", 0.0), model)
        m.observe("priority_queue_time_seconds", t.get("queued", 0.0), model, (str(self.priority),))
        m.observe("request_prefill_time_seconds", prefill, model)
        if self.generates:
            m.observe("request_decode_time_seconds", decode, model)
        m.observe("request_inference_time_seconds", prefill + (decode if self.generates else 0.0), model)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


async def metrics_handler(request: web.Request) -> web.Response:
    from .state import CTX
    body = request.app[CTX].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
