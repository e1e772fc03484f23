"""The per-GPU scheduler: engine slots, urgency-first service, cancellation, failure isolation.

Each engine slot (its own static KV caches and CUDA graphs over shared weights) has one worker
thread. The asyncio side never blocks on the model: it awaits chunks handed over with
``loop.call_soon_threadsafe``.

Scheduling, in the order a caller would feel it:

- **Admission.** When every slot is busy, queued turns wait in deadline order (the caller's turn
  time plus the first-audio budget), so the turn that has waited longest relative to its budget
  gets the next free slot. Queue depth and wait are metrics.
- **Urgency first.** Slots on one GPU share it. A turn that already has more than
  ``ahead_high_s`` of audio generated ahead of its playback clock pauses between chunks while
  any other running turn is still waiting for its first audio, until its lead falls to
  ``ahead_low_s``. Generation is pull-based, so a pause costs nothing but time the turn has
  already banked.
- **Cancellation.** Hang-up and barge-in set a flag the engine polls before every codec frame;
  the slot is free within one frame plus the chunk decode in flight. The time from ``cancel()``
  to the slot being free is recorded for every cancelled turn.
- **Failure isolation.** An exception inside the engine (a bug, CUDA OOM) fails that turn only:
  its stream raises :class:`~gateway.errors.EngineError` (the call can answer with an apology
  prompt), the slot is rebuilt (fresh caches and graphs), and if the rebuild fails the slot is
  retired while the others carry on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gateway.errors import EngineError
from gateway.metrics import Metrics
from gateway.tts.engine import SAMPLE_RATE, Engine, SpeechRequest

log = logging.getLogger(__name__)

_END = object()


@dataclass
class ServiceStats:
    """Counters the tests, the benchmark and ``/metrics`` read."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    pauses: int = 0
    slots_retired: int = 0
    #: Seconds from ``cancel()`` to the slot being free, one entry per cancelled generation.
    cancel_to_free_s: list[float] = field(default_factory=list)
    #: Order in which turns got a slot (their ``tags["turn"]`` or text), for ordering tests.
    start_order: list[str] = field(default_factory=list)


class SpeechStream:
    """One turn's generation: an async iterator over its 24 kHz float32 chunks.

    ``cancel()`` (or ``aclose()``) stops the generation; iteration then ends. Errors raised by
    the engine surface here as :class:`~gateway.errors.EngineError`.
    """

    def __init__(
        self,
        request: SpeechRequest,
        loop: asyncio.AbstractEventLoop,
        turn_started_at: float,
        deadline: float,
        clock: Callable[[], float],
    ) -> None:
        self.request = request
        self.turn_started_at = turn_started_at
        self.deadline = deadline
        self.submitted_at = clock()
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
        self.finished = asyncio.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def waiting_for_first_audio(self) -> bool:
        return self.first_chunk_at is None

    def audio_ahead(self, now: float) -> float:
        """Seconds of generated audio not yet played by a listener who started at chunk one."""
        if self.first_chunk_at is None:
            return 0.0
        return self.audio_s - (now - self._playback_origin)

    def cancel(self) -> None:
        """Stop generating (idempotent, never blocks; call from the event loop)."""
        if not self._cancel.is_set():
            self._cancelled_at = time.monotonic()
            self._cancel.set()
            # Wake a consumer that is waiting for the next chunk.
            self._queue.put_nowait(_END)

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self

    async def __anext__(self) -> np.ndarray:
        if self._cancel.is_set() and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END or self._cancel.is_set():
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise EngineError(f"speech generation failed: {item}") from item
        assert isinstance(item, np.ndarray)
        return item

    async def aclose(self) -> None:
        self.cancel()

    # --- called from the worker thread --------------------------------------------------------

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

    def _finish(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self.finished.set)
        except RuntimeError:
            pass


