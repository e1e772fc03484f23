"""Stopping a child task never swallows the stopper's own cancellation.

Every place that cancels a child and waits for it (an utterance's task, a dialog, the playout,
the SIP timers, the load simulator's ticker and callers) goes through
:func:`gateway.aio.cancel_and_wait`: a child that ends cancelled is what was asked for, but a
task cancelled *while it waits* (a shutdown, a request that went away) must still see its
CancelledError, and a child's failure is logged instead of raised into the stopper or hidden.

Each case stops something from a task that is itself cancelled while it waits on the child
(the call lifecycle's own case is in test_call_lifecycle.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
import websockets

from gateway.aio import cancel_and_wait
from gateway.loadsim.twilio_caller import Ticker, TwilioCaller


async def _cancelled_while_stopping(stop: Callable[[], Awaitable[None]]) -> list[str]:
    """Run ``stop()`` in a task, cancel that task while it waits; what happened after stop()."""
    after: list[str] = []

    async def stopper() -> None:
        await stop()
        after.append("carried on after its own cancellation")

    task = asyncio.create_task(stopper())
    await asyncio.sleep(0)  # the stopper has cancelled its child and waits on it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return after


async def _forever() -> None:
    await asyncio.Event().wait()


async def _stubborn() -> None:
    """A child that takes a few loop turns to stop (clean-up that awaits)."""
    try:
        await asyncio.Event().wait()
    finally:
        for _ in range(3):
            await asyncio.sleep(0)


def _about_the_child(caplog: pytest.LogCaptureFixture, coro: str) -> list[logging.LogRecord]:
    """Records from the stopper's logger, or asyncio's about the child's coroutine: a garbage
    collection during the test may log asyncio's "Task was destroyed" for another test's
    leftover tasks (seen once in CI), which says nothing about this child."""
    return [r for r in caplog.records
            if r.name == "test" or (r.name == "asyncio" and coro in r.getMessage())]


async def test_a_cancelled_child_is_reaped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    child = asyncio.create_task(_forever())
    await asyncio.sleep(0)
    await cancel_and_wait(child, log=logging.getLogger("test"), what="child")
    assert child.cancelled() and not _about_the_child(caplog, "_forever")


async def test_the_stoppers_own_cancellation_propagates() -> None:
    child = asyncio.create_task(_stubborn())
    await asyncio.sleep(0)
    assert await _cancelled_while_stopping(lambda: cancel_and_wait(child)) == []
    assert child.done()


async def test_a_child_that_failed_is_logged_not_raised(
        caplog: pytest.LogCaptureFixture) -> None:
    async def broken() -> None:
        raise RuntimeError("a bug in the child")

    child = asyncio.create_task(broken())
    await asyncio.sleep(0)
    await cancel_and_wait(child, log=logging.getLogger("test"), what="the child")
    [record] = _about_the_child(caplog, "broken")
    assert record.getMessage() == "the child failed while stopping"
    assert record.exc_info is not None and "a bug in the child" in str(record.exc_info[1])


# --- the load simulator -----------------------------------------------------------------------


async def test_stopping_the_loadsim_ticker_propagates_the_stoppers_cancellation() -> None:
    ticker = Ticker()
    ticker.start()
    await asyncio.sleep(0)
    assert await _cancelled_while_stopping(ticker.stop) == []


async def test_closing_a_loadsim_caller_propagates_the_closers_cancellation() -> None:
    async def twilio(ws) -> None:  # type: ignore[no-untyped-def]
        await ws.wait_closed()

    async with websockets.serve(twilio, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        caller = TwilioCaller(f"ws://127.0.0.1:{port}/twilio/media", {}, None, "CA" + "1" * 32,
                              Ticker())
        await caller.connect()
        assert await _cancelled_while_stopping(caller.close) == []
        await caller.close()
