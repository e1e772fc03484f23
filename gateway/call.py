"""The transport-agnostic call: inbound events in, 20 ms G.711 frames out.

Both transports (Twilio Media Streams, SIP/RTP) become a :class:`Call`. The transport feeds it
events (:class:`Dtmf`, :class:`PlaybackDone`, :class:`Hangup`) and implements
:class:`CallTransport` to carry frames, marks and ``clear`` back to the caller. The dialog
logic (the demo greeter today, the IVR runner later) only talks to :class:`Call`.

Speaking: :meth:`Call.say` streams a request through the speech service and the call's
phone-audio pipeline (24 kHz float -> 8 kHz -> G.711 -> 20 ms frames) to the transport, then
sends a mark; the utterance counts as played when the transport reports the mark back.
:meth:`Call.barge_in` cancels generation between chunks, drops what is buffered and tells the
transport to clear: control beats media.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from gateway.audio.framer import Framer, PhonePipeline
from gateway.audio.g711 import alaw_encode, codec_silence, float_to_int16, ulaw_encode
from gateway.errors import EngineError
from gateway.metrics import Metrics
from gateway.tts.engine import SpeechRequest, VoicePrompt
from gateway.tts.service import SpeechService, SpeechStream

log = logging.getLogger(__name__)

Codec = Literal["pcmu", "pcma"]


# --- inbound events ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dtmf:
    """A keypress (Twilio ``dtmf`` event or RFC 4733 telephone-event)."""

    digit: str
    at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class PlaybackDone:
    """The transport reports that everything before mark ``name`` has played."""

    name: str
    at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    """Voice activity detection heard the caller start speaking (speech barge-in)."""

    at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class SpeechFailed:
    """An utterance could not be generated (engine error); the dialog decides what to say."""

    utterance_id: str
    reason: str
    at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class Hangup:
    """The caller (or the network) ended the call."""

    reason: str = "hangup"
    at: float = field(default_factory=time.monotonic)


CallEvent = Dtmf | PlaybackDone | SpeechStarted | SpeechFailed | Hangup


# --- how a call ends (transport-neutral) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransferTo:
    """Hand the caller to ``target``: an E.164 number or a SIP URI."""

    target: str


@dataclass(frozen=True, slots=True)
class HangUp:
    """End the call."""


CallOutcome = TransferTo | HangUp

#: What drives a call once it is up: the IVR runner, or the first-call greeter.
Dialog = Callable[["Call"], Awaitable[None]]


class CallTransport(Protocol):
    """What a transport must do for a call. Implementations are thin I/O shells."""

    codec: Codec

    async def send_frames(self, frames: list[bytes]) -> None:
        """Send whole 20 ms G.711 frames, in order."""

    async def send_mark(self, name: str) -> None:
        """Report ``name`` back (as :class:`PlaybackDone`) once prior frames have played."""

    async def clear(self) -> None:
        """Drop audio buffered at the far end (barge-in)."""

    async def hangup(self) -> None:
        """End the call from our side."""

    async def end(self, outcome: CallOutcome) -> None:
        """Finish the call with ``outcome`` (Twilio: the <Connect action> answer; SIP: BYE or
        REFER)."""


# --- speaking ---------------------------------------------------------------------------------


@dataclass
class Utterance:
    """One thing the call says: its generation, its frames, its playback."""

    id: str
    text: str
    turn_started_at: float
    stream: SpeechStream | None = None
    first_frame_at: float | None = None
    frames_sent: int = 0
    generated: asyncio.Event = field(default_factory=asyncio.Event)
    played: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when generation failed (``error`` says why): no mark will come.
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    interrupted: bool = False
    error: str | None = None
    task: asyncio.Task[None] | None = None
    #: True for audio played from the prompt cache or a file (no generation involved).
    cached: bool = False
    #: True when this utterance answers a caller's turn (answer, key, speech, webhook reply):
    #: only those count in the first-audio histogram.
    caller_turn: bool = True
    #: With ``capture``, the 8 kHz float audio as it was sent (for caching a live render).
    capture: list[np.ndarray] | None = None

    def captured_pcm(self) -> np.ndarray | None:
        """The whole utterance as 8 kHz int16, if it was captured and generated completely."""
        if self.capture is None or self.interrupted or self.error or not self.generated.is_set():
            return None
        audio = np.concatenate(self.capture) if self.capture else np.zeros(0, np.float32)
        return float_to_int16(audio)

    @property
    def first_audio_s(self) -> float | None:
        """Seconds from the caller's turn to the first frame handed to the transport."""
        if self.first_frame_at is None:
            return None
        return self.first_frame_at - self.turn_started_at

    @property
    def done(self) -> bool:
        return self.played.is_set() or self.interrupted or self.error is not None


