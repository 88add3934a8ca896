"""What `/metrics` exports, as one table: each metric once, with its name in every naming scheme.

``--metrics-names actorserve|vllm|sglang`` picks the scheme; `http.edge.metrics` builds the exposition
from this table alone, so the three schemes cannot drift apart. A metric's name in a scheme is
the scheme's own where it has one (so its published Grafana dashboard works unchanged), else the
actorserve name (a metric only actorserve has stays visible whatever the scheme), else the metric
is not exported in that scheme (a name of that scheme only, such as SGLang's
``num_aborted_requests``, or vLLM's deprecated aliases). Every metric carries ``model_name``
(the served model's name; a pooling engine's own name for its requests), as in vLLM and SGLang.

Names are the metric *family* names: a counter's samples end in ``_total``
(``vllm:prompt_tokens`` is exposed as ``vllm:prompt_tokens_total``), a histogram's in
``_bucket``/``_sum``/``_count``. The names, types and label names of the other schemes were read
from their sources (docs/metrics.md has the table and what is left out, and why):

* vLLM: ``vllm/v1/metrics/loggers.py`` (PrometheusStatLogger) at commit 005a810b and
  ``docs/design/metrics.md`` at f7e3a087; the dashboard
  ``examples/online_serving/prometheus_grafana/grafana.json`` at e88892c9;
* SGLang: ``python/sglang/srt/metrics/collector.py`` at 00ae9c15; the dashboard
  ``examples/monitoring/grafana/dashboards/json/sglang-dashboard.json`` at bac2cc67.

Units: seconds for times, tokens for token counts and the prefix-cache counters (tokens looked up
and tokens found, as vLLM counts them), requests for request counts, a fraction in [0, 1] for
usage and hit rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import METRICS_SCHEMES

ACTORSERVE = "actorserve_"
MODEL_LABEL = "model_name"

# One bucket set per kind of quantity (the other schemes' buckets differ from each other; a
# dashboard's histogram_quantile works with any).
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5))   # 1 .. 5e6


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric. `source` is what feeds it (a stats field or an observation; two metrics with
    one source are aliases, fed together); `labels` are its labels beside ``model_name``, and a
    scheme's entry may rename or drop them (`Name.labels`)."""
    key: str
    type: str                       # "gauge" | "counter" | "histogram"
    unit: str
    doc: str
    actorserve: bool = True         # exported under ACTORSERVE + key where no scheme name applies
    vllm: "str | Name | None" = None
    sglang: "str | Name | None" = None
    labels: tuple[str, ...] = ()
    source: str = ""
    buckets: tuple[float, ...] = ()

    @property
    def feed(self) -> str:
        return self.source or self.key


@dataclass(frozen=True, slots=True)
class Name:
    """A scheme's name for a metric with labels: `labels` is the metric's labels as that scheme
    spells them, in the metric's order; None drops one (its values are summed)."""
    name: str
    labels: tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class Exported:
    """A metric as one scheme exports it."""
    metric: Metric
    name: str
    labels: tuple[str | None, ...]      # per metric label: the exported name, or None (dropped)

    @property
    def label_names(self) -> tuple[str, ...]:
        return (MODEL_LABEL, *(n for n in self.labels if n is not None))


_L, _T = LATENCY_BUCKETS, TOKEN_BUCKETS
G, C, H = "gauge", "counter", "histogram"

