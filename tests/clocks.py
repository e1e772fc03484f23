"""Test clocks (the gateway's own is :class:`gateway.clock.SystemClock`).

- :class:`VirtualClock`: time moves only when the test calls :meth:`VirtualClock.advance`; for
  tests that drive one component by hand (the IVR runner, admission, drain, the playout).
- :class:`LoopClock`: the running event loop's time; with :class:`virtual_time.VirtualTimeLoop`
  it makes a whole gateway, its peers and the test share one virtual time line.

Both implement :class:`gateway.clock.Clock`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")


class _Timer:
    __slots__ = ("callback", "cancelled", "deadline", "seq")

    def __init__(self, deadline: float, seq: int, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.seq = seq
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: _Timer) -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class _Timeout:
    """``async with clock.timeout(s)``: cancels the block at the virtual deadline, then raises
    :class:`TimeoutError` (the semantics of :func:`asyncio.timeout`)."""

    def __init__(self, clock: VirtualClock, seconds: float | None) -> None:
        self._clock = clock
        self._seconds = seconds
        self._timer: _Timer | None = None
        self._task: asyncio.Task[Any] | None = None
        self._expired = False

    async def __aenter__(self) -> _Timeout:
        if self._seconds is not None:
            self._task = asyncio.current_task()
            self._timer = self._clock.call_later(self._seconds, self._expire)
        return self

    def _expire(self) -> None:
        self._expired = True
        if self._task is not None:
            self._task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        if self._timer is not None:
            self._timer.cancel()
        if self._expired and exc_type is asyncio.CancelledError and self._task is not None:
            if self._task.uncancel() == 0:
                raise TimeoutError from exc
        return False


class VirtualClock:
    """A :class:`gateway.clock.Clock` whose time moves only in :meth:`advance`."""

    def __init__(self, start: float = 0.0, wall_start: float = 1_750_000_000.0) -> None:
        self._now = start
        #: Unix time at ``start`` (default: a Sunday afternoon in June 2025, UTC).
        self._wall_offset = wall_start - start
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        #: Timed waits (``wait_for`` with a timeout) started so far: a test waits for the code
        #: under test to reach its next one (:meth:`next_wait`).
        self.waits = 0
        self._wait_started = asyncio.Event()

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall_offset + self._now

    def set_wall(self, epoch_s: float) -> None:
        """Say what time of day it is now (monotonic time does not move)."""
        self._wall_offset = epoch_s - self._now

    def call_later(self, seconds: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(self._now + max(0.0, seconds), next(self._seq), callback)
        heapq.heappush(self._timers, timer)
        return timer

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_later(seconds, lambda: future.done() or future.set_result(None))
        try:
            await future
        finally:
            timer.cancel()

    async def wait_for(self, awaitable: Awaitable[T], seconds: float | None) -> T:
        if seconds is None:
            return await awaitable
        self.waits += 1
        self._wait_started.set()
        task = asyncio.ensure_future(awaitable)
        expired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_later(seconds, lambda: expired.done() or expired.set_result(None))
        try:
            done, _ = await asyncio.wait({task, expired}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            timer.cancel()
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise TimeoutError

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[object]:
        return _Timeout(self, seconds)

    async def next_wait(self, after: int) -> None:
        """Until a timed wait beyond the first ``after`` is pending (event-driven, no polling)."""
        while not (self.waits > after and self.waiting):
            self._wait_started.clear()
            await self._wait_started.wait()

    @property
    def waiting(self) -> bool:
        """True while something waits on a timer."""
        return any(not timer.cancelled for timer in self._timers)

    async def advance(self, seconds: float) -> None:
        """Move time forward, firing every timer that falls due in order, letting the tasks
        they wake run between them."""
        target = self._now + seconds
        while self._timers and self._timers[0].deadline <= target:
            timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, timer.deadline)
            timer.callback()
            for _ in range(5):
                await asyncio.sleep(0)
        self._now = target
        for _ in range(5):
            await asyncio.sleep(0)


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
        return await asyncio.wait_for(awaitable, seconds)

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[object]:
        return asyncio.timeout(seconds)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_later(max(0.0, seconds), callback)
