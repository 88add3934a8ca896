"""`EncoderEngine`: the `Engine` for HF encoder models (BERT family): embeddings and classifiers.

An encoder keeps no KV cache and never generates: a member whose step reaches the end of its
tokens runs its **whole** prompt in one forward, whatever ``num_computed`` says (so a chunked
or prefix-matched schedule is harmless; a chunk that stops short costs nothing). The
scheduler still does its block accounting against the `EngineInfo` this engine reports,
which is sized generously (``max_num_seqs`` full-length sequences) so admission is limited
by the batch policy, never by phantom KV. Use `encoder_batch_config` for the scheduler of
this engine: its prefill chunk covers a whole input, so every member finishes in one step.

One step: the finishing members are sorted by length and cut into micro-batches (at most
``micro_batch`` sequences and ``micro_tokens`` padded tokens each, and a new one whenever a
member is more than twice as long as the micro-batch's shortest); padding happens only inside
a micro-batch, so a short text never pays for a long one, while similar lengths still share
one forward (measured: uniform short texts 16 -> 32 per forward, 291 -> 356 embeddings/s). Then, per member:

* a base encoder (``BertModel`` ...): mean pooling over the attention mask, then
  ``dimensions`` truncation, then L2 normalisation (``normalize``, the default) — the
  all-MiniLM-L6-v2 recipe;
* a ``*ForSequenceClassification`` model: probabilities over its labels (softmax; sigmoid
  when it has a single label, the cross-encoder case), whatever the task.

Token type ids: for a pair encoded as ``[CLS] a [SEP] b [SEP]`` the tokens after the first
``[SEP]`` get type 1 (when the model has a second token type), as a BERT tokenizer would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..scheduling.base import EngineInfo, SeqOutput
from ..scheduling.batching import BatchConfig
from ..scheduling.sequence import Sequence

BLOCK_SIZE = 16


def encoder_batch_config(engine: "EncoderEngine", max_num_seqs: int = 64) -> BatchConfig:
    """Batch limits for an encoder's scheduler: every member runs its whole input in one step."""
    n = engine.info.max_model_len
    return BatchConfig(max_num_seqs=max_num_seqs, max_batch_tokens=max(16384, n),
                       max_prefill_chunk=n)


