"""`OutputStream`: what a request actor hands its client (through the runtime's `RequestHandle`).

The request actor puts its outputs here and never blocks; one consumer takes them, item by item
(a streaming client) or merged at the end (`final`, a non-streaming one). The client taking the
final item is what ends the request: the stream calls `on_final` (the runtime's `delivered`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from ..messages import RequestOutput, delta_output, merge_outputs


class OutputStream:
    """What a request actor hands its client: deltas, then one item with `finished`.

    One consumer. `get` wakes on every item (a streaming client); `final` waits for the last
    one only and merges everything at once (a non-streaming client: one wake-up per request,
    not one per token). A token that does not end the request is kept as a small tuple (its
    text, id, logprob entry, prompt logprobs, weight spans) and becomes a `RequestOutput` only
    when a streaming client takes it: a non-streaming one never pays for an object per token.
    """

    __slots__ = ("_items", "_waiter", "_at_close", "closed", "on_final", "rid")

    def __init__(self, on_final: Callable[[str], None] | None = None, rid: str = "") -> None:
        self._items: list[Any] = []   # a handful of items: a list is 10x smaller than a deque
        self._waiter: asyncio.Future[None] | None = None
        self._at_close = False      # the waiter wants the last item only
        self.closed = False
        self.on_final = on_final    # called once with `rid`, when the consumer takes the final item
        self.rid = rid

    def put(self, item: RequestOutput) -> None:
        if self.closed:
            return
        self._items.append(item)
        if item.finished:
            self.closed = True
        w = self._waiter
        if w is not None and (self.closed or not self._at_close) and not w.done():
            w.set_result(None)

    def put_token(self, text: str, token_id: int, lp: Any, prompt_logprobs: Any,
                  vdone: tuple[tuple[str, int, int], ...], vcur: str | None, vstart: int, vend: int) -> None:
        """A token that does not end the request (see the class doc); its weight spans so far
        are the closed ones `vdone` and the open one (`vcur`, `vstart`, `vend`)."""
        if self.closed:
            return
        self._items.append((text, token_id, lp, prompt_logprobs, vdone, vcur, vstart, vend))
        w = self._waiter
        if w is not None and not self._at_close and not w.done():
            w.set_result(None)

    def _expand(self, d: tuple) -> RequestOutput:  # type: ignore[type-arg]
        return delta_output(self.rid, d)

    async def _wait(self, at_close: bool) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        self._at_close = at_close
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def get(self) -> RequestOutput:
        while not self._items:
            await self._wait(False)
        return self.get_nowait()

    def get_nowait(self) -> RequestOutput:
        """The next item (IndexError if none); taking the final one tells `on_final`."""
        item = self._items.pop(0)
        if type(item) is tuple:
            return self._expand(item)
        if item.finished and self.on_final is not None:
            cb, self.on_final = self.on_final, None
            cb(self.rid)
        return item

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._items and self.closed:
            raise StopAsyncIteration
        return await self.get()

    async def final(self) -> RequestOutput:
        """Wait for the end and merge every item into one output (non-streaming clients)."""
        while not self.closed:
            await self._wait(True)
        items, self._items = self._items, []
        if not items:
            raise RuntimeError("the stream was already read to its end")
        last = items[-1]
        if self.on_final is not None and last.finished:
            cb, self.on_final = self.on_final, None
            cb(self.rid)
        return merge_outputs(items, self.rid)
