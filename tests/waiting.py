"""The one way tests wait for something that must happen: `until`, polled on the running loop
with a deadline (a condition never reached fails the test, it does not hang it)."""

from __future__ import annotations

import asyncio
from typing import Callable


async def until(pred: Callable[[], object], timeout: float = 10.0, poll: float = 0.005) -> None:
    """Wait until ``pred()`` is true (never use it to show that something did not happen)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(poll)
