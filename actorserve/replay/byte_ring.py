"""The flight recorder's ring, held as bytes (issue 31: a server at rest should not grow).

Ring entries (`recorder_ring`) arrive as small tuples. The newest `chunk` of them stay tuples
(the hot path is one ``list.append``). When that tail is full it is *sealed*: one
``marshal.dumps`` of the whole chunk, which shares repeated strings (actor names, message types,
the same rid again) inside the chunk, so a sealed event takes about a quarter of its tuple's
memory.

Sealed chunks live in one of two places:

- **a buffer taken up front** (``preallocate=True``, the server): one ``bytearray`` of
  `max_bytes`, written as a circular log. A new chunk overwrites the oldest ones in its way,
  so the ring's memory is the same from the first request on. Nothing in it grows while it
  fills.
- **their own `bytes` objects** (the default, for tests and tools), evicted oldest first past
  `max_bytes` in all.

Either way the ring keeps at most `capacity` events. It evicts whole chunks, so it may hold up
to a chunk fewer. `entries()` gives every held event back as ``(seq, entry)``, equal to what
was appended; a compacted prompt (`array`) and a step's rows (`Pairs`) survive the trip.

Each sealed chunk also keeps a 1,024-bit mask of the request ids its entries name (a bit per id's
hash: a Bloom filter with one hash), so `entries(rid)` (one request's history,
`/debug/requests/{rid}`) unpacks the chunks that may hold that request, not the whole ring: on a
loaded server the whole 100,000-event ring took the event loop ~4 ms a read.
"""

from __future__ import annotations

import json
import marshal
from array import array
from collections import deque
from typing import Any, Iterator

from .recorder_ring import Pairs, plain

CHUNK = 1024                     # events a sealed chunk holds (a few tens of KB)
_TAG = ...                       # marks a compacted value in a sealed chunk (JSON data has none)


