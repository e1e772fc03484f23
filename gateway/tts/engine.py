"""The TTS engine interfaces every implementation streams through.

An :class:`Engine` turns a :class:`SpeechRequest` into an iterator of 24 kHz float32 chunks.
Iteration is pull-based: no work happens between ``next()`` calls, and ``close()`` on the
iterator (it is a generator) stops the generation *between chunks* and leaves the engine
reusable. Engines are synchronous and not thread-safe.

A :class:`BatchEngine` (the gateway's default, :class:`gateway.tts.batched.BatchedQwenEngine`)
is an engine that also exposes its rows, so that one loop per device
(:mod:`gateway.tts.core`) can advance every active turn in one batched step. A plain
:class:`Engine` serves one request at a time (warm-up, tools; the batching benchmark's slot
baseline in ``bench/slot_engine.py`` runs several side by side).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gateway.errors import EngineError

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
class Sampling:
    """How one request samples (defaults: the published Qwen3-TTS ``generation_config.json``).

    ``temperature`` / ``top_k`` / ``top_p`` / ``repetition_penalty`` apply to the talker's
    first-codebook token (the penalty over the row's own history of those tokens); the
    ``predictor_*`` values to the code predictor's 15 codebooks. Temperature 0 is greedy;
    ``top_k`` 0 and ``top_p`` 1 switch those filters off.
    """

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    predictor_temperature: float = 0.9
    predictor_top_k: int = 50
    predictor_top_p: float = 1.0

    @classmethod
    def greedy(cls) -> Sampling:
        """Arg-max everywhere (no randomness; the repetition penalty still applies)."""
        return cls(temperature=0.0, predictor_temperature=0.0)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        for name in ("temperature", "predictor_temperature"):
            value = getattr(self, name)
            if not 0.0 <= value <= 100.0:
                raise ValueError(f"sampling {name} must be in [0, 100], got {value}")
        for name in ("top_k", "predictor_top_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"sampling {name} must be >= 0 (0: off)")
        for name in ("top_p", "predictor_top_p"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"sampling {name} must be in (0, 1], got {value}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("sampling repetition_penalty must be in (0, 10]")


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
    #: Sampling settings for this turn (None: the model's published defaults). Honoured per
    #: row by the batched engine; the benchmark's slot engine samples with the defaults only.
    sampling: Sampling | None = None
    #: The text arrives while the turn runs (a bot streaming its answer): ``text`` is its
    #: beginning, the rest is fed to the turn's stream (``SpeechStream.feed``) and the talker
    #: reads it on its text track as it comes (Qwen3-TTS's streaming mode).
    text_stream: bool = False
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
        """Reset the engine's state after a failure inside it (default: nothing to do)."""

    @property
    def fingerprint(self) -> str:
        """Identity of the model's weights and revision (part of every prompt-cache key)."""
        return self.name

    @property
    def render_settings(self) -> str:
        """This engine's settings that change the audio a request renders to (the weights'
        dtype, how the codec decodes), as text: part of every prompt-cache key. Default: none.
        """
        return ""

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


class EngineRow(Protocol):
    """What a batch loop reads of one row (a turn being generated)."""

    #: Prefill done: the row can step.
    ready: bool
    #: None while generating; "eos" or "cap" once it stopped.
    finished: str | None
    #: Codec frames generated so far.
    frames: int
    #: Prompt tokens prefilled so far.
    prefilled: int
    #: Each chunk's codes (``[n, 16]``, on the host) when the engine records them.
    codes: list[Any]

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def prefilling(self) -> bool: ...

    @property
    def frames_to_chunk(self) -> int:
        """Frames still to generate before the row's next chunk is due."""
        ...

    @property
    def waiting_for_text(self) -> bool:
        """A streaming-text turn that has read all the text it has so far: it must sit out
        until more arrives (stepping it would read padding)."""
        ...


class BatchEngine(Engine):
    """An engine whose rows one loop advances together (see :mod:`gateway.tts.core`).

    The loop calls, from its one thread: :meth:`open` for a new turn, :meth:`prefill` until
    the row is ready, :meth:`step` for the rows that advance now, :meth:`next_chunk` for each
    row's due audio, :meth:`close` when a turn ends (its row is reused at once) and
    :meth:`rebuild` after a failure inside a step (every row is lost).
    """

    #: The batch cap: turns that can generate at once.
    max_rows: int
    #: Tokens per prefill chunk (0: whole prompts), fixed per engine.
    prefill_chunk: int
    #: Seconds spent on (or waiting for) the device so far: graph replays or eager device
    #: work, device-to-host copies; the rest of an engine call is host work. The core reads
    #: it to report host time per step (``gateway_tts_step_host_seconds``).
    device_s: float = 0.0

    @property
    @abc.abstractmethod
    def free_rows(self) -> int:
        """Rows not in use."""

    @abc.abstractmethod
    def claim(self, owner: object) -> None:
        """Mark the engine as driven by ``owner`` (its own :meth:`stream` then refuses);
        ``None`` releases it."""

    @abc.abstractmethod
    def open(self, request: SpeechRequest) -> EngineRow:
        """Give ``request`` a row (raises when none is free or the prompt does not fit)."""

    @abc.abstractmethod
    def prefill(self, row: EngineRow) -> int:
        """Run the next prefill chunk of ``row``; returns the prompt tokens it processed."""

    def prefill_rows(self, rows: Sequence[EngineRow]) -> int:
        """Run the next prefill chunk of each of ``rows`` (together where the engine can);
        returns the prompt tokens processed. Default: :meth:`prefill` row by row. On an
        exception the loop retries the rows still prefilling one by one, so that only the
        row that fails is failed."""
        return sum(self.prefill(row) for row in rows)

    @abc.abstractmethod
    def step(self, rows: Sequence[EngineRow]) -> int:
        """Advance ``rows`` one codec frame in one batched step; returns the batch size run."""

    def extend_text(self, row: EngineRow, text: str, last: bool) -> int:
        """Append ``text`` (whole words) to a streaming-text turn's text track; ``last`` ends
        it. Returns the text tokens added. Default: the engine has no text track."""
        raise EngineError(f"{self.name} cannot take text while a turn runs")

    @abc.abstractmethod
    def next_chunk(self, row: EngineRow) -> np.ndarray | None:
        """The row's next audio chunk if one is due (possibly empty), else None."""

    def next_chunks(self, rows: Sequence[EngineRow]) -> list[np.ndarray | None]:
        """:meth:`next_chunk` of every row in ``rows`` (decoded together where the engine
        can). A finished row's chunk holds all its remaining frames. Default: row by row."""
        return [self.next_chunk(row) for row in rows]

    @abc.abstractmethod
    def close(self, row: EngineRow) -> None:
        """Free the row."""
