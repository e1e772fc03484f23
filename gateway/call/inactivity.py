"""A call's inbound-media watchdog, the same for every transport.

Twilio sends caller audio every 20 ms for the whole stream, and a SIP phone sends RTP every 20 ms
for the whole call. Silence on the wire for ``timeout_s`` therefore means the peer is gone
without saying so (a half-open TCP connection, a crashed proxy, a lost BYE), and nothing else
would ever end the call or free what it holds. The watch then counts the timeout
(``gateway_calls_inbound_timeouts_total{transport}``), logs it, and calls ``on_expired``: the
transport adapter ends its side (Twilio: stop reading and close the socket; SIP: BYE).

One timer per call, re-armed only when it comes due (about once per ``timeout_s``): every inbound
packet is one float store (:meth:`InactivityWatch.touch`), never a timer armed and cancelled 50
times a second. Held calls (SIP a=sendonly/inactive) expect no media: :meth:`suspend` stops the
clock and :meth:`resume` restarts it from zero.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.clock import Cancellable, Clock
from gateway.metrics import Metrics

log = logging.getLogger(__name__)

__all__ = ["InactivityWatch"]


class InactivityWatch:
    """Ends a call whose inbound media stops for ``timeout_s`` (0: never)."""

    __slots__ = ("_clock", "_expired_cb", "_label", "_metrics", "_suspended", "_timer",
                 "_transport", "expired", "last_rx", "timeout_s")

    def __init__(
        self,
        clock: Clock,
        timeout_s: float,
        *,
        transport: str,
        metrics: Metrics | None,
        on_expired: Callable[[], None],
        label: str = "",
    ) -> None:
        self._clock = clock
        self.timeout_s = timeout_s
        self._transport = transport
        self._metrics = metrics
        self._expired_cb = on_expired
        self._label = label
        self._suspended = False
        self._timer: Cancellable | None = None
        self.expired = False
        #: Clock time of the last inbound packet (or of start/resume).
        self.last_rx = clock.now()

    def start(self) -> None:
        """Begin watching (call once, on the event loop)."""
        self.last_rx = self._clock.now()
        if self.timeout_s > 0 and self._timer is None:
            self._timer = self._clock.call_later(self.timeout_s, self._check)

    def touch(self, now: float) -> None:
        """An inbound packet arrived at ``now`` (the caller's own clock read, shared)."""
        self.last_rx = now

    def relabel(self, label: str, on_expired: Callable[[], None] | None = None) -> None:
        """Name the call in the log (and who ends it) once it is known."""
        self._label = label
        if on_expired is not None:
            self._expired_cb = on_expired

    def suspend(self) -> None:
        """On hold: the caller sends nothing and that is fine."""
        self._suspended = True

    def resume(self) -> None:
        """Off hold: the silence of the hold does not count."""
        if self._suspended:
            self._suspended = False
            self.last_rx = self._clock.now()

    def cancel(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _check(self) -> None:
        self._timer = None
        if self.expired:
            return
        now = self._clock.now()
        if self._suspended:
            self._timer = self._clock.call_later(self.timeout_s, self._check)
            return
        due = self.last_rx + self.timeout_s
        if now < due:
            self._timer = self._clock.call_later(due - now, self._check)
            return
        self.expired = True
        if self._metrics is not None:
            self._metrics.calls_inbound_timeouts.labels(self._transport).inc()
        log.warning("call %s: nothing received for %.1f s; the %s peer is gone, ending the call",
                    self._label, now - self.last_rx, self._transport)
        self._expired_cb()
