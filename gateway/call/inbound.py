"""A call's cap on its inbound media rate, the same for every transport.

Twilio sends one ``media`` message and a SIP phone one RTP packet per 20 ms: 50 a second. A
stream that sends far more (a broken or hostile client, a replayed capture) would otherwise have
every message parsed and fed to the call (the speech detector, the inactivity watch) at
whatever rate it manages, taking the event loop from every other call. :class:`InboundRate` is a
token bucket over the adapter's own clock readings: it lets through :data:`MAX_RATE` messages a
second on average and bursts of up to :data:`BURST` (a network stall delivers its backlog at
once: three seconds of it pass), and says which of the rest to drop. Both are defaults:
``GATEWAY_INBOUND_MEDIA_RATE`` and ``GATEWAY_INBOUND_MEDIA_BURST`` set them per gateway, as one
:class:`InboundCap` the call lifecycle holds; each transport asks it for a meter per call
(:meth:`CallLifecycle.inbound_meter`), so neither carries the settings itself. The
adapter drops them unparsed where it can tell media apart cheaply, and counts them
(``gateway_inbound_media_dropped_total{transport}``). A normal stream never comes near the cap.
Sans-I/O: one float comparison per message, no timer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["BURST", "MAX_RATE", "InboundCap", "InboundRate"]

MAX_RATE: Final[float] = 100.0
"""Inbound media messages (or RTP packets) a second a call may send on average: twice 50."""

BURST: Final[float] = 150.0
"""Messages that may arrive back to back (three seconds of 20 ms frames)."""


def _check(rate: float, burst: float) -> None:
    if rate <= 0 or burst < 1:
        raise ValueError("need rate > 0 and burst >= 1")


class InboundRate:
    """Token bucket: :meth:`allow` says whether one more inbound message fits the cap."""

    __slots__ = ("_at", "_tokens", "burst", "dropped", "rate")

    def __init__(self, rate: float = MAX_RATE, burst: float = BURST,
                 now: float | None = None) -> None:
        _check(rate, burst)
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = now
        #: Messages refused so far.
        self.dropped = 0

    def allow(self, now: float) -> bool:
        """One message arrives at ``now`` (the adapter's clock reading for it): False when it
        is over the cap (counted in :attr:`dropped`)."""
        at = self._at
        tokens = self._tokens
        if at is not None and now > at:
            tokens = min(self.burst, tokens + (now - at) * self.rate)
        self._at = now
        if tokens < 1.0:
            self._tokens = tokens
            self.dropped += 1
            return False
        self._tokens = tokens - 1.0
        return True


@dataclass(frozen=True)
class InboundCap:
    """A gateway's cap on each call's inbound media: ``rate`` a second, bursts of ``burst``."""

    rate: float = MAX_RATE
    burst: float = BURST

    def __post_init__(self) -> None:
        _check(self.rate, self.burst)  # at start-up, not at the first call

    def meter(self, now: float | None = None) -> InboundRate:
        """A fresh token bucket for one call (or stream) under this cap."""
        return InboundRate(self.rate, self.burst, now)
