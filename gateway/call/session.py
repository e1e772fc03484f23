"""The call as a media session: inbound events in, paced 20 ms G.711 frames out.

Every transport's call is one :class:`Call`. Its transport adapter (``gateway.twilio.stream``,
``gateway.sip.endpoint``, or a third one) only translates: it reports what arrives on the wire
(:meth:`Call.inbound_audio`, :meth:`Call.dtmf`, :meth:`Call.playback_done`, :meth:`Call.received`)
and implements :class:`CallTransport` to put frames, marks and ``clear`` on the wire and to end
the call. Everything between is here, written once:

- **Events** for the dialog (:attr:`Call.events`), stamped with the injected clock.
- **The speech-detector feed**: inbound G.711 is decoded once, per codec, by the call's
  :class:`~gateway.audio.vad.SpeechStartDetector`; a detected start is a :class:`SpeechStarted`.
  The detector hears the caller only while their speech can matter: while an ``interruptible``
  utterance is generating or playing, or while the dialog asks for speech
  (:attr:`Call.wants_speech`). The rest of the call (a gather's wait for keys, a webhook, a
  prompt that must play to its end) costs it nothing.
- **Listening** (:meth:`Call.listen`): while a speech gather listens, every inbound frame also
  goes to its :class:`InboundListener` (the turn's audio for the recogniser), told in step
  with the audio when the detector hears speech start, pause and resume; a pause is also a
  :class:`SpeechPaused` for the dialog. A listener is a reason for the detector to hear the
  caller; what the detector hears, the call keeps for :data:`RECENT_S` (a fixed ring), so a
  listener that starts while the caller is already talking gets their speech from its start.
- **Inactivity**: :class:`~gateway.call.inactivity.InactivityWatch` on every inbound packet.
- **Speaking**: the dialog hands the call audio, a speech stream to :meth:`Call.speak` (24 kHz
  float chunks from the speech service) or 8 kHz PCM to :meth:`Call.play` (a cached prompt, a
  WAV file). Speech goes through the phone-audio path (conditioning -> 8 kHz -> G.711 -> 20 ms
  frames, :class:`~gateway.audio.framer.PhonePipeline`) into the call's
  :class:`~gateway.call.playout.Playout`, which paces it to the transport with backpressure. An
  utterance counts as played when its mark comes back. A live utterance starts behind its start
  buffer: the call tells the playout where the speech stream's own playback origin lies (when
  its first chunk arrived, moved later by the audio the phone path has not yet handed on), so
  the caller's buffer is never emptier than the engine's lead says (see
  :mod:`gateway.call.playout`); a gap the caller hears mid-utterance anyway is an underrun,
  counted by cause (``gateway_playout_underruns_total``: the engine's chunk came late too, or it
  did not).
- **Barge-in** (:meth:`Call.barge_in`): generation is cancelled between chunks, buffered audio
  dropped (faded out where the gateway owns the stream) and the far end cleared: control beats
  media.
- **Bounded for the call's life**, however long it lasts: the playout buffers at most its
  policy's ``buffer_frames``; :attr:`Call.utterances` keeps the last :data:`MAX_UTTERANCES`
  (a finished one lets go of its speech stream and captured audio when the next starts);
  :attr:`Call.events` holds at most :data:`MAX_EVENTS` unread events (past that a key or a
  mark is dropped and counted, a hang-up or a failure never).

Who decides what to say (the IVR runner, the greeter) and who turns text into speech (the
speech service, through :class:`gateway.speech.Speaker`) sit above the call: it never sees text
becoming audio, only audio becoming frames.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from gateway.aio import cancel_and_wait
from gateway.audio.condition import Conditioning
from gateway.audio.framer import PhonePipeline
from gateway.audio.g711 import codec_silence, float_to_int16
from gateway.audio.resample import INPUT_RATE
from gateway.call.events import (
    CallerHungUp,
    CallEvent,
    CallOutcome,
    Codec,
    Dtmf,
    PlaybackDone,
    SpeechFailed,
    SpeechPaused,
    SpeechStarted,
)
from gateway.call.frames import PromptFrames
from gateway.call.inactivity import InactivityWatch
from gateway.call.playout import FRAME_S, FrameOwner, FrameSink, Playout, PlayoutPolicy
from gateway.clock import Clock
from gateway.errors import EngineError
from gateway.metrics import Metrics

log = logging.getLogger(__name__)

#: Inbound audio is 8 kHz G.711 on every transport.
_RATE = 8000
#: Inbound audio a call with a speech detector keeps (a ring, one byte per sample): a caller who
#: talks over a prompt no gather listens to ("agent!" during the greeting) is heard by the next
#: speech gather from where their speech began.
RECENT_S = 3.0
#: Audio kept from before the detector's speech start (it fires ~250 ms into the speech).
PRE_ROLL_S = 0.5



def short_call_id(call_id: str) -> str:
    """The last 8 characters of a call's own id, for utterance ids in logs and marks: of a
    Twilio CallSid (``CA…3f9c01ab`` -> ``3f9c01ab``), of a SIP Call-ID's random part
    (``sip-<random>@10.0.0.5`` -> its random part's tail, not the host's: "27.0.0.1")."""
    local = call_id.removeprefix("sip-").split("@", 1)[0] or call_id
    return local[-8:]

class _Recent:
    """The last :data:`RECENT_S` of inbound G.711, in a preallocated ring (no per-frame
    allocation)."""

    __slots__ = ("_buf", "_filled", "_pos")

    def __init__(self, size: int) -> None:
        self._buf = bytearray(size)
        self._pos = 0
        self._filled = 0

    def push(self, frame: bytes | bytearray | memoryview) -> None:
        buf, size = self._buf, len(self._buf)
        n = len(frame)
        if n >= size:
            buf[:] = frame[n - size:]
            self._pos, self._filled = 0, size
            return
        end = self._pos + n
        if end <= size:
            buf[self._pos:end] = frame
        else:
            first = size - self._pos
            buf[self._pos:] = frame[:first]
            buf[:n - first] = frame[first:]
        self._pos = end % size
        self._filled = min(size, self._filled + n)

    def last(self, n: int) -> bytes:
        """The most recent ``n`` bytes (fewer if fewer were kept)."""
        n = min(n, self._filled)
        start = (self._pos - n) % len(self._buf)
        if start + n <= len(self._buf):
            return bytes(self._buf[start:start + n])
        return bytes(self._buf[start:]) + bytes(self._buf[:self._pos])

__all__ = [
    "MAX_EVENTS",
    "MAX_UTTERANCES",
    "AudioStream",
    "Call",
    "CallTransport",
    "Dialog",
    "InboundListener",
    "SpeechDetector",
    "StreamOpener",
    "Utterance",
]

#: Utterances a call remembers (the current one and the latest finished ones: tests, logs).
MAX_UTTERANCES = 32
#: Unread inbound events a call holds for its dialog. A dialog reads them as they come; one
#: busy elsewhere (a webhook) for seconds gets a few keys and marks, not hundreds.
MAX_EVENTS = 256


class CallTransport(FrameSink, Protocol):
    """What a transport adapter does for a call (besides reporting what arrives)."""

    #: How the far end plays audio: the adapter's one statement about pacing.
    playout: PlayoutPolicy

    async def end(self, outcome: CallOutcome) -> None:
        """Finish the call with ``outcome`` (Twilio: the <Connect action> answer; SIP: BYE or
        REFER)."""

    def abort(self, reason: str) -> None:
        """Inbound media stopped (the peer is gone): end the wire side now, no outcome."""


class AudioStream(Protocol):
    """24 kHz float32 speech, chunk by chunk, stoppable between chunks (a ``SpeechStream``)."""

    def __aiter__(self) -> AsyncIterator[npt.NDArray[np.float32]]: ...

    def cancel(self) -> None: ...

    async def aclose(self) -> None: ...


#: Opens the speech for an utterance once it exists (its id tags the request).
StreamOpener = Callable[["Utterance"], AudioStream]


@runtime_checkable
class _EngineGaps(Protocol):
    """A speech stream that counts its own underruns (``SpeechStream.gaps``: chunks handed on
    after a listener who started at its first chunk would have run out)."""

    gaps: int


class SpeechDetector(Protocol):
    """Caller speech onsets from inbound G.711 frames (:class:`gateway.audio.vad`)."""

    @property
    def speaking(self) -> bool:
        """True from a speech start until the turn's silence has lasted long enough."""
        ...

    #: Samples consumed so far.
    samples: int
    #: Sample at which the caller's current pause began (None while they speak).
    pause_start: int | None
    #: Sample at which the latest speech start was detected.
    last_event_sample: int | None

    def push(self, frame: bytes | bytearray | memoryview) -> bool: ...

    def reset(self) -> None: ...


