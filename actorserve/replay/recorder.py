"""The flight recorder: every message and every transition, allowed or not, as one event.

Event schema (docs/recording.md has the long form)::

    seq    int        1, 2, 3 ... in the order things happened on the event loop
    t_ns   int        monotonic nanoseconds from the runtime's clock
    rid    str|None   request (or control / session) id the event belongs to
    kind   str        "message", "step", or a lifecycle name: generation, pooling, control,
                      server, session
    event  str        message type, "step", "create", or the lifecycle event fired
    src    str|None   state before (transitions); None for messages
    dst    str|None   state after (None when the transition was refused); the receiving
                      actor for messages
    ok     bool       False for a refused transition
    error  str|None   why it was refused
    cause  int|None   seq of the message whose handler caused this event
    defn   str|None   hash of the lifecycle definition that ran (transitions only)
    data   dict|None  extra: step members [[rid, n_tokens], ...], request kind, probe flag ...

Events live in a bounded ring (`byte_ring.ByteRing`: the newest events as tuples, cheap on the
hot path, older ones sealed into marshalled chunks, in a buffer taken up front when the server
asks for one) and, when a path is given, are appended to a JSONL file.

Ring entries are compact (`recorder_ring`: ``seq`` and ``ok`` derived, a message in 4 fields,
prompts as 4-byte ints, a step's rows flat); `events`, live subscribers and the file see the
same 12-field events as before, so what a recording proves is unchanged.

The file opens with one `{"header": ...}` line that holds the lifecycle definitions the run
used, so replay can tell a history recorded under other definitions. Files rotate at `max_bytes` (`PATH`,
`PATH.1`, ...), each new file starting with its own header.

*Fleet recordings.* A recorder made with ``replica="r0"`` names its replica in the header,
and every header carries a clock anchor, ``{"t_ns": ..., "wall_ns": ...}``: one reading of
the event clock and one of the wall clock, taken together. Event times stay on the
runtime's monotonic clock; ``wall_ns + (t_ns - anchor.t_ns)`` puts them on the wall clock,
which recordings from different processes share (`replay.fleet` merges them so).

*Incarnations and the end marker.* A recorder never destroys an earlier recording: when its
path already holds one as it first opens (a replica restarted with the same command line),
that recording and its rotated parts move aside to ``STEM.prev-K.jsonl`` (``.1``, ``.2`` ...
with it), K one more than any already there, so ``prev-1`` is the first incarnation and the
path itself always the newest (`incarnation_path`, `incarnation_of`). `close` ends the file
with ``{"end": {"seq", "t_ns", "wall_ns"}}``; the header says ``"end_marker": true`` (this
recorder writes one), so a file of such a recorder without the marker was not closed in
order: still being written, or its process was killed (a ``prev`` one: certainly killed, a
later incarnation took its path). `read_recording` hands the marker back as ``header["end"]``.

Live listeners (the ``/debug/events`` stream) `subscribe(callback)`: each new event is handed to
every callback as an `Event`, synchronously, right after it is recorded. With no subscriber the
hot path costs one falsy check (within noise of before); a callback that raises is dropped.
"""

from __future__ import annotations

import json
import os
import re
import time
from json.encoder import encode_basestring
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable

from ..actors.clock import Clock, LoopClock
from .byte_ring import ByteRing
from .recorder_ring import COMPACTED, compact as _compact, fields as _fields, plain as _plain, to_json_list as _list

FIELDS = ("seq", "t_ns", "rid", "kind", "event", "src", "dst", "ok", "error", "cause", "defn", "data")
_LINE = ('{"seq":%d,"t_ns":%d,"rid":%s,"kind":%s,"event":%s,"src":%s,"dst":%s,"ok":%s,"error":%s,'
         '"cause":%s,"defn":%s,"data":%s}')


def _js(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, str):
        return encode_basestring(v)
    if v is True:
        return "true"
    if v is False:
        return "false"
    return json.dumps(v, separators=(",", ":"), default=_list)


