"""Timed waits in the services never lose a cancel (services.common.waiting)."""

from __future__ import annotations

import asyncio
import pathlib

from services.common.waiting import wait_event

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_cancel_arriving_as_the_event_is_set_stops_the_waiting_loop():
    async def loop(event: asyncio.Event):
        while True:
            await wait_event(event, 0.1)
            event.clear()

    async def run():
        event = asyncio.Event()
        task = asyncio.create_task(loop(event))
        await asyncio.sleep(0.01)
        event.set()
        await asyncio.sleep(0)  # the event's waiter is done, the loop not yet resumed
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        assert done and task.cancelled(), "the cancel was lost: the loop went on"

    asyncio.run(run())


def test_wait_event_says_whether_the_event_came():
    async def run():
        event = asyncio.Event()
        assert await wait_event(event, 0.01) is False
        asyncio.get_running_loop().call_later(0.01, event.set)
        assert await wait_event(event, 5) is True

    asyncio.run(run())


def test_no_service_uses_asyncio_wait_for():
    """asyncio.wait_for drops a cancel that arrives as its result does (Python 3.11): use wait_event or asyncio.timeout."""
    offenders = [f"{p.relative_to(ROOT)}:{n}" for d in ("services", "swiftkv_core", "loadtest") for p in (ROOT / d).rglob("*.py")
                 for n, text in enumerate(p.read_text().splitlines(), 1) if "asyncio.wait_for(" in text]
    assert offenders == [], offenders