#: A detector that has not heard the caller for longer than this starts afresh: its noise floor
#: (one second of windows, :data:`gateway.audio.vad.NOISE_FLOOR_S`) and its state would describe
#: a line as it was, not as it is. Shorter gaps (between the sentences of one ``say``) carry on.
_DETECTOR_MEMORY_S = 1.0


class InboundListener(Protocol):
    """Takes a call's inbound audio while a speech gather listens (a
    :class:`~gateway.asr.pool.SpeechListener`). Called on the call's task, frame by frame;
    times are on the call's clock."""

    def feed(self, frame: bytes | bytearray | memoryview) -> object: ...

    def speech_started(self, at: float) -> None: ...

    def speech_paused(self, at: float) -> None: ...

    def speech_resumed(self, at: float) -> None: ...


@dataclass(eq=False)
class Utterance:
    """One thing the call says: its generation, its frames, its playback."""

    id: str
    text: str
    turn_started_at: float
    stream: AudioStream | None = None
    first_frame_at: float | None = None
    frames_sent: int = 0
    generated: asyncio.Event = field(default_factory=asyncio.Event)
    played: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when generation failed (``error`` says why): no mark will come.
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when the first frame has gone to the transport (the caller starts hearing it).
    started: asyncio.Event = field(default_factory=asyncio.Event)
    interrupted: bool = False
    error: str | None = None
    task: asyncio.Task[None] | None = None
    #: True for audio played from the prompt cache or a file (no generation involved).
    cached: bool = False
    #: True when this utterance answers a caller's turn (answer, key, speech, webhook reply):
    #: only those count in the first-audio histogram.
    caller_turn: bool = True
    #: With ``capture``, the 8 kHz float audio as it was sent (for caching a live render).
    capture: list[npt.NDArray[np.float32]] | None = None
    #: Called once, when the first frame has gone to the transport.
    on_first_frame: Callable[[Utterance], None] | None = None
    #: The caller's speech may stop it: the speech detector listens while it is not done.
    interruptible: bool = False
    #: Its number in the call (1, 2, ...): counts past what :attr:`Call.utterances` keeps.
    seq: int = 0
    #: Gaps the caller heard in the middle of it (the playout's underruns) and their silence.
    underruns: int = 0
    underrun_s: float = 0.0
    #: Whether the latest chunk of its speech stream came late from the engine itself.
    late_chunk: bool = False
    #: When its first frame was queued for the playout (live speech: the start buffer holds it
    #: from then until ``first_frame_at``).
    first_queued_at: float | None = None

    def frames_released(self, count: int, at: float) -> None:
        """The playout handed ``count`` of this utterance's frames to the transport at ``at``."""
        self.frames_sent += count
        if self.first_frame_at is None:
            self.first_frame_at = at
            self.started.set()
            if self.on_first_frame is not None:
                self.on_first_frame(self)

    def captured_pcm(self) -> npt.NDArray[np.int16] | None:
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

    def release(self) -> None:
        """Let go of the speech stream, captured audio and task of a finished utterance (its
        record stays: text, timings, outcome)."""
        self.stream = None
        self.capture = None
        self.task = None


