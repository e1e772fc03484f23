"""Recognisers that fail on purpose, for tests/unit/asr/test_pool.py and
tests/e2e/test_speech_e2e.py.

They run inside RecognizerPool's worker processes (forked from multiprocessing's fork server),
so they live in an importable module (the workers inherit the test run's sys.path) and are
built from picklable factories.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from gateway.asr.base import MatchStatus, RecognitionResult, UnknownWord
from gateway.asr.grammar import SpeechGrammar
from gateway.errors import RecognizerError


class _Base:
    name = "fake"
    languages = frozenset({"en"})

    def unknown_words(self, phrases: Iterable[str]) -> list[UnknownWord]:
        return []

    def prepare(self, grammar: SpeechGrammar) -> None:
        return None


class Echo(_Base):
    """Answers at once: MATCH on the first branch; the digits field carries the sample count."""

    def recognize(self, pcm: npt.NDArray[np.int16], grammar: SpeechGrammar) -> RecognitionResult:
        return RecognitionResult(MatchStatus.MATCH, branch=grammar.branches[0][0],
                                 digits=str(len(pcm)), audio_s=len(pcm) / 8000)


DIE, RAISE, WEDGE = 1, 2, 3
"""Sample values that make :class:`Flaky` fail: audio made only of one of them."""


class Flaky(Echo):
    """Fails on cue, as real decoders do: constant audio of DIE kills the worker process (as a
    segfault or the OOM killer would), RAISE raises RecognizerError, WEDGE never answers."""

    def recognize(self, pcm: npt.NDArray[np.int16], grammar: SpeechGrammar) -> RecognitionResult:
        cue = int(pcm[0]) if len(pcm) and not (pcm - pcm[0]).any() else 0
        if cue == DIE:
            os._exit(70)
        if cue == RAISE:
            raise RecognizerError("decoder failed on this turn")
        if cue == WEDGE:
            threading.Event().wait(60)
        return super().recognize(pcm, grammar)


class Whereabouts(Echo):
    """Says where its worker came from: the name is ``"<parent pid> <modules>"``, the modules
    being which of the gateway process's heavy ones the worker holds."""

    def __init__(self) -> None:
        heavy = [name for name in ("torch", "transformers", "fastapi") if name in sys.modules]
        self.name = f"{os.getppid()} {','.join(heavy) or '-'}"


def cannot_load() -> Echo:
    raise RuntimeError("no model here")


class Broken(_Base):
    """Fails every turn, as a decoder whose model went bad would (tests/e2e/test_speech_e2e.py)."""

    def recognize(self, pcm: npt.NDArray[np.int16], grammar: SpeechGrammar) -> RecognitionResult:
        raise RecognizerError("the decoder failed on this turn")