def _pack_data(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its compacted values in a form marshal keeps: ``(..., bytes)`` for a prompt
    array, ``(..., tuple)`` for `Pairs`."""
    out = {}
    for k, v in data.items():
        if type(v) is array:
            v = (_TAG, v.typecode, v.tobytes())
        elif type(v) is Pairs:
            v = (_TAG, v.flat)
        out[k] = v
    return out


def _unpack_data(data: dict[str, Any]) -> dict[str, Any]:
    for k, v in data.items():
        if type(v) is tuple and v and v[0] is _TAG:
            if len(v) == 3:
                a = array(v[1])
                a.frombytes(v[2])
                data[k] = a
            else:
                data[k] = Pairs(v[1])
    return data


def _packable(t: tuple) -> tuple:
    """Entry `t` as marshal takes it, one entry at a time (the slow path, for a chunk marshal
    refused): compacted values tagged; a value marshal cannot take as its JSON form."""
    if len(t) == 10 and t[9] is not None:
        t = (*t[:9], _pack_data(t[9]))
    try:
        marshal.dumps(t)
    except ValueError:
        t = tuple(json.loads(json.dumps(plain(x) if type(x) is dict else x, default=str))
                  if x is not None and type(x) not in (int, str, bool, float) else x for x in t)
        if len(t) == 10 and t[9] is not None:
            t = (*t[:9], _pack_data(t[9]))
    return t


def _rid_bit(rid: Any) -> int:
    """The bit of `rid` in a chunk's mask (`hash` is fixed within a process, the ring's life)."""
    return 1 << (hash(rid) & 1023)


def _unpacked(t: Any) -> tuple:
    t = tuple(t)
    if len(t) == 10 and type(t[9]) is dict:
        _unpack_data(t[9])
    return t


class ByteRing:
    """The newest `capacity` ring entries, sealed ones in at most `max_bytes`.

    The hot path is the recorder's own: ``ring.tail.append(entry)``, then `seal` once the tail
    holds `chunk` entries (`full`). The count bound is applied when the ring is read (`len`,
    `entries`: the newest `capacity`); what is held beyond it (at most a chunk) is let go at the
    next seal."""

    def __init__(self, capacity: int, max_bytes: int, *, preallocate: bool = False,
                 chunk: int = CHUNK) -> None:
        if capacity < 1 or max_bytes < 1:
            raise ValueError("a ring holds at least one event in at least one byte")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.chunk = max(1, min(chunk, capacity))
        self.tail: list[tuple] = []
        self.sealed_to = 0                   # seq of the last sealed entry (entries count from 1)
        # sealed chunks, oldest first: [first seq, events, offset (-1: outside the buffer),
        # length, blob or None, the mask of the request ids its entries name (`_rid_bit`)]
        self.chunks: deque[list[Any]] = deque()
        self.sealed = 0                      # entries in `chunks`
        self.sealed_bytes = 0
        self.buffer = bytearray(max_bytes) if preallocate else None   # zeroed: its pages are taken now
        self.head = 0                        # where the buffer's next chunk goes

    # -- writing ----------------------------------------------------------------------------------
    def append(self, t: tuple) -> None:
        tail = self.tail
        tail.append(t)
        if len(tail) >= self.chunk:
            self.seal()

    def seal(self) -> None:
        """Turn the tail into one sealed chunk, and let go of whole chunks no longer needed for
        the newest `capacity` entries."""
        tail, self.tail = self.tail, []
        if tail:
            first = self.sealed_to + 1
            self.sealed_to += len(tail)
            self._store(tail, first)
        while self.chunks and self.sealed - self.chunks[0][1] >= self.capacity:
            self._pop()

    def _store(self, entries: list[tuple], first: int) -> None:
        rids = 0
        for r in {t[1] for t in entries}:
            rids |= _rid_bit(r)
        packed = [t if len(t) == 4 or t[9] is None else (*t[:9], _pack_data(t[9])) for t in entries]
        try:
            blob = marshal.dumps(packed)
        except ValueError:                    # a value marshal cannot take: entry by entry
            blob = marshal.dumps([_packable(t) for t in entries])
        if len(blob) > self.max_bytes and len(entries) > 1:     # too big for the ring: halves
            half = len(entries) // 2
            self._store(entries[:half], first)
            self._store(entries[half:], first + half)
            return
        if len(blob) > self.max_bytes:        # one event larger than the ring: all it holds,
            while self.chunks:                # kept outside the buffer
                self._pop()
            self.head = 0
            self.chunks.append([first, 1, -1, len(blob), blob, rids])
        elif self.buffer is None:
            self.chunks.append([first, len(entries), -1, len(blob), blob, rids])
            while self.sealed_bytes + len(blob) > self.max_bytes:
                self._pop()
        else:
            self._place(blob, first, len(entries), rids)
        self.sealed += len(entries)
        self.sealed_bytes += len(blob)

    def _place(self, blob: bytes, first: int, count: int, rids: int) -> None:
        n = len(blob)
        at = self.head
        # an event held outside the buffer (larger than it) goes once the buffer is written again
        while self.chunks and self.chunks[0][2] < 0:
            self._pop()
        if at + n > self.max_bytes:          # wrap: what lies past the head is the oldest lap
            while self.chunks and self.chunks[0][2] >= at:
                self._pop()
            at = 0
        while self.chunks and at <= self.chunks[0][2] < at + n:     # the oldest chunks in the way
            self._pop()
        assert self.buffer is not None
        self.buffer[at:at + n] = blob
        self.head = at + n
        self.chunks.append([first, count, at, n, None, rids])

    def _pop(self) -> None:
        c = self.chunks.popleft()
        self.sealed -= c[1]
        self.sealed_bytes -= c[3]

    # -- reading ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return min(self.capacity, self.sealed + len(self.tail))

    def entries(self, rid: Any = ...) -> Iterator[tuple[int, tuple]]:
        """The newest `capacity` entries held, oldest first, with their seqs; with `rid`, only
        those whose request id (``entry[1]``) is `rid` (None: the entries of no request)."""
        tail = list(self.tail)
        first_wanted = self.sealed_to + len(tail) - len(self) + 1
        every = rid is ...
        bit = 0 if every else _rid_bit(rid)
        for first, _count, at, n, blob, rids in list(self.chunks):
            if first + _count <= first_wanted or not (every or rids & bit):
                continue
            raw = marshal.loads(blob if blob is not None else memoryview(self.buffer)[at:at + n])
            for i in range(max(0, first_wanted - first), len(raw)):
                if every or raw[i][1] == rid:
                    yield first + i, _unpacked(raw[i])
        seq = self.sealed_to + 1
        for i in range(max(0, first_wanted - seq), len(tail)):
            if every or tail[i][1] == rid:
                yield seq + i, tail[i]

    def memory(self) -> int:
        """Bytes the ring's sealed part takes (the whole buffer when it was taken up front)."""
        return len(self.buffer) if self.buffer is not None else self.sealed_bytes
