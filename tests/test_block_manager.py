"""BlockManager against a simple model: reference counts, prefix reuse, eviction, flush."""

from __future__ import annotations

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


def test_prefix_hit_reuses_blocks_and_lru_evicts_oldest():
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
    assert bm.stats().hit_rate > 0
    bm.free(b)
    c = Sequence("c", [7, 7, 7, 7, 7, 7, 7])   # needs all 4 blocks: evicts the cached ones
    bm.match_prefix(c)
    assert bm.allocate(c, 7)
    d = Sequence("d", [1, 2, 3, 4, 9])
    bm.free(c)
    assert bm.match_prefix(d) == 0
