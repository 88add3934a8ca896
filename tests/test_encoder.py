"""EncoderEngine: the embedded MiniLM against a bare transformers forward, micro-batching,
dimensions, and a sequence classifier built from a config."""

from __future__ import annotations

import pytest
import torch

from actorserve.engine.pooling.encoder import load_encoder
from actorserve.engine.scheduling.params import PoolingParams
from actorserve.engine.scheduling.sequence import Sequence
from pooling_support import build_tiny_bert

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse.",
         "Berlin is well known for its museums and a long history of many things, " * 3]


@pytest.fixture(scope="module")
def minilm():
    return load_encoder("embed", threads=1)


def _run(engine, tok, texts, **pp):
    seqs = [Sequence(str(i), tok(t)["input_ids"], pooling=PoolingParams(**pp)) for i, t in enumerate(texts)]
    outs = engine.execute([(s, len(s.prompt_ids)) for s in seqs])
    return [o.pooled for o in outs]


def test_minilm_matches_bare_transformers(minilm):
    engine, tok, path = minilm
    assert engine.info.kind == "embed" and engine.info.max_model_len > engine.max_input_tokens
    engine.micro_batch = 2                    # force several length-sorted micro-batches
    vecs = _run(engine, tok, TEXTS)
    from transformers import AutoModel

    ref_model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
    for text, v in zip(TEXTS, vecs):          # one at a time: no padding at all in the reference
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            h = ref_model(**enc).last_hidden_state[0]
        ref = torch.nn.functional.normalize(h.mean(0), dim=-1)
        assert v.shape == (384,)
        assert float((ref - v).abs().max()) < 1e-5
    assert float(vecs[0] @ vecs[1]) > float(vecs[0] @ vecs[2]) + 0.3


def test_dimensions_and_partial_chunk(minilm):
    engine, tok, _ = minilm
    full = _run(engine, tok, TEXTS[:1])[0]
    short = _run(engine, tok, TEXTS[:1], dimensions=64)[0]
    assert short.shape == (64,) and abs(float(short.norm()) - 1.0) < 1e-5
    assert torch.allclose(short, torch.nn.functional.normalize(full[:64], dim=-1), atol=1e-6)
    seq = Sequence("p", tok(TEXTS[0])["input_ids"], pooling=PoolingParams())
    assert engine.execute([(seq, 2)])[0].pooled is None          # a chunk short of the end: nothing


def test_classifier_probs(tmp_path):
    folder = build_tiny_bert(tmp_path / "clf", 3, ["neg", "neu", "pos"])
    engine, tok, _ = load_encoder(str(folder), threads=1)
    assert engine.is_classifier and engine.labels == ["neg", "neu", "pos"] and engine.info.kind == "classify"
    probs = _run(engine, tok, ["the movie was good", "bad"], task="classify")
    for p in probs:
        assert p.shape == (3,) and abs(float(p.sum()) - 1.0) < 1e-5
    cross = build_tiny_bert(tmp_path / "cross", 1)
    engine, tok, _ = load_encoder(str(cross), threads=1)
    ids = tok("how many people live in berlin", "berlin population")["input_ids"]
    seq = Sequence("x", ids, pooling=PoolingParams(task="rerank"))
    assert engine._inputs([seq])["token_type_ids"][0].tolist().count(1) > 0
    (p,) = [o.pooled for o in engine.execute([(seq, len(ids))])]
    assert p.shape == (1,) and 0.0 < float(p[0]) < 1.0
