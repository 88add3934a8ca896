"""BlockManager against a simple model: reference counts, prefix reuse, eviction, flush."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from actorserve.engine.scheduling import block_manager
from actorserve.engine.scheduling.batching import BatchPolicy
from actorserve.engine.scheduling.block_manager import BlockManager, chain_hash
from actorserve.engine.scheduling.lane import Lane
from actorserve.engine.scheduling.sequence import Sequence

BS = 4
NUM = 12


class BlockManagerModel(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM, BS)
        self.live: dict[str, Sequence] = {}
        self.n = 0
        self.queried = 0              # tokens of the admissions that succeeded

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
            self.queried += seq.num_tokens
        else:
            self.bm.abort_match(seq)
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
        assert st_.prefix_queries_total == self.queried
        assert 0 <= st_.prefix_hit_tokens <= st_.prefix_query_tokens <= self.queried
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



def _counting_hash(monkeypatch) -> list[list[int]]:
    calls: list[list[int]] = []
    real = block_manager.chain_hash

    def counted(parent, tokens):
        calls.append(list(tokens))
        return real(parent, tokens)
    monkeypatch.setattr(block_manager, "chain_hash", counted)
    return calls


def _waits_for_memory(calls: list[list[int]], flush_at: int | None = None):
    """A request whose prompt starts with a cached 2-block prefix waits 5 steps behind a running
    one that holds every free block, then is admitted once that one ends."""
    bm = BlockManager(6, 4)
    prefix = list(range(1, 9))
    warm = Sequence("warm", prefix + [0])
    bm.match_prefix(warm)
    assert bm.allocate(warm, warm.num_tokens)
    warm.num_computed = warm.num_tokens
    bm.commit(warm)
    bm.free(warm)                                             # 2 cached blocks, 4 free
    hog = Sequence("hog", [99] * 16)
    assert bm.match_prefix(hog) == 0 and bm.allocate(hog, 16)
    hog.num_computed = 16                                     # running, nothing left to compute
    policy, lane, running = BatchPolicy(), Lane(), [hog]
    w = Sequence("w", prefix + list(range(20, 29)))           # 17 tokens: 4 full prompt blocks
    lane.append(w)
    calls.clear()
    for step in range(5):
        if step == flush_at:
            bm.flush()
        plan = policy.plan(running, [lane], bm)
        bm.check()
        assert not plan.admitted and lane.peek() is w and not w.block_table
        assert bm.stats().prefix_queries_total == 9 + 16       # the failed tries are not counted
    bm.free(hog)
    running.remove(hog)
    plan = policy.plan(running, [lane], bm)
    assert plan.admitted == [(w, 0 if flush_at is not None else 8)] and running == [w]
    w.num_computed = w.num_tokens                             # its prefill ran
    bm.commit(w)
    bm.check()
    return bm, w


def test_a_request_waiting_for_memory_is_counted_and_hashed_once(monkeypatch):
    calls = _counting_hash(monkeypatch)
    bm, w = _waits_for_memory(calls)
    # Six matches (five failed tries, one admission) and the commit: each prompt block hashed once.
    assert calls == [w.prompt_ids[i * 4:(i + 1) * 4] for i in range(4)]
    st_ = bm.stats()
    assert (st_.prefix_queries_total, st_.prefix_hits_total) == (9 + 16 + 17, 8)
    assert (st_.prefix_query_tokens, st_.prefix_hit_tokens) == (9 + 16 + 17, 8)
    assert st_.hit_rate == 8 / 42


def test_a_flush_while_waiting_leaves_no_stale_hit(monkeypatch):
    calls = _counting_hash(monkeypatch)
    bm, w = _waits_for_memory(calls, flush_at=2)              # the cached prefix goes mid-wait
    assert calls == [w.prompt_ids[i * 4:(i + 1) * 4] for i in range(4)]
    st_ = bm.stats()
    assert (st_.prefix_queries_total, st_.prefix_hits_total) == (9 + 16 + 17, 0)
    assert (st_.prefix_query_tokens, st_.prefix_hit_tokens) == (17, 0)  # the window since the flush


def test_kept_prompt_hashes_follow_the_prompt_and_the_block_size():
    bm = BlockManager(8, 2)
    a = Sequence("a", [1, 2, 3, 4, 5])
    bm.match_prefix(a)
    assert bm.allocate(a, 5)
    a.num_computed = 5
    bm.commit(a)
    bm.free(a)                                                # [1, 2], [3, 4] cached
    s = Sequence("s", [1, 2, 3, 4, 0])
    assert bm.match_prefix(s) == 4
    bm.abort_match(s)
    s.prompt_ids = [1, 2, 7, 7, 0]                            # a new prompt list: hashes redone
    assert bm.match_prefix(s) == 2
    bm.abort_match(s)
    s.prompt_ids.append(9)                                    # the same list, grown
    s.prompt_ids[2:4] = [3, 4]
    assert bm.match_prefix(s) == 4
    bm.abort_match(s)
    other = BlockManager(8, 4)                                # another block size
    b = Sequence("b", [1, 2, 3, 4, 5])
    other.match_prefix(b)
    assert other.allocate(b, 5)
    b.num_computed = 5
    other.commit(b)
    other.free(b)
    assert other.match_prefix(s) == 4 and bm.stats().prefix_queries_total == 5
    other.free(s)
    bm.check()
    other.check()
