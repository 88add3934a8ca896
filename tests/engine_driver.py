"""Drive an `Engine` the way the scheduler will, for engine tests (greedy sampling only).

Per step: allocate blocks with the `BlockManager` so each member's table covers
``num_computed + n``, call ``engine.execute``, then advance ``num_computed``, register the
newly full blocks in the prefix cache (``commit``) and append the sampled token. The
runners never touch those fields; this helper plays the scheduler's part.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from actorserve.engine.scheduling.base import SeqOutput
from actorserve.engine.scheduling.block_manager import BlockManager
from actorserve.engine.scheduling.params import SamplingParams
from actorserve.engine.scheduling.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


class RecordingGreedy:
    """A greedy sampler (argmax) that also keeps every logits row it saw, per request id."""

    def __init__(self) -> None:
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]):
        logp = torch.log_softmax(logits, dim=-1)
        out = []
        for row, seq in enumerate(seqs):
            self.logits[seq.rid].append(logits[row].clone())
            tok = int(torch.argmax(logits[row]))
            out.append((tok, float(logp[row, tok]), None))
        return out


class Driver:
    def __init__(self, engine, bm: BlockManager) -> None:
        self.engine = engine
        self.bm = bm

    def new(self, rid: str, prompt: list[int], *, cached: bool = True, **params) -> Sequence:
        seq = Sequence(rid, prompt, sampling=SamplingParams(**{"temperature": 0.0, **params}))
        if cached:
            self.bm.match_prefix(seq)
        return seq

    def step(self, batch: list[tuple[Sequence, int]]) -> list[SeqOutput]:
        for seq, n in batch:
            assert self.bm.allocate(seq, n), "out of KV blocks"
        before = [(seq.num_computed, list(seq.block_table), len(seq.output_ids)) for seq, _ in batch]
        outs = self.engine.execute(batch)
        assert len(outs) == len(batch)
        for (seq, n), out, (nc, table, nout) in zip(batch, outs, before):
            assert out.seq is seq
            assert (seq.num_computed, seq.block_table, len(seq.output_ids)) == (nc, table, nout), \
                "the engine must not touch scheduler-owned fields"
            seq.num_computed += n
            self.bm.commit(seq)
            if out.token_id is not None:
                seq.output_ids.append(out.token_id)
        self.bm.check()
        return outs

    def finish(self, seq: Sequence) -> None:
        self.engine.release(seq)
        self.bm.free(seq)

    def run(self, seqs: list[Sequence], max_new_tokens: int, *, chunk: int | None = None,
            free: bool = True) -> list[list[int]]:
        """Run all `seqs` together until each has `max_new_tokens` outputs; prefill in
        chunks of at most `chunk` tokens (whole prompt when None)."""
        live = list(seqs)
        while live:
            batch = []
            for seq in live:
                n = seq.num_uncomputed
                batch.append((seq, min(n, chunk) if chunk else n))
            self.step(batch)
            for seq in list(live):
                if len(seq.output_ids) >= max_new_tokens:
                    live.remove(seq)
                    if free:
                        self.finish(seq)
        return [list(s.output_ids) for s in seqs]
