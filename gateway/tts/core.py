"""The engine core of one device: an inbox, the scheduler, the model runner, one thread.

vLLM v1's shape. The front (:class:`~gateway.tts.service.SpeechService`) reaches a core only
through :meth:`EngineCore.add` (a turn and its output sink, a
:class:`~gateway.tts.stream.SpeechStream`) and the sink's own cancel; the core reports what
happened through :class:`CoreEvents` (counters and metrics). Each iteration of its loop:

1. **admit** (:meth:`Scheduler.admit`, under the core's lock): reap turns that stopped, cancel
   turns whose consumer stalled, take waiting turns into free rows (``open``);
2. **prefill** (:meth:`Scheduler.plan_prefill`): a burst together in one call, then chunks one
   turn at a time, within the playing rows' slack;
3. **step** (:meth:`Scheduler.plan_step`): one batched call for every row that advances;
4. **emit**: due chunks decoded in the scheduler's order and delivered to their sinks;
5. **update**: every call's measured time goes back to the scheduler's costs;

and what it delivered reaches the asyncio side in one hand-off per iteration (:class:`Outbox`):
one wake-up of the event loop per step, not one per chunk.

Failures: an exception inside a step fails every turn already heard (its stream raises
:class:`~gateway.errors.EngineError`; the call plays its error prompt), the engine is rebuilt,
and turns not heard yet start over once, invisibly (same seed, same codes). A failed batched
codec decode is handled the same way: its rows were decoded together, so a failure cannot be
pinned on one of them and their codec state is suspect. A failed prefill fails its one turn.
If the rebuild fails the core retires. A hung step is the service watchdog's:
:meth:`EngineCore.trip` takes the core out of rotation and hands back its turns (the watchdog
fails them) and its queue; when the step returns the core rebuilds and serves again.

The loop reads the time only through the clock it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from gateway.clock import Clock, SystemClock
from gateway.errors import EngineError
from gateway.logs import call_context
from gateway.tts.engine import BatchEngine, EngineRow
from gateway.tts.scheduler import Scheduler, SchedulerConfig, Turn, TurnSink

log = logging.getLogger(__name__)

__all__ = ["CoreEvents", "CoreTimes", "EngineCore", "Outbox"]


@dataclass
class CoreTimes:
    """Where a core's iterations went: the device (the engine's replays, device work and
    copies back) and everything else, the host's share (scheduling, staging, bookkeeping,
    delivery). Iterations that ran a step only."""

    steps: int = 0
    busy_s: float = 0.0
    device_s: float = 0.0
    #: Host seconds of each stepped iteration (the most recent few thousand).
    host_s: list[float] = field(default_factory=list)
    #: Rows in each stepped iteration's step, beside ``host_s``.
    rows: list[int] = field(default_factory=list)

    @property
    def host_total_s(self) -> float:
        return self.busy_s - self.device_s


class Outbox:
    """What the core hands to asyncio in one iteration, posted once per event loop.

    A chunk handed over with ``call_soon_threadsafe`` wakes the event loop (a write to its
    self-pipe) and schedules a callback; at 64 rows a step makes a dozen chunks. Collected here
    and flushed after the iteration, they cost one wake-up and one callback per event loop.
    """

    def __init__(self) -> None:
        self._items: dict[asyncio.AbstractEventLoop, list[tuple[Callable[..., Any], Any]]] = {}
        self._dead: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], arg: Any,
             on_closed: Callable[[], None] | None = None) -> None:
        """Run ``fn(arg)`` on ``loop`` at the next flush; ``on_closed`` if that loop is gone."""
        self._items.setdefault(loop, []).append((fn, arg))
        if on_closed is not None:
            self._dead.setdefault(loop, []).append(on_closed)

    def flush(self) -> None:
        items, self._items = self._items, {}
        dead, self._dead = self._dead, {}
        for loop, batch in items.items():
            try:
                loop.call_soon_threadsafe(_run_batch, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for on_closed in dead.get(loop, ()):
                    on_closed()

    def __bool__(self) -> bool:
        return bool(self._items)


def _run_batch(batch: list[tuple[Callable[..., Any], Any]]) -> None:
    for fn, arg in batch:
        fn(arg)


class TurnOutput(TurnSink, Protocol):
    """A turn's sink as the core drives it: the scheduler's view plus the output side
    (:class:`~gateway.tts.stream.SpeechStream` implements it)."""

    @property
    def abandoned(self) -> bool: ...
    def attach(self, wake: Callable[[], None]) -> None: ...
    def waiting_on_consumer(self, blocked: bool) -> None: ...
    def take_text(self) -> tuple[str, bool] | None: ...
    def deliver(self, audio: Any, now: float, outbox: Outbox,
                next_chunk_eta_s: float | None = None) -> None: ...
    def end(self, outbox: Outbox) -> None: ...
    def fail(self, exc: BaseException, outbox: Outbox) -> None: ...
    def finish(self, outbox: Outbox) -> None: ...
    def finish_now(self) -> None: ...
    def cancel_from_core(self) -> None: ...


def _out(turn: Turn) -> TurnOutput:
    return cast(TurnOutput, turn.sink)


def _row(turn: Turn) -> EngineRow | None:
    """The turn's engine row (the scheduler reads it through its narrower view)."""
    return cast(EngineRow | None, turn.row)


