"""The actor: a mailbox, a type -> handler table, and a run loop in three phases.

Design. An actor owns no task or thread. When a message lands in an idle actor's mailbox,
the `ActorSystem` schedules one *turn* on the event loop (`call_soon`); a turn handles up to
`throughput` messages and yields, so no actor starves the loop. Handlers are plain
synchronous functions: an actor never awaits inside a handler. Work that takes time (a model
step in a worker thread, a timer) is started from a handler and its result comes back as a
message (`ActorSystem.run_in_thread`, `pipe`). This is the dispatcher model of Akka and
Erlang rather than pykka's thread-per-actor: ~1 µs per message instead of a task wake-up,
and a handler sees the actor's state with nothing interleaved — no locks anywhere.

Phases (as in pykka): *setup* (`on_start`, run by `spawn`), *running* (turns), *teardown*
(`stop`: `on_stop`, then every message still queued has its reply failed with
`ActorDeadError`, so no caller ever hangs).

Dispatch. Subclasses mark methods with `@handles(MessageType)`; `__init_subclass__` builds
the class's table once. A message with no handler fails its reply with `UnhandledMessage`.

Supervision. A handler that raises fails only the message it was handling (its reply gets
`HandlerError` with the actor, the message type and the cause), then `on_failure` runs; the
default reports to the supervisor (`ActorSystem` or a parent) which may stop the actor.
The actor goes on with its next message.
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from .mailbox import Mailbox, MailboxClosed, MailboxFull, MailboxStats

if TYPE_CHECKING:
    from .system import ActorSystem


class ActorError(Exception):
    """Base class of actor runtime errors."""


class ActorDeadError(ActorError):
    """The actor stopped before it handled the message (or is stopped already)."""


class UnhandledMessage(ActorError):
    """No handler for this message type."""


class HandlerError(ActorError):
    """A handler raised; `__cause__` is the original exception."""

    def __init__(self, actor: str, message: Any, exc: BaseException) -> None:
        self.actor = actor
        self.message = message
        self.exc = exc
        super().__init__(f"{actor}: handler for {type(message).__name__} raised "
                         f"{type(exc).__name__}: {exc}")


class Phase(enum.Enum):
    new = "new"
    running = "running"
    stopping = "stopping"
    stopped = "stopped"


def handles(*types: type) -> Callable[[Callable], Callable]:
    """Mark a method as the handler of the given message types."""

    def mark(fn: Callable) -> Callable:
        fn.__handles__ = types  # type: ignore[attr-defined]
        return fn

    return mark


class Actor:
    """Base class. Subclasses define handlers with `@handles` and may override the hooks."""

    __slots__ = ("name", "mailbox", "phase", "system", "supervisor", "_turn_pending", "__weakref__")
    _handlers: ClassVar[dict[type, Callable[[Any, Any], Any]]] = {}
    throughput: ClassVar[int] = 64
    mailbox_capacity: ClassVar[int] = 1024

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        table: dict[type, Callable[[Any, Any], Any]] = {}
        for klass in reversed(cls.__mro__):
            for attr in vars(klass):
                for t in getattr(getattr(cls, attr, None), "__handles__", ()):
                    table[t] = getattr(cls, attr)   # the most derived override wins
        cls._handlers = table

    def __init__(self, name: str, *, capacity: int | None = None) -> None:
        self.name = name
        self.mailbox = Mailbox(capacity or self.mailbox_capacity)
        self.phase = Phase.new
        self.system: ActorSystem | None = None
        self.supervisor: Actor | None = None
        self._turn_pending = False

    # -- hooks ---------------------------------------------------------------------------------
    def on_start(self) -> None:
        """Setup phase; runs inside `spawn`. Raising here means the actor never runs."""

    def on_stop(self) -> None:
        """Teardown phase; runs once, before pending replies are failed."""

    def on_failure(self, message: Any, exc: BaseException) -> None:
        """A handler raised. Default: report to the supervisor."""
        if self.system is not None:
            self.system.child_failed(self, message, exc)

    def on_drained(self) -> None:
        """The mailbox just became empty at the end of a turn (e.g. time to start a step)."""

    # -- sending -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.phase is Phase.running

    def tell(self, message: Any) -> None:
        """Fire and forget. Raises `MailboxFull`, or `ActorDeadError` if the actor stopped."""
        self._enqueue((message, None))

    def ask(self, message: Any) -> asyncio.Future[Any]:
        """Send and get a future for the handler's return value (or its failure)."""
        fut = asyncio.get_running_loop().create_future()
        self._enqueue((message, fut))
        return fut

    async def send(self, message: Any) -> None:
        """Like `tell`, but waits for room in a full mailbox instead of raising."""
        while True:
            try:
                self._enqueue((message, None))
                return
            except MailboxClosed:
                raise ActorDeadError(f"{self.name} is stopped") from None
            except MailboxFull:
                await self.mailbox.wait_for_room()

    def _enqueue(self, env: tuple[Any, Any]) -> None:
        if self.phase is not Phase.running:
            raise ActorDeadError(f"{self.name} is {self.phase.value}")
        self.mailbox.put_nowait(env)
        if not self._turn_pending:
            self._turn_pending = True
            assert self.system is not None
            self.system._schedule(self)

    # -- running -------------------------------------------------------------------------------
    def _turn(self) -> None:
        """Handle up to `throughput` messages. Called by the system, never re-entrantly."""
        box = self.mailbox
        dispatch = self._handlers   # one table per class: unbound functions, called with self
        recorder = self.system.recorder if self.system is not None else None
        for _ in range(self.throughput):
            if not box._q or self.phase is not Phase.running:
                break
            message, reply = box.get_nowait()
            handler = dispatch.get(type(message))
            if recorder is not None:
                recorder.message(self.name, message)
            if handler is None:
                box.failed += 1
                err = UnhandledMessage(f"{self.name} has no handler for {type(message).__name__}")
                if reply is not None:
                    self._reply(reply, exc=err)
                self.on_failure(message, err)
                continue
            try:
                result = handler(self, message)
            except Exception as exc:  # supervision: fail this message only, go on
                box.failed += 1
                if reply is not None:
                    self._reply(reply, exc=HandlerError(self.name, message, exc))
                self.on_failure(message, exc)
            else:
                box.processed += 1
                if reply is not None and not reply.done():
                    assert self.system is not None
                    if isinstance(result, asyncio.Future):
                        self.system.chain(result, reply)
                    else:
                        self.system.resolve(reply, result)
        if recorder is not None:
            recorder.cause = None

    def _reply(self, fut: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
        """Answer an `ask` (or any future an actor owes): through the system, so what is piped
        to it is delivered in this turn."""
        if self.system is not None:
            self.system.resolve(fut, result, exc)
        elif not fut.done():
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def statistics(self) -> MailboxStats:
        return self.mailbox.statistics()

    # -- teardown ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Teardown: `on_stop`, then fail every queued reply with `ActorDeadError`."""
        if self.phase in (Phase.stopping, Phase.stopped):
            return
        self.phase = Phase.stopping
        try:
            self.on_stop()
        finally:
            for message, reply in self.mailbox.close():
                if reply is not None:
                    self._reply(reply, exc=ActorDeadError(
                        f"{self.name} stopped before handling {type(message).__name__}"))
            self.phase = Phase.stopped
            if self.system is not None:
                self.system._forget(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.phase.value}>"