class Call:
    """One phone call, whatever carries it: the media session the dialog talks to."""

    def __init__(
        self,
        call_id: str,
        transport: CallTransport,
        clock: Clock,
        *,
        transport_name: str,
        conditioning: Conditioning | None = None,
        detector: SpeechDetector | None = None,
        inactivity_s: float = 0.0,
        watch: InactivityWatch | None = None,
        metrics: Metrics | None = None,
        prompt_frames: PromptFrames | None = None,
    ) -> None:
        """``prompt_frames``: the frames of what calls play, encoded once and shared (the
        lifecycle's, for every call of the app); None: this call's own."""
        self.call_id = call_id
        self.transport = transport
        self.clock = clock
        self._prompt_frames = prompt_frames if prompt_frames is not None else PromptFrames()
        self.answered_at = clock.now()
        self.events: asyncio.Queue[CallEvent] = asyncio.Queue(maxsize=MAX_EVENTS)
        #: Events dropped because the dialog had :data:`MAX_EVENTS` unread.
        self.events_dropped = 0
        #: The latest :data:`MAX_UTTERANCES` utterances, oldest first.
        self.utterances: list[Utterance] = []
        #: Utterances started in all.
        self.utterance_count = 0
        self.ended = False
        # Set while the caller has not put the call on hold (SIP hold, RFC 3264 section 8.4).
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.outcome: CallOutcome | None = None
        #: Variables the transport knows about the call (caller, called, call_id).
        self.parameters: dict[str, str] = {"call_id": call_id}
        #: The admission seat this call holds (released when it ends).
        self.seat: str = call_id
        #: The ``line`` label of this call's metrics: the line it reached, set by the dialog
        #: factory before the call is registered (``default``: no line, or an unlisted number).
        self.line = "default"
        codec: Codec = transport.codec
        self.codec = codec
        self._pipeline = PhonePipeline(
            codec, conditioner=conditioning.new() if conditioning is not None else None)
        self.playout = Playout(
            transport, clock, transport.playout,
            silence=bytes([codec_silence(codec)]) * 160,
            on_played=self._played,
            on_failure=self._playout_failed,
            on_underrun=self._underrun,
        )
        self._detector = detector
        #: The dialog waits for the caller's speech (not only while an interruptible utterance
        #: plays): the speech detector listens meanwhile.
        self.wants_speech = False
        #: When the detector last heard a frame (None: not yet). Past a gap longer than its
        #: noise-floor memory it starts afresh rather than from a stale line.
        self._heard_at: float | None = None
        self._listener: InboundListener | None = None
        # What the detector heard lately, for a listener that starts while the caller talks.
        self._recent = _Recent(round(RECENT_S * _RATE)) if detector is not None else None
        # The detector's sample count when the last listener stopped: speech that started
        # before it was that listener's (heard, or given up for keys), never the next one's.
        self._listened_until = 0
        if watch is None:
            watch = InactivityWatch(clock, inactivity_s, transport=transport_name,
                                    metrics=metrics, on_expired=self._inactive, label=call_id)
        else:
            watch.relabel(call_id, self._inactive)
        self.inactivity = watch
        self._current: Utterance | None = None
        self._pending_marks: dict[str, Utterance] = {}
        self._metrics = metrics
        self._transport_name = transport_name
        self._started = False

    # --- state --------------------------------------------------------------------------------

    @property
    def transport_name(self) -> str:
        """``twilio`` or ``sip``: the label of this call's metrics."""
        return self._transport_name

    @property
    def speaking(self) -> bool:
        """True while an utterance is generating or not yet reported as played."""
        return self._current is not None and not self._current.done

    @property
    def timed_out(self) -> bool:
        """The inactivity watch gave up on the caller."""
        return self.inactivity.expired

    def start(self) -> None:
        """Start pacing and watching (the lifecycle calls this once the call is registered)."""
        if not self._started:
            self._started = True
            self.playout.start()
            self.inactivity.start()

    # --- what the transport adapter reports ---------------------------------------------------

    def received(self, now: float | None = None) -> None:
        """Some inbound packet arrived (it keeps the call alive). ``now``: the adapter's own
        clock read for the packet, when it has one (one read per packet)."""
        self.inactivity.touch(self.clock.now() if now is None else now)

    @property
    def listening(self) -> bool:
        """Whether the speech detector hears the caller now (see the module docstring)."""
        if self._detector is None:
            return False
        current = self._current
        return self.wants_speech or self._listener is not None or (
            current is not None and current.interruptible and not current.done)

    def inbound_audio(self, payload: bytes | bytearray | memoryview,
                      now: float | None = None) -> None:
        """20 ms of caller audio in the call's codec: liveness, then the speech detector."""
        if now is None:
            now = self.clock.now()
        self.inactivity.touch(now)
        detector = self._detector
        listener = self._listener
        if listener is not None:
            listener.feed(payload)
        if detector is None:
            return
        # Per frame, so inline: ``listening`` without the property call.
        current = self._current
        if not (listener is not None or self.wants_speech
                or (current is not None and current.interruptible and not current.done)):
            return
        heard_at, self._heard_at = self._heard_at, now
        if heard_at is not None and now - heard_at > _DETECTOR_MEMORY_S:
            detector.reset()
            self._listened_until = 0
        recent = self._recent
        if recent is not None:
            recent.push(payload)
        if listener is not None:
            self._turn(detector, listener, payload, now)
        elif detector.push(payload):
            self.deliver(SpeechStarted(at=now))

    def _turn(self, detector: SpeechDetector, listener: InboundListener,
              payload: bytes | bytearray | memoryview, now: float) -> None:
        """The detector's view of the caller's turn, told to the listener as it happens."""
        before = detector.pause_start
        if detector.push(payload):
            listener.speech_started(now)
            self.deliver(SpeechStarted(at=now))
            return
        pause = detector.pause_start
        if pause is not None and pause != before:
            since = now - (detector.samples - pause) / _RATE
            listener.speech_paused(since)
            self.deliver(SpeechPaused(since, at=now))
        elif pause is None and before is not None:
            listener.speech_resumed(now)

    @property
    def listener(self) -> InboundListener | None:
        """Who takes inbound audio now (:meth:`listen`), if anyone."""
        return self._listener

    def listen(self, listener: InboundListener | None) -> None:
        """Give inbound audio to ``listener`` from now on (None: stop).

        A caller already speaking when listening starts (talking over a prompt no gather
        listened to, say the greeting) starts the listener's turn at once, with the audio since
        their speech began (up to :data:`RECENT_S`), so what they are saying is heard whole.
        Speech that began while the previous listener listened was its turn (the answer that
        led here): the detector still calls it speaking for a moment, but it is not heard again.
        """
        previous, self._listener = self._listener, listener
        detector = self._detector
        if detector is None:
            return
        if previous is not None and listener is None:
            self._listened_until = detector.samples
        if listener is None or not detector.speaking:
            return
        now = self.clock.now()
        # A detector that has not heard the line lately (nothing interruptible played) would
        # speak of a turn long over: the next frame resets it (inbound_audio).
        heard_at = self._heard_at
        if heard_at is None or now - heard_at > _DETECTOR_MEMORY_S:
            return
        started = detector.last_event_sample
        if started is None or started <= self._listened_until:
            return
        # Started first: a listener keeps only a short pre-roll of what it hears before speech.
        listener.speech_started(now)
        if self._recent is not None:
            since = detector.samples - started + round(PRE_ROLL_S * _RATE)
            listener.feed(self._recent.last(since))
        if detector.pause_start is not None:
            listener.speech_paused(now - (detector.samples - detector.pause_start) / _RATE)

    def dtmf(self, digit: str, now: float | None = None) -> None:
        """A key the caller pressed (Twilio ``dtmf``, RFC 4733 telephone-event)."""
        if now is None:
            now = self.clock.now()
        self.inactivity.touch(now)
        self.deliver(Dtmf(digit, at=now))

    def playback_done(self, name: str) -> None:
        """The far end reports mark ``name`` played (Twilio's echo)."""
        now = self.clock.now()
        self.inactivity.touch(now)
        self.playout.far_end_played(name)
        self._played(name)

    def hold(self, held: bool) -> None:
        """The caller put the call on hold (or resumed): no media either way meanwhile, and
        the dialog's waits for the caller stand still (:meth:`wait_resumed`)."""
        self.playout.paused = held
        if held:
            self.inactivity.suspend()
            self._resumed.clear()
        else:
            self.inactivity.resume()
            self._resumed.set()

    @property
    def on_hold(self) -> bool:
        """True while the caller holds the call."""
        return not self._resumed.is_set()

    async def wait_resumed(self) -> None:
        """Return once the caller takes the call off hold (at once when it is not held)."""
        await self._resumed.wait()

    def deliver(self, event: CallEvent) -> None:
        """Hand an inbound event to the dialog."""
        if isinstance(event, PlaybackDone):
            utterance = self._pending_marks.pop(event.name, None)
            if utterance is not None:
                utterance.played.set()
        if isinstance(event, CallerHungUp):
            self.ended = True
        self._post(event)

    def _post(self, event: CallEvent) -> None:
        events = self.events
        if events.full():
            # The dialog is not reading (busy in a webhook, a caller mashing keys): keys, speech
            # starts and marks beyond the bound are dropped; a hang-up or a failure takes the
            # oldest event's place instead, so the dialog always learns of it.
            self.events_dropped += 1
            if self._metrics is not None:
                self._metrics.call_events_dropped.labels(self._transport_name).inc()
            if self.events_dropped == 1:
                log.warning("call %s: %d events unread; dropping the excess", self.call_id,
                            MAX_EVENTS)
            if not isinstance(event, CallerHungUp | SpeechFailed):
                return
            events.get_nowait()
        events.put_nowait(event)

    def _played(self, name: str) -> None:
        self.deliver(PlaybackDone(name, at=self.clock.now()))

    def _inactive(self) -> None:
        self.transport.abort("inbound timeout")

    def _underrun(self, utterance: FrameOwner, silence_s: float, starved: bool) -> None:
        """The caller heard ``silence_s`` of silence in the middle of an utterance (``starved``:
        while it waited for audio, not while its audio waited to be sent)."""
        if not isinstance(utterance, Utterance):
            return
        utterance.underruns += 1
        utterance.underrun_s += silence_s
        # The engine's own count says whose the gap is: the chunk that ended it came late from
        # the engine (also in gateway_tts_underruns_total), or it was on time and lost its lead
        # on the way (the phone path, the event loop, the transport). One late chunk explains
        # one gap: a beat a stalled loop sends late after it is not the engine's.
        cause = "engine" if starved and utterance.late_chunk else "playout"
        if cause == "engine":
            utterance.late_chunk = False
        if self._metrics is not None:
            self._metrics.playout_underruns.labels(self._transport_name, cause).inc()
            self._metrics.playout_underrun_seconds.labels(self._transport_name, cause
                                                          ).inc(silence_s)
        log.info("call %s: %s ran dry for %.1f ms after %d frames (%s)", self.call_id,
                 utterance.id, 1000 * silence_s, utterance.frames_sent, cause)

    def _playout_failed(self, exc: BaseException) -> None:
        # A transport that cannot take frames any more: the call cannot go on.
        self.transport.abort(f"playout failed: {exc}")

    # --- speaking -----------------------------------------------------------------------------

    def speak(self, text: str, open_stream: StreamOpener, *, turn_started_at: float | None = None,
              capture: bool = False, interruptible: bool = False) -> Utterance:
        """Start speaking ``text`` now from the stream ``open_stream`` gives; returns at once.

        ``turn_started_at`` is when the caller's turn ended (DTMF received, call answered):
        first-audio latency is measured from there. With ``capture`` the 8 kHz audio is kept so
        the caller of this method can cache the sentence once it was generated completely.
        ``interruptible``: the caller's speech may stop it (the speech detector listens until
        it is done, and a detected start is a :class:`SpeechStarted` for the dialog).
        """
        utterance = self._new_utterance(text, turn_started_at, interruptible)
        if capture:
            utterance.capture = []
        if not utterance.done:
            utterance.task = asyncio.create_task(self._speak(utterance, open_stream),
                                                 name=f"say-{utterance.id}")
        return utterance

    def play(
        self, pcm: npt.NDArray[np.int16], *, label: str, turn_started_at: float | None = None,
        interruptible: bool = False,
    ) -> Utterance:
        """Start playing 8 kHz int16 ``pcm`` (a cached prompt or a WAV file) now.

        No generation is involved: the first frames go out on the playout's next turn.
        ``interruptible`` as for :meth:`speak`.
        """
        utterance = self._new_utterance(label, turn_started_at, interruptible)
        utterance.cached = True
        if not utterance.done:
            utterance.task = asyncio.create_task(
                self._play(utterance, pcm), name=f"play-{utterance.id}"
            )
        return utterance

    def _new_utterance(self, text: str, turn_started_at: float | None,
                       interruptible: bool) -> Utterance:
        if self.speaking:
            raise RuntimeError("already speaking: barge_in() first")
        utterance = Utterance(
            id=f"{short_call_id(self.call_id)}-u{self.utterance_count + 1}",
            seq=self.utterance_count + 1,
            text=text,
            turn_started_at=turn_started_at if turn_started_at is not None else self.clock.now(),
            caller_turn=turn_started_at is not None,
            on_first_frame=self._first_frame,
            interruptible=interruptible,
        )
        previous = self._current
        if previous is not None:
            previous.release()  # done (not speaking): its dialog has taken what it needed
        self._current = utterance
        self.utterance_count += 1
        utterances = self.utterances
        utterances.append(utterance)
        if len(utterances) > MAX_UTTERANCES:
            del utterances[0]
        if self.ended:
            # The call is over (a dialog still running its last step): nothing is generated or
            # sent, and the utterance is already done, never left generating for nobody.
            utterance.interrupted = True
            utterance.generated.set()
        return utterance

    def _first_frame(self, utterance: Utterance) -> None:
        assert utterance.first_frame_at is not None
        if self._metrics is not None and not utterance.cached and \
                utterance.first_queued_at is not None:
            self._metrics.playout_start_hold.labels(self._transport_name).observe(
                max(0.0, utterance.first_frame_at - utterance.first_queued_at))
        if not utterance.caller_turn:
            return
        latency = utterance.first_frame_at - utterance.turn_started_at
        if self._metrics is not None:
            source = "cached" if utterance.cached else "live"
            self._metrics.first_audio.labels(self._transport_name, source, self.line
                                             ).observe(latency)
            self._metrics.turns.labels(self._transport_name, source, self.line).inc()
        log.info("call %s: %s first audio %.1f ms after the caller's turn", self.call_id,
                 utterance.id, 1000 * latency)

    async def send_digits(self, digits: str) -> bool:
        """Send keys to the far end out of band where the transport can (SIP: RFC 4733 events,
        when the caller offered telephone-event); returns once they are sent. False, sending
        nothing, where it cannot (Twilio's Media Streams carry no keys): the dialog may play
        them as tones (:func:`gateway.audio.dtmf.dtmf_tones`)."""
        send = getattr(self.transport, "send_digits", None)
        if send is None or self.ended:
            return False
        return bool(await send(digits))

    async def end(self, outcome: CallOutcome) -> None:
        """Finish the call: transfer it or hang up (the transport knows how)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        await self._stop_utterance()
        self.ended = True
        await self.transport.end(outcome)

    async def barge_in(self) -> None:
        """Stop the current utterance: cancel its generation, drop queued audio, clear."""
        utterance = self._current
        if utterance is None or utterance.done:
            return
        await self._stop_utterance()
        self._pending_marks.pop(utterance.id, None)
        self._pipeline.reset()
        await self.playout.interrupt()
        if self._metrics is not None:
            self._metrics.barge_ins.labels(self._transport_name, self.line).inc()
        log.info("call %s: barge-in stopped %s after %d frames", self.call_id, utterance.id,
                 utterance.frames_sent)

    async def close(self) -> None:
        """Stop all work for this call (hang-up or socket gone)."""
        self.ended = True
        self._listener = None
        self.inactivity.cancel()
        try:
            await self._stop_utterance()
        finally:
            # Even when whoever closes the call is cancelled meanwhile: no pacing task is left.
            await self.playout.close()
            for utterance in self.utterances:
                if utterance.done:
                    utterance.release()

    async def _stop_utterance(self) -> None:
        utterance = self._current
        if utterance is None or utterance.done:
            return
        utterance.interrupted = True
        if utterance.stream is not None:
            utterance.stream.cancel()
        await cancel_and_wait(utterance.task, log=log, what=f"call {self.call_id}: {utterance.id}")

    async def _speak(self, utterance: Utterance, open_stream: StreamOpener) -> None:
        pipeline = self._pipeline
        pipeline.reset()
        pipeline.tap = utterance.capture
        playout = self.playout
        clock = self.clock
        pushed = False
        # The stream's playback origin as its engine counts it: a listener who starts at the
        # first chunk. What the phone path has taken in (seconds of 24 kHz) and handed on
        # (frames) says how far behind that listener the caller would be.
        origin: float | None = None
        first_chunk_s = 0.0
        spare = 0.0
        taken = 0
        framed = 0
        engine_gaps = 0
        try:
            playout.begin(utterance, live=True)
            stream = open_stream(utterance)
            utterance.stream = stream
            counts = stream if isinstance(stream, _EngineGaps) else None
            async for chunk in stream:
                if origin is None:
                    origin = clock.now()
                    first_chunk_s = len(chunk) / INPUT_RATE
                if counts is not None:
                    utterance.late_chunk = counts.gaps > engine_gaps
                    engine_gaps = counts.gaps
                taken += len(chunk)
                frames = pipeline.push(chunk)
                if frames:
                    pushed = True
                    if not framed:
                        utterance.first_queued_at = clock.now()
                    if framed == 0 and playout.policy.start_buffer_adapts:
                        # A device that makes the next chunk in less than the first one plays
                        # needs none of the start buffer that covers an engine at real time:
                        # the lead it will have to spare when that chunk comes is taken off the
                        # hold (on every push: a later chunk re-states the origin while the
                        # first frame still waits for an RTP beat).
                        eta = getattr(stream, "next_chunk_eta_s", None)
                        if eta is not None:
                            spare = max(0.0, first_chunk_s - eta)
                    framed += len(frames)
                    behind = taken / INPUT_RATE - framed * FRAME_S
                    await playout.push(frames, not_before=origin + max(0.0, behind) - spare)
            if utterance.interrupted or self.ended:
                return
            tail = pipeline.flush()
            if tail:
                pushed = True
                await playout.push(tail)
            playout.end()
        except Exception as exc:
            # Not only the engine's EngineError: a bug anywhere on the phone-audio path (a
            # malformed chunk, the conditioner, the playout) must end in the dialog's error
            # path too, never in an utterance that neither plays nor fails (silence).
            await self._failed(utterance, exc, pushed)
            return
        finally:
            pipeline.tap = None
            utterance.generated.set()
        self._pending_marks[utterance.id] = utterance
        playout.mark(utterance.id)

    async def _play(self, utterance: Utterance, pcm: npt.NDArray[np.int16]) -> None:
        pushed = False
        try:
            frames = self._prompt_frames.frames(pcm, self.codec)
            self.playout.begin(utterance)
            pushed = True
            await self.playout.push(frames)
        except Exception as exc:
            await self._failed(utterance, exc, pushed)
            return
        finally:
            utterance.generated.set()
        if utterance.interrupted or self.ended:
            return
        self._pending_marks[utterance.id] = utterance
        self.playout.mark(utterance.id)

    async def _failed(self, utterance: Utterance, exc: Exception, pushed: bool) -> None:
        """``utterance`` cannot be played: tell the dialog (its error path), log it once."""
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, EngineError):
            # An engine failure the speech service already handled (and counted): one line.
            log.warning("call %s: %s failed: %s", self.call_id, utterance.id, reason)
        else:
            # A bug: the traceback, once, with the call it hit.
            log.error("call %s: %s failed: %r", self.call_id, utterance.id, exc, exc_info=exc)
        self._pipeline.reset()
        if self._metrics is not None:
            self._metrics.speech_failures.labels(self._transport_name, self.line).inc()
        if pushed and not self.ended:
            # Whatever was sent of it is incomplete: drop it here and at the far end too.
            try:
                await self.playout.interrupt()
            except Exception:
                log.exception("call %s: clearing the failed %s failed", self.call_id,
                              utterance.id)
        # Only now does the dialog hear of it: the next prompt it starts must not be cleared by
        # the interrupt above.
        utterance.error = reason
        utterance.failed.set()
        self._post(SpeechFailed(utterance.id, reason, at=self.clock.now()))


#: What drives a call once it is up: the IVR runner, or the first-call greeter.
Dialog = Callable[[Call], Awaitable[None]]
