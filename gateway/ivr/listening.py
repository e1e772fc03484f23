"""One caller turn of a speech gather: when it is over, and what the caller said.

A gather listens from the moment its prompt starts (so speech barges in as keys do) until it
decides. The decision follows VoiceXML 2.0's two end-of-speech timeouts (section 6.3.2,
``completetimeout`` / ``incompletetimeout``): the caller's turn is over once they have been
silent for ``complete_timeout`` after saying something complete (a menu phrase, all the
digits), or for ``incomplete_timeout`` after anything else (so a caller pausing between digit
groups keeps the turn, and an out-of-menu sentence still gets its answer). Whether what was said
is complete is only known by recognising it, so each pause is recognised as it begins, off the
event loop, while the caller may still go on: by the time ``complete_timeout`` has passed the
answer is usually ready, and the branch's first audio follows the end of speech by little more
than that timeout. A pause the caller talks through makes that recognition stale; the next
pause is recognised again (one recognition in flight per turn, so a caller who keeps pausing
costs one decode at a time). ``max_speech`` caps a turn: what was said by then is recognised and
decided on.

The turn is measured from the end of the caller's speech, as the detector heard it
(:attr:`SpeechDecision.ended_at`): first-audio latency and the decision time count from there.

:class:`SpeechTurn` is the state machine; the IVR runner feeds it the clock and waits for what
it says (:meth:`SpeechTurn.deadline`, :attr:`SpeechTurn.pending`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from gateway.asr.base import Encoding, RecognitionResult
from gateway.asr.grammar import SpeechGrammar
from gateway.asr.pool import SpeechListener

__all__ = ["SpeechDecision", "SpeechInput", "SpeechTurn"]


class SpeechInput(Protocol):
    """Where a gather's turns are recognised (:class:`gateway.asr.pool.RecognizerPool`)."""

    @property
    def running(self) -> bool:
        """False while the recogniser is down (starting, restarting, closed): keys only."""
        ...

    def listener(self, grammar: SpeechGrammar, *, encoding: Encoding = "pcmu",
                 max_speech_s: float = ...) -> SpeechListener:
        """A speech listener for one turn."""
        ...


@dataclass(frozen=True)
class SpeechDecision:
    """How a caller's spoken turn ended."""

    result: RecognitionResult
    #: When the caller stopped speaking (the call's clock): the turn's time.
    ended_at: float
    #: When the gather decided (``decided_at - ended_at`` is what the caller waited).
    decided_at: float
    #: Recognitions run for this turn (one per pause that got one, plus the last).
    recognitions: int
    #: True when the turn hit ``max_speech`` while the caller was still speaking.
    capped: bool = False


_CAPPED = -1
"""The key of the recognition that hears a turn cut off at ``max_speech`` (pauses are 1, 2...)."""


class SpeechTurn:
    """The end-of-turn state machine over one :class:`SpeechListener` (module docstring).

    Call :meth:`poll` whenever something may have changed (an event, a recognition done, a
    deadline passed); it returns the decision once there is one. Recognition failures
    (:class:`~gateway.errors.RecognizerError`) come out of :meth:`poll`.
    """

    def __init__(self, listener: SpeechListener, *, complete_s: float, incomplete_s: float,
                 max_speech_s: float) -> None:
        self.listener = listener
        self.complete_s = complete_s
        self.incomplete_s = incomplete_s
        self.max_speech_s = max_speech_s
        #: The recognition in flight, if any (the runner wakes up when it is done).
        self.pending: asyncio.Task[RecognitionResult] | None = None
        self._pending_key = 0
        self._result: RecognitionResult | None = None
        self._result_key = 0
        #: Recognitions started for this turn.
        self.recognitions = 0

    @property
    def speaking(self) -> bool:
        """True once the caller started speaking in this turn."""
        return self.listener.speech

    def deadline(self, now: float) -> float | None:
        """When :meth:`poll` may next decide with no event (None: only an event or the pending
        recognition can move the turn on). Ask after :meth:`poll`, which takes in a finished
        recognition."""
        s = self.listener
        if not s.speech or s.started_at is None:
            return None
        cap = s.started_at + self.max_speech_s
        if now >= cap:
            return None
        if s.paused_at is None:
            return cap
        result = self._current(s.pauses)
        if result is None:
            return cap
        return min(cap, s.paused_at + (self.complete_s if result.matched else self.incomplete_s))

    def poll(self, now: float) -> SpeechDecision | None:
        """The turn's decision at ``now``, or None to keep listening (see the class doc)."""
        self._collect()
        s = self.listener
        if not s.speech or s.started_at is None:
            return None
        cap = s.started_at + self.max_speech_s
        capped = now >= cap
        if s.paused_at is None and not capped:
            return None
        # The result must have heard everything up to this pause (or, cut off while speaking,
        # everything up to the cap).
        key = s.pauses if s.paused_at is not None else _CAPPED
        result = self._current(key)
        if result is None:
            if self.pending is None or (capped and self._pending_key != key):
                self._recognize(key)
            return None
        ended = s.paused_at if s.paused_at is not None else cap
        if capped:
            return SpeechDecision(result, ended, now, self.recognitions, capped=True)
        # The same sum as :meth:`deadline`'s: at that deadline this decides (no float slack).
        if now >= ended + (self.complete_s if result.matched else self.incomplete_s):
            return SpeechDecision(result, ended, now, self.recognitions)
        return None

    def close(self) -> None:
        """Stop listening (a decision was made, keys won, or the call ended)."""
        self.listener.close()
        self._drop_pending()

    # --- internals -----------------------------------------------------------------------

    def _current(self, key: int) -> RecognitionResult | None:
        return self._result if self._result is not None and self._result_key == key else None

    def _recognize(self, key: int) -> None:
        self._drop_pending()
        self.recognitions += 1
        self._pending_key = key
        self.pending = asyncio.ensure_future(self.listener.recognize())

    def _drop_pending(self) -> None:
        task, self.pending = self.pending, None
        if task is None:
            return
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: a stale failure is not "never retrieved"
        else:
            # The worker finishes the decode regardless; nobody waits for it.
            task.cancel()

    def _collect(self) -> None:
        """Take the pending recognition's result once it is done (re-raising its failure)."""
        task = self.pending
        if task is None or not task.done():
            return
        self.pending = None
        result = task.result()  # RecognizerError propagates: the gather falls back to keys
        self._result, self._result_key = result, self._pending_key
        s = self.listener
        if s.paused_at is not None and self._pending_key not in (s.pauses, _CAPPED):
            # The caller spoke on and paused again while it ran: recognise the newer pause.
            self._recognize(s.pauses)
