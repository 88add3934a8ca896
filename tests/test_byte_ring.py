"""The flight recorder's ring held as bytes (`replay.byte_ring`): what goes in comes out, the
count bound is exact, and a buffer taken up front never grows."""

from __future__ import annotations

import random
from array import array
from collections import deque

import pytest

from actorserve.replay.byte_ring import ByteRing
from actorserve.replay.recorder import FlightRecorder
from actorserve.replay.recorder_ring import Pairs, compact
from actorserve.actors.clock import ManualClock


def _entry(rng: random.Random, i: int) -> tuple:
    roll = rng.random()
    if roll < 0.5:                                    # a message: 4 fields
        return (i * 1000, f"r{rng.randrange(50)}", "TokenOut", f"req:r{rng.randrange(50)}")
    data = None
    if roll < 0.7:
        data = compact({"prompt": [rng.randrange(50_000) for _ in range(rng.randrange(1, 300))]})
    elif roll < 0.85:
        data = compact({"step": i, "batch": [[f"r{k}", rng.randrange(9)] for k in range(rng.randrange(1, 20))]})
    elif roll < 0.9:
        data = {"odd": [["a", 1, "stop"]], "f": 1.5, "none": None, "t": True}
    return (i * 1000, f"r{i}", "generation", "advance", "queued", "prefill",
            None if rng.random() < 0.9 else "not allowed", i - 1, "abc", data)


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    if len(a) == 4 or a[9] is None or b[9] is None:
        return a == b
    da, db = a[9], b[9]
    if a[:9] != b[:9] or da.keys() != db.keys():
        return False
    for k in da:
        x, y = da[k], db[k]
        if type(x) is not type(y):
            return False
        if isinstance(x, array):
            if (x.typecode, x.tolist()) != (y.typecode, y.tolist()):
                return False
        elif isinstance(x, Pairs):
            if x.flat != y.flat:
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("capacity,chunk,preallocate,max_bytes", [
    (10, 10, False, 1 << 20), (100, 7, False, 1 << 20), (1000, 64, True, 1 << 20),
    (5000, 128, True, 60_000), (5000, 128, False, 60_000), (3, 1024, True, 4096)])
def test_the_ring_gives_back_what_it_was_given_and_its_bound_is_exact(capacity, chunk, preallocate, max_bytes):
    rng = random.Random(capacity + chunk)
    ring = ByteRing(capacity, max_bytes, preallocate=preallocate, chunk=chunk)
    model: deque = deque()
    buffer = ring.buffer
    for i in range(1, 4001):
        t = _entry(rng, i)
        ring.append(t)
        model.append((i, t))
        if i % 397 == 0 or i == 4000:
            got = list(ring.entries())
            # the count bound is exact unless the bytes bound is what binds
            assert len(got) == len(ring) <= capacity
            if max_bytes >= 1 << 20:
                assert len(got) == min(i, capacity)
            want = list(model)[-len(got):]
            assert [s for s, _ in got] == [s for s, _ in want] == list(range(i - len(got) + 1, i + 1))
            assert all(_same(a, b) for (_, a), (_, b) in zip(got, want))
            assert ring.sealed_bytes <= max_bytes
    if preallocate:                       # the buffer is the one taken at the start, same size
        assert ring.buffer is buffer and len(buffer) == max_bytes and ring.memory() == max_bytes
    else:
        assert ring.buffer is None
    if max_bytes < 1 << 20 and capacity > 1000:
        assert len(ring) < capacity       # here the bytes bound is the one that bound


def test_an_event_larger_than_the_ring_is_all_it_holds_until_the_buffer_is_written_again():
    ring = ByteRing(100, 2048, preallocate=True, chunk=4)
    for i in range(1, 12):
        ring.append((i, "r", "M", "a"))
    big = (12, "r", "input", "generate", None, None, None, None, None, compact({"prompt": list(range(2000))}))
    ring.append(big)                      # seq 12 ends a chunk: sealed now, alone
    ((seq, t),) = ring.entries()
    assert seq == 12 and t[9]["prompt"].tolist() == list(range(2000)) and ring.sealed_bytes > 2048
    for i in range(13, 40):               # the next chunk needs the buffer: the big one goes
        ring.append((i, "r", "M", "a"))
    got = list(ring.entries())
    assert [s for s, _ in got] == list(range(13, 40)) and all(s == t[0] for s, t in got)


