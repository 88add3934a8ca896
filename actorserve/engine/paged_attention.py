"""Paged KV storage and attention over it: the torch half of the paged-KV design.

Storage. Each layer owns one K and one V tensor of shape
``[num_blocks * block_size, n_kv_heads, head_dim]``; token ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size`` (the `BlockManager` hands out
the blocks, this module only reads the tables). The tensors start zeroed: padding rows that a
batched gather picks up are masked out, and zero (never NaN) keeps ``0 * v`` at zero.

A step. `plan_step` turns the scheduler's ``[(seq, n)]`` into one flat batch of ``T`` new
tokens (ids, positions, slots) plus the attention layout, computed once and shared by all
layers:

* decode groups: the members with ``n == 1`` (decodes, and a prefill whose last token is
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

from .sequence import Sequence


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

    def scratch(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of `shape` backed by a named buffer that only grows."""
        numel = 1
        for s in shape:
            numel *= s
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * buf.numel() if buf is not None else 0), dtype=self.dtype)
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
    blocks: torch.Tensor         # block ids covering its whole context
    mask: torch.Tensor           # [group * n, len(blocks) * bs] bool, True = attend


@dataclass(slots=True)
class DecodeGroup:
    """Members with ``n == 1`` whose contexts are attended together, padded to ``nb`` blocks."""

    rows: torch.Tensor           # [D] their flat rows, ascending
    blocks: torch.Tensor         # [D * nb] padded block ids
    mask: torch.Tensor           # [D, 1, 1, nb * bs] bool, True = attend
    dense: bool = False          # rows are exactly 0..T-1 (the whole step): no select/scatter


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


def plan_step(batch: list[tuple[Sequence, int]], block_size: int, group: int) -> StepPlan:
    """Lay out one step: flat tokens, their slots, and the attention groups."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    last_rows: list[int] = []
    dec_rows: list[int] = []
    dec_seqs: list[Sequence] = []
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
        table = seq.block_table
        if len(table) * bs < end:
            raise ValueError(f"{seq!r}: block table covers {len(table) * bs} tokens, step needs {end}")
        row = len(ids)
        ids.extend(seq.token_slice(start, min(end, known)))
        if end > known:                  # a speculative step: its drafts follow the last token
            ids.extend(seq.draft[:end - known])
        if n == 1:
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            dec_rows.append(row)
            dec_seqs.append(seq)
        else:
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            nb = -(-end // bs)
            q_pos = torch.arange(start, end)
            mask = torch.arange(nb * bs)[None, :] <= q_pos[:, None]          # [n, L] causal
            if group > 1:
                mask = mask.repeat(group, 1)                                # [group * n, L]
            chunks.append(Chunk(row, n, torch.tensor(table[:nb], dtype=torch.long), mask))
        last_rows.append(row + n - 1)

    groups = []
    if dec_seqs:
        needs = [-(-(s.num_computed + 1) // bs) for s in dec_seqs]
        for members in group_by_length(needs):
            nb = max(needs[i] for i in members)
            blk = [0] * (len(members) * nb)
            ctx = []
            for j, i in enumerate(members):
                s = dec_seqs[i]
                blk[j * nb:j * nb + needs[i]] = s.block_table[:needs[i]]
                ctx.append(s.num_computed + 1)
            mask = torch.arange(nb * bs)[None, :] < torch.tensor(ctx)[:, None]
            rows = [dec_rows[i] for i in members]
            groups.append(DecodeGroup(torch.tensor(rows, dtype=torch.long),
                                      torch.tensor(blk, dtype=torch.long),
                                      mask.view(len(members), 1, 1, -1),
                                      dense=len(rows) == len(ids)))
    return StepPlan(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        slots=torch.tensor(slots, dtype=torch.long),
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
                    scale: float, softcap: float | None = None) -> None:
    """Attention of the step's queries ``q [T, n_heads, d]`` (RoPE applied, K/V already
    written) over each member's paged context; writes ``[T, n_heads * d]`` into `out`.
    `softcap` soft-caps the attention logits (Gemma2's ``attn_logit_softcapping``)."""
    nh, d = q.shape[1], q.shape[2]
    nkv = kv.n_kv
    group = nh // nkv
    for g in plan.decode:
        D = g.rows.numel()
        qd = q if g.dense else q.index_select(0, g.rows)
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
        qc = q[c.row:c.row + c.n].view(c.n, nkv, group, d).permute(1, 2, 0, 3)
        qc = qc.reshape(1, nkv, group * c.n, d)
        k, v = kv.gather(layer, c.blocks, "c")
        k = k.view(1, -1, nkv, d).transpose(1, 2)
        v = v.view(1, -1, nkv, d).transpose(1, 2)
        o = _attend(qc, k, v, c.mask, scale, softcap)
        o = o.view(nkv, group, c.n, d).permute(2, 0, 1, 3)                  # [n, nkv, group, d]
        out[c.row:c.row + c.n].view(c.n, nkv, group, d).copy_(o)
