"""The TTS engine interface every implementation streams through.

An :class:`Engine` turns a :class:`SpeechRequest` into an iterator of 24 kHz float32 chunks.
Iteration is pull-based: no work happens between ``next()`` calls, and ``close()`` on the
iterator (it is a generator) stops the generation *between chunks* and leaves the engine
reusable. Engines are synchronous and not thread-safe: one engine instance serves one request at
a time (faster-qwen3-tts holds one static KV cache per instance); the scheduler in
:mod:`gateway.tts.service` owns the threads and decides who runs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Qwen3-TTS output rate (the 12 Hz codec decodes 1920 samples per 80 ms frame).
SAMPLE_RATE = 24_000
#: Samples per codec frame at 24 kHz.
SAMPLES_PER_FRAME = 1920


@dataclass(frozen=True, slots=True)
class VoicePrompt:
    """A registered cloned voice, ready for a Base model: the stored clone prompt and the
    transcript of its reference clip (see :mod:`gateway.ivr.voices`)."""

    name: str
    identity: str
    prompt: dict[str, Any] = field(compare=False, hash=False, repr=False)
    ref_text: str = ""


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    """What to say and how.

    ``speaker``/``language``/``instruct`` select a CustomVoice voice and style; ``seed`` makes
    sampling reproducible (the prompt cache keys on it). ``max_frames`` caps the codec frames
    generated (12.5 per second of audio) so a model that never emits EOS cannot babble forever;
    ``None`` lets the engine derive a cap from the text length. ``min_frames`` suppresses the
    end-of-speech token until that many frames exist (benchmarks force a fixed length with it:
    random weights would otherwise stop at random points).
    """

    text: str
    speaker: str = "ryan"
    language: str = "English"
    instruct: str | None = None
    seed: int | None = None
    max_frames: int | None = None
    min_frames: int | None = None
    #: A cloned voice (Base models) instead of a CustomVoice ``speaker``.
    voice_prompt: VoicePrompt | None = None
    #: Free-form labels carried to logs and metrics (call id, turn id); not used by engines.
    tags: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


class Engine(abc.ABC):
    """A streaming TTS engine."""

    sample_rate: int = SAMPLE_RATE

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Short description for logs and ``/readyz`` (model id, device)."""

    @property
    @abc.abstractmethod
    def speakers(self) -> Sequence[str]:
        """Speaker names this engine accepts (lower case)."""

    @property
    @abc.abstractmethod
    def languages(self) -> Sequence[str]:
        """Language names this engine accepts (as Qwen3-TTS spells them, e.g. ``English``)."""

    @abc.abstractmethod
    def stream(
        self, request: SpeechRequest, should_stop: Callable[[], bool] | None = None
    ) -> Generator[np.ndarray, None, None]:
        """Yield 24 kHz mono float32 chunks in [-1, 1] for ``request``.

        The first chunk is yielded as soon as its codec frames are decoded. Closing the
        generator stops generation at the next chunk boundary; ``should_stop`` (polled between
        codec frames by engines that can) stops it sooner, inside a chunk.
        """

    def warmup(self, voices: Sequence[tuple[str, str] | VoicePrompt] = ()) -> None:
        """Run whatever must run before the first caller: graph capture, then one generation
        per configured voice (a ``(speaker, language)`` pair or a cloned voice)."""
        for voice in voices or [("ryan", "English")]:
            if isinstance(voice, VoicePrompt):
                request = SpeechRequest(text="Warm up.", voice_prompt=voice, max_frames=4)
            else:
                request = SpeechRequest(text="Warm up.", speaker=voice[0], language=voice[1],
                                        max_frames=4)
            for _ in self.stream(request):
                pass

    def rebuild(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op by default
        """Reset per-slot state after a failure inside the engine (default: nothing to do)."""

    @property
    def fingerprint(self) -> str:
        """Identity of the model's weights and revision (part of every prompt-cache key)."""
        return self.name

    def validate(self, request: SpeechRequest) -> None:
        """Raise ``ValueError`` with a clear message if the request cannot be served."""
        if not request.text.strip():
            raise ValueError("empty text")
        if request.voice_prompt is None and request.speaker.lower() not in self.speakers:
            raise ValueError(
                f"unknown speaker {request.speaker!r}; this model has {', '.join(self.speakers)}"
            )
        languages = {lang.lower() for lang in self.languages} | {"auto"}
        if request.language.lower() not in languages:
            raise ValueError(
                f"unknown language {request.language!r}; this model has "
                f"{', '.join(self.languages)}"
            )
