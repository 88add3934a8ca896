"""The request registry: rid -> the request actor's ref, and what each request published.

A request actor registers itself when it is spawned and leaves when it stops; on every
transition of its lifecycle it publishes its state here (one slot write). So:

* the runtime finds a request by rid in O(1) (a duplicate rid, a client that took its final
  output, `request_info`) without reading the actor;
* an abort finds the requests whose result is known but not yet taken by their client
  (``detok``, ``pool``: in no scheduler any more) in the `delivering` table: by rid in O(1),
  by prefix or all in O(requests delivering now), never by scanning every live actor.
"""

from __future__ import annotations

from typing import Any

from .actor import ActorRef


class RequestEntry:
    """One live request as its actor last published it."""
    __slots__ = ("ref", "kind", "state", "probe")

    def __init__(self, ref: ActorRef, kind: str, state: Any, probe: bool) -> None:
        self.ref = ref
        self.kind = kind          # its lifecycle's name: generation | pooling
        self.state = state        # its lifecycle state (an enum member)
        self.probe = probe


class RequestRegistry:
    __slots__ = ("live", "delivering")

    def __init__(self) -> None:
        self.live: dict[str, RequestEntry] = {}
        self.delivering: dict[str, ActorRef] = {}   # result known, client has not taken it

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, rid: str) -> bool:
        return rid in self.live

    def add(self, rid: str, entry: RequestEntry) -> None:
        self.live[rid] = entry

    def remove(self, rid: str, entry: RequestEntry) -> None:
        if self.live.get(rid) is entry:
            del self.live[rid]
            self.delivering.pop(rid, None)

    def ref(self, rid: str) -> ActorRef | None:
        e = self.live.get(rid)
        return None if e is None else e.ref

    def delivering_matches(self, rid: str | None, prefix: bool, everything: bool) -> list[tuple[str, ActorRef]]:
        """The delivering requests an abort names: O(1) by rid, else O(delivering)."""
        d = self.delivering
        if everything:
            return list(d.items())
        if not rid:
            return []
        if prefix:
            return [(r, ref) for r, ref in d.items() if r.startswith(rid)]
        ref = d.get(rid)
        return [] if ref is None else [(rid, ref)]

    def info(self, rid: str) -> dict[str, Any] | None:
        e = self.live.get(rid)
        if e is None:
            return None
        return {"rid": rid, "kind": e.kind, "state": e.state.name, "probe": e.probe, "live": e.ref.alive}