def test_values_marshal_cannot_take_come_back_as_their_json():
    class Mode(str):
        pass

    ring = ByteRing(10, 1 << 16, chunk=2)
    ring.append((1, "r", "step", "step", None, None, None, None, None, {"mode": Mode("fast"), "o": object}))
    ring.append((2, "r", "M", "a"))
    (_, t), (_, m) = ring.entries()
    assert t[9]["mode"] == "fast" and type(t[9]["mode"]) is str and t[9]["o"].startswith("<class")
    assert m == (2, "r", "M", "a")


def test_a_preallocated_recorder_records_what_a_plain_one_does():
    plain, pre = FlightRecorder(clock=ManualClock()), \
        FlightRecorder(clock=ManualClock(), capacity=100_000, ring_bytes=4 << 20, preallocate=True)
    for rec in (plain, pre):
        for i in range(3000):
            rec.input("generate", rid=f"r{i}", data={"prompt": [i, i + 1, 7], "max_tokens": 4})
            rec.note("step", "step", data={"batch": [[f"r{i}", 3]], "out": [[f"r{i}", 9]]})

            class TokenOut:
                rid = f"r{i}"
            rec.message(f"req:r{i}", TokenOut())
    assert pre.events() == plain.events() and len(pre) == 9000
    assert pre.ring.memory() == 4 << 20 and len(pre.ring.tail) < 1024
    assert pre.ring.sealed_bytes < 9000 * 60          # sealed: well under a tuple's size an event


def test_serve_flags_size_the_ring_and_refuse_an_empty_one():
    import argparse

    from actorserve.http.edge import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    cfg = serve_cli.config_from_args(p.parse_args([]))
    assert (cfg.recorder.capacity, cfg.recorder.ring_bytes) == (100_000, 12 << 20)
    cfg = serve_cli.config_from_args(p.parse_args(["--recorder-events", "5000", "--recorder-ring-mb", "0.5"]))
    assert (cfg.recorder.capacity, cfg.recorder.ring_bytes) == (5000, 512 << 10)
    with pytest.raises(ValueError, match="at least 1 event"):
        serve_cli.config_from_args(p.parse_args(["--recorder-events", "0"]))


@pytest.mark.parametrize("preallocate", [False, True])
def test_one_requests_entries_come_from_only_the_chunks_that_may_hold_it(preallocate, monkeypatch):
    import actorserve.replay.byte_ring as br

    ring = ByteRing(5000, 1 << 20, preallocate=preallocate, chunk=64)
    # requests r0..r29, 100 seqs each; between them entries of one-off ids and of none
    entries = [(i, f"r{i // 100}", "M", "a") if i % 3 else
               (i, f"x{i}" if i % 2 else None, "generation", "advance", "queued", "prefill",
                None, i - 1, "abc", {"i": i}) for i in range(1, 3001)]
    for t in entries:
        ring.append(t)
    loads = []
    real = br.marshal.loads
    monkeypatch.setattr(br.marshal, "loads", lambda b: loads.append(1) or real(b))
    every = list(ring.entries())
    whole = len(loads)
    for rid in ("r7", "r29", "r2999", None, "absent"):
        loads.clear()
        got = list(ring.entries(rid))
        assert got == [(s, t) for s, t in every if t[1] == rid]
        if rid == "r7":     # r7's own entries (seqs 700-799) span 2-3 chunks of 64; each chunk
            # names ~17 ids, so another chunk shares r7's bit of 1,024 about 1.7% of the time
            assert len(got) == 67 and 2 <= len(loads) < whole // 4
    assert whole == len(ring.chunks) > 40
