"""Build and run the whole server from a `ServerConfig`.

`build_runtime(config)` loads the model (``config.model.model``: "default", "tiny", a folder or a
.gguf), sizes the paged KV cache (``kv_blocks``, or from ``kv_memory_gb`` with
``bytes per block = 2 * layers * block_size * n_kv_heads * head_dim * 4``), builds the engine,
the `TextTokenizer`, the flight recorder (a ChatML fallback when the
tokenizer has no chat template) and the `Runtime`. `serve(config)` runs it on
``host:port`` until SIGTERM/SIGINT, then drains gracefully: the server goes `draining`, stops
accepting connections, lets in-flight requests finish (bounded by ``drain_timeout_s``), shuts the
runtime down and returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from ...actors.runtime import Runtime
from ...config import ServerConfig
from ...replay.recorder import FlightRecorder
from ...statemachines import LIFECYCLES
from .app import build_app

log = logging.getLogger("actorserve.http")

# ChatML, for models whose tokenizer ships no template (e.g. the "tiny" test model).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(slots=True)
class Built:
    runtime: Runtime
    tokenizer: Any
    served_name: str
    model_path: str
    pool_models: Any = None            # target -> http.pooling.PoolModel (embed, rerank, classify)
    dtype_reason: str = ""             # why --dtype chose what it did ("auto: the CPU has amx_bf16")
    quantization: str | None = None    # what --quantization did (engine.quant.QuantReport.describe)
    paths: dict[str, str] | None = None  # which arithmetic each kind of step takes (engine.paths.phase_paths)


def kv_bytes_per_block(model_config: Any, block_size: int, dtype_bytes: int = 4) -> int:
    layers = int(model_config.num_hidden_layers)
    heads = int(model_config.num_attention_heads)
    n_kv = int(getattr(model_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(model_config, "head_dim", None) or model_config.hidden_size // heads)
    return 2 * layers * block_size * n_kv * head_dim * dtype_bytes


def num_kv_blocks(model_config: Any, *, kv_blocks: int | None, kv_memory_gb: float, block_size: int,
                  dtype_bytes: int = 4) -> int:
    if kv_blocks is not None:
        if kv_blocks < 1:
            raise ValueError(f"kv_blocks must be >= 1, got {kv_blocks}")
        return kv_blocks
    per = kv_bytes_per_block(model_config, block_size, dtype_bytes)
    return max(1, int(kv_memory_gb * (1 << 30)) // per)


def build_runtime(config: ServerConfig) -> Built:
    from ...engine.weights.models import load_model
    from ...engine.runners.runner import build_engine
    from ...engine.text.tokenizer import TextTokenizer

    from ...engine.weights.dtype import dtype_name, resolve_dtype

    mc = config.model
    dtype, why = resolve_dtype(mc.dtype)
    log.info("dtype %s (%s)", dtype_name(dtype), why)
    model, hf_tok, path = load_model(mc.model, threads=mc.threads, dtype=dtype, quantization=mc.quantization)
    blocks = num_kv_blocks(model.config, kv_blocks=mc.kv_blocks, kv_memory_gb=mc.kv_memory_gb,
                           block_size=mc.block_size, dtype_bytes=dtype.itemsize)
    name = getattr(model, "actorserve_name", None) or str(path)
    tokenizer = TextTokenizer(hf_tok, generation_config=getattr(model, "generation_config", None))
    if not tokenizer.has_chat_template:
        log.warning("%s has no chat template; chat requests use a plain ChatML fallback", name)
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    engine = build_engine(model, num_blocks=blocks, block_size=mc.block_size, threads=mc.threads,
                          tokenizer=hf_tok, model_name=name, decode_attention=mc.decode_attention,
                          max_loaded_loras=mc.max_loaded_loras, max_lora_rank=mc.max_lora_rank)
    if engine.info.attention:
        log.info("decode attention: %s", engine.info.attention)
    if getattr(engine, "grammar", None) is not None:      # read the vocabulary for xgrammar now,
        threading.Thread(target=engine.grammar.warm, name="grammar-warm", daemon=True).start()
    rc = config.recorder
    recorder = FlightRecorder(path=rc.path, capacity=rc.capacity, lifecycles=LIFECYCLES.values(),
                              max_bytes=rc.max_bytes, backups=rc.backups, replica=rc.replica_id,
                              ring_bytes=rc.ring_bytes, preallocate=True)
    from ..pooling.pooling import load_pool_models
    pool = load_pool_models(mc, dtype)
    runtime = Runtime(engine, config=config.scheduler, recorder=recorder,
                      pooling_engines={k: pm.engine for k, pm in pool.items()},
                      detokenizer=tokenizer.detokenizer_for, weight_version=mc.weight_version)
    quant = getattr(model, "actorserve_quant", None)
    paths = None
    if getattr(engine, "layers", None) is not None:        # the paged runner (not the HF fallback)
        from ...engine.runners.paths import phase_paths
        paths = phase_paths(quant, dtype, why, mc.quantization, getattr(model, "actorserve_packed", 0))
        for phase, how in paths.items():
            log.info("%s: %s", phase, how)
    return Built(runtime, tokenizer, name, str(path), pool, f"{dtype_name(dtype)} ({why})",
                 quant.describe() if quant is not None else None, paths)


def make_app(config: ServerConfig, built: Built | None = None) -> web.Application:
    built = built or build_runtime(config)
    app = build_app(built.runtime, built.tokenizer, config, built.served_name,
                    pool_models=built.pool_models)
    from .state import CTX
    app[CTX].extra["model_path"] = built.model_path
    app[CTX].extra["dtype_reason"] = built.dtype_reason
    app[CTX].extra["quantization"] = built.quantization
    app[CTX].extra["engine_paths"] = built.paths
    return app


async def _drain(runtime: Runtime, timeout_s: float) -> None:
    """``-> draining``; wait (bounded) for the control actor's word that no request is left."""
    try:
        await asyncio.wait_for(asyncio.shield(runtime.drain("signal")), timeout_s)
    except asyncio.TimeoutError:
        log.warning("drain: requests still in flight after %.1fs; stopping anyway", timeout_s)


async def serve_async(config: ServerConfig, *, built: Built | None = None,
                      on_ready: Callable[[str], None] | None = None,
                      stop: asyncio.Event | None = None, drain_timeout_s: float = 30.0) -> int:
    """Run until `stop` is set or SIGTERM/SIGINT arrives; then drain and return 0."""
    app = make_app(config, built)
    from .state import CTX
    runtime = app[CTX].runtime
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # requests at once (streaming handlers also notice on their next write).
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"
        if on_ready is not None:
            on_ready(url)
        trimmer = None
        if config.scheduler.trim_at_rest_s > 0:
            from ...actors.rest import RestTrimmer
            trimmer = RestTrimmer(runtime.scheduler_probe(), runtime, interval=config.scheduler.trim_at_rest_s)
            trimmer.start()
        await stop.wait()
        if trimmer is not None:
            await trimmer.stop()
        log.info("shutting down: draining in-flight requests")
        await _drain(runtime, drain_timeout_s)
        await site.stop()
    finally:
        await runner.cleanup()
        for sig in installed:
            loop.remove_signal_handler(sig)
    return 0
