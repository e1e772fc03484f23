"""One turn's generation as the asyncio side sees it, and the counters the scheduler keeps.

Split from :mod:`gateway.tts.service` so that the front and the engine core
(:mod:`gateway.tts.core`) both depend on the stream without depending on each other.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from gateway.clock import Clock
from gateway.errors import EngineError
from gateway.tts.engine import SAMPLE_RATE, SpeechRequest

if TYPE_CHECKING:
    from gateway.tts.core import Outbox

__all__ = ["END_OF_STREAM", "EtaMargin", "ServiceStats", "SpeechStream", "append_bounded"]

#: Put on a stream's queue to end its iteration.
END_OF_STREAM = object()
#: Per-turn stats lists keep at most twice this many entries (then the oldest half goes), so a
#: gateway that runs for months does not grow them without bound.
_STATS_KEEP = 4096


class EtaMargin:
    """How much later than the engine core said a turn's second chunk reached its consumer:
    a decaying peak over turns, the margin every estimate a stream hands its consumer carries.

    The core's estimate (:meth:`gateway.tts.scheduler.Scheduler.next_chunk_eta`) knows its own
    steps and decodes, not the prefills and urgent turns that will come between them, nor how
    late the event loop will take the chunk (a loaded host). Measured where the consumer gets
    the chunk, the error covers all of it. One per speech service, read and written on the
    event loop. A late second chunk widens the margin at once; each on-time one shrinks it by
    ``decay`` (0.965: twenty halve it).
    """

    def __init__(self, decay: float = 0.965) -> None:
        if not 0 <= decay < 1:
            raise ValueError("decay must be within [0, 1)")
        self.decay = decay
        #: Seconds added to every estimate.
        self.value = 0.0

    def observe(self, late_s: float) -> None:
        """A second chunk came ``late_s`` after its estimate (negative: early)."""
        self.value = max(late_s, self.decay * self.value, 0.0)


def append_bounded(entries: list[Any], value: Any) -> None:
    entries.append(value)
    if len(entries) > 2 * _STATS_KEEP:
        del entries[:_STATS_KEEP]


@dataclass
class ServiceStats:
    """Counters the tests, the benchmark and ``/metrics`` read."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    pauses: int = 0
    slots_retired: int = 0
    #: Steps the watchdog gave up on (the turn failed, the slot left rotation until it returned).
    stuck_steps: int = 0
    #: Engines rebuilt (and, for a slot, warmed up) and back in service after a failure.
    recovered: int = 0
    #: Seconds from ``cancel()`` to the slot being free, one entry per cancelled generation
    #: (the most recent few thousand).
    cancel_to_free_s: list[float] = field(default_factory=list)
    #: Order in which turns got a slot (their ``tags["turn"]`` or text), for ordering tests.
    start_order: list[str] = field(default_factory=list)
    # --- the batched loop ---
    #: Batched steps run, and per step (the most recent few thousand): rows advanced, seconds
    #: the step took, seconds since the previous step began.
    steps: int = 0
    step_rows: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    step_interval_s: list[float] = field(default_factory=list)
    #: Seconds per prefill chunk run between steps.
    prefill_s: list[float] = field(default_factory=list)
    #: Rows that sat out steps because their consumer had not taken their chunks.
    backpressure_waits: int = 0
    #: Turns started over (not yet heard) after a failed batched step.
    restarted: int = 0
    #: Streaming-text turns that caught up with their text and sat out for more.
    text_underruns: int = 0


