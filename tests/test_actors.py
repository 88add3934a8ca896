"""The actor runtime: mailbox, dispatch table, supervision, teardown, quiesce, clock."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from actorserve.actors.actor import Actor, ActorDeadError, HandlerError, UnhandledMessage, handles
from actorserve.actors.clock import ManualClock
from actorserve.actors.mailbox import MailboxFull
from actorserve.actors.system import ActorSystem


@dataclass(frozen=True)
class Add:
    n: int


@dataclass(frozen=True)
class Boom:
    pass


@dataclass(frozen=True)
class Other:
    pass


@dataclass(frozen=True)
class Echo:
    rid: str


class Counter(Actor):
    def __init__(self, name="counter", capacity=None):
        super().__init__(name, capacity=capacity)
        self.total = 0
        self.log: list[str] = []
        self.failures: list[str] = []

    def on_start(self):
        self.log.append("start")

    def on_stop(self):
        self.log.append("stop")

    @handles(Add)
    def add(self, msg):
        self.total += msg.n
        return self.total

    @handles(Boom)
    def boom(self, msg):
        raise RuntimeError("kaboom")

    def on_failure(self, message, exc):
        self.failures.append(type(message).__name__)
        super().on_failure(message, exc)


class Parent(Actor):
    def __init__(self):
        super().__init__("parent")
        self.reports = []

    def on_child_failure(self, child, message, exc):
        self.reports.append((child.name, type(message).__name__, str(exc)))


async def test_dispatch_by_type_and_ask_replies():
    sysm = ActorSystem()
    c = sysm.spawn(Counter())
    assert c.log == ["start"]
    replies = [c.ask(Add(i)) for i in range(1, 5)]
    assert [await r for r in replies] == [1, 3, 6, 10]
    await sysm.quiesce()
    st = c.statistics()
    assert (st.received, st.processed, st.failed, st.current_size) == (4, 4, 0, 0)


async def test_handler_failure_fails_only_that_message_and_reports_to_supervisor():
    sysm = ActorSystem()
    parent = sysm.spawn(Parent())
    c = sysm.spawn(Counter(), supervisor=parent)
    r1 = c.ask(Add(1))
    r2 = c.ask(Boom())
    r3 = c.ask(Add(2))
    assert await r1 == 1
    with pytest.raises(HandlerError) as ei:
        await r2
    assert "Boom" in str(ei.value) and "kaboom" in str(ei.value)
    assert isinstance(ei.value.exc, RuntimeError)
    assert await r3 == 3                    # the actor goes on
    assert parent.reports == [("counter", "Boom", "kaboom")]
    assert c.failures == ["Boom"] and c.statistics().failed == 1


async def test_unhandled_message_type_is_a_typed_error():
    sysm = ActorSystem()
    c = sysm.spawn(Counter())
    with pytest.raises(UnhandledMessage):
        await c.ask(Other())
    assert sysm.failures and sysm.failures[-1][1] == "Other"


async def test_teardown_fails_every_pending_reply():
    sysm = ActorSystem()
    c = sysm.spawn(Counter())
    pending = [c.ask(Add(1)) for _ in range(3)]
    c.stop()                                 # before any turn ran
    for p in pending:
        with pytest.raises(ActorDeadError):
            await p
    assert c.log == ["start", "stop"]
    with pytest.raises(ActorDeadError):
        c.tell(Add(1))
    assert sysm.get("counter") is None
    await sysm.quiesce()


async def test_bounded_mailbox_put_nowait_raises_and_send_waits():
    sysm = ActorSystem()
    c = sysm.spawn(Counter(capacity=2))
    c.tell(Add(1))
    c.tell(Add(1))
    with pytest.raises(MailboxFull):
        c.tell(Add(1))
    await c.send(Add(5))                       # waits for the turn that makes room
    await sysm.quiesce()
    assert c.total == 7 and c.statistics().received == 3


async def test_mailbox_wakes_waiting_senders_in_order():
    from actorserve.actors.mailbox import Mailbox, MailboxClosed
    box = Mailbox(1)
    box.put_nowait(("m0", None))
    waiter = asyncio.ensure_future(box.wait_for_room())
    await asyncio.sleep(0)  # sleep-ok: one loop turn (no wall clock): the new task runs to its first await
    assert box.statistics().waiting_senders == 1 and not waiter.done()
    assert box.get_nowait() == ("m0", None)
    await asyncio.wait_for(waiter, 1)
    box.put_nowait(("m1", None))
    closer = asyncio.ensure_future(box.wait_for_room())
    await asyncio.sleep(0)  # sleep-ok: one loop turn (no wall clock): the new task runs to its first await
    assert box.close() == [("m1", None)]
    with pytest.raises(MailboxClosed):
        await closer
    with pytest.raises(MailboxClosed):
        box.put_nowait(("m2", None))


async def test_quiesce_is_exact_across_thread_work():
    sysm = ActorSystem()
    c = sysm.spawn(Counter())
    import threading
    gate = threading.Event()

    def slow():
        gate.wait(5)
        return 41

    sysm.run_in_thread(c, slow, wrap=lambda res, err: Add(res))
    q = asyncio.ensure_future(sysm.quiesce())
    for _ in range(100):                      # many loop iterations, no wall-clock wait
        await asyncio.sleep(0)  # sleep-ok: the loop turns are what is tested (quiesce must not return)
    assert sysm.busy == 1                     # the thread's result is still owed: exactly one
    assert not q.done()                       # so quiesce cannot have returned
    gate.set()
    await asyncio.wait_for(q, 5)
    assert c.total == 41 and sysm.busy == 0
    await sysm.shutdown()


async def test_turns_are_fair_between_actors():
    sysm = ActorSystem()
    a = sysm.spawn(Counter("a"))
    seen_by_b = []

    class Watcher(Counter):
        @handles(Add)
        def add(self, msg):
            seen_by_b.append(a.total)
            return super().add(msg)

    b = sysm.spawn(Watcher("b"))
    for _ in range(200):
        a.tell(Add(1))
    b.tell(Add(1))
    await sysm.quiesce()
    assert a.total == 200 and b.total == 1
    # a's first turn handles `throughput` messages, then b's turn comes (FIFO run queue)
    assert seen_by_b[0] == a.throughput == 64


async def test_duplicate_names_and_failed_setup():
    sysm = ActorSystem()
    sysm.spawn(Counter("x"))
    with pytest.raises(ValueError):
        sysm.spawn(Counter("x"))

    class Bad(Counter):
        def on_start(self):
            raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        sysm.spawn(Bad("y"))
    assert sysm.get("y") is None


def test_manual_clock_fires_timers_in_order_and_exactly():
    clock = ManualClock()
    fired = []
    clock.call_later(2.0, lambda: fired.append(("b", clock.now())))
    clock.call_later(1.0, lambda: fired.append(("a", clock.now())))
    t = clock.call_later(1.5, lambda: fired.append(("x", clock.now())))
    t.cancel()
    assert clock.advance(0.5) == 0 and fired == []
    assert clock.advance(2.0) == 2
    assert fired == [("a", 1.0), ("b", 2.0)] and clock.now() == 2.5
    with pytest.raises(ValueError):
        clock.advance(-1)


async def test_recorder_sees_messages_and_their_effects():
    from actorserve.replay.recorder import FlightRecorder
    rec = FlightRecorder(clock=ManualClock())
    sysm = ActorSystem(recorder=rec)
    c = sysm.spawn(Counter())
    c.tell(Add(2))
    await sysm.quiesce()
    evs = rec.events(kind="message")
    assert [(e.event, e.dst) for e in evs] == [("Add", "counter")]
