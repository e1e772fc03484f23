"""Recognition off the event loop: recognisers in worker processes, one speech listener per turn.

Why processes and not a thread pool: PocketSphinx (like most C decoders wrapped for Python)
holds the GIL for the whole of a decode; measured, a 0.3 s decode stalled another Python thread
for 0.19 s, which in the gateway would stall every call's 20 ms audio pacing. Worker processes
also make a decoder crash an exception for one turn instead of the end of the gateway.

* :class:`RecognizerPool` owns ``workers`` processes, each holding one recogniser built by a
  picklable factory. They are forked from multiprocessing's fork server (``forkserver``), never
  from the gateway itself (it runs an event loop and torch threads): a clean interpreter that
  has imported the recogniser once. A pool's first start pays that import (~1.3 CPU-s with
  scipy); later workers of the process (a restart after a crash or a timeout, another pool)
  only build their decoder. ``spawn`` re-imported it in every worker.
  ``await pool.recognize(pcm, grammar)`` sends one turn's audio (16 KiB per second of speech)
  to a free worker and returns its :class:`~gateway.asr.base.RecognitionResult`.
  Failures are :class:`~gateway.errors.RecognizerError`\\ s the IVR turns into "fall back to
  keys with a logged reason": a dead worker (the pool is rebuilt for the next turn), no answer
  within ``timeout_s``, or more turns waiting than ``max_pending`` (overload sheds speech, not
  calls).
* :class:`SpeechListener` is the per-turn, sans-I/O part the call feeds frame by frame while a
  speech gather listens. ``feed`` only appends bytes (cheap enough for the 20 ms path); the
  VAD's speech start (:meth:`SpeechListener.speech_started`) marks where the turn begins, with a
  pre-roll because the VAD fires ~250 ms into the speech; ``await finish()`` recognises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import multiprocessing
import multiprocessing.context
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from gateway.asr.base import RATE, Encoding, MatchStatus, RecognitionResult, Recognizer, to_pcm16
from gateway.asr.grammar import SpeechGrammar
from gateway.errors import RecognizerError, RecognizerTimeout, RecognizerUnavailable

__all__ = ["RecognizerFactory", "RecognizerPool", "SpeechListener"]

log = logging.getLogger(__name__)

RecognizerFactory = Callable[[], Recognizer]
"""Builds the recogniser inside a worker; must be picklable (a class or functools.partial)."""

PRE_ROLL_S: Final[float] = 0.5
"""Audio kept from before the VAD's speech start: it fires once 250 ms of speech were heard
(``SpeechStartDetector(min_speech_ms=250)``) plus up to one 32 ms window, so the first word
began ~0.3 s earlier; a little more keeps a soft onset."""

MAX_SPEECH_S: Final[float] = 15.0
"""Default cap on one turn's speech: menu answers and digit strings take a few seconds."""

_worker: Recognizer | None = None


def _init_worker(factory: RecognizerFactory) -> None:
    global _worker
    _worker = factory()


def _worker_ready() -> str:
    if _worker is None:
        raise RecognizerUnavailable("the recogniser worker did not initialise")
    return _worker.name


def _worker_recognize(pcm: bytes, grammar: SpeechGrammar) -> RecognitionResult:
    if _worker is None:
        raise RecognizerUnavailable("the recogniser worker did not initialise")
    return _worker.recognize(np.frombuffer(pcm, dtype=np.int16), grammar)


def _worker_prepare(grammar: SpeechGrammar) -> None:
    if _worker is None:
        raise RecognizerUnavailable("the recogniser worker did not initialise")
    _worker.prepare(grammar)


