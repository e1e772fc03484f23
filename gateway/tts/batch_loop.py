"""One batched stepping loop per device: schedule, step every row at once, hand out the audio.

The loop is the one owner of its :class:`~gateway.tts.engine.BatchEngine` (vLLM's engine-core
shape: schedule -> execute -> update from output). Each iteration:

1. **Reap.** Turns cancelled (hang-up, barge-in) or given up on by the service leave; their row
   is free for the next turn at once. Cancellation is a host flag read here, once per step:
   a cancelled row is out of the very next step, with no device sync.
2. **Admit.** While rows are free, queued turns take them in deadline order (the caller's turn
   time plus the first-audio budget); with the batch full the queue simply waits.
3. **Prefill, first priority, bounded.** New turns' prompts go through the talker between
   steps, most urgent first. How much runs before the next step is bounded by the running
   rows' playback: a playing row's slack is its lead (audio delivered but not yet played)
   minus what its next chunk still needs (a measured step per missing frame, and its decode);
   prefill chunks (``prefill_chunk`` tokens, a fixed engine setting) run while their measured
   cost fits in the smallest slack. At least one chunk runs
   per iteration, so a newcomer is never starved; a burst of newcomers is prefilled together
   when the budget allows and every one of them then gets its first frame from the same step.
4. **Plan the step.** Every ready row advances, except rows that sit this step out: a row whose
   consumer has not taken its last chunks (backpressure: the hand-off holds at most
   ``max_backlog`` chunks), and a row more than ``ahead_high_s`` ahead of playback while
   another turn waits for its first audio or is about to underrun (until its lead is down to
   ``ahead_low_s``). On a GPU a sat-out row is a masked row of the bucket; on a CPU the step
   runs only up to the highest row that advances, so sat-out rows above it cost nothing.
5. **Step** (one batched call for all rows), then **emit**: each row's due chunk is decoded
   (turns still waiting for first audio first) and handed to its stream; rows that sampled EOS
   or reached their frame cap finish and leave.

Failures: an exception inside a step fails every turn that has already been heard (its stream
raises :class:`~gateway.errors.EngineError`; the call plays its error prompt), the engine is
rebuilt, and turns not yet heard (including the prefilling ones) start over once, invisibly
(same seed, same codes). A failed prefill or codec decode fails that one turn. If the rebuild
fails the loop retires. A hung step is the watchdog's (see :mod:`gateway.tts.service`): it
fails the loop's turns, and when the step returns the loop rebuilds and serves again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import EngineError
from gateway.logs import call_context
from gateway.metrics import Metrics
from gateway.tts.engine import BatchEngine, EngineRow
from gateway.tts.stream import ServiceStats, SpeechStream

log = logging.getLogger(__name__)


class LoopHost(Protocol):
    """What a loop needs of the :class:`~gateway.tts.service.SpeechService` that owns it.

    The service's queue, condition and bookkeeping, reached under ``_cond`` from the loop's
    thread. A protocol rather than an import so the service can import the loop and the import
    graph keeps no cycle.
    """

    clock: Callable[[], float]
    metrics: Metrics | None
    stats: ServiceStats
    ahead_low_s: float
    ahead_high_s: float
    _cond: threading.Condition
    _stopping: bool
    _heap: list[tuple[float, int, SpeechStream]]

    def _pop_queued(self) -> SpeechStream | None: ...
    def _started(self, stream: SpeechStream) -> None: ...
    def _completed(self, stream: SpeechStream) -> None: ...
    def _stopped(self, stream: SpeechStream, *, cancelled: bool) -> None: ...
    def _failed(self, stream: SpeechStream, exc: BaseException) -> None: ...
    def _end(self, stream: SpeechStream) -> None: ...
    def _record_prefill(self, seconds: float) -> None: ...
    def _record_step(self, rows: int, seconds: float, interval: float | None) -> None: ...
    def _rows_waiting(self, *, backpressure: int, urgency: int, prefill: int) -> None: ...
    def _loop_back(self, loop: BatchLoop) -> None: ...
    def _retire(self, loop: BatchLoop) -> None: ...

#: Margin kept between the slack estimate and the next step when budgeting prefill work.
PREFILL_SAFETY_S = 0.02
#: A row sits out while its consumer holds this many chunks it has not taken.
DEFAULT_MAX_BACKLOG = 2
#: A consumer that takes nothing for this long has abandoned its stream: the turn is cancelled.
CONSUMER_STALL_S = 30.0


@dataclass(eq=False)
class _Turn:
    """A turn the loop owns: its stream and its engine row."""

    stream: SpeechStream
    row: EngineRow | None = None
    #: Started over once already after a failed step (a second failure fails it).
    restarted: bool = False
    #: Paused for an urgent turn (hysteresis between ahead_high and ahead_low).
    paused: bool = False
    #: Since when it has waited on its consumer (None: not waiting).
    blocked_since: float | None = None


class BatchLoop:
    """The thread that drives one :class:`BatchEngine` for a :class:`SpeechService`."""

    def __init__(self, service: LoopHost, engine: BatchEngine, index: int,
                 max_backlog: int = DEFAULT_MAX_BACKLOG) -> None:
        self.service = service
        self.engine = engine
        self.index = index
        self.max_backlog = max_backlog
        self.turns: list[_Turn] = []
        #: When the current unit of work (prefill chunk, step, decode) began; None when idle.
        self.beat_at: float | None = None
        #: From a watchdog trip until the stuck work returns.
        self.stuck = False
        self.retired = False
        self._thread: threading.Thread | None = None
        # Measured costs: step seconds per batch bucket, prefill seconds per prompt token.
        self._step_s: dict[int, float] = {}
        self._prefill_s_per_token: float | None = None
        self._decode_s = 0.0
        self._last_step_start: float | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.engine.claim(self)
        self._thread = threading.Thread(target=self._run, name=f"tts-batch-{self.index}",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def busy(self) -> int:
        return len(self.turns)

    @property
    def capacity(self) -> int:
        return self.engine.max_rows

    def wake(self) -> None:
        """Called from any thread when something the loop waits for changed."""
        with self.service._cond:
            self.service._cond.notify_all()

    # --- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        service = self.service
        cond = service._cond
        while True:
            with cond:
                if service._stopping or self.retired:
                    break
                self._reap()
                admitted = self._admit()
                if not self.turns:
                    self.beat_at = None
                    cond.wait()
                    continue
            for turn in admitted:
                self._open(turn)
            if self.stuck:
                self._recover_from_stuck()
                continue
            try:
                ran_prefill = self._prefill()
                stepping = self._plan()
                if stepping:
                    self._step(stepping)
                self._emit()
            except Exception as exc:  # a step failure, or a bug: the same way out
                self._after_failed_step(exc.error if isinstance(exc, _StepFailed) else exc)
                continue
            if self.stuck:
                self._recover_from_stuck()
                continue
            if not stepping and not ran_prefill:
                with cond:
                    self.beat_at = None
                    self._reap()
                    # Re-checked under the lock: a consumer, cancel or new turn that changed
                    # things since the plan notified nobody (the loop was not waiting yet).
                    if self.turns and not service._stopping and not self._changed():
                        cond.wait(timeout=self._idle_timeout())
        self._shutdown()

    # --- reap and admit (hold the service lock) ---------------------------------------------------

    def _reap(self) -> None:
        now = time.monotonic()
        for turn in list(self.turns):
            stream = turn.stream
            if turn.blocked_since is not None and now - turn.blocked_since > CONSUMER_STALL_S:
                log.warning("tts: nobody took %r's audio for %.0f s; cancelling it",
                            stream.request.text[:60], CONSUMER_STALL_S)
                stream._cancel.set()
            if stream.stopping:
                self._leave(turn, cancelled=stream.cancelled and not stream.abandoned)

    def _admit(self) -> list[_Turn]:
        service = self.service
        admitted: list[_Turn] = []
        free = self.engine.free_rows - sum(1 for t in self.turns if t.row is None)
        while free > 0 and not self.stuck:
            stream = service._pop_queued()
            if stream is None:
                break
            turn = _Turn(stream)
            self.turns.append(turn)
            admitted.append(turn)
            service._started(stream)
            stream._wake = self.wake
            free -= 1
        return admitted

    def _open(self, turn: _Turn) -> None:
        stream = turn.stream
        try:
            with call_context(str(stream.request.tags.get("call", ""))):
                turn.row = self.engine.open(stream.request)
        except Exception as exc:
            log.warning("tts: could not start %r: %s", stream.request.text[:60], exc)
            self._fail(turn, exc)

    # --- prefill --------------------------------------------------------------------------------

    def _prefill(self) -> bool:
        """Run prefill chunks within the playback budget (at least one); True if any ran."""
        pending = sorted((t for t in self.turns if t.row is not None and t.row.prefilling
                          and not t.stream.stopping), key=lambda t: t.stream.deadline)
        if not pending:
            return False
        clock = self.service.clock
        now = clock()
        # A playing row's slack: its lead minus the time its next chunk still needs (the frames
        # missing from it, a step each, and its decode). Prefill may spend the smallest slack.
        step = self._step_s.get(self._bucket_guess(), 0.0)
        slacks = [t.stream.audio_ahead(now) - max(1, t.row.frames_to_chunk) * step
                  - self._decode_s for t in self.turns
                  if t.row is not None and t.row.ready and t.row.finished is None
                  and t.stream.first_chunk_at is not None]
        budget = (min(slacks) - PREFILL_SAFETY_S) if slacks else float("inf")
        spent, ran = self._prefill_together(pending, budget)
        if self.stuck:
            return True
        chunk = self.engine.prefill_chunk
        for turn in pending:
            row = turn.row
            assert row is not None
            while row.prefilling:
                left = row.prompt_tokens - row.prefilled
                tokens = left if chunk <= 0 else min(chunk, left)
                rate = self._prefill_s_per_token
                estimate = rate * tokens if rate is not None else 0.0
                if ran and spent + estimate > budget:
                    return True
                self.beat_at = clock()
                t0 = time.perf_counter()
                try:
                    with call_context(str(turn.stream.request.tags.get("call", ""))):
                        done = self.engine.prefill(row)
                except Exception as exc:
                    log.exception("tts: prefill failed for %r", turn.stream.request.text[:60])
                    self._fail(turn, exc)
                    break
                elapsed = time.perf_counter() - t0
                spent += elapsed
                ran = True
                self._prefilled(done, elapsed)
                if self.stuck:
                    return True
        return ran

    def _prefill_together(self, pending: list[_Turn], budget: float) -> tuple[float, bool]:
        """Prefill the most urgent newcomers whose prompt is one chunk in one call, as many as
        the budget holds (at least two, or none): a burst of turns then reaches its first step
        after one forward instead of one per turn. Returns the seconds spent and whether it ran.

        If the call fails, the rows still prefilling are left to the one-by-one path, which
        fails only the turn whose prefill fails.
        """
        chunk = self.engine.prefill_chunk
        rate = self._prefill_s_per_token
        group: list[_Turn] = []
        tokens = 0
        for turn in pending:
            row = turn.row
            assert row is not None
            if row.prefilled or (chunk > 0 and row.prompt_tokens > chunk):
                break
            estimate = rate * (tokens + row.prompt_tokens) if rate is not None else 0.0
            if group and estimate > budget:
                break
            group.append(turn)
            tokens += row.prompt_tokens
        if len(group) < 2:
            return 0.0, False
        self.beat_at = self.service.clock()
        t0 = time.perf_counter()
        try:
            done = self.engine.prefill_rows([t.row for t in group if t.row is not None])
        except Exception as exc:
            # The one-by-one path that follows logs the failing turn's traceback.
            log.warning("tts: prefill of %d turns together failed (%s); trying them one by one",
                        len(group), exc)
            return time.perf_counter() - t0, False
        elapsed = time.perf_counter() - t0
        self._prefilled(done, elapsed)
        return elapsed, True

    def _prefilled(self, tokens: int, elapsed: float) -> None:
        """Fold one prefill call's cost into the per-token estimate and the metrics."""
        if tokens:
            per_token = elapsed / tokens
            rate = self._prefill_s_per_token
            self._prefill_s_per_token = per_token if rate is None else (
                0.7 * rate + 0.3 * per_token)
        self.service._record_prefill(elapsed)

    # --- planning and stepping -----------------------------------------------------------------

    def _plan(self) -> list[EngineRow]:
        """The rows that advance this step (the others sit it out, for reasons counted)."""
        service = self.service
        now = service.clock()
        ready = [t for t in self.turns if t.row is not None and t.row.ready
                 and t.row.finished is None and not t.stream.stopping]
        waiting_first = any(t.stream.waiting_for_first_audio for t in self.turns
                            if not t.stream.stopping)
        leads = {t: t.stream.audio_ahead(now) for t in ready}
        # Rows already playing that are about to run out: far-ahead rows make room for them.
        at_risk = [t for t in ready
                   if t.stream.first_chunk_at is not None and leads[t] < service.ahead_low_s]
        stepping: list[EngineRow] = []
        backpressure = urgency = 0
        for turn in ready:
            stream = turn.stream
            assert turn.row is not None
            if stream.backlog >= self.max_backlog:
                if turn.blocked_since is None:
                    turn.blocked_since = time.monotonic()
                    service.stats.backpressure_waits += 1
                stream._blocked = True
                backpressure += 1
                continue
            turn.blocked_since = None
            stream._blocked = False
            lead = leads[turn]
            others_need = waiting_first or any(o is not turn for o in at_risk)
            if turn.paused and (not others_need or lead <= service.ahead_low_s):
                turn.paused = False
            elif not turn.paused and others_need and lead > service.ahead_high_s:
                turn.paused = True
                service.stats.pauses += 1
            if turn.paused:
                urgency += 1
                continue
            stepping.append(turn.row)
        prefilling = sum(1 for t in self.turns if t.row is not None and t.row.prefilling)
        service._rows_waiting(backpressure=backpressure, urgency=urgency, prefill=prefilling)
        return stepping

    def _step(self, rows: list[EngineRow]) -> None:
        service = self.service
        now = service.clock()
        self.beat_at = now
        t0 = time.perf_counter()
        try:
            bucket = self.engine.step(rows)
        except Exception as exc:
            raise _StepFailed(exc) from exc
        elapsed = time.perf_counter() - t0
        previous = self._step_s.get(bucket)
        self._step_s[bucket] = elapsed if previous is None else 0.7 * previous + 0.3 * elapsed
        interval = None if self._last_step_start is None else now - self._last_step_start
        self._last_step_start = now
        service._record_step(len(rows), elapsed, interval)

    def _emit(self) -> None:
        """Decode and hand out every due chunk (first-audio turns first); finish done rows."""
        service = self.service
        clock = service.clock
        now = clock()
        order = sorted((t for t in self.turns if t.row is not None and t.row.ready),
                       key=lambda t: (not t.stream.waiting_for_first_audio,
                                      t.stream.audio_ahead(now)))
        for turn in order:
            row, stream = turn.row, turn.stream
            assert row is not None
            if stream.stopping:
                continue
            try:
                with call_context(str(stream.request.tags.get("call", ""))):
                    while True:
                        self.beat_at = clock()
                        t0 = time.perf_counter()
                        audio = self.engine.next_chunk(row)
                        if audio is None:
                            break
                        self._decode_s = 0.7 * self._decode_s + 0.3 * (time.perf_counter() - t0)
                        if len(audio):
                            stream._record_chunk(len(audio), clock())
                            stream._produced += 1
                            stream._put(audio)
                        if row.finished is None:
                            break  # one chunk per step while generating
            except Exception as exc:
                log.exception("tts: codec decode failed for %r", stream.request.text[:60])
                self._fail(turn, exc)
                continue
            if row.finished is not None:
                self._complete(turn)

    # --- turn endings ---------------------------------------------------------------------------

    def _complete(self, turn: _Turn) -> None:
        stream = turn.stream
        if turn.row is not None:
            stream.codes = turn.row.codes
        self._close_row(turn)
        with self.service._cond:
            if turn in self.turns:
                self.turns.remove(turn)
        if stream.gaps and self.service.metrics is not None:
            self.service.metrics.tts_underruns.inc(stream.gaps)
        self.service._completed(stream)

    def _leave(self, turn: _Turn, *, cancelled: bool) -> None:
        """A stopped turn leaves (hold the service lock)."""
        if turn.row is not None:
            turn.stream.codes = turn.row.codes
        self._close_row(turn)
        self.turns.remove(turn)
        self.service._stopped(turn.stream, cancelled=cancelled)

    def _fail(self, turn: _Turn, exc: BaseException) -> None:
        stream = turn.stream
        with self.service._cond:
            if turn in self.turns:
                self.turns.remove(turn)
        self._close_row(turn)
        self.service._failed(stream, exc)

    def _close_row(self, turn: _Turn) -> None:
        row, turn.row = turn.row, None
        if row is None:
            return
        with contextlib.suppress(EngineError):  # the row was lost in a rebuild already
            self.engine.close(row)

    # --- failures -------------------------------------------------------------------------------

    def _after_failed_step(self, error: BaseException) -> None:
        """Fail the heard turns, rebuild the engine, start the unheard ones over once."""
        log.error("tts batch %d: step failed (%s: %s); rebuilding the engine", self.index,
                  type(error).__name__, error, exc_info=error)
        restart: list[_Turn] = []
        for turn in list(self.turns):
            turn.row = None  # the rebuild frees every row
            if turn.stream.stopping:
                continue
            if turn.stream.first_chunk_at is not None or turn.restarted:
                self._fail(turn, error)
            else:
                turn.restarted = True
                restart.append(turn)
        if not self._rebuild():
            for turn in restart:
                self._fail(turn, error)
            return
        self.service.stats.restarted += len(restart)
        for turn in restart:
            self._open(turn)

    def _recover_from_stuck(self) -> None:
        """The step the watchdog gave up on has returned: its turns were failed already."""
        with self.service._cond:
            turns, self.turns = self.turns, []
            for turn in turns:
                turn.row = None
                self.service._end(turn.stream)
        for turn in turns:
            turn.stream._finish()
        if self._rebuild():
            self.service._loop_back(self)

    def _rebuild(self) -> bool:
        self.beat_at = None
        try:
            self.engine.rebuild()
        except Exception:
            log.exception("tts batch %d: the engine could not be rebuilt; retiring it",
                          self.index)
            self.service._retire(self)
            return False
        log.warning("tts batch %d: engine rebuilt", self.index)
        with self.service._cond:
            self.service.stats.recovered += 1
        return True

    def _shutdown(self) -> None:
        for turn in list(self.turns):
            self._close_row(turn)
            turn.stream._cancel.set()
            turn.stream._finish()
        self.turns.clear()
        self.beat_at = None

    # --- helpers --------------------------------------------------------------------------------

    def _changed(self) -> bool:
        """Work appeared since the plan: a queued turn for a free row, a consumer that took
        its chunks (hold the lock)."""
        if self.service._heap and self.engine.free_rows > 0:
            return True
        return any(t.blocked_since is not None and t.stream.backlog < self.max_backlog
                   for t in self.turns)

    def _bucket_guess(self) -> int:
        rows = sum(1 for t in self.turns if t.row is not None)
        for size in sorted(self._step_s):
            if size >= rows:
                return size
        return max(self._step_s, default=0)

    def _idle_timeout(self) -> float:
        """How long nothing can change by itself: until a paused row's lead falls to
        ``ahead_low_s`` (woken sooner by consumers, cancels and new turns)."""
        now = self.service.clock()
        waits = [max(0.005, t.stream.audio_ahead(now) - self.service.ahead_low_s)
                 for t in self.turns if t.paused]
        if any(t.blocked_since is not None for t in self.turns):
            waits.append(1.0)  # consumers wake us; re-check the stall limit now and then
        return min(waits, default=0.05)


class _StepFailed(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error
