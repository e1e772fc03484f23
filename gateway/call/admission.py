"""One call budget per replica (``GATEWAY_MAX_CALLS``), asked by every transport.

A call holds a *seat* from the moment it is admitted until it ends, whatever carries it:

- Twilio: the voice webhook may :meth:`Admission.reserve` a seat for the Media Stream it points
  at (``GATEWAY_TWILIO_RESERVATION_S``, 5 s by default: Twilio opens the stream within a second
  or two of fetching the TwiML; an unclaimed reservation lapses); the stream's ``start``
  :meth:`Admission.admit`\\ s under its CallSid, claiming the reservation, or takes a fresh seat
  if this replica has room (the webhook was answered by another replica, or reserved nothing).
- SIP: an INVITE takes its seat as it arrives, so a call that is still ringing counts too; the
  seat becomes the call's when it is answered and is released if it is cancelled or refused.

Behind a load balancer without stickiness the stream lands on the webhook's replica only by
chance, so a reservation there is a guess: it is never more than a guess's worth of capacity.
It lapses quickly, a stream admitted anywhere is admitted against *that* replica's budget (so no
replica ever holds more than ``max_calls`` seats), and the drain (:meth:`Admission.wait_idle`)
waits for calls only, never for a reservation whose stream may be on another replica. A fleet
sets ``GATEWAY_TWILIO_RESERVATION_S=0``: the webhook then only asks whether there is room.

A transport asks :meth:`Admission.refusal` (or is told by ``admit``/``reserve``) why a new call
would be turned away: ``draining`` (it will not come back), ``not_ready`` (still loading), or
``at_capacity``. Every refusal is counted in ``gateway_calls_refused_total{transport,reason}``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal

from gateway.clock import Clock
from gateway.metrics import Metrics
from gateway.readiness import Readiness

log = logging.getLogger(__name__)

__all__ = ["Admission", "Refusal"]

Refusal = Literal["draining", "not_ready", "at_capacity"]


@dataclass
class _Seat:
    transport: str
    #: Clock time a reservation lapses (None: held by a call, or a ringing SIP call).
    lapses_at: float | None = None


class Admission:
    """The replica's call budget: seats held by calls, ringing calls and reservations."""

    def __init__(self, max_calls: int, readiness: Readiness, clock: Clock,
                 metrics: Metrics | None = None) -> None:
        #: The budget (both transports together). Changing it applies to the next admission.
        self.max_calls = max_calls
        self._readiness = readiness
        self._clock = clock
        self._metrics = metrics
        self._seats: dict[str, _Seat] = {}
        #: Set while no seat is held by a call (or a ringing SIP call): reservations aside.
        self._idle = asyncio.Event()
        self._idle.set()
        if metrics is not None:
            # Read at scrape time: phantom seats (reservations whose streams went to another
            # replica) show up here before they show up as refusals.
            metrics.seats.labels("call").set_function(lambda: self.seats() - self._reserved())
            metrics.seats.labels("reservation").set_function(lambda: self._reserved())

    # --- questions ----------------------------------------------------------------------------

    def refusal(self) -> Refusal | None:
        """Why a new call would be turned away now (``None``: it is welcome)."""
        readiness = self._readiness
        if readiness.draining:
            return "draining"
        if not readiness.ready:
            return "not_ready"
        self._expire()
        if len(self._seats) >= self.max_calls:
            return "at_capacity"
        return None

    def seats(self, transport: str | None = None) -> int:
        """Seats taken (calls, ringing calls and reservations), on one transport or all."""
        self._expire()
        if transport is None:
            return len(self._seats)
        return sum(1 for seat in self._seats.values() if seat.transport == transport)

    def free(self) -> int:
        """Seats left in the budget."""
        return max(0, self.max_calls - self.seats())

    def reservations(self) -> dict[str, float]:
        """Unclaimed reservations: key -> when each lapses."""
        self._expire()
        return {key: seat.lapses_at for key, seat in self._seats.items()
                if seat.lapses_at is not None}

    def holds(self, key: str) -> bool:
        self._expire()
        return key in self._seats

    # --- seats --------------------------------------------------------------------------------

    def reserve(self, key: str, transport: str, hold_s: float) -> Refusal | None:
        """Hold a seat for a call about to connect (Twilio's webhook); lapses after ``hold_s``.

        ``hold_s`` 0 holds nothing: only whether there is room now is answered (a fleet, where
        the call's media may connect to any replica).
        """
        reason = self.refusal()
        if reason is not None:
            self._refused(transport, reason)
            return reason
        if hold_s > 0:
            self._take(key, _Seat(transport, self._clock.now() + hold_s))
        return None

    def admit(self, key: str, transport: str) -> Refusal | None:
        """A call starting: the seat reserved under ``key``, or a fresh one, or why not."""
        self._expire()
        seat = self._seats.get(key)
        if seat is not None and seat.lapses_at is not None:
            seat.lapses_at = None  # claimed: the call holds it now
            seat.transport = transport
            self._idle.clear()
            return None
        reason = self.refusal()
        if reason is not None:
            self._refused(transport, reason)
            return reason
        self._take(key, _Seat(transport))
        return None

    def release(self, key: str) -> None:
        """The call holding ``key`` ended (or never came): its seat is free."""
        if self._seats.pop(key, None) is not None and not self._calls_held():
            self._idle.set()

    async def wait_idle(self, deadline: float) -> bool:
        """Until no call holds a seat (True) or the clock passes ``deadline`` (False).

        Unclaimed reservations are not waited for: on a fleet their streams go to whichever
        replica the balancer picks (a draining one is out of its rotation), so one held here
        would keep a drained replica alive for nothing. A reserved stream that does arrive
        while calls are still draining is still taken (:meth:`admit`), and then waited for.
        """
        clock = self._clock
        while self._calls_held():
            now = clock.now()
            if now >= deadline:
                return False
            self._idle.clear()
            try:
                await clock.wait_for(self._idle.wait(), max(0.0, deadline - now))
            except TimeoutError:
                pass
        return True

    # --- internals ----------------------------------------------------------------------------

    def _take(self, key: str, seat: _Seat) -> None:
        self._seats[key] = seat
        if seat.lapses_at is None:
            self._idle.clear()

    def _reserved(self) -> int:
        self._expire()
        return sum(1 for seat in self._seats.values() if seat.lapses_at is not None)

    def _calls_held(self) -> bool:
        return any(seat.lapses_at is None for seat in self._seats.values())

    def _expire(self) -> None:
        now = self._clock.now()
        lapsed = [key for key, seat in self._seats.items()
                  if seat.lapses_at is not None and seat.lapses_at <= now]
        for key in lapsed:
            log.info("reservation %s lapsed: its stream never came", key)
            self.release(key)

    def _refused(self, transport: str, reason: Refusal) -> None:
        if self._metrics is not None:
            self._metrics.calls_refused.labels(transport, reason).inc()
