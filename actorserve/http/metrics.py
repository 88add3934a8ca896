"""Prometheus metrics, one `CollectorRegistry` per app (so tests and apps never share state).

* gauges sampled from ``runtime.stats()`` at scrape time (a custom collector, so they are never
  stale): running / queued requests, KV usage, prefix-cache hit rate, server paused; and per
  pooling engine (label ``engine``, from ``runtime.pool_stats()``): running / queued requests
  and model steps;
* histograms observed by `RequestTimer` as outputs stream: time to first token, inter-token
  latency, end-to-end latency;
* counters: prompt tokens, generation tokens, requests by kind and finish reason.

`/metrics` answers in the text exposition format.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..messages import RequestOutput

PREFIX = "actorserve_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], Any], snapshot: Callable[[], Any],
                 pool_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self._stats = stats
        self._snapshot = snapshot
        self._pool_stats = pool_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self._stats()
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the running batch",
                                value=st.running)
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests queued for admission",
                                value=st.waiting)
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of KV blocks in use",
                                value=st.kv_usage)
        yield GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate", "Prefix-cache hit rate (blocks)",
                                value=st.prefix_hit_rate)
        yield GaugeMetricFamily(PREFIX + "server_paused", "1 while generation is paused",
                                value=1.0 if self._snapshot().paused else 0.0)
        yield CounterMetricFamily(PREFIX + "requests_shed", "Requests refused by admission "
                                  "control (--max-queued-requests): 503 with Retry-After",
                                  value=self._snapshot().shed)
        yield CounterMetricFamily(PREFIX + "step_isolations", "Failed model steps whose members "
                                  "were re-run in halves to find the cause", value=st.isolations)
        yield CounterMetricFamily(PREFIX + "isolated_failures", "Requests failed as the cause of a "
                                  "model step's failure (the others went on)", value=st.isolated_failures)
        pools = self._pool_stats() if self._pool_stats is not None else {}
        if pools:
            running = GaugeMetricFamily(PREFIX + "pool_num_requests_running",
                                        "Pooling requests in a pooling engine's running batch", labels=["engine"])
            waiting = GaugeMetricFamily(PREFIX + "pool_num_requests_waiting",
                                        "Pooling requests queued for a pooling engine", labels=["engine"])
            steps = GaugeMetricFamily(PREFIX + "pool_steps", "Model steps a pooling engine has run",
                                      labels=["engine"])
            for key, ps in sorted(pools.items()):
                running.add_metric([key], ps.running)
                waiting.add_metric([key], ps.waiting)
                steps.add_metric([key], ps.steps)
            yield running
            yield waiting
            yield steps

    def describe(self) -> list[Any]:
        return []


class Metrics:
    def __init__(self, stats: Callable[[], Any], snapshot: Callable[[], Any],
                 pool_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(PREFIX + "requests", "Finished requests",
                                ["kind", "finish_reason"], registry=r)
        r.register(_StatsCollector(stats, snapshot, pool_stats))

    def timer(self, kind: str) -> "RequestTimer":
        return RequestTimer(self, kind)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's output stream: first token, gaps between tokens, the end."""

    __slots__ = ("m", "kind", "t0", "t_last", "first", "done")

    def __init__(self, metrics: Metrics, kind: str) -> None:
        self.m = metrics
        self.kind = kind
        self.t0 = time.perf_counter()
        self.t_last = self.t0
        self.first = True
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        n = len(out.token_ids)
        if n:
            if self.first:
                self.m.ttft.observe(now - self.t0)
                self.first = False
            else:
                self.m.itl.observe((now - self.t_last) / n)
            self.t_last = now
        if out.finished and not self.done:
            self.done = True
            self.m.e2e.observe(now - self.t0)
            self.m.prompt_tokens.inc(out.prompt_tokens)
            self.m.generation_tokens.inc(out.completion_tokens)
            self.m.requests.labels(self.kind, out.finish_reason or "unknown").inc()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


async def metrics_handler(request: web.Request) -> web.Response:
    from .state import CTX
    body = request.app[CTX].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