class EncoderEngine:
    """An HF encoder (base model or sequence classifier) behind the `Engine` interface."""

    def __init__(self, model: Any, *, tokenizer: Any = None, model_name: str | None = None,
                 max_input_tokens: int | None = None, threads: int | None = None,
                 micro_batch: int = 64, micro_tokens: int = 8192, max_num_seqs: int = 64) -> None:
        if threads:
            torch.set_num_threads(int(threads))
        self.model = model.eval()
        cfg = model.config
        self.is_classifier = type(model).__name__.endswith("ForSequenceClassification")
        self.num_labels = int(getattr(cfg, "num_labels", 0) or 0) if self.is_classifier else 0
        id2label = getattr(cfg, "id2label", None) or {}
        self.labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}")))
                       for i in range(self.num_labels)]
        limit = int(getattr(cfg, "max_position_embeddings", None) or 512)
        self.max_input_tokens = min(limit, int(max_input_tokens)) if max_input_tokens else limit
        self.pad_id = int(getattr(cfg, "pad_token_id", None) or 0)
        self.sep_id = getattr(tokenizer, "sep_token_id", None) if tokenizer is not None else None
        self.two_types = int(getattr(cfg, "type_vocab_size", 1) or 1) > 1
        self.micro_batch = max(1, micro_batch)
        self._max_num_seqs = max_num_seqs
        self.micro_tokens = max(self.max_input_tokens, micro_tokens)
        # +1: the scheduler reserves one position to generate into; an encoder never does.
        max_len = self.max_input_tokens + 1
        blocks = max_num_seqs * (-(-max_len // BLOCK_SIZE)) * 2
        name = model_name or Path(str(getattr(cfg, "_name_or_path", "") or "encoder")).name
        kind = "classify" if self.is_classifier else "embed"
        self.info = EngineInfo(model_name=name, block_size=BLOCK_SIZE, num_blocks=blocks,
                               max_model_len=max_len, eos_token_ids=(), vocab_size=int(cfg.vocab_size),
                               kind=kind, dtype=str(next(model.parameters()).dtype).removeprefix("torch."))

    def release(self, seq: Sequence) -> None:
        """Nothing to forget: an encoder keeps no per-sequence state."""

    def batch_config(self) -> BatchConfig:
        """What the runtime gives this engine's scheduler (see `encoder_batch_config`)."""
        return encoder_batch_config(self, self._max_num_seqs)

    # -- one step ----------------------------------------------------------------------------
    def _micro_batches(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        ordered = sorted(seqs, key=lambda s: len(s.prompt_ids))
        out: list[list[Sequence]] = []
        cur: list[Sequence] = []
        for s in ordered:
            n = len(s.prompt_ids)   # sorted: the newest member is the longest
            if cur and (len(cur) >= self.micro_batch or n * (len(cur) + 1) > self.micro_tokens
                        or n > 2 * len(cur[0].prompt_ids) + 8):
                out.append(cur)
                cur = []
            cur.append(s)
        if cur:
            out.append(cur)
        return out

    def _inputs(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        width = max(len(s.prompt_ids) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        types = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            p = s.prompt_ids
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
            mask[i, :len(p)] = 1
            if self.two_types and self.sep_id is not None and self.sep_id in p:
                first = p.index(self.sep_id)
                types[i, first + 1:len(p)] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}

    def _forward(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        inputs = self._inputs(seqs)
        try:
            out = self.model(**inputs)
        except TypeError:   # an encoder without token types
            inputs.pop("token_type_ids")
            out = self.model(**inputs)
        if self.is_classifier:
            logits = out.logits.float()
            probs = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
            return [probs[i].clone() for i in range(len(seqs))]
        hidden = out.last_hidden_state.float()
        mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        vecs = []
        for i, s in enumerate(seqs):
            v = mean[i]
            pp = s.pooling
            if pp is not None and pp.dimensions:
                v = v[:pp.dimensions]
            if pp is None or pp.normalize:
                v = F.normalize(v, dim=-1)
            vecs.append(v.clone())
        return vecs

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]]) -> list[SeqOutput]:
        outputs = [SeqOutput(seq) for seq, _ in batch]
        where = {id(seq): i for i, (seq, _) in enumerate(batch)}
        done = [seq for seq, n in batch if n > 0 and seq.num_computed + n == seq.num_tokens]
        for group in self._micro_batches(done):
            for seq, value in zip(group, self._forward(group)):
                outputs[where[id(seq)]].pooled = value
        return outputs


def _sentence_max_len(path: Path) -> int | None:
    """``max_seq_length`` from a sentence-transformers folder (what it truncates to), if any."""
    f = path / "sentence_bert_config.json"
    if not f.is_file():
        return None
    try:
        return int(json.loads(f.read_text())["max_seq_length"])
    except (ValueError, KeyError, TypeError):
        return None


def load_encoder(spec: str | os.PathLike[str] | None = "embed", *, threads: int | None = None,
                 dtype: torch.dtype = torch.float32, **engine_kw: Any) -> tuple[EncoderEngine, Any, Path]:
    """Load an encoder from `spec` (``"embed"`` = the embedded all-MiniLM-L6-v2, or an HF
    folder); a folder whose config names a ``*ForSequenceClassification`` architecture loads
    as a classifier. Returns ``(engine, hf_tokenizer, path)``. Offline only. ``dtype`` is the
    weights' (pooling itself runs in float32)."""
    from ..weights.models import resolve_model, served_name
    path = resolve_model(spec if spec is not None else "embed", convert=False)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    if threads:
        torch.set_num_threads(int(threads))
    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    archs = getattr(cfg, "architectures", None) or []
    cls = AutoModelForSequenceClassification if any(a.endswith("ForSequenceClassification")
                                                     for a in archs) else AutoModel
    model = cls.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.requires_grad_(False)
    from ..runners.dense import pack_model              # oneDNN weights packed once (engine.dense)
    pack_model(model)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    engine_kw.setdefault("max_input_tokens", _sentence_max_len(path))
    name = "all-MiniLM-L6-v2" if str(spec) == "embed" else served_name(path)
    return EncoderEngine(model, tokenizer=tok, model_name=name, **engine_kw), tok, path
