"""Test clocks (the gateway's own is :class:`gateway.clock.SystemClock`).

- :class:`VirtualClock` (now in :mod:`gateway.clock`: the script tester runs on it too): time
  moves only when the test calls :meth:`VirtualClock.advance`; for tests that drive one
  component by hand (the IVR runner, admission, drain, the playout).
- :class:`LoopClock`: the running event loop's time; with :class:`virtual_time.VirtualTimeLoop`
  it makes a whole gateway, its peers and the test share one virtual time line.

Both implement :class:`gateway.clock.Clock`. :func:`until` polls a condition on loop time
(virtual on a virtual loop), bounded in real time, for state with no event to wait on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from gateway.clock import VirtualClock, wait_for

__all__ = ["LoopClock", "VirtualClock", "until"]

T = TypeVar("T")


class LoopClock:
    """A :class:`gateway.clock.Clock` on the event loop's own time (virtual in a
    :class:`virtual_time.VirtualTimeLoop`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._wall_offset = time.time() - loop.time()

    def now(self) -> float:
        return self._loop.time()

    def wall(self) -> float:
        return self._wall_offset + self._loop.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    async def wait_for(self, awaitable: Awaitable[T], seconds: float | None) -> T:
        return await wait_for(awaitable, seconds)  # not asyncio's: see gateway.clock.wait_for

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[object]:
        return asyncio.timeout(seconds)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_later(max(0.0, seconds), callback)


async def until(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition",
                every: float = 0.02) -> T:
    """``predicate()`` once it is truthy, polled every ``every`` s of loop time (virtual on a
    virtual loop); gives up after ``timeout`` s of real time, a bound that a busy machine
    never reaches, not a wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(every)
    raise AssertionError(f"{what}: not met in {timeout:g} s")
