"""An asyncio event loop on virtual time, for end-to-end tests over real sockets.

:class:`VirtualTimeLoop` is asyncio's selector loop with one change: its clock (``time()``) is
virtual, and whenever nothing is ready to run and no I/O arrives within a short real moment, it
jumps straight to its next timer instead of sleeping until then. A gateway (uvicorn serving the
real app), its callers (the test Twilio client) and the company's backend all run in this one
loop over real loopback sockets, with :class:`clocks.LoopClock` injected into the gateway, so a
5 s gather timeout, a 30 s reservation or a 110 s drain grace passes as soon as everything is
waiting, in order with everything else that was scheduled, in milliseconds.

Real time still passes where the work is real: while an executor job runs (``to_thread``: the
engine loading, a cache write) or ``real_work()`` says another thread is computing (a gateway's
speech service generating a sentence: :attr:`SpeechService.computing`), the clock follows real
time instead of jumping, and the loop sleeps until its next timer or the work's result. Without
that the loop would race through its timers while a sentence is generated (RTP keep-alive beats,
a caller's own media), burning the cores the engine needs and making live speech look slow.
What a test waits for it waits for with a real-time limit.

``realtime = True`` turns it back into an ordinary loop (its time follows the real clock, offset
so it never goes back) for tests where real timing is the point, on the same gateway.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Real time the loop waits for I/O before concluding that everything is waiting on timers.
#: Peers in this loop write to loopback sockets synchronously, so their data is readable by the
#: next poll; the moment covers the kernel deferring delivery under load.
IDLE_S = 0.0005


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose time jumps to the next timer when the loop is idle."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        super().__init__(selectors.DefaultSelector())
        # Virtual time starts at the real clock's reading, so a stamp compared with a real
        # monotonic one (the speech service's own clock) is never years apart.
        self._virtual = time.monotonic()
        self._offset = 0.0
        self._realtime = False
        self._idle_s = idle_s
        self._jobs = 0
        #: Says whether real work runs on another thread (real time passes meanwhile).
        self.real_work: Callable[[], bool] | None = None
        #: How often, and how far, the clock jumped (tests print it).
        self.jumps = 0
        self.jumped_s = 0.0
        real_select = self._selector.select  # type: ignore[attr-defined]

        def select(timeout: float | None) -> list[tuple[Any, int]]:
            if self._realtime:
                return real_select(timeout)
            events = real_select(0)
            if events or timeout == 0:
                return events
            wait = self._idle_s if timeout is None else min(timeout, self._idle_s)
            started = time.monotonic()
            events = real_select(wait)
            if events:
                return events
            if self._jobs or (self.real_work is not None and self.real_work()):
                # Real work in progress (an executor job, an engine step): its time passes for
                # real, and the loop sleeps until its next timer or the work's result wakes it.
                rest = None if timeout is None else max(0.0, timeout - wait)
                events = real_select(rest)
                self._virtual += time.monotonic() - started
                return events
            if timeout is None:
                # No timer at all: only I/O (or a thread) can wake anything. Wait for it.
                return real_select(None)
            self._virtual += timeout
            self.jumps += 1
            self.jumped_s += timeout
            return []

        self._selector.select = select  # type: ignore[attr-defined]

    def time(self) -> float:
        if self._realtime:
            return time.monotonic() + self._offset
        return self._virtual

    @property
    def realtime(self) -> bool:
        return self._realtime

    @realtime.setter
    def realtime(self, value: bool) -> None:
        if value == self._realtime:
            return
        if value:
            self._offset = self._virtual - time.monotonic()
        else:
            self._virtual = time.monotonic() + self._offset
        self._realtime = value

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any
                        ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self._jobs += 1

        def done(_: asyncio.Future[T]) -> None:
            self._jobs -= 1

        future.add_done_callback(done)
        return future
