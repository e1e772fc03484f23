"""Real-time pacing of 20 ms media frames against a monotonic deadline (STYLE.md rules 5 and 8).

The one pacing mechanism of the gateway and its load simulator: the call playout's send
schedule and its model of an RTP phone's playback (:mod:`gateway.call.playout`), and the
simulated callers' 20 ms media clock (:mod:`gateway.loadsim.twilio_caller`) all keep their
schedule in a :class:`Pacer`.

A loop of ``send(); sleep(0.02)`` runs slow: every sleep overshoots a little and the send itself
takes time, so the stream drifts behind real time by the sum of those errors, and the far end's
jitter buffer drains until it underruns. Instead, frame ``k`` of a run is due at
``anchor + k * frame_s``, computed by multiplication rather than by adding ``frame_s`` to the
previous deadline, so neither sleep overshoot nor floating-point summation error accumulates.

The schedule is arithmetic on times it is handed (every method that needs the time takes
``now``, so a loop that read the clock once decides on that one reading); only the shell's
conveniences (:meth:`Pacer.start` and :meth:`Pacer.next_deadline` without ``now``, and
:meth:`Pacer.wait`) read or wait on the injected :class:`~gateway.clock.Clock`, so tests drive a
virtual one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gateway.clock import Clock, SystemClock

__all__ = ["FRAME_S", "Pacer"]

#: A telephony media frame: 20 ms (160 samples at 8 kHz), RTP's default packetisation.
FRAME_S = 0.02
#: Slack when comparing a clock reading with a deadline computed from it (float rounding).
_EPS = 1e-6


class Pacer:
    """The send schedule of a run of consecutive media frames.

    Usage in an I/O shell that sends one frame per deadline::

        pacer.start()
        for frame in frames:
            await pacer.wait()
            send(frame)

    Frame 0 is due at the anchor (``start``'s time); each later frame exactly ``frame_s`` after
    the previous one. A frame whose deadline has already passed is due immediately, so a short
    stall (a slow TTS chunk, a busy event loop) is caught up by sending the delayed frames
    back-to-back. Once the sender is more than ``max_lag_frames`` frames behind, catching up
    would burst more audio than an RTP receiver's jitter buffer holds (typically 40-100 ms), so
    the excess would be discarded, or, where the far end queues what it gets, every later word
    would be played that much late. The pacer then re-anchors at the current time
    (:meth:`catch_up`): the gap becomes a pause, and pacing resumes at real time from there.
    The default, 5 frames (100 ms), matches the deep end of that jitter-buffer range;
    ``max_lag_frames=None`` never re-anchors (a sound card that kept producing samples while
    the process stalled: every late frame goes at once).

    A sender that may run ahead of the schedule (Twilio buffers what it is sent, and plays it
    in real time) asks :meth:`room` how many frames may go with a given lead, and :meth:`due`
    when the next ones may; a far end that reports its playback position moves the anchor
    (:meth:`played_at`); a modelled far end that played nothing for a while lets its schedule
    slip (:meth:`slip`).
    """

    __slots__ = ("_anchor", "_anchored", "_clock", "_frame_s", "_index", "_max_lag_s", "_read",
                 "_reanchors")

    def __init__(
        self,
        clock: Clock | Callable[[], float] | None = None,
        frame_s: float = FRAME_S,
        max_lag_frames: int | None = 5,
    ) -> None:
        """``clock``: the time the shell's conveniences read and wait on (default: real time).

        A bare ``Callable[[], float]`` is accepted only until the simulator's SIP phone
        (``gateway/loadsim/sip_caller.py``, being rewritten on another branch) hands its
        :class:`~gateway.clock.Clock`; such a pacer cannot :meth:`wait`.
        """
        if frame_s <= 0:
            raise ValueError(f"frame_s must be positive, got {frame_s}")
        if max_lag_frames is not None and max_lag_frames < 0:
            raise ValueError(f"max_lag_frames must be >= 0 or None, got {max_lag_frames}")
        if clock is None:
            clock = SystemClock()
        self._clock: Clock | None
        if callable(clock):
            self._clock, self._read = None, clock
        else:
            self._clock, self._read = clock, clock.now
        self._frame_s = frame_s
        self._max_lag_s = math.inf if max_lag_frames is None else max_lag_frames * frame_s
        self._anchor = 0.0
        self._anchored = False
        self._index = 0
        self._reanchors = 0

    # --- state --------------------------------------------------------------------------------

    @property
    def frame_s(self) -> float:
        """Frame duration in seconds."""
        return self._frame_s

    @property
    def frames(self) -> int:
        """Frames counted as sent since the last anchor (start or re-anchor)."""
        return self._index

    @property
    def reanchors(self) -> int:
        """How many times the pacer fell too far behind and re-anchored, since construction."""
        return self._reanchors

    @property
    def anchored(self) -> bool:
        """A run is going (:meth:`start` was called, :meth:`stop` not since)."""
        return self._anchored

    def start(self, now: float | None = None) -> None:
        """Anchor frame 0 at ``now`` (default: the clock's current time); e.g. per utterance."""
        self._anchor = self._read() if now is None else now
        self._anchored = True
        self._index = 0

    def stop(self) -> None:
        """End the run: the next frame starts a new one (the shell calls :meth:`start`)."""
        self._anchored = False
        self._index = 0

    # --- the schedule (arithmetic on the times it is given) ------------------------------------

    def due(self, ahead: int = 0, lead_frames: float = 0.0) -> float:
        """When the frame ``ahead`` after the next one is due, released ``lead_frames`` early.

        ``due()`` is the next frame's deadline, which is also when a far end that plays from
        the anchor has played everything counted as sent.
        """
        return self._anchor + (self._index + ahead - lead_frames) * self._frame_s

    def elapsed(self, now: float) -> float:
        """Frame times since the anchor: how many frames a far end playing from it has played."""
        return (now - self._anchor) / self._frame_s

    def room(self, now: float, lead_frames: float = 0.0) -> int:
        """How many more frames are due by ``now`` when each may go ``lead_frames`` early
        (zero or less: none yet; see :meth:`due` for when)."""
        return math.floor((now - self._anchor) / self._frame_s + lead_frames + _EPS) + 1 \
            - self._index

    def lead_s(self, now: float) -> float:
        """Seconds counted as sent beyond what is due by ``now`` (negative: that far behind)."""
        return self._index * self._frame_s - (now - self._anchor)

    def sent(self, count: int = 1) -> None:
        """Count ``count`` more frames as sent."""
        self._index += count

    def catch_up(self, now: float) -> bool:
        """The lag rule: more than ``max_lag_frames`` behind at ``now``, re-anchor there (the
        backlog becomes a pause instead of a burst). True when it re-anchored."""
        if now - (self._anchor + self._index * self._frame_s) > self._max_lag_s:
            self._anchor = now
            self._index = 0
            self._reanchors += 1
            return True
        return False

    def slip(self, seconds: float) -> None:
        """The schedule moves ``seconds`` later: a far end that played nothing meanwhile (a
        phone's jitter buffer that ran dry) plays the rest that much later."""
        self._anchor += seconds

    def played_at(self, position: int, now: float) -> None:
        """The far end reports frame ``position`` of this run played by ``now``: the schedule
        moves earlier to agree, never later (a late report says playback is at least there)."""
        self._anchor = min(self._anchor, now - position * self._frame_s)

    # --- the I/O shell's conveniences -----------------------------------------------------------

    def next_deadline(self, now: float | None = None) -> float:
        """Return the clock time at which the next frame is due, and count that frame as sent
        (re-anchoring first if the sender is too far behind at ``now``, default: the clock's
        current time).

        Raises :class:`RuntimeError` if :meth:`start` was never called.
        """
        if not self._anchored:
            raise RuntimeError("Pacer.next_deadline() called before start()")
        self.catch_up(self._read() if now is None else now)
        deadline = self._anchor + self._index * self._frame_s
        self._index += 1
        return deadline

    async def wait(self) -> float:
        """Sleep on the clock until the next frame is due (not at all if it already is), count
        it as sent, and return when it was due: the shell's lateness is
        ``clock.now() - due``. That is the schedule's time before any re-anchor, so a stall
        that made the pacer re-anchor (and send this frame at once) still shows as lateness.

        Raises :class:`RuntimeError` if :meth:`start` was never called.
        """
        clock = self._clock
        if clock is None:
            raise TypeError("Pacer.wait() needs a Clock, not a bare callable")
        if not self._anchored:
            raise RuntimeError("Pacer.wait() called before start()")
        now = clock.now()
        due = self._anchor + self._index * self._frame_s
        deadline = self.next_deadline(now)
        if deadline > now:
            await clock.sleep(deadline - now)
        return due
