"""Configuration as frozen dataclasses, built once at start-up and passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine.scheduling.batching import BatchConfig

METRICS_SCHEMES = ("actorserve", "vllm", "sglang")    # /metrics naming (http.metric_names)
METRICS_AUTH = ("required", "open")                   # /metrics behind --api-key, or open


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str = "default"             # "default" (SmolLM2), "tiny", a HF folder or a .gguf file
    embedding_model: str | None = "embed"   # "embed" (all-MiniLM-L6-v2), an HF encoder folder; None = off
    rerank_model: str | None = None     # a local *ForSequenceClassification cross-encoder folder
    classify_model: str | None = None   # a local *ForSequenceClassification folder
    threads: int | None = None          # torch intra-op threads; None = all cores
    kv_blocks: int | None = None        # None = sized from kv_memory_gb
    kv_memory_gb: float = 1.0
    block_size: int = 16
    dtype: str = "auto"                 # auto | float32 | bfloat16 (engine.dtype): weights and KV cache
    decode_attention: str = "auto"      # auto | inplace | gather (engine.decode_kernel)
    quantization: str = "auto"          # auto | none | q4 | q4a8 (engine.quant): quantized decode steps
    weight_version: str = "default"     # the served weights' version (responses' weight_version)
    max_loaded_loras: int = 8           # LoRA adapter slots (--max-loaded-loras; LRU beyond, pinned kept)
    max_lora_rank: int = 64             # the largest adapter rank accepted (--max-lora-rank)
    # adapters loaded at start-up (--lora-paths): (name, path, pinned) each
    lora_paths: tuple[tuple[str, str, bool], ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    batch: BatchConfig = field(default_factory=BatchConfig)
    step_in_thread: bool = True         # run the model step in a worker thread (off the loop)
    watchdog_timeout_s: float | None = None   # unhealthy after this long without a step; None = off
    # Admission control: a request that would make more than this many wait for a scheduler is
    # refused at once (HTTP 503 with Retry-After); probes are never refused. None = unbounded.
    max_queued_requests: int | None = None
    # Every request's deadline, in seconds from its arrival: past it the request is aborted
    # through the control actor (finish_reason "timeout"). None = no deadline.
    request_timeout_s: float | None = None
    # A request still waiting for its first admission this long after its arrival is ended
    # (finish_reason abort, SGLang's "Request waiting timeout reached.", HTTP 503). None = off.
    max_queue_time_s: float | None = None
    # Admission by queued prompt tokens, beside the count: a request whose prompt would take the
    # queued prompt tokens past this is refused like one past max_queued_requests (503). An
    # empty queue always admits (the bound is on waiting work, not on one prompt). None = off.
    max_queued_tokens: int | None = None
    # Pooling schedulers only: when an idle encoder would start a step with fewer inputs than it
    # can take, wait this long for more to arrive (a batching window, like Triton's queue delay).
    pool_batch_wait_s: float = 0.005
    # /v1/responses with store: ended responses kept for GET / DELETE / previous_response_id;
    # past this many the one that ended longest ago is evicted. 0 = store nothing.
    responses_store: int = 1000
    # At rest for this long (no request, no step), the C heap's free pages go back to the OS
    # (`actors.rest.RestTrimmer`); 0 = never
    trim_at_rest_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.responses_store < 0:
            raise ValueError(f"responses_store must be >= 0, got {self.responses_store}")
        if self.trim_at_rest_s < 0:
            raise ValueError(f"trim_at_rest_s must be >= 0, got {self.trim_at_rest_s}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_queue_time_s is not None and not self.max_queue_time_s > 0:
            raise ValueError(f"max_queue_time_s must be > 0, got {self.max_queue_time_s}")
        if self.max_queued_tokens is not None and self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1, got {self.max_queued_tokens}")


@dataclass(frozen=True, slots=True)
class RecorderConfig:
    path: str | None = None             # JSONL file; None = ring buffer only
    capacity: int = 100_000             # events kept in memory
    ring_bytes: int = 12 << 20          # ...in at most this, taken when the server starts
    max_bytes: int = 256 << 20          # rotate the file past this size
    backups: int = 3
    replica_id: str | None = None       # the replica this process is in a fleet (in the header)

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.ring_bytes < 4096:
            raise ValueError(f"the flight recorder keeps at least 1 event in at least 4 KB; got "
                             f"{self.capacity} events in {self.ring_bytes} bytes")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    recorder: RecorderConfig = field(default_factory=RecorderConfig)
    debug_routes: bool = False          # /debug/* live inspection (requests, events, diagrams)
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral (None: from the chat template)
    reasoning_parser: str | None = None  # qwen3 | deepseek-r1: split <think> into reasoning_content
    metrics_names: str = "actorserve"   # actorserve | vllm | sglang: names in /metrics (dashboards)
    metrics_auth: str = "required"      # required: /metrics needs the API key like the rest; open
    profile_dir: str | None = None      # /start_profile's default output_dir (else SGLANG_TORCH_PROFILER_DIR, /tmp)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.metrics_names not in METRICS_SCHEMES:
            raise ValueError(f"metrics_names must be one of {METRICS_SCHEMES}, got {self.metrics_names!r}")
        if self.metrics_auth not in METRICS_AUTH:
            raise ValueError(f"metrics_auth must be one of {METRICS_AUTH}, got {self.metrics_auth!r}")
