"""`ActorSystem`: spawns, schedules, supervises and stops actors; knows when all is quiet.

Scheduling: an actor with mail joins the run queue; the queue is run in FIFO order, up to
`turns_per_callback` turns per event-loop callback; a turn that leaves mail behind queues
another, so actors share the loop fairly, and the loop's other callbacks run between batches.

Quiescence is exact, not slept: the system counts actors that have a turn pending plus
off-loop operations it started (`run_in_thread`, `run_inline`). `quiesce()` returns when that
count is zero, i.e. nothing can happen any more until the outside world (a client, or the
manual clock) does something.

Replies between actors (`pipe`, a handler's deferred answer via `chain`) are delivered inside
the turn that resolves them (`resolve`), not by an event-loop callback, so what the actors do
depends on the order of turns alone. Deterministic re-execution (`actorserve.replay.reexec`)
takes the turns over: it sets `dispatch` to put each turn on its own run queue. Timers started with `call_later` record a note when they fire, so a recording knows
exactly where each one landed between turns.

Supervision: a child's failure is passed to its supervisor actor if it has one (its
`on_child_failure`), else to the system's `on_failure` callback. The default policy keeps
the actor running: the failing message alone is lost, and the request actors turn their own
failures into a `failed` lifecycle state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import deque
from typing import Any, Callable, TypeVar

from .actor import RUNNING, Actor, ActorDeadError, ActorRef, Phase
from .clock import Clock, LoopClock
from .registry import RequestRegistry

log = logging.getLogger("actorserve.actors")

A = TypeVar("A", bound=Actor)


class ActorSystem:
    turns_per_callback = 64
    def __init__(self, *, clock: Clock | None = None, recorder: Any = None,
                 executor: concurrent.futures.Executor | None = None,
                 on_failure: Callable[[Actor, Any, BaseException], None] | None = None) -> None:
        self.clock: Clock = clock or LoopClock()
        self.recorder = recorder
        self._loop: asyncio.AbstractEventLoop | None = None
        self._actors: dict[str, Actor] = {}
        self._busy = 0                 # actors with a turn pending + off-loop operations
        self._idle = asyncio.Event()
        self._idle.set()
        self._executor = executor
        self._own_executor = executor is None
        self._on_failure = on_failure
        self.failures: list[tuple[str, str, BaseException]] = []
        # How a turn is scheduled: None = `loop.call_soon`; re-execution puts its run queue here.
        self.dispatch: Callable[[Callable[[Actor], None], Actor], None] | None = None
        self._links: dict[asyncio.Future[Any], list[Callable[[asyncio.Future[Any]], None]]] = {}
        self._ready: deque[Actor] = deque()      # actors whose turn is due, in order
        self._draining = False                   # a `_run_ready` callback is scheduled
        self._board: dict[str, Any] = {}         # actor name -> what it published last
        self.requests = RequestRegistry()        # rid -> the request actor's ref (and its state)

    # -- spawning ------------------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def spawn(self, actor: A, *, supervisor: Actor | None = None) -> A:
        if actor.name in self._actors:
            raise ValueError(f"an actor named {actor.name!r} is already running")
        actor.system = self
        actor.supervisor = supervisor
        actor.on_start()                 # setup; raising means it never runs
        actor.phase = Phase.running
        self._actors[actor.name] = actor
        if actor.publishes:
            self._board[actor.name] = actor.publish()
        return actor

    def get(self, name: str) -> Actor | None:
        return self._actors.get(name)

    def ref(self, name: str) -> ActorRef | None:
        """The ref of the running actor `name` (None: none runs under that name)."""
        a = self._actors.get(name)
        return None if a is None else a.ref

    def published(self, name: str) -> Any:
        """What actor `name` published after its last turn (None: it never did)."""
        return self._board.get(name)

    def _published(self, actor: Actor) -> None:
        self._board[actor.name] = actor.publish()

    @property
    def actors(self) -> dict[str, Actor]:
        return dict(self._actors)

    def _forget(self, actor: Actor) -> None:
        if self._actors.get(actor.name) is actor:
            del self._actors[actor.name]

    # -- scheduling ----------------------------------------------------------------------------
    def _schedule(self, actor: Actor) -> None:
        """`actor` has mail and no turn pending: count it busy and queue its turn (the hot path
        of every message: `_inc` and `_enqueue_turn`, inlined)."""
        if self._busy == 0:
            self._idle.clear()
        self._busy += 1
        if self.dispatch is not None:
            self.dispatch(self._run_turn, actor)
            return
        self._ready.append(actor)
        if not self._draining:
            self._draining = True
            self.loop.call_soon(self._run_ready)

    def _enqueue_turn(self, actor: Actor) -> None:
        if self.dispatch is not None:
            self.dispatch(self._run_turn, actor)
            return
        self._ready.append(actor)
        if not self._draining:
            self._draining = True
            self.loop.call_soon(self._run_ready)

    def _run_ready(self) -> None:
        """Run queued turns in FIFO order, as many as `turns_per_callback`, in one event-loop
        callback (one `call_soon` per turn cost more than a small actor's turn itself); then
        yield to the loop's other callbacks (client tasks, replies from worker threads)."""
        ready = self._ready
        for _ in range(self.turns_per_callback):
            if not ready:
                break
            self._run_turn(ready.popleft())
        if ready:
            self.loop.call_soon(self._run_ready)
        else:
            self._draining = False

    def _run_turn(self, actor: Actor) -> None:
        try:
            if actor.phase is RUNNING:
                actor._turn()
                if actor.mailbox.head is not None and actor.phase is RUNNING:
                    if actor.publishes:
                        self._board[actor.name] = actor.publish()
                    self._enqueue_turn(actor)
                    return  # still busy: keep the count
            actor._turn_pending = False
            if actor.phase is RUNNING:
                if actor.drains:
                    actor.on_drained()
                if actor.publishes:
                    self._board[actor.name] = actor.publish()
        except Exception as exc:  # a hook raised: treat as a failure of the actor
            actor._turn_pending = False
            self.child_failed(actor, None, exc)
        self._busy -= 1
        if self._busy == 0:
            self._idle.set()

    def _inc(self) -> None:
        if self._busy == 0:
            self._idle.clear()
        self._busy += 1

    def _dec(self) -> None:
        self._busy -= 1
        if self._busy == 0:
            self._idle.set()

    # -- off-loop work -------------------------------------------------------------------------
    def run_in_thread(self, target: Actor, fn: Callable[..., Any], *args: Any,
                      wrap: Callable[[Any, BaseException | None], Any]) -> None:
        """Run `fn(*args)` in a worker thread; tell `target` `wrap(result, error)` when done."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="actorserve-step")
        fut = self.loop.run_in_executor(self._executor, fn, *args)
        self.pipe(fut, target, wrap, off_loop=True)

    def call_on_step_thread(self, fn: Callable[..., Any], *args: Any) -> "asyncio.Future[Any]":
        """Run `fn(*args)` on the worker thread the model steps run on (`run_in_thread`'s one
        thread), between two steps; the future resolves with its result."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="actorserve-step")
        return self.loop.run_in_executor(self._executor, fn, *args)

    def run_inline(self, target: Actor, fn: Callable[..., Any], *args: Any,
                   wrap: Callable[[Any, BaseException | None], Any]) -> None:
        """Same contract as `run_in_thread`, but runs on the loop in its own callback (tests)."""
        fut = self.loop.create_future()

        def call() -> None:
            try:
                fut.set_result(fn(*args))
            except Exception as exc:
                fut.set_exception(exc)

        self.loop.call_soon(call)
        self.pipe(fut, target, wrap, off_loop=True)

    def pipe(self, fut: asyncio.Future[Any], target: Actor,
             wrap: Callable[[Any, BaseException | None], Any], *, off_loop: bool = False) -> None:
        """When `fut` resolves, tell `target` the wrapped outcome. An `off_loop` future (a worker
        thread's) counts for `quiesce`; an actor's reply does not: it is resolved in a turn, so
        while it is pending and every actor is idle, only the outside world can move it."""
        if off_loop:
            self._inc()

        def deliver(f: asyncio.Future[Any]) -> None:
            try:
                if f.cancelled():
                    msg = wrap(None, asyncio.CancelledError())
                elif f.exception() is not None:
                    msg = wrap(None, f.exception())
                else:
                    msg = wrap(f.result(), None)
                if target.alive:
                    target.tell(msg)
            except ActorDeadError:
                pass
            finally:
                if off_loop:
                    self._dec()

        self._link(fut, deliver)

    def chain(self, src: asyncio.Future[Any], dst: asyncio.Future[Any]) -> None:
        """Resolve `dst` (a caller's reply) like `src` (a handler's deferred answer)."""

        def copy(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                if not dst.done():
                    dst.cancel()
            else:
                exc = f.exception()
                self.resolve(dst, None if exc is not None else f.result(), exc)

        self._link(src, copy)

    def resolve(self, fut: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
        """Set an actor reply. What is piped or chained to it happens now, inside this turn:
        a piped result is told to its actor at once, so the order of everything the actors do
        depends on turns alone, never on when the event loop gets round to a callback."""
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        for fn in self._links.pop(fut, ()):
            fn(fut)

    def _link(self, fut: asyncio.Future[Any], fn: Callable[[asyncio.Future[Any]], None]) -> None:
        if fut.done() and fut not in self._links:
            fn(fut)
            return
        links = self._links.get(fut)
        if links is None:
            links = self._links[fut] = []
            fut.add_done_callback(self._resolved_elsewhere)
        links.append(fn)

    def _resolved_elsewhere(self, fut: asyncio.Future[Any]) -> None:
        """`fut` was resolved by something other than `resolve` (a worker thread, a caller):
        the event loop delivers its links."""
        for fn in self._links.pop(fut, ()):
            fn(fut)

    def callbacks_ready(self) -> bool:
        """A linked future resolved outside `resolve` and the loop has yet to deliver it."""
        return any(f.done() for f in self._links)

    # -- timers --------------------------------------------------------------------------------
    def call_later(self, delay: float, fn: Callable[[], None], label: str) -> Any:
        """A timer on the system's clock. When it fires, the recorder notes it (``input`` /
        ``timer``) before `fn` runs: a timer is an input from outside the actors."""

        def fire() -> None:
            if self.recorder is not None:
                self.recorder.input("timer", data={"label": label})
            fn()

        timer = self.clock.call_later(delay, fire)
        if hasattr(timer, "label"):
            timer.label = label
        return timer

    # -- supervision ---------------------------------------------------------------------------
    def child_failed(self, actor: Actor, message: Any, exc: BaseException) -> None:
        what = type(message).__name__ if message is not None else "hook"
        self.failures.append((actor.name, what, exc))
        del self.failures[:-100]
        sup = actor.supervisor
        if sup is not None and sup.alive and hasattr(sup, "on_child_failure"):
            sup.on_child_failure(actor, message, exc)  # type: ignore[attr-defined]
        elif self._on_failure is not None:
            self._on_failure(actor, message, exc)
        else:
            log.error("%s failed on %s: %r", actor.name, what, exc)

    # -- quiescence and shutdown ---------------------------------------------------------------
    @property
    def busy(self) -> int:
        return self._busy

    async def quiesce(self) -> None:
        """Return once no actor has mail and no off-loop operation is outstanding."""
        while self._busy:
            await self._idle.wait()

    async def stop_all(self) -> None:
        """Stop every actor the way pykka's registry does: one at a time, in the order they
        were spawned, each with a `Stop` message behind its mail, waiting until it has stopped
        and what its teardown told others has been handled. The long-lived actors go first
        and tell the requests they hold that they end; a request still live after them ends in
        its own teardown. No caller orders the actors by hand."""
        for name in list(self._actors):
            ref = self.ref(name)
            if ref is not None and ref.alive:
                await ref.stop()
                await self.quiesce()

    async def shutdown(self) -> None:
        """Stop every actor (`stop_all`) and the worker thread."""
        await self.stop_all()
        for actor in list(self._actors.values()):   # anything spawned meanwhile
            actor.stop()
        if self._executor is not None and self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
