"""The front of speech generation: turns in, chunks out, one engine core per device behind it.

The asyncio side never blocks on the model. :meth:`SpeechService.stream` validates a request,
makes its :class:`~gateway.tts.stream.SpeechStream` (the turn's async iterator and its output
sink) and adds it to an engine core (:mod:`gateway.tts.core`: one thread per device, a pure
scheduler, the model runner). That is all it says to a core: add a turn; the consumer's
``cancel()`` reaches the core through the stream. What the cores report (turns started and
ended, steps, prefills, health) arrives here as :class:`~gateway.tts.core.CoreEvents`, kept as
:class:`~gateway.tts.stream.ServiceStats` and Prometheus metrics.

Scheduling (the policy lives in :mod:`gateway.tts.scheduler`), in the order a caller feels it:

- **Admission.** With every row busy, queued turns wait in deadline order (the caller's turn
  time plus the first-audio budget). Queue depth and wait are metrics. With several devices a
  turn goes to the core with the fewest turns.
- **Urgency first.** A turn far ahead of its playback (``ahead_high_s``) sits out while another
  turn waits for its first audio, until its lead falls to ``ahead_low_s``.
- **Cancellation.** Hang-up and barge-in set a flag the core reads before every step; the row
  is free within one step. The time from ``cancel()`` to free is recorded for every cancelled
  turn.
- **Failure isolation.** An exception inside a step fails the turns it hit (their streams raise
  :class:`~gateway.errors.EngineError`; the call answers with its apology prompt), the engine is
  rebuilt and carries on; if the rebuild fails the core retires while any others carry on.
- **Watchdog.** A step that hangs (a deadlocked kernel, a wedged driver call) raises nothing.
  With ``step_timeout_s`` set, a watchdog thread fails the turns of a core that has shown no
  progress for that long: their streams raise :class:`~gateway.errors.EngineError` like any
  engine failure, the core leaves rotation and its queue moves to the healthy cores (or fails,
  if none is left). A Python thread cannot be killed, so the core stays out until its step
  returns by itself; then it is rebuilt and serves again (or retires if the rebuild fails).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence

from gateway.clock import Clock, SystemClock
from gateway.errors import EngineError
from gateway.metrics import Metrics
from gateway.tts.core import EngineCore
from gateway.tts.engine import BatchEngine, Engine, SpeechRequest
from gateway.tts.scheduler import SchedulerConfig
from gateway.tts.stream import EtaMargin, ServiceStats, SpeechStream, append_bounded

log = logging.getLogger(__name__)

# SpeechStream and ServiceStats live in gateway.tts.stream; callers import them from here.
__all__ = ["ServiceStats", "SpeechService", "SpeechStream"]


class SpeechService:
    """Owns the engine cores of one gateway (one per device) and the watchdog over them.

    ``engines`` are :class:`~gateway.tts.engine.BatchEngine` s, one per device.
    ``step_timeout_s`` arms the watchdog (None: off): the longest a core may work on one unit
    (a step, a prefill chunk, a decode) before its turns fail and it leaves rotation.
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
        clock: Clock | None = None,
        max_backlog: int = 2,
    ) -> None:
        if not engines:
            raise ValueError("at least one engine is required")
        for engine in engines:
            if not isinstance(engine, BatchEngine):
                raise TypeError(
                    f"{type(engine).__name__} is not a batch engine: the gateway serves every "
                    "turn through a batched engine core (the slot engine lives in bench/ as "
                    "the batching benchmark's baseline)"
                )
        if step_timeout_s is not None and step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be positive (None turns the watchdog off)")
        self.engines: list[BatchEngine] = list(engines)  # type: ignore[arg-type]
        self.metrics = metrics
        self.first_audio_budget_s = first_audio_budget_s
        self.ahead_high_s = ahead_high_s
        self.ahead_low_s = ahead_low_s
        self.step_timeout_s = step_timeout_s
        self.clock = clock if clock is not None else SystemClock()
        self.stats = ServiceStats()
        #: What the consumers measured of the cores' next-chunk estimates (the start buffer's).
        self.eta_margin = EtaMargin()
        self._lock = threading.Lock()
        #: Notified whenever a turn starts or ends or a core enters or leaves rotation.
        self._changed = threading.Condition(self._lock)
        self._running: set[SpeechStream] = set()
        self._healthy = len(self.engines)
        self.cores = [
            EngineCore(engine, index, self, SchedulerConfig(
                max_rows=engine.max_rows, prefill_chunk=engine.prefill_chunk,
                ahead_low_s=ahead_low_s, ahead_high_s=ahead_high_s, max_backlog=max_backlog,
            ), self.clock)
            for index, engine in enumerate(self.engines)
        ]
        self._watchdog: threading.Thread | None = None
        self._watchdog_stop = threading.Event()

    # --- introspection ------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The first engine (for validation and metadata)."""
        return self.engines[0]

    @property
    def capacity(self) -> int:
        """Turns that can generate at once: rows over every engine."""
        return sum(core.capacity for core in self.cores)

    @property
    def computing(self) -> bool:
        """An engine is working right now (a step, a prefill chunk, a decode); False while
        every engine is idle or waiting for its consumers to take their audio.

        Read without a lock (a snapshot): for observers such as a test's virtual clock, which
        must let real time pass while speech is really being computed.
        """
        return any(core.beat_at is not None for core in self.cores)

    @property
    def busy_slots(self) -> int:
        """Turns generating now (rows in use)."""
        return len(self._running)

    @property
    def queued(self) -> int:
        return sum(core.waiting for core in self.cores)

    @property
    def healthy_slots(self) -> int:
        """Engines in rotation: not retired, and not stuck in a step the watchdog gave up on."""
        return self._healthy

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block (off the event loop) until ``predicate()`` holds, re-checked whenever a turn
        starts or ends or a core's health changes; False after ``timeout`` seconds."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start one core per engine (and the watchdog, when armed)."""
        for core in self.cores:
            core.start()
        if self.step_timeout_s is not None:
            self._watchdog = threading.Thread(target=self._watch, name="tts-watchdog",
                                              daemon=True)
            self._watchdog.start()
        self._gauges()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and wait for the cores (each stops within one step)."""
        for core in self.cores:
            core.stop()
        self._watchdog_stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout)
            self._watchdog = None
        # A core stuck in a step does not come back for join(); it is a daemon thread.
        for core in self.cores:
            core.join(timeout)

    # --- the asyncio side ---------------------------------------------------------------------

    def stream(self, request: SpeechRequest, turn_started_at: float | None = None) -> SpeechStream:
        """Queue ``request`` for a row; iterate the returned stream for its chunks.

        ``turn_started_at`` (monotonic) is when the caller's turn ended; the deadline that
        orders the queue is that plus the first-audio budget.
        """
        try:
            self.engine.validate(request)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        now = self.clock.now()
        turn = turn_started_at if turn_started_at is not None else now
        stream = SpeechStream(
            request, asyncio.get_running_loop(), turn, turn + self.first_audio_budget_s, self.clock,
            self.eta_margin,
        )
        with self._lock:
            # Checked under the lock: a core the watchdog takes out between the check and the
            # add would otherwise leave this turn queued with nobody to serve it.
            core = self._pick()
            if core is None:
                raise EngineError("no healthy TTS slot left on this gateway")
            core.add(stream)
        self._gauges()
        return stream

    def _pick(self) -> EngineCore | None:
        """The healthy core with the fewest turns (hold the lock)."""
        healthy = [core for core in self.cores if not core.stuck and not core.retired]
        return min(healthy, key=lambda core: core.load / core.capacity, default=None)

    # --- CoreEvents: what the cores report, from their threads ----------------------------------

    def turn_started(self, stream: SpeechStream) -> None:
        with self._lock:
            self._running.add(stream)
            self.stats.started += 1
            append_bounded(self.stats.start_order,
                           stream.request.tags.get("turn", stream.request.text))
            stream.started_at = self.clock.now()
            self._changed.notify_all()
        if self.metrics is not None:
            self.metrics.tts_queue_wait.observe(stream.started_at - stream.submitted_at)
        self._gauges()

    def turn_ended(self, stream: SpeechStream, outcome: str) -> None:
        """``outcome``: completed, cancelled, stopped, failed, abandoned or dropped."""
        stats = self.stats
        with self._lock:
            self._running.discard(stream)
            if outcome != "dropped":
                stream.finished_at = self.clock.now()
            if outcome == "completed":
                stats.completed += 1
            elif outcome == "failed":
                stats.failed += 1
            elif outcome == "cancelled":
                stats.cancelled += 1
                if stream._cancelled_at is not None:
                    freed = self.clock.now() - stream._cancelled_at
                    append_bounded(stats.cancel_to_free_s, freed)
                    if self.metrics is not None:
                        self.metrics.tts_cancel_to_free.observe(freed)
            self._changed.notify_all()
        if self.metrics is not None:
            if outcome == "failed":
                self.metrics.tts_failures.inc()
            if outcome == "completed" and stream.gaps:
                self.metrics.tts_underruns.inc(stream.gaps)
        self._gauges()

    def stepped(self, rows: int, seconds: float, interval: float | None) -> None:
        stats = self.stats
        stats.steps += 1
        append_bounded(stats.step_rows, rows)
        append_bounded(stats.step_s, seconds)
        if interval is not None:
            append_bounded(stats.step_interval_s, interval)
        if self.metrics is not None:
            self.metrics.tts_batch_size.observe(rows)
            self.metrics.tts_step_seconds.observe(seconds)

    def iteration(self, rows: int, host_s: float) -> None:
        if self.metrics is not None:
            self.metrics.tts_step_host_seconds.observe(host_s)

    def prefilled(self, seconds: float) -> None:
        append_bounded(self.stats.prefill_s, seconds)
        if self.metrics is not None:
            self.metrics.tts_prefill_seconds.observe(seconds)

    def rows_waiting(self, *, backpressure: int, urgency: int, prefill: int,
                     text: int = 0) -> None:
        if self.metrics is not None:
            waiting = self.metrics.tts_rows_waiting
            waiting.labels("backpressure").set(backpressure)
            waiting.labels("urgency").set(urgency)
            waiting.labels("prefill").set(prefill)
            waiting.labels("text").set(text)

    def counted(self, *, pauses: int = 0, backpressure_waits: int = 0,
                restarted: int = 0, text_underruns: int = 0) -> None:
        with self._lock:
            self.stats.pauses += pauses
            self.stats.backpressure_waits += backpressure_waits
            self.stats.restarted += restarted
            self.stats.text_underruns += text_underruns
        if text_underruns and self.metrics is not None:
            self.metrics.tts_text_underruns.inc(text_underruns)

    def rebuilt(self, core: EngineCore) -> None:
        with self._lock:
            self.stats.recovered += 1
            self._changed.notify_all()

    def retired(self, core: EngineCore) -> None:
        """A core whose engine could not be rebuilt leaves service for good."""
        with self._lock:
            self.stats.slots_retired += 1
            if not core.stuck:
                self._count_healthy(-1)
            orphans = self._rehome(core.hand_back())
        self._fail_orphans(orphans)
        self._gauges()

    def back_in_service(self, core: EngineCore) -> None:
        """A core whose stuck step returned is rebuilt and back in rotation."""
        with self._lock:
            self._count_healthy(+1)
        log.warning("tts core %d: its stuck step returned; rebuilt and back in service",
                    core.index)
        self._gauges()

    # --- the watchdog -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Trip every core whose current work has shown no progress for ``step_timeout_s``."""
        timeout = self.step_timeout_s
        assert timeout is not None
        # Checked a few times per timeout: a trip lands at most a quarter late.
        period = min(0.25, max(0.005, timeout / 4))
        while not self._watchdog_stop.wait(period):
            now = self.clock.now()
            for core in self.cores:
                beat = core.beat_at
                if beat is not None and not core.stuck and now - beat > timeout:
                    self._trip(core, now - beat)

    def _trip(self, core: EngineCore, stalled_s: float) -> None:
        """A core's step hung: its turns fail, it leaves rotation, its queue moves on."""
        error = EngineError(
            f"TTS batch {core.index} made no progress for {1000 * stalled_s:.0f} ms "
            f"(limit {1000 * (self.step_timeout_s or 0):.0f} ms)"
        )
        with self._lock:
            tripped = core.trip()
            if tripped is None:
                return  # the work came back while we looked
            running, waiting = tripped
            # Counted before any consumer hears of it: whoever the error wakes finds the core
            # out of rotation already.
            self._count_healthy(-1)
            self.stats.stuck_steps += 1
            failed = sum(1 for sink in running if not sink.stopping)
            self.stats.failed += failed
            orphans = self._rehome(waiting)
        for sink in running:
            sink.abandon(error)
        log.error("tts core %d: no progress for %.0f ms; %d turn(s) failed, engine out of "
                  "service until the step returns (%d healthy left)", core.index,
                  1000 * stalled_s, failed, self._healthy)
        if self.metrics is not None:
            self.metrics.tts_stuck_steps.inc()
            if failed:
                self.metrics.tts_failures.inc(failed)
        self._fail_orphans(orphans)
        self._gauges()

    def _rehome(self, streams: list[SpeechStream]) -> list[SpeechStream]:
        """Queue ``streams`` on healthy cores (hold the lock); returns those with none left."""
        orphans = []
        for stream in streams:
            core = self._pick()
            if core is None:
                orphans.append(stream)
            else:
                core.add(stream)
        return orphans

    def _fail_orphans(self, orphans: list[SpeechStream]) -> None:
        failed = 0
        for stream in orphans:
            if not stream.stopping:
                failed += 1
                stream.abandon(EngineError("no healthy TTS slot left on this gateway"))
            stream.finish_now()
        with self._lock:
            self.stats.failed += failed
        if failed:
            log.error("no healthy TTS slot left: failed %d queued turn(s)", failed)

    def _count_healthy(self, delta: int) -> None:
        # Under self._lock, where a core enters or leaves rotation. The gauge is set first:
        # whoever reads the new count (``healthy_slots``, without the lock) finds /metrics
        # saying it already.
        healthy = self._healthy + delta
        if self.metrics is not None:
            self.metrics.tts_slots_healthy.set(healthy)
        self._healthy = healthy
        self._changed.notify_all()

    def _gauges(self) -> None:
        if self.metrics is None:
            return
        self.metrics.tts_busy_slots.set(len(self._running))
        self.metrics.tts_queue_depth.set(self.queued)
        self.metrics.tts_slots_healthy.set(self._healthy)
