"""BlockManager against a simple model: reference counts, prefix reuse, eviction, flush."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from actorserve.engine.block_manager import BlockManager, chain_hash
from actorserve.engine.sequence import Sequence

BS = 4
NUM = 12


class BlockManagerModel(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM, BS)
        self.live: dict[str, Sequence] = {}
        self.n = 0

    @rule(target=seqs, prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], []]),
          tail=st.lists(st.integers(1, 5), min_size=1, max_size=9))
    def admit(self, prefix, tail):
        self.n += 1
        seq = Sequence(f"s{self.n}", prefix + tail)
        cached = self.bm.match_prefix(seq)
        assert cached % BS == 0 and cached < seq.num_tokens
        need = seq.num_uncomputed
        if self.bm.allocate(seq, need):
            seq.num_computed += need
            self.bm.commit(seq)
            self.live[seq.rid] = seq
        else:
            self.bm.free(seq)
            assert not seq.block_table
        return seq.rid

    @rule(rid=seqs)
    def decode(self, rid):
        seq = self.live.get(rid)
        if seq is None:
            return
        seq.output_ids.append(3)
        if self.bm.allocate(seq, 1):
            seq.num_computed += 1
            self.bm.commit(seq)
        else:
            seq.output_ids.pop()

    @rule(rid=seqs)
    def free(self, rid):
        seq = self.live.pop(rid, None)
        if seq is not None:
            self.bm.free(seq)
            assert seq.block_table == [] and seq.num_computed == 0

    @rule()
    def flush(self):
        if not self.live:
            self.bm.flush()
            assert self.bm.stats().cached_free_blocks == 0

    @invariant()
    def accounting(self):
        self.bm.check()
        held = {b for s in self.live.values() for b in s.block_table}
        st_ = self.bm.stats()
        assert st_.used_blocks == len(held)
        assert st_.free_blocks + st_.cached_free_blocks + st_.used_blocks == NUM
        for s in self.live.values():
            assert len(s.block_table) * BS >= s.num_computed
            # a shared block holds the same tokens for everyone who holds it
            tokens = s.token_ids()
            parent = b""
            for i, h in enumerate(s.block_hashes):
                parent = chain_hash(parent, tokens[i * BS:(i + 1) * BS])
                assert parent == h


TestBlockManager = BlockManagerModel.TestCase
TestBlockManager.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


def test_prefix_hit_reuses_blocks():
    bm = BlockManager(4, 2)
    a = Sequence("a", [1, 2, 3, 4, 5])
    bm.match_prefix(a)
    assert bm.allocate(a, 5)
    a.num_computed = 5
    bm.commit(a)
    shared = list(a.block_table[:2])
    bm.free(a)
    b = Sequence("b", [1, 2, 3, 4, 9])
    assert bm.match_prefix(b) == 4 and b.block_table == shared
    assert bm.stats().hit_rate == 4 / 10                      # 4 of the 5 + 5 queried tokens
    bm.free(b)


def _cache_prefixes(bm: BlockManager, n: int) -> None:
    """Cache the one-block prefixes ``[p, p]`` for p = 1..n, each by a request that ends."""
    for p in range(1, n + 1):
        seq = Sequence(f"make{p}", [p, p, 0])                 # one full block and a partial one
        assert bm.match_prefix(seq) == 0 and bm.allocate(seq, 3)
        seq.num_computed = 3
        bm.commit(seq)
        bm.free(seq)


def _touch(bm: BlockManager, p: int) -> None:
    seq = Sequence(f"touch{p}", [p, p, 0])
    assert bm.match_prefix(seq) == 2                          # a hit: block in use again...
    bm.free(seq)                                              # ...and back, most recently used


@pytest.mark.parametrize("evictions", [1, 2, 3, 4])
def test_lru_evicts_least_recently_used(evictions):
    # Prefixes 1..5 are cached in that order, then used again in the order 2, 4, 1, 5, so
    # least-recently-used first the order is 3, 2, 4, 1, 5. FIFO (by caching order) would
    # evict 1 first, MRU 5, and a random or LIFO policy would keep the wrong set.
    bm = BlockManager(2 * 5 + 3, 2)
    _cache_prefixes(bm, 5)
    for p in (2, 4, 1, 5):
        _touch(bm, p)
    st_ = bm.stats()
    assert (st_.cached_free_blocks, st_.free_blocks) == (5, 8)
    # A new request that needs every plain free block and `evictions` cached ones.
    big = Sequence("big", [99] * (2 * (st_.free_blocks + evictions)))
    assert bm.match_prefix(big) == 0 and bm.allocate(big, big.num_tokens)
    assert bm.stats().cached_free_blocks == 5 - evictions
    survivors = {p for p in range(1, 6) if _cached(bm, p)}
    assert survivors == set([3, 2, 4, 1, 5][evictions:])
    bm.check()


def _cached(bm: BlockManager, p: int) -> bool:
    seq = Sequence(f"probe{p}", [p, p, 0])
    hit = bm.match_prefix(seq) == 2
    bm.free(seq)
    return hit


def test_a_held_cached_block_is_never_evicted():
    bm = BlockManager(2 * 2, 2)
    _cache_prefixes(bm, 2)                                    # 1 is now least recently used
    holder = Sequence("holder", [1, 1, 0])
    assert bm.match_prefix(holder) == 2                       # ...but in use again
    big = Sequence("big", [99] * 6)                          # 2 free + 1 eviction: must take 2's block
    assert bm.match_prefix(big) == 0 and bm.allocate(big, 6)
    assert holder.block_table[0] not in big.block_table
    assert not bm.allocate(Sequence("more", [98, 98]), 2)     # nothing left to evict
    bm.free(big)
    bm.free(holder)
    assert _cached(bm, 1) and not _cached(bm, 2)
    bm.check()


def test_token_slice_equals_the_whole_list_sliced():
    # Every range over a prompt/output boundary, ranges past the end and empty ones.
    for n_prompt in (0, 1, 3):
        for n_out in (0, 1, 4):
            seq = Sequence("s", list(range(10, 10 + n_prompt)))
            seq.output_ids.extend(range(50, 50 + n_out))
            whole = seq.token_ids()
            for start in range(seq.num_tokens + 3):
                for end in range(seq.num_tokens + 3):
                    assert seq.token_slice(start, end) == whole[start:end], (n_prompt, n_out, start, end)


def test_match_and_commit_never_build_the_whole_token_list(monkeypatch):
    def whole(self):
        raise AssertionError("token_ids() called")
    bm = BlockManager(8, 2)
    a = Sequence("a", [1, 2, 3, 4, 5])
    a.output_ids.extend([6, 7, 8])                            # blocks across prompt and output
    monkeypatch.setattr(Sequence, "token_ids", whole)
    assert bm.match_prefix(a) == 0 and bm.allocate(a, a.num_tokens)
    a.num_computed = a.num_tokens
    bm.commit(a)
    assert len(a.block_hashes) == 4
    bm.free(a)
    b = Sequence("b", [1, 2, 3, 4, 5])
    b.output_ids.extend([6, 7, 0])
    assert bm.match_prefix(b) == 6                            # two prompt blocks and the mixed one
    monkeypatch.undo()
    parent = b""
    for i, h in enumerate(b.block_hashes):
        parent = chain_hash(parent, b.token_ids()[2 * i:2 * i + 2])
        assert h == parent
    bm.free(b)
    bm.check()
