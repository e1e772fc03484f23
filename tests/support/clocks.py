"""Test clocks (the gateway's own is :class:`gateway.clock.SystemClock`).

- :class:`VirtualClock` (now in :mod:`gateway.clock`: the script tester runs on it too): time
  moves only when the test calls :meth:`VirtualClock.advance`; for tests that drive one
  component by hand (the IVR runner, admission, drain, the playout).
- :class:`LoopClock`: the running event loop's time; with
  :class:`~tests.support.virtual_time.VirtualTimeLoop`
  it makes a whole gateway, its peers and the test share one virtual time line.
- :class:`ManualClock`: a :class:`VirtualClock` that a synchronous test sets by hand
  (``clock.t = 5.0``), or that moves ``step`` seconds on every reading; for components that
  only read the time (the pacer, the chunk planner, digest nonces, the engine core's thread).

All implement :class:`gateway.clock.Clock`. Waiting for a condition on loop time is
:func:`tests.support.waiting.until`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from gateway.clock import VirtualClock, timer_delay, wait_for

__all__ = ["LoopClock", "ManualClock", "VirtualClock"]

T = TypeVar("T")


class LoopClock:
    """A :class:`gateway.clock.Clock` on the event loop's own time (virtual in a
    :class:`~tests.support.virtual_time.VirtualTimeLoop`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._wall_offset = time.time() - loop.time()

    def now(self) -> float:
        return self._loop.time()

    def wall(self) -> float:
        return self._wall_offset + self._loop.time()

    # Every wait goes through timer_delay, as SystemClock's do: a wait shorter than the loop's
    # clock resolution would never move this loop's virtual time (see gateway.clock.MIN_WAIT_S).
    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, timer_delay(seconds)))

    async def wait_for(self, awaitable: Awaitable[T], seconds: float | None) -> T:
        return await wait_for(awaitable, seconds)  # not asyncio's: see gateway.clock.wait_for

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[object]:
        return asyncio.timeout(None if seconds is None else timer_delay(seconds))

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_later(max(0.0, timer_delay(seconds)), callback)


class ManualClock(VirtualClock):
    """A :class:`gateway.clock.Clock` whose time is :attr:`t`, set by hand without firing
    timers (a synchronous test has no loop to run them on), or moved ``step`` seconds by every
    :meth:`now` (a clock that is always late by the time anyone looks)."""

    def __init__(self, t: float = 0.0, *, step: float = 0.0,
                 wall_start: float = 1_750_000_000.0) -> None:
        super().__init__(t, wall_start)
        self.step = step

    @property
    def t(self) -> float:
        """The current time (monotonic seconds); assigning moves it (the wall clock with it)."""
        return self._now

    @t.setter
    def t(self, value: float) -> None:
        self._now = value

    def now(self) -> float:
        self._now += self.step
        return self._now
