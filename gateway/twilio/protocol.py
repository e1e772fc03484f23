"""Sans-I/O Twilio Media Streams protocol (bidirectional ``<Connect><Stream>``).

Reference: https://www.twilio.com/docs/voice/media-streams/websocket-messages

:class:`MediaStreamProtocol` is fed the text of each WebSocket message and returns one typed
event; it builds the text of outbound ``media``, ``mark`` and ``clear`` messages from typed
objects. It never awaits and never touches a socket or a clock: the WebSocket stream in
:mod:`gateway.twilio.stream` only pumps.

Every rejected message raises a :class:`gateway.errors.CallProtocolError` subclass whose
``close_code`` the shell sends before closing *that* call's socket.

Fifty of every fifty-odd messages a second are ``media``. Their typed event, :class:`Media`, is
a plain slotted object, and a well-formed one on a started stream is read without pydantic: the
stdlib JSON parser, a check that it has only the documented fields and that each is an ASCII
string, the stream's SID, and a strict base64 decode (about a third of the cost of validating
and copying a model). Anything else, including a ``media`` message that is not exactly that, goes
through the full pydantic validation, which accepts it or rejects it with its precise reason:
the fast path only ever accepts what the full one accepts.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import re
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from gateway.errors import InvalidMessage, MessageTooLarge, ProtocolViolation, UnsupportedData

#: Default cap on one inbound message. A 20 ms media message is ~300 bytes; Twilio never sends
#: anything near this, so a larger message is hostile or broken.
MAX_MESSAGE_BYTES = 64 * 1024

#: The only inbound format Twilio Media Streams carries (docs: "audio/x-mulaw", 8000 Hz, mono).
SUPPORTED_ENCODING = "audio/x-mulaw"
SUPPORTED_SAMPLE_RATE = 8000

# Twilio SIDs are two letters and 32 hex digits; the docs' samples use "MZXXXX...". Accepting
# only [A-Za-z0-9] keeps the SID safe to splice into outbound JSON without escaping.
_SID_RE = re.compile(r"^[A-Za-z0-9]{2,64}$")


class _Wire(BaseModel):
    # Twilio adds fields over time; ignoring extras keeps old gateways working.
    model_config = ConfigDict(extra="ignore", frozen=True)


class Connected(_Wire):
    """First message on every stream: names the protocol."""

    event: Literal["connected"]
    protocol: str = "Call"
    version: str = ""


class MediaFormat(_Wire):
    """Format of the inbound media."""

    encoding: str
    sampleRate: int
    channels: int = 1


class StartMetadata(_Wire):
    """Stream metadata carried by ``start``."""

    accountSid: str
    streamSid: str
    callSid: str
    tracks: list[str] = Field(default_factory=list)
    mediaFormat: MediaFormat
    customParameters: dict[str, str] = Field(default_factory=dict)


class Start(_Wire):
    """Sent once, right after ``connected``."""

    event: Literal["start"]
    sequenceNumber: str = ""
    start: StartMetadata
    streamSid: str = ""


class MediaPayload(_Wire):
    """One chunk of inbound audio (base64 mu-law, normally 20 ms = 160 bytes)."""

    track: str = "inbound"
    chunk: str = ""
    timestamp: str = ""
    payload: str


class MediaMessage(_Wire):
    """The wire schema of an inbound ``media`` message (its event is :class:`Media`)."""

    event: Literal["media"]
    sequenceNumber: str = ""
    media: MediaPayload
    streamSid: str


@dataclass(slots=True)
class Media:
    """Inbound audio: :attr:`audio` holds the decoded mu-law bytes (normally 160, 20 ms).

    Treat it as read-only. Not ``frozen``: a frozen dataclass sets each field through
    ``object.__setattr__``, which is a quarter of the cost of reading the message.
    """

    streamSid: str
    audio: bytes
    sequenceNumber: str = ""
    track: str = "inbound"
    chunk: str = ""
    timestamp: str = ""

    event: ClassVar[str] = "media"


class DtmfPayload(_Wire):
    """A detected keypress."""

    track: str = "inbound_track"
    digit: str


class Dtmf(_Wire):
    """A keypress on the caller's side (bidirectional streams only)."""

    event: Literal["dtmf"]
    sequenceNumber: str = ""
    streamSid: str
    dtmf: DtmfPayload


class MarkPayload(_Wire):
    """Name of a mark we sent."""

    name: str


class Mark(_Wire):
    """Echo of a mark we sent: the audio before it has finished playing (or was cleared)."""

    event: Literal["mark"]
    sequenceNumber: str = ""
    streamSid: str
    mark: MarkPayload


class StopMetadata(_Wire):
    """Who stopped."""

    accountSid: str = ""
    callSid: str = ""