TABLE: tuple[Metric, ...] = (
    # -- sampled at scrape time from the generation scheduler's stats --------------------------
    Metric("num_requests_running", G, "requests", "Requests in the running batch",
           vllm="vllm:num_requests_running", sglang="sglang:num_running_reqs"),
    Metric("num_requests_waiting", G, "requests", "Requests queued for admission",
           vllm="vllm:num_requests_waiting", sglang="sglang:num_queue_reqs"),
    Metric("kv_cache_usage_perc", G, "fraction", "Fraction of KV blocks in use (0-1)",
           vllm="vllm:kv_cache_usage_perc", sglang="sglang:token_usage"),
    Metric("gpu_cache_usage_perc", G, "fraction", "Fraction of KV blocks in use (0-1); vLLM's "
           "deprecated name, which its example dashboard still queries", actorserve=False,
           vllm="vllm:gpu_cache_usage_perc", source="kv_cache_usage_perc"),
    Metric("prefix_cache_hit_rate", G, "fraction", "Prefix-cache hit rate in tokens since start "
           "or the last flush_cache (hits / queries)", sglang="sglang:cache_hit_rate"),
    Metric("prefix_cache_queries", C, "tokens", "Prefix cache queries, in tokens looked up",
           vllm="vllm:prefix_cache_queries"),
    Metric("prefix_cache_hits", C, "tokens", "Prefix cache hits, in tokens found cached",
           vllm="vllm:prefix_cache_hits"),
    Metric("num_preemptions", C, "requests", "Requests retracted for want of KV blocks (their KV "
           "freed, recomputed later)", vllm="vllm:num_preemptions",
           sglang="sglang:num_retracted_requests"),
    Metric("preemptions_by_priority", C, "requests", "Requests retracted for want of KV blocks or "
           "for a higher-priority arrival (--scheduling-policy priority), by the retracted "
           "request's priority", labels=("priority",)),
    Metric("queue_timeouts", C, "requests", "Requests ended by --max-queue-time while still "
           "queued (503, \"Request waiting timeout reached.\")"),
    Metric("pause_retractions", C, "requests", "Running requests retracted by "
           "pause_generation(mode=retract)"),
    Metric("spec_decode_num_drafts", C, "steps", "Speculative verifications (--speculative): a "
           "request's step that checked drafts", vllm="vllm:spec_decode_num_drafts"),
    Metric("spec_decode_num_draft_tokens", C, "tokens", "Draft tokens proposed and verified",
           vllm="vllm:spec_decode_num_draft_tokens"),
    Metric("spec_decode_num_accepted_tokens", C, "tokens", "Draft tokens the model accepted",
           vllm="vllm:spec_decode_num_accepted_tokens"),
    Metric("gen_throughput", G, "tokens/s", "Generation throughput since the previous scrape "
           "(tokens/s)", actorserve=False, sglang="sglang:gen_throughput"),
    Metric("server_paused", G, "1", "1 while generation is paused"),
    Metric("requests_shed", C, "requests", "Requests refused by admission control "
           "(--max-queued-requests): 503 with Retry-After"),
    Metric("step_isolations", C, "steps", "Failed model steps whose members were re-run in "
           "halves to find the cause"),
    Metric("isolated_failures", C, "requests", "Requests failed as the cause of a model step's "
           "failure (the others went on)"),
    # -- sampled from each pooling engine's scheduler (label engine: its target) ---------------
    Metric("lora_requests", C, "requests", "Requests admitted under each LoRA adapter (since start)",
           labels=("lora_name",)),
    Metric("lora_adapters_loaded", G, "adapters", "LoRA adapters loaded and ready"),
    Metric("pool_num_requests_running", G, "requests", "Pooling requests in a pooling engine's "
           "running batch", labels=("engine",)),
    Metric("pool_num_requests_waiting", G, "requests", "Pooling requests queued for a pooling "
           "engine", labels=("engine",)),
    Metric("pool_steps", G, "steps", "Model steps a pooling engine has run", labels=("engine",)),
    # -- observed per request, at the HTTP edge, from its outputs --------------------------------
    Metric("prompt_tokens", C, "tokens", "Prompt tokens of finished requests",
           vllm="vllm:prompt_tokens", sglang="sglang:prompt_tokens"),
    Metric("generation_tokens", C, "tokens", "Tokens generated by finished requests",
           vllm="vllm:generation_tokens", sglang="sglang:generation_tokens"),
    Metric("cached_tokens", C, "tokens", "Prompt tokens of finished requests found in the "
           "prefix cache", sglang="sglang:cached_tokens"),
    Metric("requests", C, "requests", "Finished requests, by kind and finish reason",
           labels=("kind", "finish_reason"),
           vllm=Name("vllm:request_success", (None, "finished_reason")),
           sglang=Name("sglang:num_requests", (None, None))),
    Metric("aborted_requests", C, "requests", "Requests that ended aborted (abort, timeout)",
           actorserve=False, sglang="sglang:num_aborted_requests"),
    Metric("time_to_first_token_seconds", H, "seconds", "Time to first token", buckets=_L,
           vllm="vllm:time_to_first_token_seconds", sglang="sglang:time_to_first_token_seconds"),
    Metric("inter_token_latency_seconds", H, "seconds", "Time between output tokens", buckets=_L,
           vllm="vllm:inter_token_latency_seconds", sglang="sglang:inter_token_latency_seconds"),
    Metric("time_per_output_token_seconds", H, "seconds", "Time between output tokens; vLLM's "
           "deprecated name, which its example dashboard still queries", actorserve=False,
           vllm="vllm:time_per_output_token_seconds", source="inter_token_latency_seconds",
           buckets=_L),
    Metric("e2e_request_latency_seconds", H, "seconds", "End-to-end request latency", buckets=_L,
           vllm="vllm:e2e_request_latency_seconds", sglang="sglang:e2e_request_latency_seconds"),
    Metric("request_queue_time_seconds", H, "seconds", "Time a request spent queued (its "
           "lifecycle's queued state, requeues after retraction included)", buckets=_L,
           vllm="vllm:request_queue_time_seconds", sglang="sglang:queue_time_seconds"),
    Metric("priority_queue_time_seconds", H, "seconds", "Time a request spent queued, by its "
           "priority (0 unless it asked for another)", buckets=_L, labels=("priority",)),
    Metric("request_prefill_time_seconds", H, "seconds", "Time a request spent in prefill "
           "(pooling: forward)", buckets=_L, vllm="vllm:request_prefill_time_seconds"),
    Metric("request_decode_time_seconds", H, "seconds", "Time a generation request spent in "
           "decode", buckets=_L, vllm="vllm:request_decode_time_seconds"),
    Metric("request_inference_time_seconds", H, "seconds", "Time a request spent in prefill and "
           "decode", buckets=_L, vllm="vllm:request_inference_time_seconds"),
    Metric("request_prompt_tokens", H, "tokens", "Prompt length of finished requests",
           buckets=_T, vllm="vllm:request_prompt_tokens", sglang="sglang:prompt_tokens_histogram"),
    Metric("request_generation_tokens", H, "tokens", "Generation length of finished generation "
           "requests", buckets=_T, vllm="vllm:request_generation_tokens",
           sglang="sglang:generation_tokens_histogram"),
)

BY_KEY: dict[str, Metric] = {m.key: m for m in TABLE}


def exported(scheme: str) -> list[Exported]:
    """The metrics `scheme` exports, with their names there."""
    if scheme not in METRICS_SCHEMES:
        raise ValueError(f"unknown metrics naming scheme {scheme!r}; use one of {METRICS_SCHEMES}")
    out = []
    for m in TABLE:
        own = getattr(m, scheme) if scheme != "actorserve" else None
        if isinstance(own, Name):
            out.append(Exported(m, own.name, own.labels))
        elif own is not None:
            out.append(Exported(m, own, m.labels))
        elif m.actorserve:
            out.append(Exported(m, ACTORSERVE + m.key, m.labels))
    return out