@dataclass(frozen=True)
class Voice:
    """The voice a call speaks with."""

    speaker: str = "ryan"
    language: str = "English"
    instruct: str | None = None
    seed: int | None = None
    #: A registered cloned voice (with a Base model) instead of ``speaker``.
    prompt: VoicePrompt | None = None


class Call:
    """One phone call, whatever carries it."""

    _ids = itertools.count(1)

    def __init__(
        self,
        call_id: str,
        transport: CallTransport,
        speech: SpeechService,
        voice: Voice,
        *,
        metrics: Metrics | None = None,
        transport_name: str = "twilio",
        max_frames_per_send: int = 50,
    ) -> None:
        self.call_id = call_id
        self.transport = transport
        self.speech = speech
        self.voice = voice
        self.answered_at = time.monotonic()
        self.events: asyncio.Queue[CallEvent] = asyncio.Queue()
        self.utterances: list[Utterance] = []
        self.ended = False
        self.outcome: CallOutcome | None = None
        #: Variables the transport knows about the call (caller, called, call_id).
        self.parameters: dict[str, str] = {"call_id": call_id}
        self._pipeline = PhonePipeline(codec=transport.codec)
        self._current: Utterance | None = None
        self._pending_marks: dict[str, Utterance] = {}
        self._metrics = metrics
        self._transport_name = transport_name
        self._max_frames_per_send = max_frames_per_send
        self._seq = itertools.count(1)

    # --- state --------------------------------------------------------------------------------

    @property
    def transport_name(self) -> str:
        """``twilio`` or ``sip``: the label of this call's metrics."""
        return self._transport_name

    @property
    def speaking(self) -> bool:
        """True while an utterance is generating or not yet reported as played."""
        return self._current is not None and not self._current.done

    # --- events from the transport ------------------------------------------------------------

    def deliver(self, event: CallEvent) -> None:
        """Hand an inbound event to the call (from the transport's receive loop)."""
        if isinstance(event, PlaybackDone):
            utterance = self._pending_marks.pop(event.name, None)
            if utterance is not None:
                utterance.played.set()
        if isinstance(event, Hangup):
            self.ended = True
        self.events.put_nowait(event)

    # --- speaking -----------------------------------------------------------------------------

    def say(
        self, text: str, *, turn_started_at: float | None = None, capture: bool = False
    ) -> Utterance:
        """Start speaking ``text`` now (live generation); returns at once with the handle.

        ``turn_started_at`` is when the caller's turn ended (DTMF received, call answered):
        first-audio latency is measured from there. With ``capture`` the 8 kHz audio is kept so
        the caller of this method can cache the sentence once it was generated completely.
        """
        utterance = self._new_utterance(text, turn_started_at)
        if capture:
            utterance.capture = []
        utterance.task = asyncio.create_task(self._speak(utterance), name=f"say-{utterance.id}")
        return utterance

    def play(
        self, pcm: np.ndarray, *, label: str, turn_started_at: float | None = None
    ) -> Utterance:
        """Start playing 8 kHz int16 ``pcm`` (a cached prompt or a WAV file) now.

        No generation is involved: the first frames go out within the same event-loop turn.
        """
        utterance = self._new_utterance(label, turn_started_at)
        utterance.cached = True
        utterance.task = asyncio.create_task(
            self._play(utterance, pcm), name=f"play-{utterance.id}"
        )
        return utterance

    def _new_utterance(self, text: str, turn_started_at: float | None) -> Utterance:
        if self.speaking:
            raise RuntimeError("already speaking: barge_in() first")
        utterance = Utterance(
            id=f"{self.call_id[-8:]}-u{next(self._seq)}",
            text=text,
            turn_started_at=turn_started_at if turn_started_at is not None else time.monotonic(),
            caller_turn=turn_started_at is not None,
        )
        self._current = utterance
        self.utterances.append(utterance)
        return utterance

    async def end(self, outcome: CallOutcome) -> None:
        """Finish the call: transfer it or hang up (the transport knows how)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        await self.close()
        await self.transport.end(outcome)

    async def barge_in(self) -> None:
        """Stop the current utterance: cancel its generation, drop queued audio, clear."""
        utterance = self._current
        if utterance is None or utterance.done:
            return
        utterance.interrupted = True
        if utterance.stream is not None:
            utterance.stream.cancel()
        if utterance.task is not None and not utterance.task.done():
            utterance.task.cancel()
            try:
                await utterance.task
            except asyncio.CancelledError:
                pass
        self._pending_marks.pop(utterance.id, None)
        self._pipeline.reset()
        await self.transport.clear()
        if self._metrics is not None:
            self._metrics.barge_ins.labels(self._transport_name).inc()
        log.info("call %s: barge-in stopped %s after %d frames", self.call_id, utterance.id,
                 utterance.frames_sent)

    async def close(self) -> None:
        """Stop all work for this call (hang-up or socket gone)."""
        self.ended = True
        utterance = self._current
        if utterance is not None and not utterance.done:
            utterance.interrupted = True
            if utterance.stream is not None:
                utterance.stream.cancel()
            if utterance.task is not None and not utterance.task.done():
                utterance.task.cancel()
                try:
                    await utterance.task
                except asyncio.CancelledError:
                    pass

    async def _speak(self, utterance: Utterance) -> None:
        voice = self.voice
        request = SpeechRequest(
            text=utterance.text,
            speaker=voice.speaker,
            language=voice.language,
            instruct=voice.instruct,
            seed=voice.seed,
            voice_prompt=voice.prompt,
            tags={"call": self.call_id, "utterance": utterance.id},
        )
        pipeline = self._pipeline
        pipeline.reset()
        pipeline.tap = utterance.capture
        try:
            stream = self.speech.stream(request, turn_started_at=utterance.turn_started_at)
            utterance.stream = stream
            async for chunk in stream:
                frames = pipeline.push(chunk)
                if frames:
                    await self._send(utterance, frames)
            if utterance.interrupted or self.ended:
                return
            tail = pipeline.flush()
            if tail:
                await self._send(utterance, tail)
        except EngineError as exc:
            utterance.error = str(exc)
            utterance.failed.set()
            log.warning("call %s: %s failed: %s", self.call_id, utterance.id, exc)
            pipeline.reset()
            if self._metrics is not None:
                self._metrics.speech_failures.labels(self._transport_name).inc()
            # Whatever was sent of it is incomplete: drop it at the far end too.
            if utterance.frames_sent:
                await self.transport.clear()
            self.events.put_nowait(SpeechFailed(utterance.id, str(exc)))
            return
        finally:
            pipeline.tap = None
            utterance.generated.set()
        self._pending_marks[utterance.id] = utterance
        await self.transport.send_mark(utterance.id)

    async def _play(self, utterance: Utterance, pcm: np.ndarray) -> None:
        codec = self.transport.codec
        encoded = ulaw_encode(pcm) if codec == "pcmu" else alaw_encode(pcm)
        framer = Framer(codec_silence(codec))
        frames = framer.push(encoded) + framer.flush()
        try:
            await self._send(utterance, frames)
        finally:
            utterance.generated.set()
        if utterance.interrupted or self.ended:
            return
        self._pending_marks[utterance.id] = utterance
        await self.transport.send_mark(utterance.id)

    async def _send(self, utterance: Utterance, frames: list[bytes]) -> None:
        step = self._max_frames_per_send
        for start in range(0, len(frames), step):
            await self.transport.send_frames(frames[start : start + step])
            if utterance.first_frame_at is None:
                # Measured once the transport has taken the frame: what the caller waits for.
                utterance.first_frame_at = time.monotonic()
                if utterance.caller_turn:
                    if self._metrics is not None:
                        source = "cached" if utterance.cached else "live"
                        self._metrics.first_audio.labels(self._transport_name, source).observe(
                            utterance.first_frame_at - utterance.turn_started_at
                        )
                        self._metrics.turns.labels(self._transport_name, source).inc()
                    log.info("call %s: %s first audio %.1f ms after the caller's turn",
                             self.call_id, utterance.id,
                             1000 * (utterance.first_frame_at - utterance.turn_started_at))
        utterance.frames_sent += len(frames)
