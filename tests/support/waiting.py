"""Waiting for a condition, the one way the tests do it when there is no event to await.

Prefer an event (``asyncio.Event``, a future, ``FakeTwilioCall.wait_for``, a component's own
``wait_for``). Where the state lives somewhere that cannot signal this process (another
process's /metrics, a peer's log, a registry with no hook), poll it with one of these:

- :func:`until` (async): polls on the running loop's time, virtual on a
  :class:`~tests.support.virtual_time.VirtualTimeLoop`, so it costs no real time there;
- :func:`wait_until` (sync): polls on real time, for threads and synchronous tests;
- :func:`until_in_thread` (async): :func:`wait_until` off the loop, for a predicate that blocks
  (an HTTP scrape of another process) and must not stall the loop's other tasks.

Every bound is a bound, not a wait: ``timeout`` is real time that a busy machine never reaches
when the condition is on its way; reaching it fails the test with ``what`` in the message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["never", "until", "until_in_thread", "wait_until"]

T = TypeVar("T")


async def until(predicate: Callable[[], T | None], timeout: float = 20.0,
                what: str = "condition", every: float = 0.02) -> T:
    """``predicate()`` once it is truthy, polled every ``every`` s of loop time (virtual on a
    virtual loop); AssertionError naming ``what`` after ``timeout`` s of real time."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not met in {timeout:g} s")
        await asyncio.sleep(every)


def wait_until(predicate: Callable[[], T | None], timeout: float = 20.0,
               what: str = "condition", every: float = 0.02) -> T:
    """``predicate()`` once it is truthy, polled every ``every`` s of real time (blocking the
    calling thread); AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not met in {timeout:g} s")
        time.sleep(every)


async def until_in_thread(predicate: Callable[[], T | None], timeout: float = 20.0,
                          what: str = "condition", every: float = 0.02) -> T:
    """:func:`wait_until` in a worker thread: for a predicate that blocks (a scrape of another
    process's /metrics) while the loop keeps serving the test's callers."""
    return await asyncio.to_thread(wait_until, predicate, timeout, what, every)


async def never(predicate: Callable[[], object], within: float, what: str,
                every: float = 0.01) -> None:
    """Assert that ``predicate()`` stays falsy for ``within`` s of loop time: a negative property
    (no retransmission, no early close, no packet after a BYE) watched over the window in which
    it would show, named by the protocol timer or limit it stands for. Fails as soon as the
    predicate turns truthy, with ``what`` in the message, instead of looking only at the end.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        if predicate():
            raise AssertionError(f"{what} within {within:g} s")
        if loop.time() >= end:
            return
        await asyncio.sleep(min(every, max(0.0, end - loop.time())))
