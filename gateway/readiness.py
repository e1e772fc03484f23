"""Whether this replica takes calls: loading, ready, failed, draining.

One small object the composition root creates and hands to whoever asks the question: admission
(why a call would be refused), ``/readyz`` and the SIP endpoint (OPTIONS 503 while it is not
ready or draining). The engine loader flips it to ready or failed; SIGTERM starts the drain.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.clock import Clock
from gateway.metrics import Metrics

log = logging.getLogger(__name__)

__all__ = ["Readiness"]


class Readiness:
    """Loading -> ready (or failed); ready or not, draining once SIGTERM came."""

    def __init__(self, metrics: Metrics, clock: Clock) -> None:
        self._metrics = metrics
        self._clock = clock
        self.started_at = clock.now()
        self.ready = False
        #: Why start-up failed (None while loading or once ready).
        self.load_error: str | None = None
        #: True from SIGTERM on: new calls are refused, active calls finish.
        self.draining = False
        #: Called with the message when start-up fails (the CLI stops the server and exits 1).
        self.on_fatal: Callable[[str], None] | None = None
        #: What the engine is (for /readyz), once ready.
        self.engine_name: str | None = None
        self._settled = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []

    @property
    def uptime_s(self) -> float:
        return self._clock.now() - self.started_at

    @property
    def taking_calls(self) -> bool:
        """Ready and not draining: a new call is welcome (capacity permitting)."""
        return self.ready and not self.draining

    def mark_ready(self, engine_name: str) -> None:
        self.engine_name = engine_name
        self.ready = True
        self._settle()

    def fail(self, message: str) -> None:
        """Start-up failed: say why once, and tell the process (which exits 1)."""
        self.load_error = message
        log.error("%s", message)
        if self.on_fatal is not None:
            self.on_fatal(message)
        self._settle()

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) once start-up is over, ready or failed."""
        if self.ready or self.load_error is not None:
            callback()
        else:
            self._listeners.append(callback)

    async def settled(self) -> None:
        """Until start-up is over (ready or failed)."""
        await self._settled.wait()

    def _settle(self) -> None:
        self._settled.set()
        listeners, self._listeners = self._listeners, []
        for callback in listeners:
            callback()

    def begin_drain(self) -> bool:
        """Stop taking calls (/readyz 503, Twilio busy message, SIP 503); calls continue.

        Returns False when a drain had already begun.
        """
        if self.draining:
            return False
        self.draining = True
        self._metrics.draining.set(1)
        return True