class RecognizerPool:
    """Recognisers in worker processes, awaited from the event loop (see the module docstring)."""

    def __init__(
        self,
        factory: RecognizerFactory,
        *,
        workers: int = 1,
        timeout_s: float = 5.0,
        max_pending: int | None = None,
    ) -> None:
        """``max_pending`` defaults to 4 turns per worker (waiting or running)."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._factory = factory
        self._workers = workers
        self._timeout = timeout_s
        self._max_pending = max_pending if max_pending is not None else 4 * workers
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._pending = 0
        self._closed = False
        self._restart: asyncio.Future[None] | None = None
        #: The recogniser's name as its workers report it (set by :meth:`start`).
        self.name = ""

    @property
    def workers(self) -> int:
        """Number of worker processes."""
        return self._workers

    @property
    def pending(self) -> int:
        """Turns submitted and not yet answered."""
        return self._pending

    @property
    def running(self) -> bool:
        """True while workers are up to take turns (False: starting, restarting, closed)."""
        return self._executor is not None and not self._closed

    def _new_executor(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=self._workers,
            mp_context=_context(self._factory),
            initializer=_init_worker,
            initargs=(self._factory,),
        )

    async def start(self) -> None:
        """Start the workers and wait until each has loaded its recogniser (~1-2 s each).

        Raises :class:`RecognizerUnavailable` when a worker cannot load one (e.g. pocketsphinx
        is not installed): speech gathers then fall back to keys.
        """
        if self._closed:
            raise RecognizerUnavailable("the recogniser pool is closed")
        if self._executor is not None:
            return
        executor = self._new_executor()
        loop = asyncio.get_running_loop()
        try:
            names = await asyncio.gather(*(loop.run_in_executor(executor, _worker_ready)
                                           for _ in range(self._workers)))
        except BrokenProcessPool as exc:
            _kill(executor, wait=False)
            raise RecognizerUnavailable(f"a recogniser worker failed to start: {exc}") from exc
        if self._closed:
            _kill(executor, wait=False)
            raise RecognizerUnavailable("the recogniser pool is closed")
        self.name = names[0]
        # Published only once every worker is ready: no turn ever waits for a process start.
        self._executor = executor

    async def ready(self) -> None:
        """Wait for a restart after a failure to finish (returns at once when running).

        Raises :class:`RecognizerUnavailable` if the restart failed.
        """
        restart = self._restart
        if restart is not None:
            await asyncio.shield(restart)
        if self._executor is None:
            raise RecognizerUnavailable("the recogniser is not running (see the log for why)")

    def _replace(self, executor: concurrent.futures.ProcessPoolExecutor) -> None:
        """Kill ``executor`` and start a fresh one in the background, once per failure."""
        if self._executor is not executor:
            return  # another turn on the same executor already did
        self._executor = None
        # No waiting here (this runs on the event loop): the executor's own thread reaps.
        _kill(executor, wait=False)
        if not self._closed:
            self._restart = asyncio.ensure_future(self._restart_quietly())

    async def _restart_quietly(self) -> None:
        try:
            await self.start()
        except RecognizerUnavailable as exc:
            # Speech gathers keep falling back to keys; nothing awaits this task, so log here.
            log.error("recogniser pool could not restart: %s", exc)

    async def _submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._closed:
            raise RecognizerUnavailable("the recogniser pool is closed")
        executor = self._executor
        if executor is None:
            raise RecognizerUnavailable("the recogniser is not running (starting or restarting)")
        if self._pending >= self._max_pending:
            raise RecognizerUnavailable(f"{self._pending} turns already waiting for "
                                        f"{self._workers} recogniser worker(s)")
        self._pending += 1
        try:
            future = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
            return await asyncio.wait_for(future, self._timeout)
        except TimeoutError as exc:
            # The worker may be wedged, and a process cannot be interrupted mid-decode: replace
            # the workers (turns in flight on them fail and fall back to keys too).
            log.warning("recogniser timed out after %g s; restarting its workers", self._timeout)
            self._replace(executor)
            raise RecognizerTimeout(f"no recognition result within {self._timeout:g} s") from exc
        except BrokenProcessPool as exc:
            # A worker died (crash, OOM kill): every turn on this executor fails.
            log.warning("recogniser worker died; restarting its workers: %s", exc)
            self._replace(executor)
            raise RecognizerUnavailable(f"the recogniser worker died: {exc}") from exc
        finally:
            self._pending -= 1

    async def recognize(
        self, pcm: npt.NDArray[np.int16], grammar: SpeechGrammar
    ) -> RecognitionResult:
        """Recognise one turn of 8 kHz int16 audio in a worker; RecognizerError on failure."""
        result: RecognitionResult = await self._submit(
            _worker_recognize, np.ascontiguousarray(pcm, dtype=np.int16).tobytes(), grammar
        )
        return result

    async def prepare(self, grammar: SpeechGrammar) -> None:
        """Check and compile ``grammar`` in one worker (others compile it on first use)."""
        await self._submit(_worker_prepare, grammar)

    def listener(
        self,
        grammar: SpeechGrammar,
        *,
        encoding: Encoding = "pcmu",
        max_speech_s: float = MAX_SPEECH_S,
        vad_gated: bool = True,
    ) -> SpeechListener:
        """A speech listener for one turn (see :class:`SpeechListener`)."""
        return SpeechListener(self.recognize, grammar, encoding=encoding,
                              max_speech_s=max_speech_s, vad_gated=vad_gated)

    async def close(self) -> None:
        """Stop the workers (turns in flight fail with RecognizerUnavailable)."""
        self._closed = True
        if self._restart is not None and not self._restart.done():
            self._restart.cancel()
        executor, self._executor = self._executor, None
        if executor is not None:
            # Workers hold no state worth a graceful goodbye, and one may be wedged in a decode.
            await asyncio.get_running_loop().run_in_executor(None, _kill, executor)


def _context(factory: RecognizerFactory) -> multiprocessing.context.BaseContext:
    """Where workers come from: the fork server, with this module and the factory's preloaded.

    The preload takes effect when the process's fork server starts (its first pool); it is the
    same for every pool of the gateway (its one recogniser). ``spawn`` where there is no fork
    server (Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    target = factory.func if isinstance(factory, functools.partial) else factory
    modules = [__name__, getattr(target, "__module__", None) or __name__]
    context.set_forkserver_preload(list(dict.fromkeys(modules)))
    return context


def _kill(executor: concurrent.futures.ProcessPoolExecutor, wait: bool = True) -> None:
    """Stop ``executor`` now, even with a worker stuck in C code.

    ``ProcessPoolExecutor`` has no public way to do this before Python 3.14
    (``terminate_workers``), so this kills the processes it lists in ``_processes``.
    """
    procs: dict[int, Any] = dict(getattr(executor, "_processes", None) or {})
    for proc in procs.values():
        if proc.is_alive():
            proc.kill()
    executor.shutdown(wait=wait, cancel_futures=True)


class SpeechListener:
    """One caller turn's audio while a speech gather listens; sans-I/O until it recognises.

    It is the :class:`~gateway.call.session.InboundListener` a call feeds while the gather
    listens (:meth:`Call.listen <gateway.call.session.Call.listen>`): every inbound frame, and
    the detector's speech start, pauses and resumes, in step with the audio. Not thread-safe:
    feed it from the call's task. With ``vad_gated`` (the default) it keeps only the last
    :data:`PRE_ROLL_S` of audio until :meth:`speech_started`, then up to ``max_speech_s`` more;
    without, it keeps everything from the first frame, up to the cap.

    :meth:`recognize` recognises what was heard so far (a speech gather does at each pause, to
    know whether the caller said something complete); :meth:`finish` does it one last time.
    """

    __slots__ = ("_bps", "_buf", "_encoding", "_finished", "_grammar", "_limit", "_pre_roll",
                 "_recognize", "_started", "dropped_s", "paused_at", "pauses", "started_at")

    def __init__(
        self,
        recognize: Callable[[npt.NDArray[np.int16], SpeechGrammar], Any],
        grammar: SpeechGrammar,
        *,
        encoding: Encoding = "pcmu",
        max_speech_s: float = MAX_SPEECH_S,
        vad_gated: bool = True,
        pre_roll_s: float = PRE_ROLL_S,
    ) -> None:
        """``recognize`` is an async callable such as :meth:`RecognizerPool.recognize`."""
        if encoding not in ("pcmu", "pcma", "l16"):
            raise ValueError(f"unknown audio encoding {encoding!r}; use pcmu, pcma or l16")
        if max_speech_s <= 0:
            raise ValueError(f"max_speech_s must be > 0, got {max_speech_s}")
        self._recognize = recognize
        self._grammar = grammar
        self._encoding: Encoding = encoding
        self._bps = 2 if encoding == "l16" else 1
        self._pre_roll = round(pre_roll_s * RATE) * self._bps
        # Bytes held at most once speech started: the pre-roll (when gated) plus the cap.
        self._limit = round(max_speech_s * RATE) * self._bps + (self._pre_roll if vad_gated
                                                                 else 0)
        self._started = not vad_gated
        self._finished = False
        self._buf = bytearray()
        #: Seconds of audio dropped at the front (before the pre-roll) or past the cap.
        self.dropped_s = 0.0
        #: When speech started (the call's clock; None before, or without VAD gating).
        self.started_at: float | None = None
        #: When the caller's current pause began (None while they speak, or before speech).
        self.paused_at: float | None = None
        #: Pauses so far: a result recognised during pause ``n`` is current while this is n.
        self.pauses = 0

    @property
    def grammar(self) -> SpeechGrammar:
        """What this turn listens for."""
        return self._grammar

    @property
    def speech(self) -> bool:
        """True once speech started (always, without VAD gating)."""
        return self._started

    @property
    def full(self) -> bool:
        """True when the turn reached ``max_speech_s``: end it now (the issue's length cap)."""
        return self._started and len(self._buf) >= self._limit

    @property
    def audio_s(self) -> float:
        """Seconds of audio held for recognition."""
        return len(self._buf) / self._bps / RATE

    def feed(self, frame: bytes | bytearray | memoryview) -> bool:
        """Append inbound audio (one 20 ms frame, or any length). False once :attr:`full`.

        After :meth:`finish` it is a no-op: the call's frame path must never fail because a
        gather stopped listening a frame late.
        """
        if self._finished:
            return False
        buf = self._buf
        if not self._started:
            buf += frame
            excess = len(buf) - self._pre_roll
            if excess > 0:
                del buf[:excess]
                self.dropped_s += excess / self._bps / RATE
            return True
        room = self._limit - len(buf)
        if len(frame) > room:
            self.dropped_s += (len(frame) - max(room, 0)) / self._bps / RATE
            frame = frame[: max(room, 0)]
        buf += frame
        return len(buf) < self._limit

    def speech_started(self, at: float | None = None) -> None:
        """The VAD heard speech start (again: the caller resumed after a long pause): keep the
        pre-roll and everything that follows."""
        self._started = True
        if self.started_at is None:
            self.started_at = at
        self.paused_at = None

    def speech_paused(self, at: float) -> None:
        """The caller stopped speaking at ``at`` (maybe only for a breath)."""
        if self._started:
            self.paused_at = at
            self.pauses += 1

    def speech_resumed(self, at: float) -> None:
        """The caller is speaking again after a pause."""
        self.paused_at = None

    def audio(self) -> npt.NDArray[np.int16]:
        """The turn's audio so far as 8 kHz int16 (RecognizerError for malformed l16)."""
        try:
            return to_pcm16(bytes(self._buf), self._encoding)
        except ValueError as exc:
            raise RecognizerError(f"bad audio for recognition: {exc}") from exc

    async def recognize(self) -> RecognitionResult:
        """Recognise the audio so far (off the loop); the listener keeps listening.

        NO_SPEECH without decoding if speech never started; RecognizerError on failure.
        """
        if not self._started:
            return RecognitionResult(MatchStatus.NO_SPEECH, reason="the caller did not speak")
        result: RecognitionResult = await self._recognize(self.audio(), self._grammar)
        return result

    async def finish(self) -> RecognitionResult:
        """Stop listening and recognise the whole turn (off the loop).

        NO_SPEECH without decoding if speech never started; raises :class:`RecognizerError`
        when recognition fails; call it once.
        """
        if self._finished:
            raise RuntimeError("this speech listener has finished")
        self._finished = True
        if not self._started:
            self._buf = bytearray()
            return RecognitionResult(MatchStatus.NO_SPEECH, reason="the caller did not speak")
        pcm = self.audio()
        self._buf = bytearray()
        result: RecognitionResult = await self._recognize(pcm, self._grammar)
        return result

    def close(self) -> None:
        """Stop listening without recognising (keys won, the call ended)."""
        self._finished = True
        self._buf = bytearray()