class CoreEvents(Protocol):
    """What a core tells the front (counters, metrics, health). Called from the core's thread."""

    def turn_started(self, stream: Any) -> None: ...
    def turn_ended(self, stream: Any, outcome: str) -> None:
        """``outcome``: completed, cancelled, stopped (left unheard), failed, dropped (never
        started)."""
    def stepped(self, rows: int, seconds: float, interval: float | None) -> None: ...
    def iteration(self, rows: int, host_s: float) -> None:
        """An iteration that stepped ``rows`` rows spent ``host_s`` on the host."""
    def prefilled(self, seconds: float) -> None: ...
    def rows_waiting(self, *, backpressure: int, urgency: int, prefill: int,
                     text: int = 0) -> None: ...
    def counted(self, *, pauses: int = 0, backpressure_waits: int = 0,
                restarted: int = 0, text_underruns: int = 0) -> None: ...
    def rebuilt(self, core: EngineCore) -> None: ...
    def retired(self, core: EngineCore) -> None: ...
    def back_in_service(self, core: EngineCore) -> None: ...


class EngineCore:
    """The thread that owns one :class:`BatchEngine` (see the module docstring)."""

    def __init__(self, engine: BatchEngine, index: int, events: CoreEvents,
                 config: SchedulerConfig, clock: Clock | None = None) -> None:
        self.engine = engine
        self.index = index
        self.events = events
        self.clock = clock if clock is not None else SystemClock()
        self.scheduler = Scheduler(config)
        #: When the current unit of work (prefill chunk, step, decode) began; None when idle.
        self.beat_at: float | None = None
        #: From a watchdog trip until the stuck work returns.
        self.stuck = False
        self.retired = False
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._outbox = Outbox()
        self._last_step_start: float | None = None
        self.times = CoreTimes()
        self._stepped_rows = 0

    # --- the front's side (any thread) ------------------------------------------------------------

    def add(self, stream: Any) -> None:
        """Queue ``stream``'s turn by its deadline; the core picks it up at its next admit."""
        with self._cond:
            self.scheduler.add(Turn(sink=stream, deadline=stream.deadline, payload=stream))
            self._cond.notify_all()

    def wake(self) -> None:
        """Something the core may wait for changed (a consumer took chunks, a cancel)."""
        with self._cond:
            self._cond.notify_all()

    @property
    def load(self) -> int:
        """Turns running or waiting here (how the front spreads turns over cores)."""
        return len(self.scheduler.running) + len(self.scheduler._waiting)

    @property
    def capacity(self) -> int:
        return self.engine.max_rows

    @property
    def running(self) -> list[Turn]:
        return list(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    def start(self) -> None:
        self.engine.claim(self)
        self._thread = threading.Thread(target=self._run, name=f"tts-core-{self.index}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            for turn in self.scheduler.running:
                _out(turn).cancel_from_core()
            for turn in self.scheduler.take_waiting():
                _out(turn).cancel_from_core()
                _out(turn).finish_now()
            self._cond.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def hand_back(self) -> list[Any]:
        """Empty this core's queue (a retired core's turns go to the others)."""
        with self._cond:
            return [turn.payload for turn in self.scheduler.take_waiting()]

    def trip(self) -> tuple[list[Any], list[Any]] | None:
        """The watchdog gave up on the work under way: the core leaves rotation until that work
        returns. Returns the running turns' sinks (the caller fails them) and the queue (the
        caller re-homes it); None if the work came back meanwhile."""
        with self._cond:
            if self.stuck or self.retired or self.beat_at is None:
                return None
            self.stuck = True
            running = [turn.sink for turn in self.scheduler.running]
            waiting = [turn.payload for turn in self.scheduler.take_waiting()]
            self._cond.notify_all()
        return running, waiting

    # --- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        cond = self._cond
        scheduler = self.scheduler
        while True:
            with cond:
                if self._stopping or self.retired:
                    break
                if self.stuck:
                    admission = None
                else:
                    admission = scheduler.admit(self.clock.now(), self.engine.free_rows)
                if admission is not None and not scheduler.running and not admission.leave \
                        and not admission.dropped:
                    self._outbox.flush()
                    self.beat_at = None
                    cond.wait()
                    continue
            if self.stuck:
                self._recover_from_stuck()
                continue
            assert admission is not None
            t_iteration = time.perf_counter()
            device_before = self.engine.device_s
            self._stepped_rows = 0
            self._settle(admission)
            ran = False
            try:
                self._feed_text()
                ran = self._prefill()
                if not self.stuck:
                    ran = self._step_and_emit() or ran
            except _StepFailed as failure:
                self._after_failed_step(failure.error)
                ran = True
            except Exception as exc:  # a bug: the same way out as a failed step
                self._after_failed_step(exc)
                ran = True
            self._outbox.flush()
            if self._stepped_rows:
                self._account(time.perf_counter() - t_iteration,
                              self.engine.device_s - device_before)
            if self.stuck:
                continue
            if not ran:
                with cond:
                    self.beat_at = None
                    # Re-checked under the lock: a consumer, cancel or new turn that changed
                    # things since the plan notified nobody (the core was not waiting yet).
                    if (scheduler.running and not self._stopping
                            and not any(t.sink.stopping for t in scheduler.running)
                            and not scheduler.work_appeared(self._free_rows())):
                        cond.wait(timeout=scheduler.idle_timeout(self.clock.now()))
        self._shutdown()

    def _free_rows(self) -> int:
        return self.engine.free_rows - sum(1 for t in self.scheduler.running if t.row is None)

    def _settle(self, admission: Any) -> None:
        """Carry out an admission: stalled consumers cancelled, leavers out, newcomers in."""
        for turn in admission.stalled:
            log.warning("tts: nobody took %r's audio for %.0f s; cancelling it",
                        turn.payload.request.text[:60], self.scheduler.config.consumer_stall_s)
            _out(turn).cancel_from_core()
        for turn in admission.dropped:
            self.events.turn_ended(turn.payload, "dropped")
            _out(turn).finish(self._outbox)
        for turn, cancelled in admission.leave:
            self._close_row(turn)
            abandoned = _out(turn).abandoned
            self.events.turn_ended(turn.payload, "cancelled" if cancelled and not abandoned
                                   else "stopped")
            _out(turn).finish(self._outbox)
        for turn in admission.admit:
            self.events.turn_started(turn.payload)
            _out(turn).attach(self.wake)
            self._open(turn)

    def _open(self, turn: Turn) -> None:
        request = turn.payload.request
        try:
            with call_context(str(request.tags.get("call", ""))):
                turn.row = self.engine.open(request)
        except Exception as exc:
            log.warning("tts: could not start %r: %s", request.text[:60], exc)
            self._fail(turn, exc)

    # --- streamed text -----------------------------------------------------------------------

    def _feed_text(self) -> None:
        """Hand the text that arrived for streaming turns to their rows' text tracks."""
        for turn in list(self.scheduler.running):
            row = _row(turn)
            if row is None or turn.sink.stopping:
                continue
            piece = _out(turn).take_text()
            if piece is None:
                continue
            text, last = piece
            try:
                self.engine.extend_text(row, text, last)
            except Exception as exc:
                log.warning("tts: could not extend %r's text: %s",
                            turn.payload.request.text[:60], exc)
                self._fail(turn, exc)

    # --- prefill --------------------------------------------------------------------------------

    def _prefill(self) -> bool:
        """Run the prefill the scheduler plans; True if any ran."""
        scheduler = self.scheduler
        plan = scheduler.plan_prefill(self.clock.now())
        if not plan:
            return False
        if plan.together:
            rows = [row for t in plan.together if (row := _row(t)) is not None]
            self.beat_at = self.clock.now()
            t0 = time.perf_counter()
            try:
                tokens = self.engine.prefill_rows(rows)
            except Exception as exc:
                # The one-by-one plan that follows logs the failing turn's traceback.
                log.warning("tts: prefill of %d turns together failed (%s); trying them one "
                            "by one", len(rows), exc)
                plan = scheduler.plan_prefill(self.clock.now(), together=False)
            else:
                self._prefilled(tokens, time.perf_counter() - t0)
            if self.stuck:
                return True
        for turn, _tokens in plan.chunks:
            row = _row(turn)
            if row is None or not row.prefilling or turn.sink.stopping:
                continue
            self.beat_at = self.clock.now()
            t0 = time.perf_counter()
            try:
                with call_context(str(turn.payload.request.tags.get("call", ""))):
                    done = self.engine.prefill(row)
            except Exception as exc:
                log.exception("tts: prefill failed for %r", turn.payload.request.text[:60])
                self._fail(turn, exc)
                continue
            self._prefilled(done, time.perf_counter() - t0)
            if self.stuck:
                return True
        return True

    def _prefilled(self, tokens: int, seconds: float) -> None:
        self.scheduler.prefilled(tokens, seconds)
        self.events.prefilled(seconds)

    # --- step and emit --------------------------------------------------------------------------

    def _step_and_emit(self) -> bool:
        """Plan and run the step, then deliver due chunks; True if anything ran."""
        scheduler = self.scheduler
        now = self.clock.now()
        plan = scheduler.plan_step(now)
        self.events.rows_waiting(backpressure=plan.backpressure, urgency=plan.urgency,
                                 prefill=plan.prefilling, text=plan.text)
        if plan.new_pauses or plan.new_backpressure_waits or plan.new_text_underruns:
            self.events.counted(pauses=plan.new_pauses,
                                backpressure_waits=plan.new_backpressure_waits,
                                text_underruns=plan.new_text_underruns)
        blocked = {id(t) for t in plan.blocked}
        for turn in scheduler.running:
            _out(turn).waiting_on_consumer(id(turn) in blocked)
        if plan.rows:
            self._step([row for t in plan.rows if (row := _row(t)) is not None], now)
        delivered = self._emit(plan.decode)
        return bool(plan.rows) or delivered

    def _step(self, rows: list[Any], now: float) -> None:
        self.beat_at = now
        t0 = time.perf_counter()
        try:
            bucket = self.engine.step(rows)
        except Exception as exc:
            raise _StepFailed(exc) from exc
        elapsed = time.perf_counter() - t0
        self.scheduler.stepped(bucket, elapsed)
        interval = None if self._last_step_start is None else now - self._last_step_start
        self._last_step_start = now
        self._stepped_rows = len(rows)
        self.events.stepped(len(rows), elapsed, interval)

    def _account(self, busy_s: float, device_s: float) -> None:
        """One stepped iteration: its host time (all but the device's) goes on the record."""
        times = self.times
        host = max(0.0, busy_s - device_s)
        times.steps += 1
        times.busy_s += busy_s
        times.device_s += device_s
        times.host_s.append(host)
        times.rows.append(self._stepped_rows)
        if len(times.host_s) > 8192:
            del times.host_s[:4096], times.rows[:4096]
        self.events.iteration(self._stepped_rows, host)

    def _emit(self, order: list[Turn]) -> bool:
        """Decode every due chunk in one batched call, deliver them (in ``order``), and finish
        the rows that are done."""
        turns = [t for t in order if t.row is not None and not t.sink.stopping]
        if not turns:
            return False
        rows = [row for t in turns if (row := _row(t)) is not None]
        self.beat_at = self.clock.now()
        t0 = time.perf_counter()
        try:
            audios = self.engine.next_chunks(rows)
        except Exception as exc:
            # The rows were decoded together: a failure cannot be pinned on one of them, and
            # the codec state of every row in the call is suspect. The same way out as a step.
            raise _StepFailed(exc) from exc
        elapsed = time.perf_counter() - t0
        delivered = False
        now = self.clock.now()
        for turn, audio in zip(turns, audios, strict=True):
            assert turn.row is not None
            if audio is not None:
                if len(audio):
                    # With the chunk, when the next one should come (the start buffer's cue).
                    eta = self.scheduler.next_chunk_eta(turn.row.frames_to_chunk)
                    _out(turn).deliver(audio, now, self._outbox, eta)
                    delivered = True
            if turn.row.finished is not None:
                self._complete(turn)
                delivered = True
        if any(audio is not None for audio in audios):
            self.scheduler.decoded(elapsed)
        return delivered

    # --- turn endings ---------------------------------------------------------------------------

    def _complete(self, turn: Turn) -> None:
        row = _row(turn)
        if row is not None:
            turn.payload.codes = row.codes
        self._close_row(turn)
        with self._cond:
            self.scheduler.remove(turn)
        self.events.turn_ended(turn.payload, "completed")
        _out(turn).end(self._outbox)

    def _fail(self, turn: Turn, exc: BaseException) -> None:
        with self._cond:
            self.scheduler.remove(turn)
        self._close_row(turn)
        listening = not turn.sink.stopping
        self.events.turn_ended(turn.payload, "failed" if listening else "stopped")
        _out(turn).fail(exc, self._outbox)

    def _close_row(self, turn: Turn) -> None:
        row, turn.row = turn.row, None
        if row is None:
            return
        with contextlib.suppress(EngineError):  # the row was lost in a rebuild already
            self.engine.close(row)  # type: ignore[arg-type]

    # --- failures -------------------------------------------------------------------------------

    def _after_failed_step(self, error: BaseException) -> None:
        """Fail the heard turns, rebuild the engine, start the unheard ones over once."""
        log.error("tts core %d: step failed (%s: %s); rebuilding the engine", self.index,
                  type(error).__name__, error, exc_info=error)
        restart: list[Turn] = []
        for turn in list(self.scheduler.running):
            turn.row = None  # the rebuild frees every row
            if turn.sink.stopping:
                continue
            if turn.sink.playing or turn.restarted:
                self._fail(turn, error)
            else:
                restart.append(turn)
        self.scheduler.restart(restart)
        if not self._rebuild():
            for turn in restart:
                self._fail(turn, error)
            return
        self.events.counted(restarted=len(restart))
        for turn in restart:
            self._open(turn)

    def _recover_from_stuck(self) -> None:
        """The work the watchdog gave up on has returned: its turns were failed already."""
        with self._cond:
            turns = list(self.scheduler.running)
            self.scheduler.running.clear()
        for turn in turns:
            turn.row = None
            self.events.turn_ended(turn.payload, "abandoned")
            _out(turn).finish(self._outbox)
        self._outbox.flush()
        if self._rebuild():
            with self._cond:
                self.stuck = False
            self.events.back_in_service(self)

    def _rebuild(self) -> bool:
        self.beat_at = None
        try:
            self.engine.rebuild()
        except Exception:
            log.exception("tts core %d: the engine could not be rebuilt; retiring it",
                          self.index)
            with self._cond:
                self.retired = True
            self.events.retired(self)
            return False
        log.warning("tts core %d: engine rebuilt", self.index)
        self.events.rebuilt(self)
        return True

    def _shutdown(self) -> None:
        for turn in list(self.scheduler.running):
            self._close_row(turn)
            _out(turn).cancel_from_core()
            _out(turn).finish(self._outbox)
        self.scheduler.running.clear()
        for turn in self.scheduler.take_waiting():
            _out(turn).cancel_from_core()
            _out(turn).finish(self._outbox)
        self._outbox.flush()
        self.beat_at = None
        self.engine.claim(None)


class _StepFailed(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error
