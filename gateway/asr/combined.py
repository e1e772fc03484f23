"""PocketSphinx first, Whisper when it does not match: a menu gather's two passes.

Measured on ``bench/asr.py``'s held-out half (bench/RESULTS.md): PocketSphinx routed 76.4 % of
the in-menu phrases and Whisper tiny.en 77.2 %, but mostly different ones; taking
PocketSphinx's match when it has one and asking Whisper otherwise routed 89.0 % at 1.6 % false
accepts, with 42 % of turns paying for both passes. Digit strings and free-form turns go to
Whisper alone: PocketSphinx took a wrong six-digit string for 38.7 % of them, Whisper 1.2 %
(reading back the ones it is unsure of). Both recognisers live in the same worker process.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.asr.base import RecognitionResult, UnknownWord
from gateway.asr.grammar import SpeechGrammar
from gateway.asr.sphinx import LANGUAGES as SPHINX_LANGUAGES
from gateway.asr.sphinx import PocketSphinxRecognizer
from gateway.asr.whisper import DEFAULT_MODEL, WhisperRecognizer

__all__ = ["CombinedRecognizer"]


class CombinedRecognizer:
    """PocketSphinx's match when it has one, else Whisper's (see the module docstring)."""

    def __init__(self, model: str = DEFAULT_MODEL, **whisper: Any) -> None:
        """``model`` and ``whisper``: :class:`WhisperRecognizer`'s arguments."""
        self._whisper = WhisperRecognizer(model, **whisper)
        self._sphinx = PocketSphinxRecognizer()
        self._name = f"{self._sphinx.name}+{self._whisper.name}"

    @property
    def name(self) -> str:
        """``pocketsphinx-<version>/en-us+whisper-<model>/<compute type>``."""
        return self._name

    @property
    def languages(self) -> frozenset[str]:
        """Whisper's (PocketSphinx only helps with its own, English)."""
        return self._whisper.languages

    def unknown_words(self, phrases: Iterable[str]) -> list[UnknownWord]:
        """None: Whisper takes the phrases PocketSphinx's dictionary lacks."""
        return []

    def _first_pass(self, grammar: SpeechGrammar) -> bool:
        return (grammar.digits is None and not grammar.transcribe
                and grammar.language in SPHINX_LANGUAGES
                and not self._sphinx.unknown_words(p for _, ps in grammar.branches for p in ps))

    def prepare(self, grammar: SpeechGrammar) -> None:
        """Compile ``grammar`` for both passes."""
        self._whisper.prepare(grammar)
        if self._first_pass(grammar):
            self._sphinx.prepare(grammar)

    def recognize(self, pcm: npt.NDArray[np.int16], grammar: SpeechGrammar) -> RecognitionResult:
        """See :class:`gateway.asr.base.Recognizer`; ``cpu_s`` counts both passes."""
        if not self._first_pass(grammar):
            return self._whisper.recognize(pcm, grammar)
        first = self._sphinx.recognize(pcm, grammar)
        if first.matched:
            return first
        second = self._whisper.recognize(pcm, grammar)
        return replace(second, cpu_s=second.cpu_s + first.cpu_s,
                       recognizer=f"{first.recognizer}+{second.recognizer}")
