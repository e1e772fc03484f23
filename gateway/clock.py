"""Time as the gateway sees it: one injected :class:`Clock` (STYLE.md rule 8).

Every component that stamps, waits or times out takes a clock from the composition root
(:func:`gateway.app.create_app`) instead of calling ``time.monotonic()``, ``asyncio.sleep()`` or
``asyncio.timeout()`` itself: the call lifecycle and its playout, the Twilio and SIP transports,
admission, drain and the IVR runner (gather timeouts and the webhook deadline). Production runs
on :class:`SystemClock`; tests drive a virtual clock (``tests/support/clocks.py``) so a 5 s gather
timeout, a 30 s reservation or a 110 s drain grace costs no real time.

The protocol is small on purpose: two readings (:meth:`Clock.now`, monotonic, and
:meth:`Clock.wall`, the time of day that business hours need) and the four ways the gateway
waits. Everything else (deadlines, pacing) is arithmetic on :meth:`Clock.now`.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Protocol, TypeVar

__all__ = ["MIN_WAIT_S", "Cancellable", "Clock", "SystemClock", "VirtualClock", "timer_delay",
           "wait_for"]

T = TypeVar("T")

#: The shortest timed wait handed to asyncio. asyncio runs a timer up to its clock's resolution
#: early (1 ns for ``CLOCK_MONOTONIC``) without that clock having passed the timer's time, so the
#: gateway's usual loop, "wait until the deadline, then check ``now() >= deadline``", could wake
#: with the deadline a few picoseconds ahead (the float sums of a call's timers leave such
#: remainders) and wait again: for a nanosecond on a real clock, for ever on a virtual-time
#: loop, whose time moves only when the loop is idle (a bot's stalled-answer deadline spun a
#: test gateway's event loop for 300 s). A timer at least this far ahead fires only once the
#: clock has passed it, and a microsecond more is nothing to any wait the gateway makes.
MIN_WAIT_S = 1e-6


def timer_delay(seconds: float) -> float:
    """The delay to give asyncio for a wait of ``seconds``: ``seconds``, but at least
    :data:`MIN_WAIT_S` when it is positive (zero and below stay: they mean "do not wait")."""
    return seconds if seconds <= 0.0 or seconds >= MIN_WAIT_S else MIN_WAIT_S


class Cancellable(Protocol):
    """A scheduled callback that can be called off (``asyncio.TimerHandle`` is one)."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic seconds and the waits built on them."""

    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch (``time.time()``): the time of day, for business
        hours. Never used to measure intervals (it jumps when the host's clock is set)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return after ``seconds`` (at once for ``seconds <= 0``, after one loop turn)."""
        ...

    async def wait_for(self, awaitable: Awaitable[T], seconds: float | None) -> T:
        """``awaitable``'s result, or :class:`TimeoutError` after ``seconds`` (``None``: never);
        on timeout the awaitable is cancelled, as :func:`asyncio.wait_for` does."""
        ...

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[object]:
        """A block that raises :class:`TimeoutError` once it has run ``seconds``."""
        ...

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Cancellable:
        """Run ``callback`` on the event loop after ``seconds``."""
        ...


class SystemClock:
    """Real time: ``time.monotonic()`` and asyncio's own waits.

    asyncio's timers run on the loop's clock, which is ``CLOCK_MONOTONIC`` for both the default
    loop and uvloop, the same base as ``time.monotonic()``; stamps use ``time.monotonic()``
    itself because uvloop's loop time has millisecond resolution (first-audio latencies of a
    cached prompt are well under a millisecond).
    """

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, timer_delay(seconds)))

    async def wait_for(self, awaitable: Awaitable[T], seconds: float | None) -> T:
        return await wait_for(awaitable, seconds)

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[object]:
        return asyncio.timeout(None if seconds is None else timer_delay(seconds))

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_later(max(0.0, timer_delay(seconds)), callback)


async def wait_for(awaitable: Awaitable[T], seconds: float | None) -> T:
    """:func:`asyncio.wait_for` as Python 3.12 implements it, on :func:`asyncio.timeout`.

    Python 3.11's own returns the awaitable's result when the waiting task is cancelled in the
    loop turn that the awaitable completes (bpo-42130): the cancellation is lost, and a task
    that loops on a timed wait (the SIP endpoint's timers, woken by the very request that
    stops it) never ends, so whoever stops it waits for ever. A positive wait lasts at least
    :data:`MIN_WAIT_S` (see there).
    """
    if seconds is None:
        return await awaitable
    if seconds <= 0:
        future = asyncio.ensure_future(awaitable)
        if future.done():
            return future.result()
        future.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await future
        raise TimeoutError
    async with asyncio.timeout(timer_delay(seconds)):
        return await awaitable


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


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
    """A :class:`Clock` whose time moves only in :meth:`advance`: tests, and the script
    tester (``gateway script test``), which runs the real IVR runner through a whole call
    in no time."""

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
        timer = self.call_later(seconds, lambda: _resolve(future))
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
        timer = self.call_later(seconds, lambda: _resolve(expired))
        waiters: set[asyncio.Future[Any]] = {task, expired}
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
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

    def next_deadline(self) -> float | None:
        """When the earliest pending timer fires (None: nothing waits on time)."""
        while self._timers and self._timers[0].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0].deadline if self._timers else None

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
