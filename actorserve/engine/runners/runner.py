"""Model runners: the `Engine` the scheduler drives, over a real transformers model.

`PagedLlamaRunner` serves the Llama-shaped families (Llama, SmolLM2, Mistral, Qwen2, Qwen3,
Gemma, Gemma2, Phi-3: the same module tree ``model.embed_tokens / layers[i].{input_layernorm,
self_attn, post_attention_layernorm, mlp} / norm / rotary_emb`` and ``lm_head``; what differs
between them, fused projections, per-head q/k norms, Gemma2's extra norms and soft-capping,
is in `families`). It does not copy or re-implement the weights: each step calls the HF
submodules (linear layers, RMSNorm, MLP, rotary embedding) directly and replaces only what
HF does per request, i.e. the KV cache and the attention over it, with the paged version in
`paged_attention`. So any member can join or leave any step, prefill chunks mix with
decodes, and a prefix-cache hit simply means the first ``num_computed`` tokens already sit
in the slots the block table names.

One step (``execute``): plan the flat batch, embed, then per layer norm -> q/k/v -> RoPE ->
write K/V into the slots -> paged attention -> o_proj + residual -> MLP + residual; at the
end the final norm and the LM head run only on the rows that produce something: the last
row of each member whose chunk reaches the end of its known tokens, and the prompt rows of a
sequence that asked for prompt logprobs (`prompt_logprobs`). Generation rows go to
the sampler (``actorserve.engine.sampling.sampling.sample`` unless one is injected); pooling rows get
the full-vocabulary log-softmax (score/rerank/classify through the LM head) or, for
``embed``, the final hidden state. The runner never touches ``num_computed``, the output
ids or the block table: the scheduler owns them.

`HFFallbackRunner` (`hf_fallback`) serves any other causal LM with the plain HF forward and
HF's own KV cache, one sequence at a time; what both share (the sampler, a step's final rows
into outputs) is `sampling_runner`'s. `build_engine` picks between them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels import glue as glue_mod
from ..sampling import prompt_logprobs as prompt_lp
from ..scheduling.base import PreemptFlag, SeqOutput, StepPreempted, engine_info
from .block_tables import BlockTables
from ..kernels.decode_kernel import PARALLEL_MIN_ELEMENTS as ATTENTION_PARALLEL_MIN
from ..kernels.decode_kernel import load as load_decode_kernel
from .families import PAGED_MODEL_TYPES, Family, apply_rope, family_of, project_qkv, supports_paged
from .paged_attention import PagedKV, StepPlan, paged_attention, plan_step
from ..kernels.fused_step import FusedStep
from .hf_fallback import HFFallbackRunner
from ..weights.lora import LoraSlots
from .lora_step import LayerHook, LoraStep
from .lora_step import down as lora_down
from .lora_step import mlp as lora_mlp
from ..kernels.quant import GATE_UP_GROUP, MAX_ROWS, step_pool
from ..kernels.widths import kernel_takes
from ..kernels.quant import _Lib as quant_lib
from .sampling_runner import Sampler, _SamplingRunner
from ..scheduling.sequence import Sequence
from ..scheduling.speculative import accepted

__all__ = ["PAGED_MODEL_TYPES", "HFFallbackRunner", "PagedLlamaRunner", "build_engine",
           "engine_info", "supports_paged"]

class PagedLlamaRunner(_SamplingRunner):
    """Paged-KV runner over a Llama-family HF model (see the module docstring)."""

    verifies_drafts = True        # speculative steps (`engine.scheduling.speculative`) are understood

    def __init__(self, model: Any, *, num_blocks: int, block_size: int = 16, sampler: Sampler | None = None,
                 threads: int | None = None, tokenizer: Any = None, model_name: str | None = None,
                 max_model_len: int | None = None, decode_attention: str | None = None,
                 max_loaded_loras: int = 8, max_lora_rank: int = 64) -> None:
        family = family_of(model)
        if family is None:
            raise ValueError(f"{type(model).__name__} is not a model family the paged runner drives "
                             "(`engine.runners.families`); use HFFallbackRunner")
        self.family: Family = family
        if threads:
            torch.set_num_threads(int(threads))
        self.threads = torch.get_num_threads()     # the step's threads; narrow q4 steps run torch on one
        cfg = model.config
        self.model = model.eval()
        self.base = model.model
        self.layers = list(self.base.layers)
        self.lm_head = model.lm_head
        attn0 = self.layers[0].self_attn
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(attn0, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.group = self.n_heads // self.n_kv
        self.scale = float(getattr(attn0, "scaling", self.head_dim ** -0.5))
        self.dtype = self.base.embed_tokens.weight.dtype
        self.kv = PagedKV(len(self.layers), num_blocks, block_size, self.n_kv, self.head_dim, self.dtype)
        self.tables = BlockTables(block_size, width=-(-min(num_blocks * block_size, 4096) // block_size))
        # decode attention: the in-place C kernel, or the torch gather + SDPA (`decode_kernel`)
        self.decode_kernel, attention = load_decode_kernel(decode_attention)
        if self.decode_kernel is not None:
            self.decode_kernel.threads = self.threads
        self.info = dataclasses.replace(
            engine_info(model, num_blocks=num_blocks, block_size=block_size, tokenizer=tokenizer,
                        model_name=model_name, max_model_len=max_model_len), attention=attention)
        self._sampler = sampler
        self._grammar_for(tokenizer)
        self._rope_cos = self._rope_sin = torch.empty(0)
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None) or None
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) or None
        # q4: the kernels' threads spin through a decode step instead of sleeping (`quant.StepPool`)
        self.step_pool = step_pool(model)
        # q4: the norms and RoPE of those steps in C too (`glue`), where it copies HF's norms
        quantized = getattr(model, "actorserve_quant", None) is not None
        # the widest step the quantized kernels (and so the step pool, the glue and the fused
        # step) take: `quant.kernel_rows`, 16 where bf16 activations take the dot path
        self.kernel_rows = model.actorserve_quant.kernel_rows if quantized else MAX_ROWS
        # ... and such a step attends every row through the decode kernel, prompt chunks too
        # (`plan_step`'s `decode_rows`): so the fused step takes a short prompt's prefill
        self.decode_rows = self.kernel_rows if quantized and self.decode_kernel is not None else 0
        self.glue = (glue_mod.load() if quantized and not family.sandwich
                     and glue_mod.usable(self.layers, self.dtype) else None)
        # whether the final norm is of the kind the glue computes too (`_final_norm`)
        self._final_norm_glued = glue_mod.norm_usable(self.base.norm, self.dtype)
        act = getattr(cfg, "hidden_act", None)
        self._silu_mlp = act == "silu" and all(hasattr(self.layers[0].mlp, a)
                                               for a in ("gate_proj", "up_proj", "down_proj"))
        # q4 decode steps of a Llama-shaped model: all the layers in one C call (`fused_step`)
        self.fused = (FusedStep(self, quant_lib(), self.decode_kernel._fn, self.decode_kernel.part)
                      if self.glue is not None and FusedStep.supports(self) else None)
        # LoRA adapters in slots (`lora`): a step with any adapter member adds their deltas
        self.lora = LoraSlots(self.layers, max_loaded=max_loaded_loras, max_rank=max_lora_rank)
        # set by the scheduler: give the step up at the next layer boundary (`StepPreempted`)
        self.preempt = PreemptFlag()
        self._pooled = False        # in a narrow quantized step: the pool spins, torch has one thread

    def release(self, seq: Sequence) -> None:
        """Give back the sequence's row of the int32 block tables."""
        self.tables.release(seq)

    # -- pieces of a step ------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`, ``[T, 1, d]``: a table built by the model's own
        rotary module (so scaling variants and ``attention_scaling`` match HF), grown on demand."""
        need = int(positions.max()) + 1
        if self._rope_cos.shape[0] < need:
            cap = max(need, min(max(2 * self._rope_cos.shape[0], 256), self.info.max_model_len))
            cos, sin = self.base.rotary_emb(like, torch.arange(cap)[None])
            self._rope_cos, self._rope_sin = cos[0].contiguous(), sin[0].contiguous()
        return self._rope_cos[positions][:, None, :], self._rope_sin[positions][:, None, :]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head, soft-capped as HF caps it (Gemma2's ``final_logit_softcapping``). In a
        narrow quantized step whose rows the head's kernel does not take (a q8 head past
        `widths.Q8_B16_ROWS`, or `Q8_BF16_ROWS` without avx512_bf16), the dense product runs on all the runner's threads with the
        step pool asleep: SmolLM2's head at 16 rows took 6.0-6.3 ms on one thread and 3.4-3.5
        on two (the 2-core AMD EPYC; 10-12 ms through the q8 kernel)."""
        if self._pooled and not kernel_takes(self.lm_head, hidden.shape[0]):
            with self.step_pool.paused(), _torch_threads(self.threads):
                logits = self.lm_head(hidden)
        else:
            logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _mlp(self, mlp: Any, x: torch.Tensor, lora: LayerHook | None = None, glue_threads: int = 0) -> torch.Tensor:
        """The layer's MLP; with `glue_threads` (the glued steps') SiLU(gate) * up through the C
        glue, rows over that many threads, as the fused decode step computes it."""
        if not self._silu_mlp:
            return mlp(x) if lora is None else lora_mlp(mlp, x, lora)
        group = getattr(mlp, GATE_UP_GROUP, None)            # q4: one kernel call for both
        if group is not None:
            g, u = group(x)
        else:
            g, u = mlp.gate_proj(x), mlp.up_proj(x)
        if lora is not None:
            lora("gate_proj", x, g)
            lora("up_proj", x, u)
        act = self.glue.silu_mul(g, u, glue_threads) if glue_threads and self.glue is not None else None
        if act is None:
            F.silu(g, inplace=True)
            act = g.mul_(u)
        return mlp.down_proj(act) if lora is None else lora_down(mlp, act, lora)

    def _o_proj(self, attn: Any, x: torch.Tensor, lora: LayerHook | None) -> torch.Tensor:
        y = attn.o_proj(x)
        if lora is not None:
            lora("o_proj", x, y)
        return y

    def _forward(self, plan: StepPlan, lora: LoraStep | None = None) -> torch.Tensor:
        """Run all layers over the flat batch; return the hidden states before the final norm.
        With `lora` (a step with adapter members) each targeted linear adds their deltas (in
        the fused C step too, `lora_kernel`)."""
        T, nh, nkv, d = plan.num_tokens, self.n_heads, self.n_kv, self.head_dim
        fam = self.family
        h = self.base.embed_tokens(plan.input_ids)
        cos, sin = self._rope(plan.positions, h)
        attn_out = self.kv.scratch("attn", (T, nh * d))
        if self.glue is not None:
            if T <= self.kernel_rows and (self._pooled or self.step_pool is None):
                if self.fused is not None and self.fused.run(plan, h, cos, sin, lora):
                    return h
                return self._forward_glued(plan, h, cos, sin, attn_out, lora)
            # a prompt chunk, or a step wider than the kernels (never pooled): the glue's norms
            # and RoPE too, their rows over all the runner's threads (a step of four 256-token
            # prompts spent ~110 of 830 ms in HF's norm, RoPE and their casts)
            return self._forward_glued(plan, h, cos, sin, attn_out, lora, threads=self.threads)
        for li, layer in enumerate(self.layers):
            self._check_preempt(li)
            a = layer.self_attn
            lo = None if lora is None else lora.layer(li)
            x = layer.input_layernorm(h)
            q, k, v = project_qkv(fam, a, x, nh, nkv, d, lo)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            self.kv.write(li, plan.slots, k, v)
            paged_attention(q, self.kv, li, plan, attn_out, self.scale, self.attn_softcap, self.decode_kernel)
            self._check_preempt(li, mlp=True)
            if fam.sandwich:                                 # Gemma2: norm each branch's output too
                h.add_(layer.post_attention_layernorm(self._o_proj(a, attn_out, lo)))
                h.add_(layer.post_feedforward_layernorm(self._mlp(layer.mlp, layer.pre_feedforward_layernorm(h), lo)))
                continue
            h.add_(self._o_proj(a, attn_out, lo))            # h is this step's own tensor
            h.add_(self._mlp(layer.mlp, layer.post_attention_layernorm(h), lo))
        return h

    def _check_preempt(self, li: int, mlp: bool = False) -> None:
        """A layer boundary (or, at ``len(layers)``, the end of the forward, before anything
        is sampled; with `mlp`, layer li's own boundary between attention and MLP): give the step
        up if the scheduler asked (`engine.scheduling.base`). The Python paths read it twice a
        layer: under load a wide mixed step's layer took 13-25 ms there (its ~20 torch calls
        each wait for the GIL while the event loop takes in the arrival), so the half-layer
        bounds how long the arrival waits. A fused decode step (all layers in one C call) reads
        the same flag at its own layer boundaries."""
        if self.preempt.is_set():
            raise StepPreempted(f"in layer {li}, before its MLP" if mlp else f"at layer {li}")

    def _forward_glued(self, plan: StepPlan, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       attn_out: torch.Tensor, lora: LoraStep | None = None, threads: int = 1) -> torch.Tensor:
        """`_forward` for a quantized step with the C glue: each residual add and the norm
        after it in one call, RoPE in place (the same arithmetic as HF's modules); with
        `threads`, their rows shared out over that many OpenMP threads (outside the step pool)."""
        glue, fam, layers = self.glue, self.family, self.layers
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        x = self.kv.scratch("glue_x", tuple(h.shape))
        # long contexts: attention goes parallel (OpenMP), so the step pool sleeps through it
        pause = (self._pooled and self.decode_kernel is not None and self.threads > 1
                 and sum(int(g.ctx.sum()) for g in plan.decode) * nkv * d >= ATTENTION_PARALLEL_MIN)
        glue.add_rmsnorm(h, None, layers[0].input_layernorm, x, threads)
        for li, layer in enumerate(layers):
            self._check_preempt(li)
            a = layer.self_attn
            lo = None if lora is None else lora.layer(li)
            q, k, v = project_qkv(fam, a, x, nh, nkv, d, lo)
            if not glue.rope(q, cos, sin, threads):
                q = apply_rope(q, cos, sin)
            if not glue.rope(k, cos, sin, threads):
                k = apply_rope(k, cos, sin)
            self.kv.write(li, plan.slots, k, v)
            with self.step_pool.paused() if pause else contextlib.nullcontext():
                paged_attention(q, self.kv, li, plan, attn_out, self.scale, self.attn_softcap, self.decode_kernel)
            glue.add_rmsnorm(h, self._o_proj(a, attn_out, lo), layer.post_attention_layernorm, x, threads)
            self._check_preempt(li, mlp=True)
            m = self._mlp(layer.mlp, x, lo, glue_threads=threads)
            if li + 1 < len(layers):
                glue.add_rmsnorm(h, m, layers[li + 1].input_layernorm, x, threads)
            else:
                h.add_(m)
        return h

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]]) -> list[SeqOutput]:
        outputs = [SeqOutput(seq) for seq, _ in batch]
        plan = plan_step(batch, self.tables, self.group, inplace=self.decode_kernel is not None,
                         decode_rows=self.decode_rows)
        if plan.num_tokens == 0:
            return outputs
        lora = self.lora.step(batch, plan)     # None: every member runs on the base model
        # a step of decode rows only (a short prompt's chunk laid out as decode rows too): the
        # pool spins and torch keeps one thread. A step with a chunk attends it through torch,
        # which wants every thread.
        if self.step_pool is not None and plan.num_tokens <= self.kernel_rows and not plan.chunks:
            with self.step_pool, _torch_threads(1):
                self._pooled = True
                try:
                    return self._run(plan, batch, outputs, lora)
                finally:
                    self._pooled = False
        return self._run(plan, batch, outputs, lora)

    def _run(self, plan: StepPlan, batch: list[tuple[Sequence, int]], outputs: list[SeqOutput],
             lora: LoraStep | None = None) -> list[SeqOutput]:
        h = self._forward(plan, lora)
        self._check_preempt(len(self.layers))         # the last boundary: before any sampling
        if self._pooled and not kernel_takes(self.lm_head, len(batch)):
            # a pooled step too wide for the head's kernel: the head and the sampling are
            # torch's, on all the runner's threads with the step pool asleep (SmolLM2 at 64
            # rows: the sampling alone took ~10 ms on one thread beside the spinning worker)
            self._pooled = False
            with self.step_pool.paused(), _torch_threads(self.threads):
                return self._tail(plan, batch, outputs, h)
        return self._tail(plan, batch, outputs, h)

    def _tail(self, plan: StepPlan, batch: list[tuple[Sequence, int]], outputs: list[SeqOutput],
              h: torch.Tensor) -> list[SeqOutput]:
        """After the layers: prompt logprobs, speculation's verification, the head and the
        sampling of the members whose step ends a token."""
        owed = prompt_lp.owed_rows(batch, plan.last_rows)
        if owed:      # the prompt rows of sequences that asked for prompt logprobs
            prompt_lp.score_rows(owed, lambda a, b: self._logits(self._final_norm(h[a:b])))
        members = [i for i, (seq, n) in enumerate(batch)
                   if n > 0 and seq.num_computed + n == seq.num_tokens + len(seq.draft)]
        spec = [i for i in members if batch[i][0].draft]
        if spec:
            members = [i for i in members if not batch[i][0].draft]
            self._verify(outputs, batch, spec, plan, h)
        if not members:
            return outputs
        last = [plan.last_rows[i] for i in members]
        # a decode step whose every row ends a token takes its rows as they are (no copies)
        every = last == list(range(h.shape[0]))
        hidden = self._final_norm(h if every else h.index_select(0, torch.tensor(last, dtype=torch.long)))
        everyone = list(range(len(members)))
        self._finish(outputs, [batch[i][0] for i in members], members, hidden,
                     lambda idx: self._logits(hidden if idx == everyone else hidden[idx]))
        return outputs

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's final norm of the rows `x` (sampled rows, prompt-logprob rows, draft
        rows alike): one C call where the glue computes the layers' norms and the final one is
        of the same kind (`glue.norm_usable`, checked at load), else the module."""
        if self.glue is not None and self._final_norm_glued and x.is_contiguous():
            out = torch.empty_like(x)
            self.glue.add_rmsnorm(x, None, self.base.norm, out)
            return out
        return self.base.norm(x)


    def _verify(self, outputs: list[SeqOutput], batch: list[tuple[Sequence, int]], spec: list[int],
                plan: StepPlan, h: torch.Tensor) -> None:
        """Speculating members (`engine.scheduling.speculative`): every row of each one's step (its last
        token, then its drafts) is sampled like a decode row of that sequence; the drafts the
        picks confirm are accepted, and the pick after them is the step's last token."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for i in spec:
            seq, n = batch[i]
            rows.extend(range(plan.last_rows[i] - n + 1, plan.last_rows[i] + 1))
            seqs.extend([seq] * n)
        hidden = self._final_norm(h.index_select(0, torch.tensor(rows, dtype=torch.long)))
        per_row = [SeqOutput(s) for s in seqs]
        self._finish(per_row, seqs, list(range(len(seqs))), hidden, lambda idx: self._logits(hidden[idx]))
        at = 0
        for i in spec:
            seq, n = batch[i]
            mine = per_row[at:at + n]
            at += n
            a = accepted(seq.draft, [o.token_id for o in mine])
            first = mine[0]
            first.extra = mine[1:a + 1]
            outputs[i] = first


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's own operations on `n` threads for the block: a narrow q4 step's products run on
    the step pool's threads, and its few torch operations are tiny, so the OpenMP team stays
    out of it (a spinning OpenMP thread would take turns on the core with the pool's worker);
    its attention still gets the runner's thread count (`DecodeKernel.threads`)."""
    keep = torch.get_num_threads()
    if keep == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(keep)


def build_engine(model: Any, **kw: Any) -> PagedLlamaRunner | HFFallbackRunner:
    """The paged runner for Llama-family models, the HF fallback for anything else.

    Keyword arguments are those of the runners (``num_blocks``, ``block_size``, ``sampler``,
    ``threads``, ``tokenizer``, ``model_name``, ``max_model_len``; ``decode_attention``,
    ``max_loaded_loras`` and ``max_lora_rank`` for the paged runner only: the HF fallback
    serves no adapters, its ``lora`` is None)."""
    if supports_paged(model):
        return PagedLlamaRunner(model, **kw)
    for key in ("decode_attention", "max_loaded_loras", "max_lora_rank"):
        kw.pop(key, None)
    return HFFallbackRunner(model, **kw)