class SpeechStream:
    """One turn's generation: an async iterator over its 24 kHz float32 chunks.

    ``cancel()`` (or ``aclose()``) stops the generation; iteration then ends. Errors raised by
    the engine surface here as :class:`~gateway.errors.EngineError`.

    It is also the turn's output sink for the engine core (:mod:`gateway.tts.core`), which reads
    it as a :class:`~gateway.tts.scheduler.TurnSink` (lead, backlog, whether it stopped) and
    hands it audio with :meth:`deliver`, then :meth:`end` or :meth:`fail`, through the core's
    :class:`~gateway.tts.core.Outbox` (one hand-off to the event loop per core iteration).
    """

    def __init__(
        self,
        request: SpeechRequest,
        loop: asyncio.AbstractEventLoop,
        turn_started_at: float,
        deadline: float,
        clock: Clock,
        margin: EtaMargin | None = None,
    ) -> None:
        self.request = request
        self._clock = clock
        self._margin = margin
        # When the second chunk should reach the consumer (set at the first; None after).
        self._second_due: float | None = None
        self.turn_started_at = turn_started_at
        self.deadline = deadline
        self.submitted_at = clock.now()
        self.started_at: float | None = None
        self.first_chunk_at: float | None = None
        self.finished_at: float | None = None
        #: Seconds of audio generated so far.
        self.audio_s = 0.0
        #: Underruns seen by a listener who starts playing at the first chunk: a chunk arriving
        #: after the previous audio would have finished playing.
        self.gaps = 0
        self.gap_s = 0.0
        self.chunk_times: list[float] = []
        self._playback_origin = 0.0
        self._loop = loop
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._cancel = threading.Event()
        self._cancelled_at: float | None = None
        # Set when the service gave up on this turn (watchdog, no healthy engine): its consumer
        # has been handed an EngineError and the core must stop as soon as it can.
        self._abandoned = False
        self.finished = asyncio.Event()
        # Backpressure: chunks handed over (core thread) and taken (consumer). Each counter
        # has one writer, so their difference is safe to read from either side.
        self._produced = 0
        self._consumed = 0
        #: Set by the core while this turn waits on its consumer; taking a chunk then wakes the
        #: core through ``_wake``.
        self._blocked = False
        self._wake: Callable[[], None] | None = None
        #: Each frame's codec ids when the engine records them (tests, benchmarks).
        self.codes: list[Any] = []
        #: When the next chunk is expected, in seconds after the one just taken (the engine
        #: core's estimate from its measured step and decode times, plus the service's measured
        #: margin; None before the first chunk or without an estimate). The phone path's start
        #: buffer holds a live utterance's first frame only as long as that says it must.
        self.next_chunk_eta_s: float | None = None
        # Streamed text: what the event loop fed, waiting for the core (a deque: appended on
        # one thread, popped on the other), and a word cut short, held for the next piece.
        self._text_in: collections.deque[tuple[str, bool]] = collections.deque()
        self._text_held = ""
        self._text_last = False

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def abandoned(self) -> bool:
        """True once the service failed this turn itself (a stuck step, no healthy engine)."""
        return self._abandoned

    @property
    def stopping(self) -> bool:
        """The core must not produce more for this turn (cancelled or abandoned)."""
        return self._abandoned or self._cancel.is_set()

    @property
    def waiting_for_first_audio(self) -> bool:
        return self.first_chunk_at is None

    @property
    def playing(self) -> bool:
        """Its first chunk was delivered."""
        return self.first_chunk_at is not None

    @property
    def backlog(self) -> int:
        """Chunks handed over that the consumer has not taken yet."""
        return self._produced - self._consumed

    def audio_ahead(self, now: float) -> float:
        """Seconds of generated audio not yet played by a listener who started at chunk one."""
        if self.first_chunk_at is None:
            return 0.0
        return self.audio_s - (now - self._playback_origin)

    lead = audio_ahead

    def cancel(self) -> None:
        """Stop generating (idempotent, never blocks; call from the event loop)."""
        if not self._cancel.is_set():
            self._cancelled_at = self._clock.now()
            self._cancel.set()
            # Wake a consumer that is waiting for the next chunk.
            self._queue.put_nowait(END_OF_STREAM)
            if self._wake is not None:
                self._wake()  # the core frees the row without waiting for a step

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self

    async def __anext__(self) -> np.ndarray:
        if self._cancel.is_set() and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is END_OF_STREAM or self._cancel.is_set():
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise EngineError(f"speech generation failed: {item}") from item
        assert isinstance(item, _Chunk)
        self._took(item.eta_s)
        self._consumed += 1
        if self._blocked and self._wake is not None:
            self._blocked = False
            self._wake()
        return item.audio

    def _took(self, eta_s: float | None) -> None:
        """The consumer takes a chunk whose successor the core expects in ``eta_s``."""
        now = self._clock.now()
        if self._second_due is not None:
            if self._margin is not None:
                self._margin.observe(now - self._second_due)
            self._second_due = None
        elif self._consumed == 0 and eta_s is not None:
            self._second_due = now + eta_s
        margin = self._margin.value if self._margin is not None else 0.0
        self.next_chunk_eta_s = None if eta_s is None else eta_s + margin

    async def aclose(self) -> None:
        self.cancel()

    # --- streamed text: fed from the event loop, taken by the core ------------------------------

    def feed(self, text: str, last: bool = False) -> None:
        """More of a streaming-text turn's text (``request.text_stream``); ``last`` ends it.

        Whole words reach the engine: a word cut at the end of ``text`` waits for the next
        piece (or ``last``), so each piece the engine tokenises starts at a word boundary and
        gives the tokens the whole text would.
        """
        if not self.request.text_stream:
            raise EngineError("this turn's text was given whole; it takes no more")
        if self._text_last:
            raise EngineError("this turn's text has ended")
        held = self._text_held + text
        if last:
            # Whitespace after the last word is no word: the text ends where the words do.
            ready, self._text_held = held.rstrip(), ""
        else:
            cut = max(held.rfind(" "), held.rfind("\n"))
            ready, self._text_held = (held[:cut], held[cut:]) if cut > 0 else ("", held)
        self._text_last = last
        if ready or last:
            self._text_in.append((ready, last))
            if self._wake is not None:
                self._wake()

    def take_text(self) -> tuple[str, bool] | None:
        """Text fed since the last take (the core's thread), and whether it ended."""
        pieces = []
        while self._text_in:
            pieces.append(self._text_in.popleft())
        if not pieces:
            return None
        return "".join(text for text, _last in pieces), any(last for _t, last in pieces)

    # --- the output sink: called from the engine core's thread --------------------------------

    def attach(self, wake: Callable[[], None]) -> None:
        """The core that serves this turn: woken by a cancel and by a consumer it waits on."""
        self._wake = wake

    def waiting_on_consumer(self, blocked: bool) -> None:
        """The core sits this turn out until its consumer takes a chunk (then wakes it)."""
        self._blocked = blocked

    def deliver(self, audio: np.ndarray, now: float, outbox: Outbox,
                next_chunk_eta_s: float | None = None) -> None:
        """Hand over one chunk (it reaches the consumer at the outbox's next flush), with the
        core's estimate of how long the next one will take."""
        self._record_chunk(len(audio), now)
        self._produced += 1
        outbox.post(self._loop, self._queue.put_nowait, _Chunk(audio, next_chunk_eta_s),
                    self._cancel.set)

    def end(self, outbox: Outbox) -> None:
        """The turn is complete: iteration ends after its last chunk."""
        outbox.post(self._loop, self._queue.put_nowait, END_OF_STREAM, self._cancel.set)
        self.finish(outbox)

    def fail(self, exc: BaseException, outbox: Outbox) -> None:
        """The turn failed: its consumer gets ``exc`` as an EngineError (if it still listens)."""
        if not self.stopping:
            outbox.post(self._loop, self._queue.put_nowait, exc, self._cancel.set)
        self.finish(outbox)

    def finish(self, outbox: Outbox) -> None:
        """Nothing more will happen to this turn (``finished`` is set at the flush)."""
        outbox.post(self._loop, _set_event, self.finished)

    def finish_now(self) -> None:
        """:meth:`finish` without a core iteration to flush it (queued turns at a stop)."""
        try:
            self._loop.call_soon_threadsafe(self.finished.set)
        except RuntimeError:
            pass

    def cancel_from_core(self) -> None:
        """The core (or the service) stops the turn: its consumer's iteration ends."""
        if not self._cancel.is_set():
            self._cancelled_at = self._clock.now()
            self._cancel.set()
            self._put(END_OF_STREAM)

    def abandon(self, error: EngineError) -> None:
        """Fail the turn from outside the core (the watchdog): the consumer gets ``error``."""
        if self._abandoned:
            return
        self._abandoned = True
        if not self._cancel.is_set():
            self._put(error)

    def _record_chunk(self, samples: int, now: float) -> None:
        if self.first_chunk_at is None:
            self.first_chunk_at = now
            self._playback_origin = now
        else:
            ran_out_at = self._playback_origin + self.audio_s
            if now > ran_out_at:
                # The listener heard silence from ran_out_at to now; playback resumes now.
                self.gaps += 1
                self.gap_s += now - ran_out_at
                self._playback_origin += now - ran_out_at
        self.audio_s += samples / SAMPLE_RATE
        self.chunk_times.append(now)

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancel.set()


class _Chunk(NamedTuple):
    """A chunk on its way to the consumer, with the core's estimate of the next one."""

    audio: np.ndarray
    eta_s: float | None


def _set_event(event: asyncio.Event) -> None:
    event.set()
