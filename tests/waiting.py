"""The one way tests wait for something that must happen: `until`, polled on the running loop
with a deadline (a condition never reached fails the test with a message, it does not hang it).

Prefer an exact wait where there is one (``await rt.quiesce()`` when every actor is on the loop,
an event the code under test sets, a future); `until` is for what only the outside world moves
(a step in its thread, a socket, another process). tests/test_waiting_rules.py keeps it the only
polling loop in tests/ and keeps wall-clock sleeps out of the tests."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Union

What = Union[str, Callable[[], str], None]


def _describe(pred: Callable[[], object]) -> str:
    try:
        return inspect.getsource(pred).strip()      # the lambda's line: what was awaited
    except (OSError, TypeError):
        return getattr(pred, "__qualname__", repr(pred))


async def until(pred: Callable[[], Any], timeout: float = 10.0, poll: float = 0.005,
                what: What = None) -> Any:
    """Wait until ``pred()`` is truthy and return that value; ``pred`` may be a coroutine
    function (it is awaited on each poll). ``poll=0`` checks once per loop turn: for state the
    loop itself moves fast (the fake engine steps on the loop, and a timed poll would let a whole
    generation pass between two looks). After ``timeout`` seconds the test fails with an
    AssertionError naming ``what`` (a text, or a callable giving it at failure time, e.g. with
    the state reached) or the predicate's source. Never use it to show that something did not
    happen: a wait that ends proves nothing about what has not happened yet."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        got = pred()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if loop.time() >= end:
            text = what() if callable(what) else what
            raise AssertionError(f"not reached within {timeout:g}s: {text or _describe(pred)}")
        await asyncio.sleep(poll)  # sleep-ok: the poll interval of the one bounded wait
