"""The flight recorder's ring entries, kept small (`recorder.FlightRecorder`; issue 31: a full
ring of 100k events was ~35 MB of a server at rest).

A ring entry holds only what an `Event` cannot derive: ``seq`` is its position in the ring
(which holds consecutive seqs), ``ok`` is ``error is None``, and a message (about half of all
events: one per token) is ``(t_ns, rid, event, dst)``; any other event is ``(t_ns, rid, kind,
event, src, dst, error, cause, defn, data)``. In `data`, an arrival's prompt (the list of token
ids) is kept as 4-byte ints (`array`) rather than a list of int objects (~40 bytes a token),
and a step's ``batch`` / ``out`` (a 2-item list per member) as one flat tuple (`Pairs`).
`fields` and `plain` give the events back whole, so the file, `events()` and live subscribers
see what they saw before.
"""

from __future__ import annotations

from array import array
from typing import Any

COMPACTED = frozenset(("prompt", "batch", "out"))     # the data keys `compact` looks at


class Pairs:
    """A list of 2-item lists kept flat: one tuple, 8 bytes a field instead of a 72-byte list a
    row."""
    __slots__ = ("flat",)

    def __init__(self, flat: tuple) -> None:
        self.flat = flat

    def tolist(self) -> list[list[Any]]:
        f = self.flat
        return [[f[i], f[i + 1]] for i in range(0, len(f), 2)]


def to_json_list(o: Any) -> list[Any]:
    """``json.dumps``'s `default`: a compacted value as the list it stands for."""
    if isinstance(o, (array, Pairs)):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def compact(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` with its prompt as an ``array('i')`` (when its ints fit) and a step's
    ``batch`` / ``out`` flat (when every row is a 2-item list); anything else as it is."""
    data = dict(data)
    prompt = data.get("prompt")
    if type(prompt) is list:
        try:
            data["prompt"] = array("i", prompt)
        except (TypeError, OverflowError):
            pass
    for key in ("batch", "out"):
        rows = data.get(key)
        if type(rows) is list and rows and all(type(r) is list and len(r) == 2 for r in rows):
            data[key] = Pairs(tuple(x for r in rows for x in r))
    return data


def plain(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its compacted values as lists again."""
    return {k: v.tolist() if isinstance(v, (array, Pairs)) else v for k, v in data.items()}


def fields(seq: int, t: tuple) -> tuple:
    """The 12 fields (`recorder.FIELDS`) of the event at `seq` whose ring entry is `t`; its
    compacted values stay compacted (the file's writer lists them)."""
    if len(t) == 4:
        return (seq, t[0], t[1], "message", t[2], None, t[3], True, None, None, None, None)
    t_ns, rid, kind, event, src, dst, error, cause, defn, data = t
    return (seq, t_ns, rid, kind, event, src, dst, error is None, error, cause, defn, data)
