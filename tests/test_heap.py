"""`actorserve.heap.settle`: what `actorserve serve` does to the Python heap once it has loaded."""

from __future__ import annotations

import gc

from actorserve import heap


def test_settle_freezes_the_loaded_heap_and_raises_the_young_threshold():
    before = gc.get_threshold()
    kept = [object() for _ in range(10)]        # something alive to freeze
    try:
        gc.unfreeze()
        heap.settle()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (heap.GEN0_THRESHOLD, before[1], before[2])
        assert heap.GEN0_THRESHOLD > before[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert kept
