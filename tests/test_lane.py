"""`Lane`: the scheduler's waiting queue, FIFO with O(1) removal from anywhere."""

from __future__ import annotations

from collections import deque
import random

import pytest

from actorserve.engine.scheduling.lane import Lane
from actorserve.engine.scheduling.sequence import Sequence


def seqs(n: int) -> list[Sequence]:
    return [Sequence(f"r{i}", [i]) for i in range(n)]


def test_removals_in_the_middle_keep_the_order_of_the_rest():
    s = seqs(8)
    lane = Lane(s)
    assert lane.discard(s[3]) and lane.discard(s[5]) and lane.discard(s[0])
    assert not lane.discard(s[3])                     # already gone
    assert not lane.discard(Sequence("r3", [3]))      # same rid, another sequence: not a member
    assert list(lane) == [s[1], s[2], s[4], s[6], s[7]] and len(lane) == 5
    assert s[4] in lane and s[5] not in lane
    assert lane.peek() is s[1] and lane.popleft() is s[1] and lane.peek() is s[2]
    lane.append(s[3])                                 # back at the tail
    assert [x.rid for x in lane] == ["r2", "r4", "r6", "r7", "r3"]


def test_it_behaves_as_a_deque_under_random_operations():
    """The model is a deque (remove = linear scan): every operation the scheduler uses, in any
    order, leaves both with the same members in the same order."""
    rng = random.Random(7)
    pool = seqs(60)
    lane, model = Lane(), deque()
    for _ in range(5000):
        op = rng.randrange(6)
        out = [x for x in pool if x not in model]
        if op == 0 and out:
            x = rng.choice(out)
            lane.append(x), model.append(x)
        elif op == 1 and out:
            x = rng.choice(out)
            lane.appendleft(x), model.appendleft(x)
        elif op == 2 and out:
            xs = rng.sample(out, min(len(out), 3))
            lane.extendleft(xs), model.extendleft(xs)          # the last one ends up first
        elif op == 3 and model:
            assert lane.peek() is model[0] and lane.popleft() is model.popleft()
        elif op == 4 and model:
            x = rng.choice(model)
            assert lane.discard(x)
            model.remove(x)
        elif op == 5:
            n = rng.randrange(-3, 4)
            lane.rotate(n), model.rotate(n)
        assert list(lane) == list(model) and len(lane) == len(model) and bool(lane) == bool(model)


def test_empty_lane_and_double_insertion_are_refused():
    lane = Lane()
    with pytest.raises(IndexError):
        lane.peek()
    with pytest.raises(IndexError):
        lane.popleft()
    s = seqs(1)[0]
    lane.append(s)
    with pytest.raises(ValueError):
        lane.appendleft(s)
    lane.clear()
    assert not lane and list(lane) == []