class Stop(_Wire):
    """The stream ended (the caller hung up or the TwiML moved on)."""

    event: Literal["stop"]
    sequenceNumber: str = ""
    streamSid: str
    stop: StopMetadata = Field(default_factory=StopMetadata)


InboundMessage = Annotated[
    Connected | Start | MediaMessage | Dtmf | Mark | Stop, Field(discriminator="event")
]
_INBOUND: TypeAdapter[Connected | Start | MediaMessage | Dtmf | Mark | Stop] = TypeAdapter(
    InboundMessage)
_KNOWN_EVENTS = frozenset({"connected", "start", "media", "dtmf", "mark", "stop"})
_DTMF_DIGITS = frozenset("0123456789*#ABCD")
# The documented fields of a media message and of its "media" object: the fast path takes a
# message with these only (Twilio adding one sends it down the full path, still accepted).
_MEDIA_FIELDS = frozenset({"event", "sequenceNumber", "media", "streamSid"})
_PAYLOAD_FIELDS = frozenset({"track", "chunk", "timestamp", "payload"})

#: One inbound event.
Inbound = Connected | Start | Media | Dtmf | Mark | Stop


# --- outbound ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutboundMedia:
    """Audio to play: mu-law 8 kHz bytes (we always send whole 20 ms frames)."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class OutboundMark:
    """Ask Twilio to echo ``name`` once everything sent before it has played."""

    name: str


@dataclass(frozen=True, slots=True)
class OutboundClear:
    """Drop every buffered outbound frame at Twilio (barge-in)."""


OutboundMessage = OutboundMedia | OutboundMark | OutboundClear


class StreamState(enum.Enum):
    """Lifecycle of one stream."""

    AWAITING_START = "awaiting_start"
    STREAMING = "streaming"
    STOPPED = "stopped"


class MediaStreamProtocol:
    """State machine of one Twilio Media Stream.

    ``receive(text)`` returns the typed event or raises a
    :class:`~gateway.errors.CallProtocolError`; ``send(message)`` returns the text to write.
    """

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self.state = StreamState.AWAITING_START
        self.stream_sid: str | None = None
        self.call_sid: str | None = None
        self.start_metadata: StartMetadata | None = None
        # Pre-built prefix of every outbound message of this stream: the per-frame path is one
        # base64 call and one string concatenation (perf-anchors: json.dumps ~3 us, template
        # ~0.4 us per frame).
        self._media_prefix = ""
        self._tail = ""

    # --- inbound ------------------------------------------------------------------------------

    def receive(self, data: str | bytes) -> Inbound:
        """Parse one inbound WebSocket message and advance the state machine."""
        if isinstance(data, bytes):
            raise UnsupportedData("binary frame: Twilio Media Streams sends JSON text only")
        # Cheap length check first; a str of n chars encodes to >= n bytes.
        if len(data) > self.max_message_bytes or (
            len(data) * 4 > self.max_message_bytes
            and len(data.encode("utf-8", "surrogatepass")) > self.max_message_bytes
        ):
            raise MessageTooLarge(f"message larger than {self.max_message_bytes} bytes")
        if self.state is StreamState.STREAMING:
            media = self._media(data)
            if media is not None:
                return media
        message = self._parse(data)
        return self._advance(message)

    def _media(self, data: str) -> Media | None:
        """The per-frame path: a well-formed ``media`` message of this started stream, read
        without pydantic; ``None`` for anything else (the full parser then decides)."""
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return None
        # Exactly the documented shape, every value an ASCII string: then the stdlib parser and
        # pydantic's read the same message (no NaN, no lone surrogate, nothing ignored).
        if type(obj) is not dict or obj.get("event") != "media" or not obj.keys() <= _MEDIA_FIELDS:
            return None
        media = obj.get("media")
        sequence = obj.get("sequenceNumber", "")
        if (type(media) is not dict or obj.get("streamSid") != self.stream_sid
                or type(sequence) is not str or not media.keys() <= _PAYLOAD_FIELDS):
            return None
        payload = media.get("payload")
        track = media.get("track", "inbound")
        chunk = media.get("chunk", "")
        timestamp = media.get("timestamp", "")
        if (type(payload) is not str or type(track) is not str or type(chunk) is not str
                or type(timestamp) is not str
                or not (sequence + track + chunk + timestamp).isascii()):
            return None
        try:
            audio = binascii.a2b_base64(payload, strict_mode=True)
        except (binascii.Error, ValueError):
            return None
        assert self.stream_sid is not None
        return Media(self.stream_sid, audio, sequence, track, chunk, timestamp)

    def _parse(self, data: str) -> Inbound:
        try:
            message = _INBOUND.validate_json(data)
        except ValidationError as exc:
            raise InvalidMessage(_describe(exc, data)) from None
        if isinstance(message, MediaMessage):
            try:
                # strict_mode rejects characters outside the alphabet and bad padding instead of
                # silently skipping them (Python >= 3.11).
                audio = binascii.a2b_base64(message.media.payload, strict_mode=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidMessage(f"media payload is not valid base64: {exc}") from None
            payload = message.media
            return Media(message.streamSid, audio, message.sequenceNumber, payload.track,
                         payload.chunk, payload.timestamp)
        if isinstance(message, Dtmf) and message.dtmf.digit not in _DTMF_DIGITS:
            raise InvalidMessage(f"dtmf digit {message.dtmf.digit[:8]!r} is not a DTMF key")
        return message

    def _advance(self, message: Inbound) -> Inbound:
        if isinstance(message, Connected):
            if self.state is not StreamState.AWAITING_START:
                raise ProtocolViolation("'connected' after the stream started")
            return message
        if isinstance(message, Start):
            if self.state is not StreamState.AWAITING_START:
                raise ProtocolViolation("a second 'start' on one stream")
            meta = message.start
            fmt = meta.mediaFormat
            if fmt.encoding != SUPPORTED_ENCODING or fmt.sampleRate != SUPPORTED_SAMPLE_RATE:
                raise ProtocolViolation(
                    f"unsupported mediaFormat {fmt.encoding}/{fmt.sampleRate}: "
                    f"expected {SUPPORTED_ENCODING}/{SUPPORTED_SAMPLE_RATE}"
                )
            if fmt.channels != 1:
                raise ProtocolViolation(f"unsupported mediaFormat: {fmt.channels} channels")
            if not _SID_RE.match(meta.streamSid):
                raise InvalidMessage("start.streamSid is not a Twilio SID")
            if not _SID_RE.match(meta.callSid):
                # The call SID keys the gateway's call table and every log line of the call: a
                # 60 KB or multi-line value would forge log lines and bloat both.
                raise InvalidMessage("start.callSid is not a Twilio SID")
            if message.streamSid and message.streamSid != meta.streamSid:
                raise ProtocolViolation("start.streamSid and streamSid disagree")
            self.state = StreamState.STREAMING
            self.stream_sid = meta.streamSid
            self.call_sid = meta.callSid
            self.start_metadata = meta
            self._media_prefix = (
                '{"event":"media","streamSid":"' + meta.streamSid + '","media":{"payload":"'
            )
            self._tail = '"}}'
            return message
        # media / dtmf / mark / stop
        if self.state is StreamState.AWAITING_START:
            raise ProtocolViolation(f"'{message.event}' before 'start'")
        if self.state is StreamState.STOPPED:
            raise ProtocolViolation(f"'{message.event}' after 'stop'")
        if message.streamSid != self.stream_sid:
            raise ProtocolViolation(f"unknown streamSid {message.streamSid[:40]!r}")
        if isinstance(message, Stop):
            self.state = StreamState.STOPPED
        return message

    # --- outbound -----------------------------------------------------------------------------

    def send(self, message: OutboundMessage) -> str:
        """Text of one outbound message. Only valid once the stream has started."""
        if self.stream_sid is None:
            raise ProtocolViolation("cannot send before 'start'")
        if isinstance(message, OutboundMedia):
            return self.media_text(message.payload)
        if isinstance(message, OutboundMark):
            return json.dumps(
                {"event": "mark", "streamSid": self.stream_sid, "mark": {"name": message.name}},
                separators=(",", ":"),
            )
        return '{"event":"clear","streamSid":"' + self.stream_sid + '"}'

    def media_text(self, payload: bytes) -> str:
        """Per-frame fast path of ``send(OutboundMedia(payload))``."""
        return self._media_prefix + base64.b64encode(payload).decode("ascii") + self._tail


def _describe(exc: ValidationError, data: str) -> str:
    """One precise line for a rejected message (no payload echoed back into logs)."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0] if errors else {"type": "", "loc": (), "msg": str(exc)}
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "message is not valid JSON"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        try:
            event = json.loads(data).get("event")
        except (ValueError, AttributeError):
            event = None
        if event is None:
            return "message has no 'event' field"
        if not isinstance(event, str) or event not in _KNOWN_EVENTS:
            return f"unknown event {str(event)[:40]!r}"
    if not first.get("loc") and kind in ("model_type", "model_attributes_type", "dict_type"):
        return "message is not a JSON object"
    loc = ".".join(str(part) for part in first.get("loc", ()))
    return f"invalid field {loc or '<root>'}: {first.get('msg', '')}"
