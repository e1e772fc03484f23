"""An in-memory call transport: the far end of a :class:`gateway.call.Call` that records what
the call made it do, for tests that drive a call, a runner or the lifecycle without a socket."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.call import Call, CallOutcome, PlayoutPolicy
from gateway.clock import Clock
from gateway.ivr.cases import INSTANT

__all__ = ["MemoryTransport", "RecordingOwner"]


class MemoryTransport:
    """Records frames, marks, clears and the outcome.

    ``playout``: the policy the call paces by (default :data:`gateway.ivr.cases.INSTANT`: the
    far end plays everything at once). ``echo_marks``: every mark is played back at once (the
    call must be set on :attr:`call`), as a Twilio caller echoes them; off, marks are only
    logged. ``clock``: stamps :attr:`frames` and :attr:`cleared` with its time. An abort is a
    test failure unless ``record_aborts`` (then it is kept in :attr:`aborted`).
    """

    codec = "pcmu"

    def __init__(self, playout: PlayoutPolicy = INSTANT, *, echo_marks: bool = True,
                 clock: Clock | None = None, record_aborts: bool = False) -> None:
        self.playout = playout
        self.echo_marks = echo_marks
        self.clock = clock
        self.record_aborts = record_aborts
        self.call: Call | None = None
        #: ``("frames", count)``, ``("mark", name)``, ``("clear", None)`` in order.
        self.log: list[tuple[str, Any]] = []
        #: Every frame with the clock's time when it was sent (0.0 without a clock).
        self.frames: list[tuple[float, bytes]] = []
        #: Every message: the clock's time and its frames.
        self.messages: list[tuple[float, list[bytes]]] = []
        #: Every mark with the clock's time.
        self.marks: list[tuple[float, str]] = []
        #: The clock's time of every clear.
        self.cleared: list[float] = []
        self.outcome: CallOutcome | None = None
        self.aborted: str | None = None
        #: Set once the first frame has gone out.
        self.sending = asyncio.Event()

    def _now(self) -> float:
        return self.clock.now() if self.clock is not None else 0.0

    async def send_frames(self, frames: list[bytes]) -> None:
        self.log.append(("frames", len(frames)))
        now = self._now()
        self.messages.append((now, list(frames)))
        self.frames.extend((now, frame) for frame in frames)
        self.sending.set()

    async def send_mark(self, name: str) -> None:
        self.log.append(("mark", name))
        self.marks.append((self._now(), name))
        if self.echo_marks:
            assert self.call is not None
            asyncio.get_running_loop().call_soon(self.call.playback_done, name)

    async def clear(self) -> None:
        self.log.append(("clear", None))
        self.cleared.append(self._now())

    async def end(self, outcome: CallOutcome) -> None:
        self.outcome = outcome

    def abort(self, reason: str) -> None:
        if not self.record_aborts:
            raise AssertionError(f"aborted: {reason}")
        self.aborted = reason


class RecordingOwner:
    """The owner of what a :class:`gateway.call.Playout` plays (an utterance, in the gateway):
    counts the frames released to the far end and keeps the time of the first."""

    def __init__(self) -> None:
        self.released = 0
        self.first: float | None = None

    def frames_released(self, count: int, at: float) -> None:
        self.first = at if self.first is None else self.first
        self.released += count
