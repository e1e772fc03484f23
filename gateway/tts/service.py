"""The per-GPU scheduler: urgency-first service, cancellation, failure isolation.

Two ways to run the device, chosen by the engines given:

- **Batched (the default).** A :class:`~gateway.tts.engine.BatchEngine` per device, driven by
  one :class:`~gateway.tts.batch_loop.BatchLoop` thread: every active turn is a row and each
  step advances every row by one codec frame. Turns join between steps and leave at EOS, their
  frame cap, cancel or failure; see :mod:`gateway.tts.batch_loop` for the schedule.
- **Slots (the benchmark's baseline).** Plain engines, one worker thread each, every slot
  generating one turn at a time (what the gateway did before continuous batching).

The asyncio side never blocks on the model: it awaits chunks handed over with
``loop.call_soon_threadsafe``. The hand-off is bounded for the batched loop: a row whose
consumer has not taken its chunks sits out steps, so a consumer that simply iterates paces its
turn (a call's audio path blocks once it is far enough ahead of the caller's playback).

Scheduling, in the order a caller would feel it (both modes):

- **Admission.** With every row (or slot) busy, queued turns wait in deadline order (the
  caller's turn time plus the first-audio budget), so the turn that has waited longest relative
  to its budget gets the next free one. Queue depth and wait are metrics.
- **Urgency first.** A turn far ahead of its playback (``ahead_high_s``) sits out while another
  turn waits for its first audio, until its lead falls to ``ahead_low_s``.
- **Cancellation.** Hang-up and barge-in set a flag the engine side reads before every codec
  frame (batched: before every step); the row or slot is free within one frame. The time from
  ``cancel()`` to free is recorded for every cancelled turn.
- **Failure isolation.** An exception inside the engine fails the turns it hit (their streams
  raise :class:`~gateway.errors.EngineError`; the call answers with its apology prompt), the
  engine is rebuilt and carries on with the other and the queued turns; if the rebuild fails
  the engine is retired while any others carry on.
- **Watchdog.** A step that hangs (a deadlocked kernel, a wedged driver call) raises nothing.
  With ``step_timeout_s`` set, a watchdog thread fails the turns of an engine that has shown no
  progress (a codec frame, a chunk handed over, a batched step) for that long: their streams
  raise :class:`~gateway.errors.EngineError` like any engine failure, and the engine leaves
  rotation. A Python thread cannot be killed, so it stays out until its step returns by
  itself; then it is rebuilt and serves again (or is retired if the rebuild fails). Turns
  queued while no healthy engine is left fail at once rather than wait for one.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.errors import EngineError
from gateway.logs import call_context
from gateway.metrics import Metrics
from gateway.tts.batch_loop import BatchLoop
from gateway.tts.engine import BatchEngine, Engine, SpeechRequest, VoicePrompt
from gateway.tts.stream import END_OF_STREAM, ServiceStats, SpeechStream, append_bounded

log = logging.getLogger(__name__)

# SpeechStream and ServiceStats live in gateway.tts.stream; callers import them from here.
__all__ = ["ServiceStats", "SpeechService", "SpeechStream"]


@dataclass(eq=False)
class _Slot:
    """One engine slot as its worker and the watchdog see it."""

    index: int
    engine: Engine
    #: The turn it is generating (None while idle).
    stream: SpeechStream | None = None
    #: When the engine last showed progress (a codec frame polled, a chunk handed over); None
    #: while idle or deliberately paused for an urgent turn, which the watchdog must not judge.
    beat_at: float | None = None
    #: From a watchdog trip until the stuck step returns: out of rotation, not counted healthy.
    stuck: bool = False


class SpeechService:
    """Owns one GPU's engines, the threads that drive them and the queue in front of them.

    ``engines`` are either :class:`~gateway.tts.engine.BatchEngine` s (one batched loop each,
    one per device: the default) or plain engine slots (one worker thread each: the baseline).
    ``step_timeout_s`` arms the watchdog (None: off): the longest an engine step may run
    without progress before its turns fail and its engine leaves rotation. ``warmup_voices``
    are what a rebuilt slot warms up with before it takes turns again (the voices calls use).
    """

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        metrics: Metrics | None = None,
        first_audio_budget_s: float = 0.2,
        ahead_high_s: float = 1.0,
        ahead_low_s: float = 0.5,
        step_timeout_s: float | None = None,
        warmup_voices: Sequence[tuple[str, str] | VoicePrompt] = (),
        clock: Callable[[], float] = time.monotonic,
        max_backlog: int = 2,
    ) -> None:
        if not engines:
            raise ValueError("at least one engine slot is required")
        if not 0 <= ahead_low_s <= ahead_high_s:
            raise ValueError("need 0 <= ahead_low_s <= ahead_high_s")
        if step_timeout_s is not None and step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be positive (None turns the watchdog off)")
        batched = [isinstance(engine, BatchEngine) for engine in engines]
        if any(batched) and not all(batched):
            raise ValueError("engines must be all batch engines or all slots, not a mix")
        if max_backlog < 1:
            raise ValueError("max_backlog must be >= 1")
        self.engines = list(engines)
        self.metrics = metrics
        self.first_audio_budget_s = first_audio_budget_s
        self.ahead_high_s = ahead_high_s
        self.ahead_low_s = ahead_low_s
        self.step_timeout_s = step_timeout_s
        self.warmup_voices = list(warmup_voices)
        self.clock = clock
        self.stats = ServiceStats()
        self._heap: list[tuple[float, int, SpeechStream]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._running: set[SpeechStream] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._healthy = len(self.engines)
        self._loops = [BatchLoop(self, engine, index, max_backlog=max_backlog)
                       for index, engine in enumerate(self.engines)
                       if isinstance(engine, BatchEngine)]
        self._slots = [] if self._loops else [
            _Slot(index, engine) for index, engine in enumerate(self.engines)
        ]
        self._watchdog: threading.Thread | None = None
        self._watchdog_stop = threading.Event()

    # --- introspection ------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The first engine (for validation and metadata)."""
        return self.engines[0]

    @property
    def batched(self) -> bool:
        """True when batched loops (not slots) serve the turns."""
        return bool(self._loops)

    @property
    def capacity(self) -> int:
        """Turns that can generate at once: rows over every batch engine, or slots."""
        if self._loops:
            return sum(loop.capacity for loop in self._loops)
        return len(self._slots)

    @property
    def computing(self) -> bool:
        """An engine is working right now (a step, a prefill chunk, a decode); False while
        every engine is idle or waiting for its consumers to take their audio.

        Read without the lock (a snapshot): for observers such as a test's virtual clock,
        which must let real time pass while speech is really being computed.
        """
        if self._loops:
            return any(loop.beat_at is not None for loop in self._loops)
        return any(slot.beat_at is not None for slot in self._slots)

    @property
    def busy_slots(self) -> int:
        """Turns generating now (batch rows or slots in use)."""
        return len(self._running)

    @property
    def queued(self) -> int:
        return sum(1 for _, _, s in self._heap if not s.stopping)

    @property
    def healthy_slots(self) -> int:
        """Engines in rotation: not retired, and not stuck in a step the watchdog gave up on."""
        return self._healthy

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start one loop per batch engine, or one worker thread per slot (and the watchdog,
        when armed)."""
        for loop in self._loops:
            loop.start()
        for slot in self._slots:
            thread = threading.Thread(
                target=self._worker, args=(slot,), name=f"tts-slot-{slot.index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        if self.step_timeout_s is not None:
            self._watchdog = threading.Thread(target=self._watch, name="tts-watchdog",
                                              daemon=True)
            self._watchdog.start()
        self._gauges()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and wait for the workers (each stops within one frame)."""
        with self._cond:
            self._stopping = True
            for stream in list(self._running) + [s for _, _, s in self._heap]:
                stream._cancel.set()
            self._cond.notify_all()
        self._watchdog_stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout)
            self._watchdog = None
        # A worker stuck in a step does not come back for join(); it is a daemon thread.
        for loop in self._loops:
            loop.join(timeout)
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()

    # --- the asyncio side ---------------------------------------------------------------------

    def stream(self, request: SpeechRequest, turn_started_at: float | None = None) -> SpeechStream:
        """Queue ``request`` for a row or slot; iterate the returned stream for its chunks.

        ``turn_started_at`` (monotonic) is when the caller's turn ended; the deadline that
        orders the queue is that plus the first-audio budget.
        """
        try:
            self.engine.validate(request)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        now = self.clock()
        turn = turn_started_at if turn_started_at is not None else now
        stream = SpeechStream(
            request, asyncio.get_running_loop(), turn, turn + self.first_audio_budget_s, self.clock
        )
        with self._cond:
            # Checked under the lock: an engine the watchdog takes out between the check and
            # the push would otherwise leave this turn queued with nobody to serve it.
            if self._healthy <= 0:
                raise EngineError("no healthy TTS slot left on this gateway")
            heapq.heappush(self._heap, (stream.deadline, next(self._seq), stream))
            self._cond.notify_all() if self._loops else self._cond.notify()
        self._gauges()
        return stream

    # --- called by the batched loops (hold no lock unless stated) --------------------------------

    def _pop_queued(self) -> SpeechStream | None:
        """The most urgent queued turn (hold the lock); cancelled ones are dropped."""
        while self._heap:
            _, _, stream = heapq.heappop(self._heap)
            if stream.stopping:
                stream._finish()
                continue
            return stream
        return None

    def _started(self, stream: SpeechStream) -> None:
        """A turn got a row (hold the lock)."""
        self._running.add(stream)
        self.stats.started += 1
        append_bounded(self.stats.start_order,
                        stream.request.tags.get("turn", stream.request.text))
        stream.started_at = self.clock()
        if self.metrics is not None:
            self.metrics.tts_queue_wait.observe(stream.started_at - stream.submitted_at)
        self._gauges()

    def _completed(self, stream: SpeechStream) -> None:
        with self._cond:
            self.stats.completed += 1
            self._end(stream)
        stream._put(END_OF_STREAM)
        stream._finish()
        self._gauges()

    def _stopped(self, stream: SpeechStream, *, cancelled: bool) -> None:
        """A cancelled or abandoned turn left its row (hold the lock)."""
        if cancelled:
            self.stats.cancelled += 1
            if stream._cancelled_at is not None:
                freed = time.monotonic() - stream._cancelled_at
                append_bounded(self.stats.cancel_to_free_s, freed)
                if self.metrics is not None:
                    self.metrics.tts_cancel_to_free.observe(freed)
        self._end(stream)
        stream._finish()
        self._gauges()

    def _failed(self, stream: SpeechStream, exc: BaseException) -> None:
        with self._cond:
            listening = not stream.stopping
            if listening:
                self.stats.failed += 1
            self._end(stream)
        if listening:
            stream._put(exc)
            if self.metrics is not None:
                self.metrics.tts_failures.inc()
        stream._finish()
        self._gauges()

    def _end(self, stream: SpeechStream) -> None:
        self._running.discard(stream)
        stream.finished_at = self.clock()

    def _record_step(self, rows: int, seconds: float, interval: float | None) -> None:
        stats = self.stats
        stats.steps += 1
        append_bounded(stats.step_rows, rows)
        append_bounded(stats.step_s, seconds)
        if interval is not None:
            append_bounded(stats.step_interval_s, interval)
        if self.metrics is not None:
            self.metrics.tts_batch_size.observe(rows)
            self.metrics.tts_step_seconds.observe(seconds)

    def _record_prefill(self, seconds: float) -> None:
        append_bounded(self.stats.prefill_s, seconds)
        if self.metrics is not None:
            self.metrics.tts_prefill_seconds.observe(seconds)

    def _rows_waiting(self, *, backpressure: int, urgency: int, prefill: int) -> None:
        if self.metrics is not None:
            waiting = self.metrics.tts_rows_waiting
            waiting.labels("backpressure").set(backpressure)
            waiting.labels("urgency").set(urgency)
            waiting.labels("prefill").set(prefill)

    def _retire(self, loop: BatchLoop) -> None:
        """A batch engine that could not be rebuilt leaves service for good."""
        with self._cond:
            loop.retired = True
            self.stats.slots_retired += 1
            if not loop.stuck:
                self._count_healthy(-1)
            loop.stuck = False
            orphans = self._orphans()
            self._cond.notify_all()
        self._fail_orphans(orphans)
        self._gauges()

    def _loop_back(self, loop: BatchLoop) -> None:
        """A loop whose stuck step returned is rebuilt and back in rotation."""
        with self._cond:
            if loop.stuck:
                loop.stuck = False
                self._count_healthy(+1)
            self._cond.notify_all()
        log.warning("tts batch %d: its stuck step returned; rebuilt and back in service",
                    loop.index)
        self._gauges()

    # --- the worker threads -------------------------------------------------------------------

    def _next(self, slot: _Slot) -> SpeechStream | None:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                while self._heap:
                    _, _, stream = heapq.heappop(self._heap)
                    if stream.stopping:
                        stream._finish()
                        continue
                    self._running.add(stream)
                    slot.stream = stream
                    return stream
                self._cond.wait()

    def _worker(self, slot: _Slot) -> None:
        while True:
            stream = self._next(slot)
            if stream is None:
                return
            self._gauges()
            ok = True
            try:
                # The worker's log records carry the call this turn belongs to.
                with call_context(str(stream.request.tags.get("call", ""))):
                    ok = self._run(slot, stream)
            finally:
                with self._cond:
                    self._running.discard(stream)
                    slot.stream = None
                    stream.finished_at = self.clock()
                    self._cond.notify_all()
                stream._finish()
                self._gauges()
            if not ok and not self._recover(slot):
                return

    def _run(self, slot: _Slot, stream: SpeechStream) -> bool:
        """Generate one turn; False if the engine failed or got stuck (the slot needs a
        rebuild)."""
        engine = slot.engine
        stats = self.stats
        stats.started += 1
        append_bounded(stats.start_order, stream.request.tags.get("turn", stream.request.text))
        stream.started_at = self.clock()
        if self.metrics is not None:
            self.metrics.tts_queue_wait.observe(stream.started_at - stream.submitted_at)
        generator = None
        # The first step includes the prefill: it is judged from here.
        slot.beat_at = self.clock()
        try:
            generator = engine.stream(stream.request,
                                      should_stop=lambda: self._poll(slot, stream))
            while not stream.stopping:
                self._yield_to_urgent(slot, stream)
                if stream.stopping:
                    break
                chunk = next(generator, None)
                slot.beat_at = self.clock()
                if chunk is None or stream.stopping:
                    break
                stream._record_chunk(len(chunk), self.clock())
                stream._put(chunk)
        except Exception as exc:
            if stream.abandoned:
                # The watchdog already failed this turn and counted it; the step it gave up on
                # has now come back with an error.
                log.warning("tts slot %d: the step the watchdog gave up on raised %r",
                            slot.index, exc)
            else:
                stats.failed += 1
                log.exception("generation failed for %r", stream.request.text[:60])
                stream._put(exc)
                if self.metrics is not None:
                    self.metrics.tts_failures.inc()
            return False
        finally:
            if generator is not None:
                generator.close()
            slot.beat_at = None
        if slot.stuck:
            # The watchdog failed this turn while a step hung; the step is back now. Whatever
            # state it left behind is suspect: rebuild before serving again.
            return False
        if stream.gaps and self.metrics is not None:
            self.metrics.tts_underruns.inc(stream.gaps)
        if stream.cancelled:
            stats.cancelled += 1
            if stream._cancelled_at is not None:
                freed = time.monotonic() - stream._cancelled_at
                append_bounded(stats.cancel_to_free_s, freed)
                if self.metrics is not None:
                    self.metrics.tts_cancel_to_free.observe(freed)
        else:
            stats.completed += 1
            stream._put(END_OF_STREAM)
        return True

    def _poll(self, slot: _Slot, stream: SpeechStream) -> bool:
        """Called by the engine before every codec frame: pause if urgency says so, then say
        whether to stop. Pausing here (not only between chunks) lets an urgent turn in another
        slot have the GPU within one frame. Each call is also a sign of progress."""
        self._yield_to_urgent(slot, stream)
        slot.beat_at = self.clock()
        return stream.stopping

    def _yield_to_urgent(self, slot: _Slot, stream: SpeechStream) -> None:
        """Pause a turn that is well ahead of playback while another waits for first audio."""
        if stream.audio_ahead(self.clock()) <= self.ahead_high_s:
            return
        paused = False
        with self._cond:
            while (
                not stream.stopping
                and not self._stopping
                and stream.audio_ahead(self.clock()) > self.ahead_low_s
                and any(s is not stream and s.waiting_for_first_audio and not s.stopping
                        for s in self._running)
            ):
                if not paused:
                    paused = True
                    self.stats.pauses += 1
                    slot.beat_at = None  # waiting on purpose: not the watchdog's business
                self._cond.wait(timeout=0.01)
            if paused:
                slot.beat_at = self.clock()

    def _recover(self, slot: _Slot) -> bool:
        """Rebuild a slot after an engine failure or a stuck step; retire it if that fails."""
        try:
            slot.engine.rebuild()
        except Exception:
            log.exception("tts slot %d could not be rebuilt; retiring it", slot.index)
            with self._cond:
                self.stats.slots_retired += 1
                if not slot.stuck:  # a stuck slot was already taken out of the count
                    self._count_healthy(-1)
                slot.stuck = False
                orphans = self._orphans()
            self._fail_orphans(orphans)
            self._gauges()
            return False
        try:
            # A rebuilt slot pays its first-use costs on its next step (on a CPU the static
            # caches are rebuilt lazily: ~3.5 s for the tiny model, longer than the watchdog's
            # default): pay them here, before a caller's turn does. A failure here is not
            # proof the slot is gone (the next turn will tell, and rebuild again).
            slot.engine.warmup(self.warmup_voices)
        except Exception as exc:
            log.warning("tts slot %d: warm-up after the rebuild failed: %s", slot.index, exc)
        with self._cond:
            returned = slot.stuck
            if returned:
                slot.stuck = False
                self._count_healthy(+1)
            self.stats.recovered += 1
        if returned:
            log.warning("tts slot %d: its stuck step returned; rebuilt and back in service",
                        slot.index)
        else:
            log.warning("tts slot %d rebuilt after a failure", slot.index)
        self._gauges()
        return True

    # --- the watchdog -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Trip every slot whose current step has shown no progress for ``step_timeout_s``."""
        timeout = self.step_timeout_s
        assert timeout is not None
        # Checked a few times per timeout: a trip lands at most a quarter late.
        period = min(0.25, max(0.005, timeout / 4))
        while not self._watchdog_stop.wait(period):
            now = self.clock()
            for slot in self._slots:
                beat = slot.beat_at
                if beat is not None and not slot.stuck and now - beat > timeout:
                    self._trip(slot, now - beat)
            for loop in self._loops:
                beat = loop.beat_at
                if beat is not None and not loop.stuck and now - beat > timeout:
                    self._trip_loop(loop, now - beat)

    def _trip_loop(self, loop: BatchLoop, stalled_s: float) -> None:
        """A batched step hung: every turn of that loop fails; the loop leaves rotation."""
        with self._cond:
            if loop.stuck or loop.retired or loop.beat_at is None:
                return
            loop.stuck = True
            self._count_healthy(-1)
            self.stats.stuck_steps += 1
            error = EngineError(
                f"TTS batch {loop.index} made no progress for {1000 * stalled_s:.0f} ms "
                f"(limit {1000 * (self.step_timeout_s or 0):.0f} ms)"
            )
            failed = 0
            for turn in loop.turns:
                if not turn.stream.stopping:
                    failed += 1
                turn.stream._abandon(error)
                self._running.discard(turn.stream)
            self.stats.failed += failed
            orphans = self._orphans()
            self._cond.notify_all()
        log.error("tts batch %d: no progress for %.0f ms; %d turn(s) failed, engine out of "
                  "service until the step returns (%d healthy left)", loop.index,
                  1000 * stalled_s, failed, self._healthy)
        if self.metrics is not None:
            self.metrics.tts_stuck_steps.inc()
            if failed:
                self.metrics.tts_failures.inc(failed)
        self._fail_orphans(orphans)
        self._gauges()

    def _trip(self, slot: _Slot, stalled_s: float) -> None:
        with self._cond:
            stream = slot.stream
            if stream is None or slot.stuck or slot.beat_at is None:
                return  # the step came back while we looked
            slot.stuck = True
            self._count_healthy(-1)
            self.stats.stuck_steps += 1
            listening = not stream.stopping
            if listening:
                self.stats.failed += 1
            stream._abandon(EngineError(
                f"TTS slot {slot.index} made no progress for {1000 * stalled_s:.0f} ms "
                f"(limit {1000 * (self.step_timeout_s or 0):.0f} ms)"
            ))
            orphans = self._orphans()
            self._cond.notify_all()
        log.error(
            "tts slot %d: no progress for %.0f ms on %r; turn failed, slot out of service "
            "until the step returns (%d healthy left)", slot.index, 1000 * stalled_s,
            stream.request.text[:60], self._healthy,
        )
        if self.metrics is not None:
            self.metrics.tts_stuck_steps.inc()
            if listening:
                self.metrics.tts_failures.inc()
        self._fail_orphans(orphans)
        self._gauges()

    def _orphans(self) -> list[SpeechStream]:
        """With no healthy engine left, take every queued turn off the queue (hold the lock)."""
        if self._healthy > 0 or not self._heap:
            return []
        orphans = [stream for _, _, stream in self._heap]
        self._heap.clear()
        return orphans

    def _fail_orphans(self, orphans: list[SpeechStream]) -> None:
        failed = 0
        for stream in orphans:
            if not stream.stopping:
                failed += 1
                stream._abandon(EngineError("no healthy TTS slot left on this gateway"))
            stream._finish()
        self.stats.failed += failed
        if failed:
            log.error("no healthy TTS slot left: failed %d queued turn(s)", failed)

    def _count_healthy(self, delta: int) -> None:
        # Under self._cond, where a slot or loop enters or leaves rotation. The gauge is set
        # first: whoever reads the new count (``healthy_slots``, without the lock) finds
        # /metrics saying it already (it used to lag by a few statements, and a scrape saw it).
        healthy = self._healthy + delta
        if self.metrics is not None:
            self.metrics.tts_slots_healthy.set(healthy)
        self._healthy = healthy

    def _gauges(self) -> None:
        if self.metrics is None:
            return
        self.metrics.tts_busy_slots.set(len(self._running))
        self.metrics.tts_queue_depth.set(self.queued)
        self.metrics.tts_slots_healthy.set(self._healthy)
