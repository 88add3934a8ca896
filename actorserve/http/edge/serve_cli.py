"""Serve a model over HTTP (OpenAI-compatible, native and control routes)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from ...config import METRICS_AUTH, METRICS_SCHEMES, ModelConfig, RecorderConfig, SchedulerConfig, ServerConfig
from ...engine.scheduling.batching import SCHEDULING_POLICIES, BatchConfig
from ..openai.reasoning import CHOICES as REASONING_CHOICES, get_format


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default="default", help='"default", "tiny", an HF folder or a .gguf')
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV cache blocks (default: from --kv-memory-gb)")
    p.add_argument("--kv-memory-gb", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="weights and KV cache; auto = bfloat16 where the CPU has AMX/AVX-512 BF16 "
                        "(or the GPU supports it), else float32. Sampling and pooling stay float32")
    p.add_argument("--decode-attention", default="auto", choices=("auto", "inplace", "gather"),
                   help="decode attention: inplace = a C kernel (built on first use) reads the paged "
                        "KV cache where it lies; gather = torch copies each context out, then SDPA; "
                        "auto = inplace where a C compiler can build it")
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "q4", "q4a8"),
                   help="auto (default): the linears whose weights re-quantize exactly to 4-bit "
                        "blocks (a model converted from a GGUF's Q4_1/Q8_0, like the default one) "
                        "decode through C kernels that read those blocks, with the model's own "
                        "arithmetic; other weights, prefill and wide steps stay dense. q4: every "
                        "linear gets the 4-bit copy (exact only for such a GGUF). q4a8: the same "
                        "weights multiplied by activations rounded to 8 bits per 32 (llama.cpp's "
                        "arithmetic): faster, slightly less accurate. none: dense only")
    p.add_argument("--weight-version", default="default",
                   help="the served weights' version, answered as weight_version (SGLang's); "
                        "/update_weights_from_disk and /update_weight_version change it")
    p.add_argument("--lora-paths", "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to load at start-up: NAME=PATH, a bare PATH "
                        "(named by it, SGLang's), or JSON {\"lora_name\", \"lora_path\", \"pinned\"} "
                        "(vLLM's {\"name\", \"path\"} too); requests name one with model: NAME")
    p.add_argument("--max-loras", "--max-loras-per-batch", type=int, default=None, metavar="N",
                   help="distinct LoRA adapters in one step (default: any number); a request under "
                        "another adapter waits for one to leave")
    p.add_argument("--max-loaded-loras", type=int, default=8, metavar="N",
                   help="LoRA adapters held at once (default 8); a load beyond evicts the least "
                        "recently used adapter that is not pinned and not in use")
    p.add_argument("--max-lora-rank", type=int, default=64, metavar="R",
                   help="the largest adapter rank accepted (default 64)")
    p.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM's command lines: adapters are always enabled")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="tokens computed in one step, prefill chunks and decodes together")
    p.add_argument("--max-prefill-chunk", type=int, default=None,
                   help="the largest prefill chunk of one request in one step (SGLang's "
                        "--chunked-prefill-size)")
    p.add_argument("--speculative", default=None, choices=("ngram",),
                   help="speculative decoding without a draft model: n-gram (prompt-lookup) drafts "
                        "verified in one step; greedy requests only, output identical (default: off)")
    p.add_argument("--speculative-tokens", type=int, default=4, metavar="K",
                   help="drafts proposed per step and request (default 4)")
    p.add_argument("--speculative-max-batch", type=int, default=8, metavar="N",
                   help="speculate only while at most N requests decode (default 8: verifying "
                        "costs more than it gains in a full batch)")
    p.add_argument("--record", default=None, metavar="PATH",
                   help="flight-recorder JSONL file; a directory (existing, or ending in /) "
                        "means DIR/<replica id>.jsonl")
    p.add_argument("--recorder-events", type=int, default=100_000, metavar="N",
                   help="events the flight recorder keeps in memory (default 100000)")
    p.add_argument("--recorder-ring-mb", type=float, default=12.0, metavar="MB",
                   help="memory those events may take, taken at start (default 12; the older "
                        "events are kept marshalled, about 60 bytes each)")
    p.add_argument("--replica-id", default=None, metavar="ID",
                   help="this server's name in a fleet, written in the recording's header "
                        "(default with --record DIR: <host>-<pid>)")
    p.add_argument("--embedding-model", default="embed", metavar="PATH",
                   help='encoder for /v1/embeddings: "embed" (the embedded all-MiniLM-L6-v2, default), '
                        'an HF folder, or "none"')
    p.add_argument("--rerank-model", default=None, metavar="PATH",
                   help="cross-encoder (*ForSequenceClassification) folder for /v1/rerank "
                        "(default: decoder-only rerank on the generation model)")
    p.add_argument("--classify-model", default=None, metavar="PATH",
                   help="sequence classifier folder for /v1/classify "
                        "(default: label tokens on the generation model)")
    p.add_argument("--watchdog-timeout", type=float, default=None, metavar="SECONDS",
                   help="mark the server unhealthy when work is pending and no model step "
                        "completes for this long (default: off)")
    p.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="refuse a request (503 with Retry-After) when N already wait for a "
                        "scheduler; health probes are never refused (default: unbounded)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort every request this long after its arrival, finish_reason "
                        "timeout (default: none)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="fcfs (default): arrival order, and a non-zero request priority is a 400 "
                        "(vLLM's answer); priority: the waiting queue by each request's priority "
                        "(a LOWER value first, vLLM's order), then arrival, and a higher-priority "
                        "request may retract a lower-priority running one")
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   help="SGLang's spelling of --scheduling-policy priority, with SGLang's order: a "
                        "HIGHER value first, unless --schedule-low-priority-values-first")
    p.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with --enable-priority-scheduling: a lower value is served first (SGLang's flag)")
    p.add_argument("--max-queue-time", type=float, default=None, metavar="SECONDS",
                   help="end a request still waiting for its first admission this long after its "
                        "arrival: 503 \"Request waiting timeout reached.\" (SGLang's answer; default: off)")
    p.add_argument("--max-queued-tokens", type=int, default=None, metavar="N",
                   help="refuse a request (503 with Retry-After, as --max-queued-requests) whose "
                        "prompt would take the queued prompt tokens past N (default: unbounded)")
    p.add_argument("--debug-routes", action="store_true",
                   help="enable /debug/requests/{rid}, /debug/events (SSE) and /debug/diagram/{kind} "
                        "(behind --api-key when one is set)")
    p.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                   help="how the model writes tool calls (default: chosen from its chat template)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_CHOICES,
                   help="a reasoning model's format: split <think>...</think> out of chat answers "
                        "into reasoning_content (and the Responses API's reasoning items), and "
                        "honour max_thinking_tokens (default: off)")
    p.add_argument("--enable-reasoning", action="store_true",
                   help="accepted for older vLLM / SGLang command lines; --reasoning-parser enables it")
    p.add_argument("--metrics-names", default="actorserve", choices=METRICS_SCHEMES,
                   help="metric names in /metrics: actorserve_* (default), or vLLM's vllm:* or SGLang's "
                        "sglang:*, so their published Grafana dashboards work unchanged")
    p.add_argument("--metrics-auth", default="required", choices=METRICS_AUTH,
                   help="with --api-key: /metrics needs the key like every route (required, the "
                        "default) or is open for a Prometheus scraper without it (open, as vLLM)")
    p.add_argument("--trim-at-rest", type=float, default=2.0, metavar="SECONDS",
                   help="after this long with no request and no step, give the C heap's free pages "
                        "back to the OS (malloc_trim; default 2, 0 = never)")
    p.add_argument("--responses-store", type=int, default=1000, metavar="N",
                   help="/v1/responses: keep at most N ended stored responses (for GET, DELETE and "
                        "previous_response_id); past that the oldest is evicted; 0 stores none")
    p.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="/start_profile's default output directory (a body's output_dir wins; without "
                        "either: SGLANG_TORCH_PROFILER_DIR, else /tmp)")
    p.add_argument("--switch-interval", type=float, default=None, metavar="SECONDS",
                   help="the interpreter's thread switch interval (sys.setswitchinterval): how long "
                        "the model step's thread may wait for the event loop to hand over the GIL "
                        "(default: Python's, 0.005)")
    p.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    batch_kw = {}
    if args.max_num_seqs is not None:
        batch_kw["max_num_seqs"] = args.max_num_seqs
    if args.max_batch_tokens is not None:
        batch_kw["max_batch_tokens"] = args.max_batch_tokens
    if getattr(args, "max_prefill_chunk", None) is not None:
        batch_kw["max_prefill_chunk"] = args.max_prefill_chunk
    if getattr(args, "speculative", None):
        batch_kw.update(speculative=args.speculative, speculative_tokens=args.speculative_tokens,
                        speculative_max_batch=args.speculative_max_batch)
    sglang_priority = bool(getattr(args, "enable_priority_scheduling", False))
    if sglang_priority or getattr(args, "scheduling_policy", "fcfs") == "priority":
        batch_kw["scheduling_policy"] = "priority"
        # vLLM's flag: lower first; SGLang's alone: higher first unless told otherwise
        batch_kw["priority_low_first"] = (getattr(args, "scheduling_policy", "fcfs") == "priority"
                                          or bool(getattr(args, "schedule_low_priority_values_first", False)))
    if getattr(args, "max_loras", None) is not None:
        batch_kw["max_loras"] = args.max_loras
    from ...replay.fleet import recording_path

    record, replica = recording_path(args.record, getattr(args, "replica_id", None))
    return ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key,
        model=ModelConfig(model=args.model, threads=args.threads, kv_blocks=args.kv_blocks,
                          kv_memory_gb=args.kv_memory_gb, block_size=args.block_size,
                          dtype=getattr(args, "dtype", "auto"),
                          decode_attention=getattr(args, "decode_attention", "auto"),
                          quantization=getattr(args, "quantization", "none"),
                          weight_version=getattr(args, "weight_version", "default"),
                          embedding_model=None if str(args.embedding_model).lower() in ("none", "off", "")
                          else args.embedding_model,
                          rerank_model=args.rerank_model, classify_model=args.classify_model,
                          max_loaded_loras=_at_least(getattr(args, "max_loaded_loras", 8), 0, "--max-loaded-loras"),
                          max_lora_rank=_at_least(getattr(args, "max_lora_rank", 64), 1, "--max-lora-rank"),
                          lora_paths=parse_lora_paths(getattr(args, "lora_paths", None) or ())),
        scheduler=SchedulerConfig(batch=BatchConfig(**batch_kw),
                                  watchdog_timeout_s=getattr(args, "watchdog_timeout", None),
                                  max_queued_requests=getattr(args, "max_queued_requests", None),
                                  request_timeout_s=getattr(args, "request_timeout", None),
                                  max_queue_time_s=getattr(args, "max_queue_time", None),
                                  max_queued_tokens=getattr(args, "max_queued_tokens", None),
                                  responses_store=getattr(args, "responses_store", 1000),
                                  trim_at_rest_s=getattr(args, "trim_at_rest", 2.0)),
        recorder=RecorderConfig(path=record, replica_id=replica,
                                capacity=getattr(args, "recorder_events", 100_000),
                                ring_bytes=int(getattr(args, "recorder_ring_mb", 12.0) * (1 << 20))),
        debug_routes=bool(getattr(args, "debug_routes", False)),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=_reasoning_parser(getattr(args, "reasoning_parser", None)),
        metrics_names=getattr(args, "metrics_names", "actorserve"),
        metrics_auth=getattr(args, "metrics_auth", "required"),
        profile_dir=getattr(args, "profile_dir", None))


def _at_least(value: int, low: int, flag: str) -> int:
    if value < low:
        raise ValueError(f"{flag} must be >= {low}, got {value}")
    return value


def parse_lora_paths(items: Any) -> tuple[tuple[str, str, bool], ...]:
    """``--lora-paths`` entries as (name, path, pinned): NAME=PATH, a bare PATH (its own name,
    SGLang's), or a JSON object (SGLang's lora_name/lora_path/pinned, vLLM's name/path)."""
    out: dict[str, tuple[str, str, bool]] = {}
    for item in items:
        item = str(item).strip()
        if item.startswith("{"):
            try:
                obj = json.loads(item)
            except ValueError as exc:
                raise ValueError(f"--lora-paths {item!r}: not JSON ({exc})") from None
            name, path = obj.get("lora_name", obj.get("name")), obj.get("lora_path", obj.get("path"))
            pinned = obj.get("pinned", False)
            if not isinstance(name, str) or not isinstance(path, str) or not isinstance(pinned, bool):
                raise ValueError(f"--lora-paths {item!r}: needs string lora_name and lora_path "
                                 "(and a boolean pinned)")
        elif "=" in item:
            name, _, path = item.partition("=")
            pinned = False
        else:
            name, path, pinned = item, item, False
        if not name or not path or ":" in name or any(c.isspace() for c in name):
            raise ValueError(f"--lora-paths {item!r}: a name (no spaces or ':') and a path are needed")
        if name in out:
            raise ValueError(f"--lora-paths: the name {name!r} is given twice")
        out[name] = (name, path, pinned)
    return tuple(out.values())


def _reasoning_parser(name: str | None) -> str | None:
    return None if name is None else get_format(name).name     # aliases -> the parser's name


def switch_interval(seconds: float | None) -> None:
    """``--switch-interval``: the interpreter's (process-wide) thread switch interval."""
    if seconds is None:
        return
    if not seconds > 0:
        raise ValueError(f"--switch-interval must be > 0, got {seconds}")
    sys.setswitchinterval(seconds)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        switch_interval(getattr(args, "switch_interval", None))
    except ValueError as exc:
        print(f"actorserve serve: {exc}", file=sys.stderr)
        return 2
    from .server import build_runtime, serve_async
    from ...heap import settle

    built = build_runtime(config)
    from ...omp import release_idle_threads
    release_idle_threads()          # the step thread's OpenMP team: the only one (actorserve.omp)
    settle()         # the loaded heap frozen, the young generation's threshold raised (actorserve.heap)

    def ready(url: str) -> None:
        print(f"actorserve serving {built.served_name} at {url}", flush=True)

    return asyncio.run(serve_async(config, built=built, on_ready=ready))