def _event(seq: int, t: tuple) -> "Event":
    """The `Event` at `seq` whose ring entry is `t`, its prompt a list again."""
    f = _fields(seq, t)
    data = f[11]
    if data is not None and not COMPACTED.isdisjoint(data):
        f = (*f[:11], _plain(data))
    return Event(*f)


def to_line(ev: tuple) -> str:
    """One event's 12 fields, in `FIELDS` order, as its JSONL line: the same JSON as `json.dumps`
    of its dict, 3x faster (the file sink's cost is on the event loop)."""
    return _LINE % (ev[0], ev[1], _js(ev[2]), _js(ev[3]), _js(ev[4]), _js(ev[5]), _js(ev[6]),
                    _js(ev[7]), _js(ev[8]), _js(ev[9]), _js(ev[10]), _js(ev[11]))


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    t_ns: int
    rid: str | None
    kind: str
    event: str
    src: str | None
    dst: str | None
    ok: bool
    error: str | None
    cause: int | None
    defn: str | None
    data: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Event":
        return cls(**{f: d.get(f) for f in FIELDS})


class FlightRecorder:
    """Implements the lifecycle `TransitionObserver` and the actor system's message hook."""

    def __init__(self, *, capacity: int = 100_000, path: str | os.PathLike[str] | None = None,
                 clock: Clock | None = None, lifecycles: Iterable[Any] = (),
                 max_bytes: int = 256 << 20, backups: int = 3, record_messages: bool = True,
                 flush_every: int = 512, replica: str | None = None,
                 wall_clock: Callable[[], int] = time.time_ns, ring_bytes: int | None = None,
                 preallocate: bool = False) -> None:
        self.clock: Clock = clock or LoopClock()
        self.replica = replica
        self.wall_clock = wall_clock
        # entries: see `recorder_ring`; `ring_bytes` bounds the sealed part (default: ample for
        # `capacity` events); `preallocate` takes that memory now (the server)
        self.ring = ByteRing(capacity, ring_bytes or capacity * 512, preallocate=preallocate)
        self.seq = 0
        self.cause: int | None = None
        self.record_messages = record_messages
        self.path = os.fspath(path) if path is not None else None
        self.max_bytes = max_bytes
        self.backups = backups
        self._lifecycles = {lc.name: lc for lc in lifecycles}
        self._pending: list[tuple] = []
        self._flush_every = flush_every
        self._file: IO[str] | None = None
        self._written = 0
        self._subscribers: list[Callable[[Event], None]] = []
        if self.path is not None:
            keep_earlier(self.path)
            self._open()

    # -- recording (hot path) ---------------------------------------------------------------------
    def _add(self, rid: str | None, kind: str, event: str, src: str | None, dst: str | None,
             error: str | None, cause: int | None, defn: str | None,
             data: dict[str, Any] | None) -> int:
        seq = self.seq = self.seq + 1
        t = (self.clock.now_ns(), rid, kind, event, src, dst, error, cause, defn, data)
        ring = self.ring
        tail = ring.tail
        tail.append(t)
        if len(tail) >= ring.chunk:
            ring.seal()
        if self._file is not None or self._subscribers:
            self._emit(seq, t)
        return seq

    def _emit(self, seq: int, t: tuple) -> None:
        if self._file is not None:
            self._pending.append((seq, t))
            if len(self._pending) >= self._flush_every:
                self.flush()
        if self._subscribers:          # one falsy check when nobody listens
            self._publish(_event(seq, t))

    # -- live subscribers -------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Call `callback(event)` for every event recorded from now on; returns `unsubscribe`."""
        self._subscribers = [*self._subscribers, callback]     # copy: safe while publishing

        def unsubscribe() -> None:
            self._subscribers = [c for c in self._subscribers if c is not callback]

        return unsubscribe

    def _publish(self, event: "Event") -> None:
        for cb in self._subscribers:
            try:
                cb(event)
            except Exception:          # a broken listener must never break recording
                self._subscribers = [c for c in self._subscribers if c is not cb]

    def message(self, actor: str, message: Any) -> None:
        """A message is being handled by `actor`; what its handler does is caused by it."""
        if self.record_messages:
            seq = self.cause = self.seq = self.seq + 1
            t = (self.clock.now_ns(), getattr(message, "rid", None), type(message).__name__, actor)
            ring = self.ring
            tail = ring.tail
            tail.append(t)
            if len(tail) >= ring.chunk:
                ring.seal()
            if self._file is not None or self._subscribers:
                self._emit(seq, t)

    def transition(self, lc: Any, model: Any, event: str, src: Any, dst: Any,
                   error: str | None, cause: str | None = None) -> None:
        self._add(getattr(model, "rid", None), lc.name, event, src.name,
                  dst.name if dst is not None else None, error, self.cause, lc.definition_hash, None)

    def created(self, lc: Any, model: Any, data: dict[str, Any] | None = None) -> None:
        """A lifecycle instance came to be, in its initial state."""
        self._add(getattr(model, "rid", None), lc.name, "create", None, model.state.name,
                  None, self.cause, lc.definition_hash, data)

    def note(self, kind: str, event: str, *, rid: str | None = None,
             data: dict[str, Any] | None = None) -> int:
        """Anything else worth replaying (scheduler steps, client disconnects, arrivals)."""
        if data is not None and not COMPACTED.isdisjoint(data):
            data = _compact(data)
        return self._add(rid, kind, event, None, None, None, self.cause, None, data)

    def input(self, event: str, *, rid: str | None = None, data: dict[str, Any] | None = None) -> int:
        """Something entered the actors from outside (a client call, a model step coming back, a
        timer): re-execution feeds these back in, each at the point it was recorded."""
        self.cause = None
        if data is not None and not COMPACTED.isdisjoint(data):
            data = _compact(data)
        return self._add(rid, "input", event, None, None, None, None, None, data)

    # -- reading ----------------------------------------------------------------------------------
    def events(self, *, rid: str | None = None, kind: str | None = None) -> list[Event]:
        out = []
        for seq, t in self.ring.entries() if rid is None else self.ring.entries(rid):
            if kind is not None and (t[2] if len(t) != 4 else "message") != kind:
                continue
            out.append(_event(seq, t))
        return out

    def __len__(self) -> int:
        return len(self.ring)

    # -- file sink --------------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        head: dict[str, Any] = {"format": "actorserve-recording/1",
                                "lifecycles": {n: lc.describe() for n, lc in self._lifecycles.items()},
                                "end_marker": True}
        if self.replica is not None:
            head["replica"] = self.replica
        head["clock"] = {"t_ns": self.clock.now_ns(), "wall_ns": self.wall_clock()}
        return {"header": head}

    def _open(self) -> None:
        assert self.path is not None
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")
        line = json.dumps(self.header(), separators=(",", ":")) + "\n"
        self._file.write(line)
        self._written = len(line)

    def _rotate(self) -> None:
        assert self._file is not None and self.path is not None
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            if os.path.exists(f"{self.path}.{i}"):
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
        if self.backups > 0:
            os.replace(self.path, f"{self.path}.1")
        self._open()

    def flush(self) -> None:
        if self._file is None or not self._pending:
            return
        parts = [to_line(_fields(seq, t)) for seq, t in self._pending]
        self._pending.clear()
        if self._written >= self.max_bytes:  # rotate lazily: the live file never ends empty
            self._rotate()
        chunk = "\n".join(parts) + "\n"
        assert self._file is not None
        self._file.write(chunk)
        self._file.flush()
        self._written += len(chunk)

    def close(self) -> None:
        """Flush, end the file with its end marker (the recording ended in order), close."""
        if self._file is not None:
            self.flush()
            end = {"end": {"seq": self.seq, "t_ns": self.clock.now_ns(), "wall_ns": self.wall_clock()}}
            self._file.write(json.dumps(end, separators=(",", ":")) + "\n")
            self._file.close()
            self._file = None


