"""Paged KV accounting: ref-counted blocks and a prefix cache over full blocks.

Pure bookkeeping (no torch): the runner owns the K/V tensors and writes token ``i`` of a
sequence into slot ``block_table[i // block_size] * block_size + i % block_size``.

Prefix cache. A full block is named by a chain hash, sha256(parent hash || token ids), so a
block matches only when the whole prefix before it matches too; sha256 makes an accidental
collision practically impossible. Blocks whose reference count drops to zero keep their hash
and sit in an LRU of evictable blocks; allocation takes plain free blocks first and then evicts
the least recently used cached block.

Adapters. A sequence under a LoRA adapter (`Sequence.lora`) computes other K/V than the base
model for the same tokens, so its chain starts from the adapter's digest (``lora.key``) instead
of the empty root: its blocks match only blocks computed under the same adapter weights, never
the base's or another adapter's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import NamedTuple

from .sequence import Sequence


class KVStats(NamedTuple):
    num_blocks: int
    free_blocks: int          # never used or flushed
    cached_free_blocks: int   # refcount 0 but still holding a cached prefix (evictable)
    used_blocks: int          # refcount > 0
    prefix_query_tokens: int  # since start or the last flush (the hit rate's window)
    prefix_hit_tokens: int
    prefix_queries_total: int = 0   # tokens looked up in the prefix cache since start (a counter)
    prefix_hits_total: int = 0      # of those, tokens found cached (a counter; flush keeps it)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def chain_root(seq: Sequence) -> bytes:
    """Where the sequence's chain of block hashes starts: b"" for the base model, the digest of
    its adapter's weights under a LoRA adapter (see the module docstring)."""
    lora = seq.lora
    return b"" if lora is None else lora.key


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}            # block -> chain hash (full, registered blocks)
        self._block_of: dict[bytes, int] = {}           # chain hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached blocks, LRU first
        self._query_tokens = 0
        self._hit_tokens = 0
        self._queries_total = 0        # never reset: the counters vLLM's prefix_cache_* export
        self._hits_total = 0

    # -- queries -------------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, n_tokens: int) -> int:
        total = -(-(seq.num_computed + n_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= self.num_available

    def stats(self) -> KVStats:
        used = self.num_blocks - len(self._free) - len(self._evictable)
        return KVStats(self.num_blocks, len(self._free), len(self._evictable), used,
                       self._query_tokens, self._hit_tokens, self._queries_total, self._hits_total)

    # -- prefix cache ----------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached full blocks that prefix `seq`; return the number of tokens reused.

        At least one token is always left to compute, so the step that follows produces logits;
        a sequence that still owes prompt logprobs reuses nothing from the first position they
        need (`Sequence.prompt_logprob_from`). Call only on a sequence that holds no blocks.
        The query is counted here; an admission that then fails undoes it (`abort_match`).
        """
        assert not seq.block_table, "match_prefix on a sequence that already holds blocks"
        n_tokens = seq.num_tokens
        self._query_tokens += n_tokens
        self._queries_total += n_tokens
        if not self.enable_prefix_cache:
            return 0
        bs = self.block_size
        parent = chain_root(seq)
        matched = 0
        limit = n_tokens - 1
        if seq.prompt_logprob_from is not None:
            limit = min(limit, seq.prompt_logprob_from)
        for i in range(limit // bs):
            h = self._block_hash(seq, i, parent)
            block = self._block_of.get(h)
            if block is None:
                break
            self._take(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            parent = h
            matched += bs
        seq.num_computed = seq.num_cached = matched
        self._hit_tokens += matched
        self._hits_total += matched
        return matched

    def abort_match(self, seq: Sequence) -> None:
        """Undo the `match_prefix` of an admission that failed (its blocks could not be
        allocated; the sequence stays queued): release its blocks and take its query back out of
        the counters, so a sequence that waits for memory is counted once, when it is admitted.
        Call it right after that `match_prefix` (the same step: no flush in between)."""
        hits = seq.num_cached
        self.free(seq)
        self._queries_total -= seq.num_tokens
        self._hits_total -= hits
        self._query_tokens = max(0, self._query_tokens - seq.num_tokens)
        self._hit_tokens = max(0, self._hit_tokens - hits)

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_cache:
            return
        full = seq.num_computed // self.block_size
        if full <= len(seq.block_hashes):
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else chain_root(seq)
        for i in range(len(seq.block_hashes), full):
            h = self._block_hash(seq, i, parent)
            block = seq.block_table[i]
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block
                self._hash_of[block] = h
            seq.block_hashes.append(h)
            parent = h

    def _block_hash(self, seq: Sequence, i: int, parent: bytes) -> bytes:
        """The chain hash of full block ``i`` of `seq` (``parent``: block ``i - 1``'s).

        A prompt block's is computed once per sequence and kept on it (`Sequence.prompt_hashes`,
        filled in order; recomputed only if the prompt list or the block size is not the one they
        were made for). A block reaching into the output is hashed from its tokens each time:
        the output grows, and such a block is hashed again only after a retraction."""
        bs = self.block_size
        prompt = seq.prompt_ids
        if (i + 1) * bs > len(prompt):
            return chain_hash(parent, seq.token_slice(i * bs, (i + 1) * bs))
        key = seq.prompt_hash_key
        root = chain_root(seq)
        if key is None or key[0] != bs or key[1] is not prompt or key[2] != len(prompt) or key[3] != root:
            seq.prompt_hashes = []
            seq.prompt_hash_key = (bs, prompt, len(prompt), root)
        cache = seq.prompt_hashes
        while len(cache) <= i:
            j = len(cache)
            cache.append(chain_hash(cache[-1] if cache else root, prompt[j * bs:(j + 1) * bs]))
        return cache[i]

    def flush(self) -> int:
        """Forget every cached prefix that no sequence holds; return how many blocks it freed."""
        n = 0
        for block in list(self._evictable):
            self._forget(block)
            self._free.append(block)
            n += 1
        self._evictable.clear()
        for block, h in list(self._hash_of.items()):  # in-use blocks stop being shareable
            del self._hash_of[block]
            del self._block_of[h]
        self._query_tokens = self._hit_tokens = 0
        return n

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, n_tokens: int) -> bool:
        """Grow the block table to cover ``num_computed + n_tokens``; all or nothing."""
        need = self.blocks_needed(seq, n_tokens)
        if need == 0:
            return True
        if need > self.num_available:
            return False
        for _ in range(need):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            self._ref[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (tail first, so the tail is evicted first) and reset it."""
        for block in reversed(seq.block_table):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, f"block {block} released twice"
            if self._ref[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table.clear()
        seq.table_epoch += 1           # mirrors of the table (`engine.runners.block_tables`) start over
        seq.block_hashes.clear()
        seq.num_computed = 0
        seq.num_cached = 0

    # -- internals -------------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            self._evictable.pop(block, None)
        self._ref[block] += 1

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]

    def check(self) -> None:
        """Assert the internal invariants (tests call this)."""
        free = set(self._free)
        ev = set(self._evictable)
        assert not free & ev, "a block is both free and evictable"
        for b in range(self.num_blocks):
            r = self._ref[b]
            if r == 0:
                assert (b in free) != (b in ev), f"unreferenced block {b} is lost"
            else:
                assert b not in free and b not in ev, f"referenced block {b} is on a free list"
        assert len(self._hash_of) == len(self._block_of)
