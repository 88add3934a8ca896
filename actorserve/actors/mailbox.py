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
    """Mail is held as a head and a tail: `head` is the next envelope (None: no mail), and the
    tail deque exists only while two or more wait. A server holds one mailbox per live request,
    and a request actor's mailbox holds one message at a time nearly always: no deque is made
    (~600 bytes, and an object the garbage collector tracks) for each message it gets."""

    __slots__ = ("capacity", "head", "_q", "_senders", "received", "processed", "failed", "closed")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.head: Envelope | None = None          # the next envelope; None: the mailbox is empty
        self._q: deque[Envelope] | None = None     # the envelopes after it (made on the second)
        self._senders: deque[asyncio.Future[None]] | None = None  # made on first wait
        self.received = 0
        self.processed = 0
        self.failed = 0
        self.closed = False

    def __len__(self) -> int:
        if self.head is None:
            return 0
        return 1 + len(self._q) if self._q is not None else 1

    def put_nowait(self, env: Envelope) -> None:
        if self.closed:
            raise MailboxClosed("mailbox is closed")
        if self.head is None:
            self.head = env
        else:
            q = self._q
            if q is None:
                q = self._q = deque()
            if len(q) + 1 >= self.capacity:
                raise MailboxFull(f"mailbox full ({self.capacity} messages)")
            q.append(env)
        self.received += 1

    async def wait_for_room(self) -> None:
        while not self.closed and len(self) >= self.capacity:
            fut = asyncio.get_running_loop().create_future()
            if self._senders is None:
                self._senders = deque()
            self._senders.append(fut)
            try:
                await fut
            finally:
                if fut in self._senders:
                    self._senders.remove(fut)
        if self.closed:
            raise MailboxClosed("mailbox is closed")

    def get_nowait(self) -> Envelope:
        env = self.head
        if env is None:
            raise IndexError("mailbox is empty")
        q = self._q
        if q is not None:
            self.head = q.popleft()
            if not q:
                self._q = None
        else:
            self.head = None
        if self._senders:
            fut = self._senders.popleft()
            if not fut.done():
                fut.set_result(None)
        return env

    def close(self) -> list[Envelope]:
        self.closed = True
        left = [] if self.head is None else [self.head, *(self._q or ())]
        self.head = None
        self._q = None
        while self._senders:
            fut = self._senders.popleft()  # type: ignore[union-attr]
            if not fut.done():
                fut.set_result(None)
        return left

    def statistics(self) -> MailboxStats:
        return MailboxStats(len(self), self.capacity, self.received, self.processed,
                            self.failed, len(self._senders or ()), self.closed)
