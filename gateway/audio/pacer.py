"""Real-time pacing of 20 ms media frames against a monotonic deadline (STYLE.md rules 5 and 8).

A loop of ``send(); sleep(0.02)`` runs slow: every sleep overshoots a little and the send itself
takes time, so the stream drifts behind real time by the sum of those errors, and the far end's
jitter buffer drains until it underruns. Instead, frame ``k`` of a run is due at
``anchor + k * frame_s``, computed by multiplication rather than by adding ``frame_s`` to the
previous deadline, so neither sleep overshoot nor floating-point summation error accumulates.

The pacer never sleeps and never reads a clock it was not given; the I/O shell sleeps until
:meth:`Pacer.next_deadline` and tests drive a fake clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Pacer"]


class Pacer:
    """Hands out send deadlines for consecutive media frames.

    Usage in the I/O shell::

        pacer.start()
        for frame in frames:
            await asyncio.sleep(max(0.0, pacer.next_deadline() - clock()))
            send(frame)

    Frame 0 is due at the anchor (``start``'s time); each later frame exactly ``frame_s`` after
    the previous one. A frame whose deadline has already passed is due immediately, so a short
    stall (a slow TTS chunk, a busy event loop) is caught up by sending the delayed frames
    back-to-back. Once the sender is more than ``max_lag_frames`` frames behind, catching up
    would burst more audio than an RTP receiver's jitter buffer holds (typically 40-100 ms), so
    the excess would be discarded, or, where the far end queues what it gets, every later word
    would be played that much late. The pacer then re-anchors at the current time: the gap
    becomes a pause, and pacing resumes at real time from there. The default, 5 frames (100 ms),
    matches the deep end of that jitter-buffer range.
    """

    __slots__ = ("_anchor", "_clock", "_frame_s", "_index", "_max_lag_s", "_reanchors")

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        frame_s: float = 0.02,
        max_lag_frames: int = 5,
    ) -> None:
        if frame_s <= 0:
            raise ValueError(f"frame_s must be positive, got {frame_s}")
        if max_lag_frames < 0:
            raise ValueError(f"max_lag_frames must be >= 0, got {max_lag_frames}")
        self._clock = clock
        self._frame_s = frame_s
        self._max_lag_s = max_lag_frames * frame_s
        self._anchor: float | None = None
        self._index = 0
        self._reanchors = 0

    @property
    def frame_s(self) -> float:
        """Frame duration in seconds."""
        return self._frame_s

    @property
    def frames(self) -> int:
        """Deadlines handed out since the last anchor (start or re-anchor)."""
        return self._index

    @property
    def reanchors(self) -> int:
        """How many times the pacer fell too far behind and re-anchored, since construction."""
        return self._reanchors

    def start(self, now: float | None = None) -> None:
        """Anchor frame 0 at ``now`` (default: the clock's current time); e.g. per utterance."""
        self._anchor = self._clock() if now is None else now
        self._index = 0

    def next_deadline(self) -> float:
        """Return the clock time at which the next frame is due, and count that frame as sent.

        Raises :class:`RuntimeError` if :meth:`start` was never called.
        """
        if self._anchor is None:
            raise RuntimeError("Pacer.next_deadline() called before start()")
        deadline = self._anchor + self._index * self._frame_s
        now = self._clock()
        if now - deadline > self._max_lag_s:
            self._anchor = deadline = now
            self._index = 0
            self._reanchors += 1
        self._index += 1
        return deadline