_PREV = re.compile(r"^(?P<stem>.*)\.prev-(?P<k>[0-9]+)(?P<ext>\.jsonl)?$")


def incarnation_path(path: str, k: int) -> str:
    """Where the K-th earlier incarnation of the recording at `path` lives:
    ``STEM.prev-K.jsonl`` for ``STEM.jsonl``, ``PATH.prev-K`` for any other name."""
    return f"{path[:-6]}.prev-{k}.jsonl" if path.endswith(".jsonl") else f"{path}.prev-{k}"


def incarnation_of(path: str | os.PathLike[str]) -> tuple[str, int | None]:
    """(the path of the newest incarnation, K) for an earlier incarnation's file
    (`incarnation_path`); (path, None) for any other file, the newest one included."""
    path = os.fspath(path)
    m = _PREV.match(path)
    if m is None:
        return path, None
    return m["stem"] + (m["ext"] or ""), int(m["k"])


def _parts(base: str) -> list[int]:
    """The numbers N of the rotated parts ``BASE.N`` present, newest (1) first."""
    folder, name = os.path.split(base)
    return sorted(int(f[len(name) + 1:]) for f in os.listdir(folder or ".")
                  if f.startswith(name + ".") and f[len(name) + 1:].isdigit())


def keep_earlier(path: str) -> str | None:
    """Move the recording at `path` (with its rotated parts) aside to its next incarnation
    name, when there is one (a non-empty file, or rotated parts); return where it went."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return None
    parts = _parts(path)
    if not parts and not (os.path.isfile(path) and os.path.getsize(path) > 0):
        return None
    ks = [k for f in os.listdir(folder)
          if (inc := incarnation_of(os.path.join(os.path.dirname(path), f)))[0] == path
          and (k := inc[1]) is not None]
    prev = incarnation_path(path, max(ks, default=0) + 1)
    for n in parts:
        os.replace(f"{path}.{n}", f"{prev}.{n}")
    if os.path.exists(path):
        os.replace(path, prev)
    return prev


def read_recording(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[Event]]:
    """Read a JSONL recording: its header and its events, in order.

    A recording that is still being written may end in a half-written line (no newline yet):
    that last fragment is left out, as it is not an event yet. A malformed line anywhere
    else is an error (`ValueError` naming the line). The end marker `FlightRecorder.close`
    writes, when it is the last line, comes back as ``header["end"]``."""
    header: dict[str, Any] = {}
    events: list[Event] = []
    end: dict[str, Any] | None = None
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):        # the unterminated tail of a file being written
                break
            raise ValueError(f"{path}: line {n} is not a recording event: {exc}") from None
        if "header" in obj:
            header = obj["header"]
        elif "end" in obj and "seq" not in obj:
            end = obj["end"]
        else:
            events.append(Event.from_dict(obj))
            end = None                 # an end marker counts only as the last line
    if end is not None:
        header = {**header, "end": end}
    return header, events


def read_all_parts(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[Event]]:
    """Read a rotated recording whole: ``PATH.N`` … ``PATH.1`` then ``PATH``, oldest first.
    Raises `ValueError` when the parts do not join up (a part was lost between them)."""
    base = os.fspath(path)
    numbers = _parts(base)[::-1]
    header: dict[str, Any] = {}
    events: list[Event] = []
    for part in [f"{base}.{i}" for i in numbers] + [base]:
        header, evs = read_recording(part)
        if events and evs and evs[0].seq != events[-1].seq + 1:
            raise ValueError(f"{part} starts at seq {evs[0].seq} but the part before it ends at "
                             f"seq {events[-1].seq}: the recording has a gap")
        events.extend(evs)
    return header, events


def ended_in_order(header: dict[str, Any]) -> bool | None:
    """True: the file ends with the end marker; False: its recorder writes one and it has
    none (not closed in order); None: a recorder from before end markers (judge by events)."""
    if "end" in header:
        return True
    return False if header.get("end_marker") else None
