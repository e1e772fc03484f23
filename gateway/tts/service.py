"""Runs engine generations on worker threads and streams their chunks into asyncio.

One worker thread per engine slot (an engine instance serves one request at a time). The
asyncio side never blocks on the model: it awaits chunks handed over with
``loop.call_soon_threadsafe``. Cancelling a stream (hang-up, barge-in) sets a flag the worker
checks between chunks; the worker then closes the engine's generator, which stops generation at
the next chunk boundary and frees the slot.

Jobs are taken in submission order here; the urgency-first scheduler (a turn still waiting for
its first audio goes first) replaces :meth:`SpeechService._next_job` in the streaming-engine
work without changing this interface.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from gateway.errors import EngineError
from gateway.tts.engine import Engine, SpeechRequest

log = logging.getLogger(__name__)

_END = object()


@dataclass
class ServiceStats:
    """Counters the tests and ``/metrics`` read."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    #: Seconds from ``cancel()`` to the slot being free, one entry per cancelled generation.
    cancel_to_free_s: list[float] = field(default_factory=list)


class SpeechStream:
    """Async iterator over one request's 24 kHz float32 chunks.

    ``cancel()`` (or ``aclose()``) stops the generation between chunks; iteration then ends.
    Errors raised by the engine surface here as :class:`~gateway.errors.EngineError`.
    """

    def __init__(self, request: SpeechRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None
        self.first_chunk_at: float | None = None
        self._loop = loop
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._cancel = threading.Event()
        self._cancelled_at: float | None = None
        self.finished = asyncio.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop generating at the next chunk boundary (idempotent, never blocks)."""
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

    def _put(self, item: object) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _finish(self) -> None:
        self._loop.call_soon_threadsafe(self.finished.set)


class SpeechService:
    """Owns the engine slots and their worker threads."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ValueError("at least one engine slot is required")
        self.engines = list(engines)
        self.stats = ServiceStats()
        self._jobs: queue.Queue[tuple[int, SpeechStream] | None] = queue.Queue()
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._busy = 0
        self._lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        """The first slot's engine (for validation and metadata)."""
        return self.engines[0]

    @property
    def busy_slots(self) -> int:
        return self._busy

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def start(self) -> None:
        """Start one worker thread per engine slot."""
        for index, engine in enumerate(self.engines):
            thread = threading.Thread(
                target=self._worker, args=(engine,), name=f"tts-slot-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every worker to exit once its current chunk is done, and wait for them."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()

    def stream(self, request: SpeechRequest) -> SpeechStream:
        """Queue ``request``; iterate the returned stream for its chunks (call from asyncio)."""
        try:
            self.engine.validate(request)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        stream = SpeechStream(request, asyncio.get_running_loop())
        self._jobs.put((next(self._seq), stream))
        return stream

    def _worker(self, engine: Engine) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            _, stream = job
            if stream.cancelled:
                stream._finish()
                continue
            with self._lock:
                self._busy += 1
            try:
                self._run(engine, stream)
            finally:
                with self._lock:
                    self._busy -= 1
                stream._finish()

    def _run(self, engine: Engine, stream: SpeechStream) -> None:
        self.stats.started += 1
        stream.started_at = time.monotonic()
        generator = None
        try:
            generator = engine.stream(stream.request)
            for chunk in generator:
                if stream.cancelled:
                    break
                if stream.first_chunk_at is None:
                    stream.first_chunk_at = time.monotonic()
                stream._put(chunk)
                if stream.cancelled:
                    break
        except Exception as exc:
            self.stats.failed += 1
            log.exception("generation failed for %r", stream.request.text[:60])
            stream._put(exc)
            return
        finally:
            if generator is not None:
                generator.close()
        if stream.cancelled:
            self.stats.cancelled += 1
            if stream._cancelled_at is not None:
                self.stats.cancel_to_free_s.append(time.monotonic() - stream._cancelled_at)
        else:
            self.stats.completed += 1
            stream._put(_END)
