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
(`on_stop`, then every message still queued has its reply failed with `ActorDeadError`, so no
caller ever hangs). Stopping is a message, as in pykka: `ActorRef.stop()` queues a `Stop`
behind the mail already sent, so an actor finishes what it was told before it stops.

References. Nothing outside an actor holds the actor: it holds an `ActorRef` (name, `tell`,
`ask`, `alive`, `stop`), and messages carry refs and rids, never actor objects; the system
(`ActorSystem.ref`) and the request registry hand out refs by name or rid.

Reads. An actor that others must be able to read declares `publish()`: the system calls it
after each of the actor's turns (and at spawn and stop) and keeps the plain data it returns
(`ActorSystem.published`), so a reader gets a snapshot taken between turns, never the actor's
fields while they change.

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
from typing import Any, Callable, ClassVar, Protocol

from .mailbox import Mailbox, MailboxClosed, MailboxFull, MailboxStats


class Dispatcher(Protocol):
    """What an actor needs of the system that runs it (`ActorSystem` is one): this module
    does not import the system, the system imports it."""
    recorder: Any
    clock: Any

    def _schedule(self, actor: "Actor") -> None: ...
    def _forget(self, actor: "Actor") -> None: ...
    def _published(self, actor: "Actor") -> None: ...
    def resolve(self, fut: "asyncio.Future[Any]", result: Any = None, exc: BaseException | None = None) -> None: ...
    def chain(self, src: "asyncio.Future[Any]", dst: "asyncio.Future[Any]") -> None: ...
    def child_failed(self, actor: "Actor", message: Any, exc: BaseException) -> None: ...


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


RUNNING = Phase.running     # read on every message: a module global, not an enum class lookup


def handles(*types: type) -> Callable[[Callable], Callable]:
    """Mark a method as the handler of the given message types."""

    def mark(fn: Callable) -> Callable:
        fn.__handles__ = types  # type: ignore[attr-defined]
        return fn

    return mark


class Stop:
    """The message that stops an actor (`ActorRef.stop`): handled by the run loop itself, after
    the mail queued before it, never by a handler."""
    __slots__ = ()

    def __repr__(self) -> str:
        return "Stop()"


STOP = Stop()


class ActorRef:
    """The only handle to an actor outside it: its name, `tell`, `ask`, `alive`, `stop`.

    A message carries refs (and rids), never an actor, so what a handler can do to another
    actor is send it mail. The ref of an actor is made once (`Actor.ref`); two refs are equal
    when they name the same actor."""

    __slots__ = ("name", "_actor", "__weakref__")

    def __init__(self, actor: "Actor") -> None:
        self.name = actor.name
        self._actor = actor

    @property
    def alive(self) -> bool:
        return self._actor.phase is RUNNING

    def tell(self, message: Any) -> None:
        """Fire and forget. Raises `MailboxFull`, or `ActorDeadError` if the actor stopped."""
        self._actor._enqueue((message, None))

    def tell_if_alive(self, message: Any) -> bool:
        """Tell unless the actor has stopped (a request that already ended); False if not sent."""
        a = self._actor
        if a.phase is not RUNNING:
            return False
        a._enqueue((message, None))
        return True

    def ask(self, message: Any) -> "asyncio.Future[Any]":
        """Send and get a future for the handler's return value (or its failure)."""
        return self._actor.ask(message)

    async def send(self, message: Any) -> None:
        """Like `tell`, but waits for room in a full mailbox instead of raising."""
        await self._actor.send(message)

    def stop(self) -> "asyncio.Future[Any]":
        """Queue a `Stop` behind the mail already sent; the future resolves once the actor has
        stopped (at once if it already has)."""
        if self._actor.phase is RUNNING:
            return self._actor.ask(STOP)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    @property
    def queued(self) -> int:
        """Messages sent and not yet handled (what admission control counts)."""
        return len(self._actor.mailbox)

    def statistics(self) -> MailboxStats:
        return self._actor.mailbox.statistics()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other._actor is self._actor

    def __hash__(self) -> int:
        return id(self._actor)

    def __repr__(self) -> str:
        return f"<ActorRef {self.name}>"


class Actor:
    """Base class. Subclasses define handlers with `@handles` and may override the hooks."""

    __slots__ = ("name", "mailbox", "phase", "system", "supervisor", "_turn_pending", "_ref", "__weakref__")
    _handlers: ClassVar[dict[type, Callable[[Any, Any], Any]]] = {}
    throughput: ClassVar[int] = 64
    mailbox_capacity: ClassVar[int] = 1024
    publishes: ClassVar[bool] = False     # the class defines `publish` (set by __init_subclass__)
    drains: ClassVar[bool] = False        # the class defines `on_drained` (likewise)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        table: dict[type, Callable[[Any, Any], Any]] = {}
        for klass in reversed(cls.__mro__):
            for attr in vars(klass):
                for t in getattr(getattr(cls, attr, None), "__handles__", ()):
                    table[t] = getattr(cls, attr)   # the most derived override wins
        cls._handlers = table
        cls.publishes = cls.publish is not Actor.publish
        cls.drains = cls.on_drained is not Actor.on_drained

    def __init__(self, name: str, *, capacity: int | None = None) -> None:
        self.name = name
        self.mailbox = Mailbox(capacity or self.mailbox_capacity)
        self.phase = Phase.new
        self.system: Dispatcher | None = None
        self.supervisor: Actor | None = None
        self._turn_pending = False
        self._ref: ActorRef | None = None

    @property
    def ref(self) -> ActorRef:
        """This actor's reference: what others hold and messages carry."""
        r = self._ref
        if r is None:
            r = self._ref = ActorRef(self)
        return r

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

    def publish(self) -> Any:
        """Plain data for readers outside the actor, taken after each turn (see the module doc).
        An actor that defines it is read only through what it published."""
        return None

    # -- sending -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.phase is RUNNING

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
        if self.phase is not RUNNING:
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
        n = self.throughput
        while n and box.head is not None and self.phase is RUNNING:
            n -= 1
            message, reply = box.get_nowait()
            handler = dispatch.get(type(message))
            if recorder is not None:
                recorder.message(self.name, message)
            if handler is None:
                if message is STOP:
                    box.processed += 1
                    self.stop()
                    if reply is not None:
                        self._reply(reply, None)
                    break
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
        """Teardown now: `on_stop`, then fail every queued reply with `ActorDeadError`. From
        inside the actor (a request that reached its end); others send `Stop` (`ActorRef.stop`)."""
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
                if self.publishes:
                    self.system._published(self)
                self.system._forget(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.phase.value}>"