class SpeechService:
    """Owns one GPU's engine slots, their worker threads and the queue in front of them."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        metrics: Metrics | None = None,
        first_audio_budget_s: float = 0.2,
        ahead_high_s: float = 1.0,
        ahead_low_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not engines:
            raise ValueError("at least one engine slot is required")
        if not 0 <= ahead_low_s <= ahead_high_s:
            raise ValueError("need 0 <= ahead_low_s <= ahead_high_s")
        self.engines = list(engines)
        self.metrics = metrics
        self.first_audio_budget_s = first_audio_budget_s
        self.ahead_high_s = ahead_high_s
        self.ahead_low_s = ahead_low_s
        self.clock = clock
        self.stats = ServiceStats()
        self._heap: list[tuple[float, int, SpeechStream]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._running: set[SpeechStream] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._healthy = len(self.engines)

    # --- introspection ------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The first slot's engine (for validation and metadata)."""
        return self.engines[0]

    @property
    def busy_slots(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return sum(1 for _, _, s in self._heap if not s.cancelled)

    @property
    def healthy_slots(self) -> int:
        return self._healthy

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start one worker thread per engine slot."""
        for index, engine in enumerate(self.engines):
            thread = threading.Thread(
                target=self._worker, args=(index, engine), name=f"tts-slot-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        self._gauges()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and wait for the workers (each stops within one frame)."""
        with self._cond:
            self._stopping = True
            for stream in list(self._running) + [s for _, _, s in self._heap]:
                stream._cancel.set()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()

    # --- the asyncio side ---------------------------------------------------------------------

    def stream(self, request: SpeechRequest, turn_started_at: float | None = None) -> SpeechStream:
        """Queue ``request`` for a slot; iterate the returned stream for its chunks.

        ``turn_started_at`` (monotonic) is when the caller's turn ended; the deadline that
        orders the queue is that plus the first-audio budget.
        """
        try:
            self.engine.validate(request)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if self._healthy == 0:
            raise EngineError("no healthy TTS slot left on this gateway")
        now = self.clock()
        turn = turn_started_at if turn_started_at is not None else now
        stream = SpeechStream(
            request, asyncio.get_running_loop(), turn, turn + self.first_audio_budget_s, self.clock
        )
        with self._cond:
            heapq.heappush(self._heap, (stream.deadline, next(self._seq), stream))
            self._cond.notify()
        self._gauges()
        return stream

    # --- the worker threads -------------------------------------------------------------------

    def _next(self) -> SpeechStream | None:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                while self._heap:
                    _, _, stream = heapq.heappop(self._heap)
                    if stream.cancelled:
                        stream._finish()
                        continue
                    self._running.add(stream)
                    return stream
                self._cond.wait()

    def _worker(self, index: int, engine: Engine) -> None:
        while True:
            stream = self._next()
            if stream is None:
                return
            self._gauges()
            ok = True
            try:
                ok = self._run(engine, stream)
            finally:
                with self._cond:
                    self._running.discard(stream)
                    stream.finished_at = self.clock()
                    self._cond.notify_all()
                stream._finish()
                self._gauges()
            if not ok and not self._recover(index, engine):
                return

    def _run(self, engine: Engine, stream: SpeechStream) -> bool:
        """Generate one turn; False if the engine failed (the slot needs a rebuild)."""
        stats = self.stats
        stats.started += 1
        stats.start_order.append(stream.request.tags.get("turn", stream.request.text))
        stream.started_at = self.clock()
        if self.metrics is not None:
            self.metrics.tts_queue_wait.observe(stream.started_at - stream.submitted_at)
        generator = None
        try:
            generator = engine.stream(stream.request, should_stop=lambda: self._poll(stream))
            while not stream.cancelled:
                self._yield_to_urgent(stream)
                if stream.cancelled:
                    break
                chunk = next(generator, None)
                if chunk is None or stream.cancelled:
                    break
                stream._record_chunk(len(chunk), self.clock())
                stream._put(chunk)
        except Exception as exc:
            stats.failed += 1
            log.exception("generation failed for %r", stream.request.text[:60])
            stream._put(exc)
            if self.metrics is not None:
                self.metrics.tts_failures.inc()
            return False
        finally:
            if generator is not None:
                generator.close()
        if stream.gaps and self.metrics is not None:
            self.metrics.tts_underruns.inc(stream.gaps)
        if stream.cancelled:
            stats.cancelled += 1
            if stream._cancelled_at is not None:
                freed = time.monotonic() - stream._cancelled_at
                stats.cancel_to_free_s.append(freed)
                if self.metrics is not None:
                    self.metrics.tts_cancel_to_free.observe(freed)
        else:
            stats.completed += 1
            stream._put(_END)
        return True

    def _poll(self, stream: SpeechStream) -> bool:
        """Called by the engine before every codec frame: pause if urgency says so, then say
        whether to stop. Pausing here (not only between chunks) lets an urgent turn in another
        slot have the GPU within one frame."""
        self._yield_to_urgent(stream)
        return stream.cancelled

    def _yield_to_urgent(self, stream: SpeechStream) -> None:
        """Pause a turn that is well ahead of playback while another waits for first audio."""
        if stream.audio_ahead(self.clock()) <= self.ahead_high_s:
            return
        paused = False
        with self._cond:
            while (
                not stream.cancelled
                and not self._stopping
                and stream.audio_ahead(self.clock()) > self.ahead_low_s
                and any(s is not stream and s.waiting_for_first_audio and not s.cancelled
                        for s in self._running)
            ):
                if not paused:
                    paused = True
                    self.stats.pauses += 1
                self._cond.wait(timeout=0.01)

    def _recover(self, index: int, engine: Engine) -> bool:
        """Rebuild a slot after an engine failure; retire it if that fails too."""
        try:
            engine.rebuild()
            log.warning("tts slot %d rebuilt after a failure", index)
            return True
        except Exception:
            log.exception("tts slot %d could not be rebuilt; retiring it", index)
            self.stats.slots_retired += 1
            self._healthy -= 1
            self._gauges()
            return False

    def _gauges(self) -> None:
        if self.metrics is None:
            return
        self.metrics.tts_busy_slots.set(len(self._running))
        self.metrics.tts_queue_depth.set(self.queued)
        self.metrics.tts_slots_healthy.set(self._healthy)
