"""Paged KV storage and attention over it: the torch half of the paged-KV design.

Storage. Each layer owns one K and one V tensor of shape
``[num_blocks * block_size, n_kv_heads, head_dim]``; token ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size`` (the `BlockManager` hands out
the blocks; the runner mirrors the tables into persistent int32 rows, `block_tables`, which this
module reads). The tensors start zeroed: padding rows that a
batched gather picks up are masked out, and zero (never NaN) keeps ``0 * v`` at zero.

A step. `plan_step` turns the scheduler's ``[(seq, n)]`` into one flat batch of ``T`` new
tokens (ids, positions, slots) plus the attention layout, computed once and shared by all
layers:

* in place: with the decode kernel (`decode_kernel`, ``inplace=True``) every ``n == 1``
  member is one group whose block tables and context lengths go to the C kernel, which reads
  the K/V rows where they lie, each context at its own length: no gather, no padding, no mask.
* decode groups (torch path): the members with ``n == 1`` (decodes, and a prefill whose last token is
  all that is left, e.g. after a prefix-cache hit), grouped by context length
  (`group_by_length`): within a group the contexts are gathered as whole blocks with one
  ``index_select`` into a padded ``[D, nb * block_size]`` layout and attended in one batched
  SDPA call with a length mask. One long request no longer makes every short one gather and
  attend over its length: a group only pads up to at most twice its shortest member (or 8
  blocks more), so the padded work stays within about 2x the real work whatever the mix, at the
  price of one SDPA call per group (a handful: lengths double from group to group).
* chunks: every member with ``n > 1`` (prefill, whole or chunked). Each gathers its own
  blocks and attends with a causal mask offset by what was already computed, so a chunk
  that continues a cached prefix or an earlier chunk sees that context.

GQA without copies. The query heads that share a KV head are folded into the query-length
axis: ``q[T, n_heads, d] -> [.., n_kv, group * T, d]``, so SDPA reads the gathered K/V
once instead of ``repeat_kv`` materialising ``group`` copies of it.

Buffers. The gather targets are scratch tensors owned by `PagedKV`, grown on demand and
reused by every layer of every step (per-layer temporaries were a large share of step time
at high batch, see DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import prefill_attention
from .block_tables import BlockTables
from ..kernels.decode_kernel import DecodeKernel
from ..scheduling.sequence import Sequence


class PagedKV:
    """Per-layer K/V tensors in slot layout plus reusable scratch buffers."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.n_kv, self.head_dim = n_kv, head_dim
        shape = (num_blocks * block_size, n_kv, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self._scratch: dict[str, torch.Tensor] = {}
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A contiguous tensor of `shape` backed by a named buffer that only grows (of the
        cache's dtype unless `dtype` says otherwise; one name, one dtype)."""
        numel = 1
        for s in shape:
            numel *= s
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * buf.numel() if buf is not None else 0),
                              dtype=dtype or self.dtype)
            self._scratch[name] = buf
        return buf[:numel].view(shape)

    def gather(self, layer: int, blocks: torch.Tensor, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` (flat list of block ids) as ``[len(blocks) * bs, n_kv, d]``."""
        bs, nkv, d = self.block_size, self.n_kv, self.head_dim
        shape = (blocks.numel(), bs, nkv, d)
        kb = self.scratch("k" + tag, shape)
        vb = self.scratch("v" + tag, shape)
        torch.index_select(self.k[layer].view(-1, bs, nkv, d), 0, blocks, out=kb)
        torch.index_select(self.v[layer].view(-1, bs, nkv, d), 0, blocks, out=vb)
        return kb.view(-1, nkv, d), vb.view(-1, nkv, d)


@dataclass(slots=True)
class Chunk:
    """One member computing ``n > 1`` tokens: rows ``[row, row + n)`` of the flat batch."""

    row: int
    n: int
    blocks: torch.Tensor         # block ids covering its whole context (int32)
    start: int                   # its first token's position (0: a prompt with nothing cached)
    group: int = 1               # query heads per KV head
    _mask: torch.Tensor | None = None

    def mask(self, bs: int) -> torch.Tensor:
        """``[group * n, len(blocks) * bs]`` bool, True = attend (causal from `start`); built on
        the first layer that needs it (a prompt from position 0 without soft-capping never does)."""
        if self._mask is None:
            q_pos = torch.arange(self.start, self.start + self.n)
            m = torch.arange(self.blocks.numel() * bs)[None, :] <= q_pos[:, None]
            self._mask = m.repeat(self.group, 1) if self.group > 1 else m
        return self._mask


@dataclass(slots=True)
class DecodeGroup:
    """Members with ``n == 1`` whose contexts are attended together, padded to ``nb`` blocks."""

    rows: torch.Tensor           # [D] their flat rows, ascending
    table: torch.Tensor          # [D, nb] their block tables (int32), padded with stale ids
    ctx: torch.Tensor            # [D] int32: each one's context length, its new token included
    mask: torch.Tensor | None    # [D, 1, 1, nb * bs] bool, True = attend (the gather path only)
    dense: bool = False          # rows are exactly 0..T-1 (the whole step): no select/scatter

    @property
    def blocks(self) -> torch.Tensor:
        """``[D * nb]`` padded block ids, what the gather path copies."""
        return self.table.reshape(-1)


@dataclass(slots=True)
class StepPlan:
    input_ids: torch.Tensor      # [T]
    positions: torch.Tensor      # [T]
    slots: torch.Tensor          # [T]
    decode: list[DecodeGroup] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)   # per member: its last flat row, -1 if n == 0

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


# The most context tokens a step's prompt chunks may read in all and still be laid out as decode
# rows (`plan_step`): a fresh 250-token prompt reads 31k. The tails of 830-token prompts (the
# long load of `benchmarks/peers.py`) read far more, and as decode rows each row walks its whole
# context through the decode kernel: their TTFT p50 went from 1.66 s to 2.53 s when steps of up
# to 256 rows took that path (2026-12-07, AMD EPYC).
DECODE_ROWS_CONTEXT = 1 << 15


def plan_step(batch: list[tuple[Sequence, int]], tables: BlockTables, group: int,
              inplace: bool = False, decode_rows: int = 0) -> StepPlan:
    """Lay out one step: flat tokens, their slots, and the attention groups. The block ids come
    from `tables` (each member's row synced first); Python work here is per member and per new
    token, never per block: slots, padded decode blocks and chunk blocks are tensor gathers.
    `inplace` (the decode kernel reads each context at its own length): one decode group of
    every ``n == 1`` member, no masks. With `inplace`, a step of at most `decode_rows` tokens
    attends every row as a decode row, prompt chunks and verify rows too: a chunk's row at
    position ``p`` reads the context ``[0, p]`` (every row's K/V is written before any row
    attends, so the per-row length is the causal mask). Such a step is one dense decode group,
    which the fused step (`kernels.fused_step`) runs in one C call, unless its chunks' rows
    would read more than `DECODE_ROWS_CONTEXT` context tokens in all: past that, a chunk after
    a long context (the tail of a long prompt) attends faster as a chunk."""
    bs = tables.block_size
    chunk_context = 0                     # context tokens the chunks' rows read, as decode rows
    ids: list[int] = []
    pos: list[int] = []
    last_rows: list[int] = []
    trows: list[int] = []                 # per computing member: its row in `tables`
    counts: list[int] = []                # ... and how many tokens it computes
    dec: list[tuple[int, int, int]] = []  # decode members: (flat row, table row, context length)
    chunks: list[Chunk] = []
    for seq, n in batch:
        start = seq.num_computed
        if n <= 0:
            last_rows.append(-1)
            continue
        end = start + n
        known = seq.num_tokens
        if end > known + len(seq.draft):
            raise ValueError(f"{seq!r}: asked to compute {n} tokens, only {seq.num_uncomputed} known"
                             f" and {len(seq.draft)} drafted")
        if len(seq.block_table) * bs < end:
            raise ValueError(f"{seq!r}: block table covers {len(seq.block_table) * bs} tokens, step needs {end}")
        trow = tables.row(seq)
        row = len(ids)
        ids.extend(seq.token_slice(start, min(end, known)))
        if end > known:                  # a speculative step: its drafts follow the last token
            ids.extend(seq.draft[:end - known])
        trows.append(trow)
        counts.append(n)
        if n == 1:
            pos.append(start)
            dec.append((row, trow, end))
        else:
            pos.extend(range(start, end))
            nb = -(-end // bs)
            chunks.append(Chunk(row, n, tables.table[trow, :nb], start, group))
            chunk_context += n * start + n * (n + 1) // 2
        last_rows.append(row + n - 1)

    positions = torch.tensor(pos, dtype=torch.long)
    if trows:
        per_token = torch.tensor(trows, dtype=torch.long)
        if len(trows) != len(pos):
            per_token = per_token.repeat_interleave(torch.tensor(counts, dtype=torch.long))
        slots = tables.table[per_token, positions // bs].long() * bs + positions % bs
    else:
        slots = torch.empty(0, dtype=torch.long)

    groups = []
    if inplace and chunks and 0 < len(ids) <= decode_rows and chunk_context <= DECODE_ROWS_CONTEXT:
        nb = -(-(int(positions.max()) + 1) // bs)
        groups.append(DecodeGroup(torch.arange(len(ids)), tables.table[per_token, :nb],
                                  (positions + 1).to(torch.int32), None, dense=True))
        dec, chunks = [], []
    if dec:
        needs = [-(-ctx // bs) for _, _, ctx in dec]
        for members in [list(range(len(dec)))] if inplace else group_by_length(needs):
            nb = max(needs[i] for i in members)
            tab = torch.tensor([dec[i][1] for i in members], dtype=torch.long)
            ctx = torch.tensor([dec[i][2] for i in members], dtype=torch.int32)
            mask = None if inplace else \
                (torch.arange(nb * bs)[None, :] < ctx[:, None]).view(len(members), 1, 1, -1)
            groups.append(DecodeGroup(torch.tensor([dec[i][0] for i in members], dtype=torch.long),
                                      tables.table[tab, :nb], ctx, mask,
                                      dense=len(members) == len(ids)))
    return StepPlan(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=positions,
        slots=slots,
        decode=groups,
        chunks=chunks,
        last_rows=last_rows,
    )


def group_by_length(needs: list[int], ratio: int = 2, slack: int = 8) -> list[list[int]]:
    """Partition indices of `needs` (blocks each context covers) into groups attended together:
    in order of length, a group takes members while their need is at most ``ratio`` times its
    shortest's or ``slack`` blocks more; each group's indices ascending (so one group over the
    whole step keeps the step's row order)."""
    order = sorted(range(len(needs)), key=needs.__getitem__)
    groups: list[list[int]] = []
    first = -1
    for i in order:
        if not groups or (needs[i] > ratio * first and needs[i] > first + slack):
            groups.append([])
            first = needs[i]
        groups[-1].append(i)
    return [sorted(g) for g in groups]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """SDPA, or with `softcap` (Gemma2) HF's eager attention: scores ``tanh(s / c) * c``,
    masked, softmax in float32."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = (torch.tanh(s / softcap) * softcap).masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def paged_attention(q: torch.Tensor, kv: PagedKV, layer: int, plan: StepPlan, out: torch.Tensor,
                    scale: float, softcap: float | None = None, kernel: DecodeKernel | None = None) -> None:
    """Attention of the step's queries ``q [T, n_heads, d]`` (RoPE applied, K/V already
    written) over each member's paged context; writes ``[T, n_heads * d]`` into `out`.
    `softcap` soft-caps the attention logits (Gemma2's ``attn_logit_softcapping``). With
    `kernel` (`decode_kernel`) the decode members' contexts are read in place, in float32."""
    nh, d = q.shape[1], q.shape[2]
    nkv = kv.n_kv
    group = nh // nkv
    for g in plan.decode:
        D = g.rows.numel()
        qd = q if g.dense else q.index_select(0, g.rows)
        if kernel is not None:
            qf = qd.to(torch.float32).contiguous().view(D, nkv, group, d)
            of = kv.scratch("kernel_out", (D, nh * d), torch.float32)
            kernel.run(qf, kv.k[layer], kv.v[layer], g.table, g.ctx, kv.block_size, scale, softcap, of)
            if g.dense:
                out.copy_(of)
            else:
                out.index_copy_(0, g.rows, of.to(out.dtype))
            continue
        qd = qd.view(D, nkv, group, d)                                      # heads of a KV head = rows
        k, v = kv.gather(layer, g.blocks, "d")
        k = k.view(D, -1, nkv, d).transpose(1, 2)                           # [D, nkv, L, d]
        v = v.view(D, -1, nkv, d).transpose(1, 2)
        o = _attend(qd, k, v, g.mask, scale, softcap)
        o = o.reshape(D, nh * d)
        if g.dense:
            out.copy_(o)
        else:
            out.index_copy_(0, g.rows, o)
    for c in plan.chunks:
        if softcap is None and prefill_attention.takes(q, c.n, c.start):   # bf16 (its docstring)
            k, v = kv.gather(layer, c.blocks, "c")
            prefill_attention.causal(q[c.row:c.row + c.n], k, v, scale,
                                     out[c.row:c.row + c.n].view(c.n, nh, d), c.start)
            continue
        if c.start == 0 and softcap is None:        # a prompt from position 0: causal, no mask
            k, v = kv.gather(layer, c.blocks, "c")  # (its padding lies past every query)
            k = k.view(1, -1, nkv, d).transpose(1, 2)
            v = v.view(1, -1, nkv, d).transpose(1, 2)
            qh = q[c.row:c.row + c.n].transpose(0, 1).unsqueeze(0)             # [1, nh, n, d]
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
            out[c.row:c.row + c.n].view(c.n, nh, d).copy_(o[0].transpose(0, 1))
            continue
        qc = q[c.row:c.row + c.n].view(c.n, nkv, group, d).permute(1, 2, 0, 3)
        qc = qc.reshape(1, nkv, group * c.n, d)
        k, v = kv.gather(layer, c.blocks, "c")
        k = k.view(1, -1, nkv, d).transpose(1, 2)
        v = v.view(1, -1, nkv, d).transpose(1, 2)
        o = _attend(qc, k, v, c.mask(kv.block_size), scale, softcap)
        o = o.view(nkv, group, c.n, d).permute(2, 0, 1, 3)                  # [n, nkv, group, d]
        out[c.row:c.row + c.n].view(c.n, nkv, group, d).copy_(o)
