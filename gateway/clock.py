"""Time as the gateway sees it: one injected :class:`Clock` (STYLE.md rule 8).

Every component that stamps, waits or times out takes a clock from the composition root
(:func:`gateway.app.create_app`) instead of calling ``time.monotonic()``, ``asyncio.sleep()`` or
``asyncio.timeout()`` itself: the call lifecycle and its playout, the Twilio and SIP transports,
admission, drain and the IVR runner (gather timeouts and the webhook deadline). Production runs
on :class:`SystemClock`; tests drive a virtual clock (``tests/clocks.py``) so a 5 s gather
timeout, a 30 s reservation or a 110 s drain grace costs no real time.

The protocol is small on purpose: two readings (:meth:`Clock.now`, monotonic, and
:meth:`Clock.wall`, the time of day that business hours need) and the four ways the gateway
waits. Everything else (deadlines, pacing) is arithmetic on :meth:`Clock.now`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar

__all__ = ["Cancellable", "Clock", "SystemClock"]

T = TypeVar("T")


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
        await asyncio.sleep(max(0.0, seconds))

    async def wait_for(self, awaitable: Awaitable[T], seconds: float | None) -> T:
        return await asyncio.wait_for(awaitable, seconds)

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[object]:
        return asyncio.timeout(seconds)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_later(max(0.0, seconds), callback)
