"""Waiting with a timeout without ever losing a cancel.

Python 3.11's `asyncio.wait_for` returns the awaited result when it is cancelled in the same moment that result
arrives: the cancel is lost. A loop that waits on an event between rounds (the batch runner, the trainer, the live
traffic publisher) then never stops, and the gateway's shutdown waits for it forever. `asyncio.timeout` keeps the
cancel, so every timed wait in the services goes through it."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """True once `event` is set, False after `seconds` without it."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
        return True
    except TimeoutError:
        return False
