"""The recogniser interface: 8 kHz caller audio and a grammar in, one result out.

A :class:`Recognizer` is synchronous CPU work on one whole caller turn (the audio between the
VAD's speech start and end, plus a little margin). It never runs on the event loop: the
gateway drives it through :class:`gateway.asr.pool.RecognizerPool`, which runs recognisers in
worker processes (a decoder such as PocketSphinx holds the GIL for the whole of a decode, so a
thread pool would stall every call's 20 ms audio pacing; measured in ``gateway.asr.sphinx``).

Implementations: :class:`gateway.asr.sphinx.PocketSphinxRecognizer` (built in, English, no
download) and :class:`gateway.asr.whisper.WhisperRecognizer` (faster-whisper on CTranslate2,
a model directory or hub id). Others (Vosk, a cloud service) implement the same protocol.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from gateway.asr.grammar import SpeechGrammar
from gateway.audio.g711 import alaw_decode, ulaw_decode

__all__ = [
    "RATE",
    "Encoding",
    "MatchStatus",
    "RecognitionResult",
    "Recognizer",
    "UnknownWord",
    "Vocabulary",
    "Word",
    "to_pcm16",
]

RATE = 8000
"""Every recogniser takes telephone audio: 8 kHz, mono."""

Encoding = Literal["pcmu", "pcma", "l16"]
"""How inbound audio arrives: G.711 mu-law (Twilio, SIP PCMU), A-law (SIP PCMA), or int16 PCM
(native byte order)."""


def to_pcm16(data: bytes | bytearray | memoryview, encoding: Encoding) -> npt.NDArray[np.int16]:
    """Decode inbound audio bytes to int16 PCM at 8 kHz."""
    if encoding == "pcmu":
        return ulaw_decode(data)
    if encoding == "pcma":
        return alaw_decode(data)
    if encoding == "l16":
        if len(data) % 2:
            raise ValueError("l16 audio must be a whole number of 16-bit samples")
        return np.frombuffer(data, dtype=np.int16).copy()
    raise ValueError(f"unknown audio encoding {encoding!r}; use pcmu, pcma or l16")


class MatchStatus(enum.Enum):
    """How a turn ended. ``NO_MATCH`` and ``NO_SPEECH`` are results, not errors."""

    MATCH = "match"
    """The caller said a phrase of the grammar (``branch``/``phrase``) or its digit string."""
    NO_MATCH = "no_match"
    """The caller spoke, but not something the grammar accepts (``reason`` says why)."""
    NO_SPEECH = "no_speech"
    """The audio holds no speech the recogniser could find."""


@dataclass(frozen=True)
class Word:
    """One word of a transcript, where it is in the turn's audio (seconds), and how sure the
    recogniser is of it (0..1; the mean of its tokens' probabilities for Whisper)."""

    text: str
    start_s: float
    end_s: float
    probability: float


@dataclass(frozen=True)
class RecognitionResult:
    """The outcome of one caller turn.

    Times are seconds from the first sample given to the recogniser. ``cpu_s`` is the CPU time
    the recognition took (thread CPU time inside the worker), the figure that sizes a gateway.
    """

    status: MatchStatus
    #: The branch whose phrase was said (None for digits or no match).
    branch: str | None = None
    #: The grammar's phrase as the author wrote it ("Representative"), None unless a phrase.
    phrase: str | None = None
    #: The digit string said in digits mode ("417029"), None otherwise.
    digits: str | None = None
    #: Words the recogniser heard (its open-vocabulary pass), for call traces and logs.
    transcript: str = ""
    #: 0..1: how sure the recogniser is of ``MATCH`` (for no match: of its best guess).
    confidence: float = 0.0
    #: Why there was no match, in plain words (None on a match).
    reason: str | None = None
    #: Where the recognised speech starts and ends within the audio (None without speech).
    speech_start_s: float | None = None
    speech_end_s: float | None = None
    #: Length of the audio that was recognised.
    audio_s: float = 0.0
    #: CPU seconds the recognition took.
    cpu_s: float = 0.0
    #: Which recogniser produced this ("pocketsphinx-5.1.1/en-us").
    recognizer: str = ""
    #: The transcript's words with their timings, where the recogniser gives them (Whisper).
    words: tuple[Word, ...] = ()
    #: A MATCH the recogniser is not sure of (a digit string): read it back to the caller and
    #: use it only once they confirm it.
    confirm: bool = False

    @property
    def matched(self) -> bool:
        """True when the turn chose a branch or filled the digit string."""
        return self.status is MatchStatus.MATCH


@dataclass(frozen=True)
class UnknownWord:
    """A phrase word the recogniser cannot recognise, and where it is in the phrase text."""

    phrase: str
    word: str
    #: 0-based character offset of the word in ``phrase``.
    offset: int
    #: A hint for the author ("spell numbers out"), or "".
    hint: str = ""

    def __str__(self) -> str:
        hint = f" ({self.hint})" if self.hint else ""
        return f'"{self.word}" is not in the recogniser\'s dictionary{hint}'


class Vocabulary(Protocol):
    """What script validation asks of a recogniser, without loading its decoder."""

    @property
    def languages(self) -> frozenset[str]:
        """Primary language subtags it recognises (``{"en"}``)."""
        ...

    def unknown_words(self, phrases: Iterable[str]) -> list[UnknownWord]:
        """Words of ``phrases`` it cannot recognise (empty when all are known)."""
        ...


@runtime_checkable
class Recognizer(Protocol):
    """A speech recogniser for one process: synchronous, not thread-safe, one turn at a time."""

    @property
    def name(self) -> str:
        """Short id for results, logs and metrics ("pocketsphinx-5.1.1/en-us")."""
        ...

    @property
    def languages(self) -> frozenset[str]:
        """Primary language subtags it recognises (``{"en"}``)."""
        ...

    def unknown_words(self, phrases: Iterable[str]) -> list[UnknownWord]:
        """Words of ``phrases`` it cannot recognise (empty when all are known)."""
        ...

    def prepare(self, grammar: SpeechGrammar) -> None:
        """Compile ``grammar`` ahead of the first turn that uses it (raises GrammarError)."""
        ...

    def recognize(self, pcm: npt.NDArray[np.int16], grammar: SpeechGrammar) -> RecognitionResult:
        """Recognise one turn of 8 kHz int16 audio against ``grammar``.

        Raises :class:`~gateway.errors.GrammarError` for a grammar it cannot use and
        :class:`~gateway.errors.RecognizerError` when recognition itself fails.
        """
        ...
