"""Fixtures for the pooling tests (no tests here): the embedded MiniLM encoder, a tiny BERT
classifier / cross-encoder built from a config with a hand-made WordPiece vocabulary, and
`serve_pooling(...)`: an aiohttp test server whose runtime hosts a generation engine and
pooling engines side by side."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

from aiohttp.test_utils import TestClient, TestServer

from actorserve.actors.runtime import Runtime
from actorserve.config import ModelConfig, SchedulerConfig, ServerConfig
from actorserve.engine.scheduling.batching import BatchConfig
from actorserve.http.edge.app import build_app
from actorserve.http.pooling.pooling import PoolModel
from actorserve.replay.recorder import FlightRecorder
from actorserve.statemachines import LIFECYCLES

WORDS = ("the a is of and to in berlin new york city museum people live population how many "
         "good bad great terrible movie film love hate it was this food man eating bread horse "
         "riding registered inhabitants area square kilometers known for its well").split()


def build_tiny_bert(folder: Path, num_labels: int, labels: list[str] | None = None) -> Path:
    """A random 2-layer BertForSequenceClassification with its own WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(WORDS) + list("abcdefghijklmnopqrstuvwxyz0123456789.,?!") \
        + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)
    id2label = {i: (labels[i] if labels else f"LABEL_{i}") for i in range(num_labels)}
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, num_labels=num_labels,
                     id2label=id2label, label2id={v: k for k, v in id2label.items()})
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def pool_model(target: str, spec: Any, *, threads: int = 1) -> PoolModel:
    from actorserve.engine.pooling.encoder import load_encoder

    engine, tok, _ = load_encoder(spec, threads=threads)
    return PoolModel(target, engine.info.model_name, tok, engine)


@contextlib.asynccontextmanager
async def serve_pooling(tiny: tuple[Any, Any, Any], pool: dict[str, PoolModel], *, kv_blocks: int = 256,
                        name: str = "tiny-llama",
                        debug_routes: bool = False,
                        request_timeout_s: float | None = None) -> AsyncIterator[tuple[TestClient, Runtime]]:
    from actorserve.engine.runners.runner import build_engine

    model, hf_tok, tok = tiny
    engine = build_engine(model, num_blocks=kv_blocks, block_size=16, tokenizer=hf_tok, model_name=name)
    rt = Runtime(engine, config=SchedulerConfig(batch=BatchConfig(), step_in_thread=True,
                                                request_timeout_s=request_timeout_s),
                 recorder=FlightRecorder(capacity=200_000, lifecycles=LIFECYCLES.values()),
                 pooling_engines={k: pm.engine for k, pm in pool.items()})
    config = ServerConfig(model=ModelConfig(model="tiny", kv_blocks=kv_blocks), debug_routes=debug_routes)
    app = build_app(rt, tok, config, name, pool_models=pool)
    async with TestServer(app, host="127.0.0.1", port=0, handler_cancellation=True) as server:
        async with TestClient(server) as client:
            yield client, rt
