"""A bounded mailbox with anyio-style `put_nowait`/`put` and `statistics()`.

`put_nowait` raises `MailboxFull` instead of blocking; `put` waits for room (the waiting
senders are woken in order as the owner drains). A closed mailbox raises `MailboxClosed`;
`close()` hands back what was still queued so the owner can fail each pending reply.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, NamedTuple


class MailboxFull(Exception):
    """The mailbox holds `capacity` messages; the sender must wait or give up."""


class MailboxClosed(Exception):
    """The owner has stopped; nothing more is accepted."""


class MailboxStats(NamedTuple):
    current_size: int
    capacity: int
    received: int
    processed: int
    failed: int
    waiting_senders: int
    closed: bool


# An envelope is a plain tuple (message, reply future or None): cheaper than an object.
Envelope = tuple[Any, "asyncio.Future[Any] | None"]


class Mailbox:
    __slots__ = ("capacity", "_q", "_senders", "received", "processed", "failed", "closed")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._q: deque[Envelope] = deque()
        self._senders: deque[asyncio.Future[None]] = deque()
        self.received = 0
        self.processed = 0
        self.failed = 0
        self.closed = False

    def __len__(self) -> int:
        return len(self._q)

    def put_nowait(self, env: Envelope) -> None:
        if self.closed:
            raise MailboxClosed("mailbox is closed")
        if len(self._q) >= self.capacity:
            raise MailboxFull(f"mailbox full ({self.capacity} messages)")
        self._q.append(env)
        self.received += 1

    async def wait_for_room(self) -> None:
        while not self.closed and len(self._q) >= self.capacity:
            fut = asyncio.get_running_loop().create_future()
            self._senders.append(fut)
            try:
                await fut
            finally:
                if fut in self._senders:
                    self._senders.remove(fut)
        if self.closed:
            raise MailboxClosed("mailbox is closed")

    def get_nowait(self) -> Envelope:
        env = self._q.popleft()
        if self._senders:
            fut = self._senders.popleft()
            if not fut.done():
                fut.set_result(None)
        return env

    def close(self) -> list[Envelope]:
        self.closed = True
        left = list(self._q)
        self._q.clear()
        while self._senders:
            fut = self._senders.popleft()
            if not fut.done():
                fut.set_result(None)
        return left

    def statistics(self) -> MailboxStats:
        return MailboxStats(len(self._q), self.capacity, self.received, self.processed,
                            self.failed, len(self._senders), self.closed)
