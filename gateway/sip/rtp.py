"""RTP for the SIP leg: packets, DTMF events, our outgoing stream and receive statistics.

Sans-I/O (STYLE.md 1): nothing here opens a socket or reads a clock. The UDP shell hands in the
datagram bytes and their arrival time, and sends the bytes it is given back.

- :class:`RtpPacket`: the RTP fixed header, CSRC list, header extension and padding
  (RFC 3550 section 5.1 and 5.3.1) as a value object with :meth:`~RtpPacket.parse` /
  :meth:`~RtpPacket.serialize`.
- :class:`TelephoneEvent` and :class:`DtmfReceiver`: RFC 4733 named telephone events (DTMF),
  one digit reported per key press at the event's first packet.
- :class:`RtpSender`: packetizes our 20 ms frames (sequence, timestamp, marker bit per
  RFC 3551 section 4.1).
- :class:`RtpReceiverStats`: the RFC 3550 appendix A.1 sequence bookkeeping (extended highest
  sequence number, expected, lost) and the appendix A.8 interarrival jitter.
- :class:`RtpPayloadDecoder`: G.711 payload to int16 PCM through :mod:`gateway.audio.g711`.

Sequence numbers (16 bit) and timestamps (32 bit) wrap; all modular arithmetic goes through
:func:`seq_add`, :func:`seq_diff`, :func:`seq_gt`, :func:`ts_add`, :func:`ts_diff` and
:func:`ts_gt`.

Errors: everything raised on purpose is :class:`RtpError` (a
:class:`~gateway.errors.GatewayError`). Its protocol outcome (STYLE.md 10) is *a logged and
dropped RTP packet*: a malformed datagram never ends the call, since UDP may deliver anything to
an open port. Misuse of the sending side (out-of-range header fields, a bad constructor
argument) raises it too, with a message naming the field.
"""

from __future__ import annotations

import collections
import random
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

import numpy as np
import numpy.typing as npt

from gateway.audio.g711 import alaw_decode, ulaw_decode
from gateway.errors import GatewayError

__all__ = [
    "DIGIT_TO_EVENT",
    "EVENT_TO_DIGIT",
    "MAX_DROPOUT",
    "MAX_MISORDER",
    "MIN_SEQUENTIAL",
    "PAYLOAD_TYPE_PCMA",
    "PAYLOAD_TYPE_PCMU",
    "RTP_HEADER_SIZE",
    "RTP_VERSION",
    "SAMPLES_PER_FRAME",
    "SEQ_MOD",
    "TELEPHONE_EVENT_SIZE",
    "TS_MOD",
    "DtmfReceiver",
    "DtmfSender",
    "RtpError",
    "RtpPacket",
    "RtpPayloadDecoder",
    "RtpReceiverStats",
    "RtpSender",
    "TelephoneEvent",
    "seq_add",
    "seq_diff",
    "seq_gt",
    "ts_add",
    "ts_diff",
    "ts_gt",
]

# --- wrap-around arithmetic (RFC 3550 section 5.1: sequence 16 bit, timestamp 32 bit) ----------

SEQ_MOD: Final[int] = 1 << 16
"""Modulus of the RTP sequence number (``RTP_SEQ_MOD`` in RFC 3550 appendix A.1)."""

SEQ_MASK: Final[int] = SEQ_MOD - 1
SEQ_HALF: Final[int] = SEQ_MOD >> 1

TS_MOD: Final[int] = 1 << 32
"""Modulus of the RTP timestamp."""

TS_MASK: Final[int] = TS_MOD - 1
TS_HALF: Final[int] = TS_MOD >> 1


def seq_add(a: int, n: int) -> int:
    """``a + n`` in the 16-bit sequence space (``n`` may be negative)."""
    return (a + n) & SEQ_MASK


def seq_diff(a: int, b: int) -> int:
    """Signed shortest distance ``a - b`` in the 16-bit sequence space, in [-32768, 32767].

    ``seq_diff(0, 65535) == 1``: 0 is the packet after 65535. Exactly half the space apart is
    ambiguous and reads as -32768 (so neither :func:`seq_gt` direction holds).
    """
    d = (a - b) & SEQ_MASK
    return d - SEQ_MOD if d >= SEQ_HALF else d


def seq_gt(a: int, b: int) -> bool:
    """Whether sequence number ``a`` is newer than ``b`` (serial-number order, RFC 1982)."""
    return 0 < ((a - b) & SEQ_MASK) < SEQ_HALF


def ts_add(a: int, n: int) -> int:
    """``a + n`` in the 32-bit timestamp space (``n`` may be negative)."""
    return (a + n) & TS_MASK


def ts_diff(a: int, b: int) -> int:
    """Signed shortest distance ``a - b`` in the 32-bit timestamp space."""
    d = (a - b) & TS_MASK
    return d - TS_MOD if d >= TS_HALF else d


def ts_gt(a: int, b: int) -> bool:
    """Whether timestamp ``a`` is later than ``b`` (serial-number order, RFC 1982)."""
    return 0 < ((a - b) & TS_MASK) < TS_HALF


# --- packets (RFC 3550 section 5.1) ------------------------------------------------------------

RTP_VERSION: Final[int] = 2
RTP_HEADER_SIZE: Final[int] = 12
"""Octets in the fixed header, before any CSRC identifiers."""

MAX_CSRC: Final[int] = 15
"""The CC field is 4 bits."""

MAX_PAYLOAD_TYPE: Final[int] = 127

PAYLOAD_TYPE_PCMU: Final[int] = 0
"""Static payload type of G.711 mu-law, 8000 Hz (RFC 3551 table 4)."""

PAYLOAD_TYPE_PCMA: Final[int] = 8
"""Static payload type of G.711 A-law, 8000 Hz (RFC 3551 table 4)."""

SAMPLES_PER_FRAME: Final[int] = 160
"""20 ms at 8000 Hz, the RFC 3551 section 4.5.14 default packetization for G.711."""

_VERSION_BITS: Final[int] = RTP_VERSION << 6
_PADDING_BIT: Final[int] = 0x20
_EXTENSION_BIT: Final[int] = 0x10
_CC_MASK: Final[int] = 0x0F
_MARKER_BIT: Final[int] = 0x80
_PT_MASK: Final[int] = 0x7F

# V|P|X|CC, M|PT, sequence, timestamp, SSRC.
_HEADER: Final = struct.Struct("!BBHII")
# Header extension: profile-defined 16 bits, length in 32-bit words (RFC 3550 section 5.3.1).
_EXTENSION_HEADER: Final = struct.Struct("!HH")
_CSRC_LISTS: Final = tuple(struct.Struct(f"!{n}I") for n in range(MAX_CSRC + 1))


class RtpError(GatewayError):
    """A malformed RTP packet or telephone-event payload, or an out-of-range field to send.

    Outcome for received data: log and drop the packet; the call continues.
    """


@dataclass(slots=True)
class RtpPacket:
    """One RTP packet (RFC 3550 section 5.1).

    ``extension`` is ``(profile_defined, data)`` with ``len(data)`` a multiple of 4
    (RFC 3550 section 5.3.1). ``padding`` is the number of padding octets after the payload,
    the last of which holds that count; :meth:`serialize` writes the others as zero.
    """

    payload_type: int
    sequence: int
    timestamp: int
    ssrc: int
    payload: bytes = b""
    marker: bool = False
    csrc: list[int] = field(default_factory=list)
    extension: tuple[int, bytes] | None = None
    padding: int = 0

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview) -> RtpPacket:
        """Parse one datagram; raise :class:`RtpError` saying what is wrong with it.

        Checks the RFC 3550 appendix A.1 validity rules that need no session state: version 2,
        a complete fixed header, CSRC list and header extension, and a padding count that fits.
        A packet that is all padding (empty payload) is accepted; some senders use them to probe
        bandwidth. Payload type 72-76 (RTCP multiplexed per RFC 5761) is the caller's concern.
        """
        if type(data) is not bytes:
            data = bytes(data)
        length = len(data)
        if length < RTP_HEADER_SIZE:
            raise RtpError(
                f"RTP packet too short: {length} bytes, the fixed header needs {RTP_HEADER_SIZE}"
            )
        first, second, sequence, timestamp, ssrc = _HEADER.unpack_from(data)
        if first >> 6 != RTP_VERSION:
            raise RtpError(f"RTP version {first >> 6}, expected {RTP_VERSION}")
        pos = RTP_HEADER_SIZE
        count = first & _CC_MASK
        if count:
            pos += 4 * count
            if length < pos:
                raise RtpError(
                    f"RTP packet truncated: CSRC count {count} needs {pos} header bytes, "
                    f"got {length}"
                )
            csrc = list(_CSRC_LISTS[count].unpack_from(data, RTP_HEADER_SIZE))
        else:
            csrc = []
        extension = None
        if first & _EXTENSION_BIT:
            if length < pos + 4:
                raise RtpError(
                    f"RTP packet truncated: extension bit set but only {length - pos} bytes "
                    "after the CSRC list, the extension header needs 4"
                )
            profile, words = _EXTENSION_HEADER.unpack_from(data, pos)
            pos += 4
            end = pos + 4 * words
            if length < end:
                raise RtpError(
                    f"RTP packet truncated: header extension of {words} words needs {4 * words} "
                    f"bytes, got {length - pos}"
                )
            extension = (profile, data[pos:end])
            pos = end
        end = length
        padding = 0
        if first & _PADDING_BIT:
            padding = data[-1]
            if padding == 0:
                raise RtpError("RTP padding bit set but the padding count (last octet) is 0")
            if padding > length - pos:
                raise RtpError(
                    f"RTP padding count {padding} exceeds the {length - pos} bytes after the header"
                )
            end -= padding
        return cls(
            second & _PT_MASK,
            sequence,
            timestamp,
            ssrc,
            data[pos:end],
            bool(second & _MARKER_BIT),
            csrc,
            extension,
            padding,
        )

    def serialize(self) -> bytes:
        """The packet's wire bytes; raise :class:`RtpError` naming any out-of-range field."""
        payload_type = self.payload_type
        if not 0 <= payload_type <= MAX_PAYLOAD_TYPE:
            raise RtpError(f"RTP payload type {payload_type} outside 0..{MAX_PAYLOAD_TYPE}")
        csrc = self.csrc
        count = len(csrc)
        first = _VERSION_BITS | count
        if count > MAX_CSRC:
            raise RtpError(f"RTP packet has {count} CSRC identifiers, at most {MAX_CSRC} fit")
        extension = self.extension
        if extension is not None:
            first |= _EXTENSION_BIT
        padding = self.padding
        if padding:
            if not 0 < padding <= 0xFF:
                raise RtpError(f"RTP padding {padding} outside 0..255")
            first |= _PADDING_BIT
        try:
            data = _HEADER.pack(
                first,
                payload_type | _MARKER_BIT if self.marker else payload_type,
                self.sequence,
                self.timestamp,
                self.ssrc,
            )
            if count:
                data += _CSRC_LISTS[count].pack(*csrc)
        except struct.error:
            raise RtpError(self._range_error()) from None
        if extension is not None:
            profile, ext_data = extension
            words, rest = divmod(len(ext_data), 4)
            if rest or words > 0xFFFF or not 0 <= profile <= 0xFFFF:
                raise RtpError(
                    f"RTP header extension needs a 16-bit profile value and a multiple of 4 bytes "
                    f"(at most {4 * 0xFFFF}); got profile {profile}, {len(ext_data)} bytes"
                )
            data += _EXTENSION_HEADER.pack(profile, words) + ext_data
        if padding:
            return data + self.payload + bytes(padding - 1) + bytes((padding,))
        return data + self.payload

    __bytes__ = serialize

    def _range_error(self) -> str:
        for name, value, limit in (
            ("sequence", self.sequence, SEQ_MASK),
            ("timestamp", self.timestamp, TS_MASK),
            ("ssrc", self.ssrc, TS_MASK),
        ):
            if not 0 <= value <= limit:
                return f"RTP {name} {value} outside 0..{limit}"
        return f"RTP CSRC identifiers {self.csrc} not all within 0..{TS_MASK}"


# --- RFC 4733 telephone events -----------------------------------------------------------------

TELEPHONE_EVENT_SIZE: Final[int] = 4
"""Octets of one event in a telephone-event payload (RFC 4733 section 2.3)."""

MAX_EVENT_DURATION: Final[int] = 0xFFFF
"""Largest duration field; longer events are split into segments (RFC 4733 section 2.5.1.3)."""

_EVENT: Final = struct.Struct("!BBH")
_END_BIT: Final[int] = 0x80
_VOLUME_MASK: Final[int] = 0x3F

EVENT_TO_DIGIT: Final[Mapping[int, str]] = MappingProxyType(
    {**{n: str(n) for n in range(10)}, 10: "*", 11: "#", 12: "A", 13: "B", 14: "C", 15: "D"}
)
"""DTMF event codes to key labels (RFC 4733 section 3.2, table 3)."""

DIGIT_TO_EVENT: Final[Mapping[str, int]] = MappingProxyType(
    {digit: event for event, digit in EVENT_TO_DIGIT.items()}
)
"""Inverse of :data:`EVENT_TO_DIGIT`."""


@dataclass(slots=True)
class TelephoneEvent:
    """One RFC 4733 named-event payload (section 2.3).

    ``event`` is the code (0-255; :data:`EVENT_TO_DIGIT` for DTMF), ``end`` the E bit,
    ``volume`` the power level in -dBm0 (0-63), ``duration`` in timestamp units since the
    event's start (the RTP timestamp of all its packets). The R bit is ignored on receipt and
    sent as zero (section 2.3.3).
    """

    event: int
    end: bool
    volume: int
    duration: int

    @classmethod
    def parse(cls, payload: bytes) -> TelephoneEvent:
        """Parse a telephone-event payload of exactly 4 bytes, else raise :class:`RtpError`."""
        if len(payload) != TELEPHONE_EVENT_SIZE:
            raise RtpError(
                f"telephone-event payload must be {TELEPHONE_EVENT_SIZE} bytes "
                f"(RFC 4733 section 2.3), got {len(payload)}"
            )
        event, flags, duration = _EVENT.unpack(payload)
        return cls(event, bool(flags & _END_BIT), flags & _VOLUME_MASK, duration)

    def serialize(self) -> bytes:
        """The 4 payload bytes; raise :class:`RtpError` naming any out-of-range field."""
        if not 0 <= self.event <= 0xFF:
            raise RtpError(f"telephone-event code {self.event} outside 0..255")
        if not 0 <= self.volume <= _VOLUME_MASK:
            raise RtpError(f"telephone-event volume {self.volume} outside 0..{_VOLUME_MASK}")
        if not 0 <= self.duration <= MAX_EVENT_DURATION:
            raise RtpError(
                f"telephone-event duration {self.duration} outside 0..{MAX_EVENT_DURATION}"
            )
        flags = _END_BIT | self.volume if self.end else self.volume
        return _EVENT.pack(self.event, flags, self.duration)

    __bytes__ = serialize


class DtmfReceiver:
    """Turns received telephone-event packets into digits, one per key press.

    An event is identified by its RTP timestamp: every packet of one event (start, updates, the
    usually triplicated end packet) carries the event's start time, and the next event gets a new
    one (RFC 4733 section 2.5.1.2 and 2.5.1.4). A digit is therefore reported at the *first*
    packet seen with a timestamp newer than the last event's, whatever its E bit says: that is the
    lowest latency for barge-in, and an event whose start packets were all lost is still reported
    once, from its end packet. Packets of the current event and older ones (reordered or late
    retransmissions) report nothing.

    A key held past the 16-bit duration (about 8.2 s at 8 kHz) continues in a new segment whose
    timestamp is the previous one plus 0xFFFF (RFC 4733 section 2.5.1.3); that is not a new press.
    A new SSRC (the far end restarted its stream) starts afresh.

    ``payload_type``: when given, packets of other payload types are ignored, so the caller may
    feed the whole stream; when ``None`` the caller feeds only the negotiated telephone-event type.
    A payload that is not one 4-byte event raises :class:`RtpError` (log and drop it).
    """

    def __init__(self, payload_type: int | None = None) -> None:
        self.payload_type = payload_type
        self.events = 0
        """Distinct events seen (DTMF or not)."""
        self.last_duration = 0
        """Longest duration (timestamp units) seen for the latest event (its current segment)."""
        self.last_event: TelephoneEvent | None = None
        """The latest packet's payload of the latest event."""
        self._ssrc: int | None = None
        self._timestamp = 0
        self._ended = False

    def feed(self, packet: RtpPacket) -> str | None:
        """Return the digit if ``packet`` starts a new DTMF key press, else ``None``."""
        if self.payload_type is not None and packet.payload_type != self.payload_type:
            return None
        event = TelephoneEvent.parse(packet.payload)
        timestamp = packet.timestamp
        if self._ssrc != packet.ssrc:
            self._ssrc = packet.ssrc
            self.last_event = None
        previous = self.last_event
        if previous is not None:
            if timestamp == self._timestamp:
                self._update(event)
                return None
            if not ts_gt(timestamp, self._timestamp):
                return None
            if (
                not self._ended
                and event.event == previous.event
                and timestamp == ts_add(self._timestamp, MAX_EVENT_DURATION)
            ):
                # Next segment of a long event (RFC 4733 section 2.5.1.3).
                self._timestamp = timestamp
                self.last_duration = 0
                self._update(event)
                return None
        self._timestamp = timestamp
        self.events += 1
        self.last_duration = 0
        self._ended = False
        self._update(event)
        return EVENT_TO_DIGIT.get(event.event)

    def _update(self, event: TelephoneEvent) -> None:
        self.last_event = event
        if event.duration > self.last_duration:
            self.last_duration = event.duration
        if event.end:
            self._ended = True


class DtmfSender:
    """Keys sent as RFC 4733 telephone events, planned one 20 ms frame at a time (sans-I/O).

    Each key is an event of ``tone_ms`` whose packets all carry the event's first timestamp and
    a growing duration; its last packet has the E bit and is sent three times (RFC 4733
    section 2.5.1.4: the end is retransmitted, since it is what a receiver waits for). A gap
    of ``gap_ms`` follows each key; ``w`` is a pause of ``pause_ms`` (Twilio's ``sendDigits``).
    While a key is on the wire its frames replace the audio (section 2.5.1.2 lets a sender
    mute it); gaps and pauses carry the audio as usual.

    :meth:`next` is asked once per outgoing frame: the event payload for that frame and whether
    it starts an event (the marker bit; its packets then carry that frame's timestamp), or None
    for an audio frame.
    """

    def __init__(self, digits: str, *, tone_ms: int = 100, gap_ms: int = 100,
                 pause_ms: int = 500, volume: int = 10,
                 samples_per_frame: int = SAMPLES_PER_FRAME) -> None:
        unknown = [d for d in digits if d not in DIGIT_TO_EVENT and d != "w"]
        if unknown:
            raise RtpError(f"{unknown[0]!r} is not a DTMF key (0-9, *, #, A-D; w pauses)")
        frame_ms = max(1, samples_per_frame // 8)
        #: Per frame: (payload, starts an event, ends a key) or None (audio).
        self._frames: collections.deque[tuple[bytes, bool, bool] | None] = collections.deque()
        for digit in digits:
            if digit == "w":
                self._frames.extend([None] * (pause_ms // frame_ms))
                continue
            event, n = DIGIT_TO_EVENT[digit], max(1, tone_ms // frame_ms)
            for i in range(n - 1):
                payload = TelephoneEvent(event, False, volume, (i + 1) * samples_per_frame)
                self._frames.append((payload.serialize(), i == 0, False))
            end = TelephoneEvent(event, True, volume, n * samples_per_frame).serialize()
            self._frames.extend([(end, n == 1, False), (end, False, False), (end, False, True)])
            self._frames.extend([None] * (gap_ms // frame_ms))
        #: Keys whose events have all been sent.
        self.sent = 0

    @property
    def done(self) -> bool:
        return not self._frames

    def next(self) -> tuple[bytes, bool] | None:
        """The next frame's event payload and marker (None: send audio this frame)."""
        if not self._frames:
            return None
        frame = self._frames.popleft()
        if frame is None:
            return None
        payload, first, last = frame
        self.sent += last
        return payload, first


# --- our outgoing stream -----------------------------------------------------------------------

_SYSTEM_RANDOM: Final = random.SystemRandom()


class RtpSender:
    """Packetizer for one outgoing RTP stream (sans-I/O: returns bytes, the shell sends them).

    SSRC, first sequence number and first timestamp are random unless given (RFC 3550
    section 5.1 and 8.1); by default from the OS's CSPRNG, since predictable values ease
    known-plaintext attacks on encrypted media. Pass ``rng`` (e.g. ``random.Random(0)``) for
    reproducible tests.

    Each :meth:`packet` is one frame of ``samples_per_frame`` samples: the sequence number
    advances by 1 and the timestamp by the frame's sampling instants, both wrapping. The marker
    bit is set on the first packet of the stream and of every talkspurt (RFC 3551 section 4.1):
    after :meth:`start_talkspurt` (e.g. after barge-in flushed queued audio) or :meth:`skip`.
    """

    def __init__(
        self,
        payload_type: int,
        ssrc: int | None = None,
        initial_sequence: int | None = None,
        initial_timestamp: int | None = None,
        samples_per_frame: int = SAMPLES_PER_FRAME,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 <= payload_type <= MAX_PAYLOAD_TYPE:
            raise RtpError(f"RTP payload type {payload_type} outside 0..{MAX_PAYLOAD_TYPE}")
        if not 0 < samples_per_frame < TS_HALF:
            raise RtpError(f"samples_per_frame {samples_per_frame} must be positive")
        rng = _SYSTEM_RANDOM if rng is None else rng
        self.payload_type = payload_type
        self.ssrc = rng.getrandbits(32) if ssrc is None else ssrc
        self.sequence = rng.getrandbits(16) if initial_sequence is None else initial_sequence
        """Sequence number of the next packet."""
        self.timestamp = rng.getrandbits(32) if initial_timestamp is None else initial_timestamp
        """Timestamp of the next packet."""
        for name, value, limit in (
            ("ssrc", self.ssrc, TS_MASK),
            ("initial_sequence", self.sequence, SEQ_MASK),
            ("initial_timestamp", self.timestamp, TS_MASK),
        ):
            if not 0 <= value <= limit:
                raise RtpError(f"RTP {name} {value} outside 0..{limit}")
        self.samples_per_frame = samples_per_frame
        self.packets_sent = 0
        """Sender's packet count (RFC 3550 section 6.4.1)."""
        self.octets_sent = 0
        """Sender's octet count: payload octets only (RFC 3550 section 6.4.1)."""
        self._marker = True

    def start_talkspurt(self) -> None:
        """Set the marker bit on the next packet (RFC 3551 section 4.1)."""
        self._marker = True

    def skip(self, frames: int = 1) -> None:
        """Advance the timestamp by ``frames`` unsent frames (silence suppression).

        The sequence number stays put, since it counts packets sent (RFC 3550 section 5.1), and
        the next packet opens a talkspurt, so it carries the marker bit (RFC 3551 section 4.1).
        """
        if frames < 0:
            raise RtpError(f"cannot skip {frames} frames")
        if frames:
            self.timestamp = ts_add(self.timestamp, frames * self.samples_per_frame)
            self._marker = True

    def packet(self, payload: bytes) -> bytes:
        """Serialized RTP packet carrying one frame's ``payload``; advances sequence/timestamp."""
        second = self.payload_type
        if self._marker:
            second |= _MARKER_BIT
            self._marker = False
        return self._emit(second, self.timestamp, payload)

    def event_packet(self, payload: bytes, payload_type: int, timestamp: int,
                     marker: bool) -> bytes:
        """Serialized packet of a payload that rides in the stream on its own terms: an RFC 4733
        event has its own payload type and keeps its start ``timestamp`` in every packet, with
        the ``marker`` on its first only (RFC 4733 2.5.1), while the stream's sampling clock
        advances under it as for any frame. A pending talkspurt marker stays for the next
        :meth:`packet`."""
        if not 0 <= payload_type <= MAX_PAYLOAD_TYPE:
            raise RtpError(f"RTP payload type {payload_type} outside 0..{MAX_PAYLOAD_TYPE}")
        second = payload_type | _MARKER_BIT if marker else payload_type
        return self._emit(second, timestamp & TS_MASK, payload)

    def _emit(self, second: int, timestamp: int, payload: bytes) -> bytes:
        data = _HEADER.pack(_VERSION_BITS, second, self.sequence, timestamp, self.ssrc)
        self.sequence = seq_add(self.sequence, 1)
        self.timestamp = ts_add(self.timestamp, self.samples_per_frame)
        self.packets_sent += 1
        self.octets_sent += len(payload)
        return data + payload


# --- reception statistics (RFC 3550 appendix A.1 and A.8) --------------------------------------

MAX_DROPOUT: Final[int] = 3000
"""Largest forward sequence jump taken as loss rather than a restart (RFC 3550 appendix A.1)."""

MAX_MISORDER: Final[int] = 100
"""Largest backward sequence jump taken as reordering (RFC 3550 appendix A.1)."""

MIN_SEQUENTIAL: Final[int] = 2
"""Packets in sequence before a source is valid (RFC 3550 appendix A.1)."""

_DUPLICATE_WINDOW: Final[int] = 128
"""Sequence numbers remembered for duplicate detection; must exceed :data:`MAX_MISORDER`."""

_WINDOW_MASK: Final[int] = (1 << _DUPLICATE_WINDOW) - 1


class RtpReceiverStats:
    """Per-source reception statistics: RFC 3550 appendix A.1 and A.8, for RTCP and metrics.

    Feed every received packet of the source (the caller checks the transport source address and
    keeps one instance per stream). A packet with a new SSRC restarts the statistics for it.

    - Sequence validation as in appendix A.1: a source is valid after ``min_sequential`` packets
      in sequence (probation); a jump of :data:`MAX_DROPOUT` or more is a restart only when the
      next packet follows it. :meth:`update` returns whether to use the packet.
    - ``received`` counts late packets and duplicates, so :attr:`lost` (expected minus received,
      RFC 3550 section 6.4.1) may be negative; ``duplicates`` counts the packets seen twice
      within the last 128 sequence numbers.
    - :attr:`jitter` is the A.8 estimator ``J += (|D| - J) / 16`` in timestamp units
      (:attr:`jitter_ms` in milliseconds). Duplicates and discarded packets do not update it.
    """

    def __init__(self, min_sequential: int = MIN_SEQUENTIAL) -> None:
        if min_sequential < 1:
            raise RtpError(f"min_sequential {min_sequential} must be at least 1")
        self.min_sequential = min_sequential
        self.ssrc: int | None = None
        self.received = 0
        """Packets received since the source became valid, duplicates and late ones included."""
        self.duplicates = 0
        self.cycles = 0
        """Sequence wrap count, shifted: a multiple of :data:`SEQ_MOD` (A.1 ``cycles``)."""
        self.base_seq = 0
        self.max_seq = 0
        self.jitter = 0.0
        """Interarrival jitter in timestamp units (RFC 3550 section 6.4.1, appendix A.8)."""
        self.clock_rate = 8000
        self._bad_seq = SEQ_MOD + 1
        self._probation = min_sequential
        self._seen = 0
        self._transit: float | None = None

    @property
    def valid(self) -> bool:
        """Whether the source has passed probation."""
        return self.ssrc is not None and self._probation == 0

    @property
    def extended_highest_sequence(self) -> int:
        """Highest sequence number received, extended by the wrap count (A.1)."""
        return self.cycles + self.max_seq

    @property
    def expected(self) -> int:
        """Packets expected since the source became valid (RFC 3550 appendix A.3)."""
        if not self.valid:
            return 0
        return self.cycles + self.max_seq - self.base_seq + 1

    @property
    def lost(self) -> int:
        """Cumulative packets lost: expected minus received (may be negative, section 6.4.1)."""
        return self.expected - self.received

    @property
    def jitter_ms(self) -> float:
        """:attr:`jitter` in milliseconds, at the clock rate of the latest update."""
        return self.jitter * 1000.0 / self.clock_rate

    def _init_seq(self, seq: int) -> None:
        self.base_seq = seq
        self.max_seq = seq
        self._bad_seq = SEQ_MOD + 1
        self.cycles = 0
        self.received = 0
        self.duplicates = 0
        self._seen = 1
        # A restart breaks the timestamp/arrival relation; the next packet re-anchors it.
        self._transit = None

    def update(
        self,
        packet: RtpPacket,
        arrival_time_s: float,
        clock_rate: int = 8000,
        *,
        update_jitter: bool = True,
    ) -> bool:
        """Account for one received packet; return whether to use it (A.1 ``update_seq``).

        ``False`` means discard: the source is still on probation, the packet jumped
        :data:`MAX_DROPOUT` or more ahead without a follower yet, or it is a duplicate.

        ``arrival_time_s`` is the receive time on any monotonic clock (only differences count).
        ``clock_rate`` is the payload's RTP clock. Pass ``update_jitter=False`` for packets whose
        timestamp does not follow the sampling clock, e.g. RFC 4733 events, which repeat their
        start timestamp for a whole key press and would read as jitter.
        """
        seq = packet.sequence
        if packet.ssrc != self.ssrc:
            self.ssrc = packet.ssrc
            self._init_seq(seq)
            self.max_seq = seq_add(seq, -1)
            self._probation = self.min_sequential
            self.jitter = 0.0
        if self._probation:
            if seq == seq_add(self.max_seq, 1):
                self._probation -= 1
                self.max_seq = seq
                if self._probation == 0:
                    self._init_seq(seq)
                    self.received += 1
                    self._update_jitter(packet, arrival_time_s, clock_rate, update_jitter)
                    return True
            else:
                self._probation = self.min_sequential - 1
                self.max_seq = seq
            return False
        udelta = (seq - self.max_seq) & SEQ_MASK
        if udelta < MAX_DROPOUT:
            if udelta:
                if seq < self.max_seq:
                    self.cycles += SEQ_MOD
                self.max_seq = seq
                self._seen = ((self._seen << udelta) | 1) & _WINDOW_MASK
            elif self._seen & 1:
                self.received += 1
                self.duplicates += 1
                return False
        elif udelta <= SEQ_MOD - MAX_MISORDER:
            if seq != self._bad_seq:
                self._bad_seq = seq_add(seq, 1)
                return False
            # Two sequential packets after a big jump: the sender restarted; resync (A.1).
            self._init_seq(seq)
        else:
            # Reordered or duplicate, at most MAX_MISORDER behind.
            bit = 1 << (SEQ_MOD - udelta)
            if self._seen & bit:
                self.received += 1
                self.duplicates += 1
                return False
            self._seen |= bit
        self.received += 1
        self._update_jitter(packet, arrival_time_s, clock_rate, update_jitter)
        return True

    def _update_jitter(
        self, packet: RtpPacket, arrival_time_s: float, clock_rate: int, update_jitter: bool
    ) -> None:
        if not update_jitter:
            return
        self.clock_rate = clock_rate
        # A.8: transit time in timestamp units; its absolute value is meaningless (unsynchronized
        # clocks), only successive differences D(i-1, i) count.
        transit = arrival_time_s * clock_rate - packet.timestamp
        previous = self._transit
        self._transit = transit
        if previous is None:
            return
        d = transit - previous
        # The timestamp wraps; fold the difference back into the signed 32-bit range.
        if d >= TS_HALF:
            d -= TS_MOD
        elif d < -TS_HALF:
            d += TS_MOD
        self.jitter += (abs(d) - self.jitter) / 16.0


# --- payload decoding --------------------------------------------------------------------------


class RtpPayloadDecoder:
    """Decodes G.711 payloads ("PCMU"/"PCMA", any case: RFC 3551 table 4) to int16 PCM."""

    def __init__(self, codec: str) -> None:
        name = codec.upper()
        if name == "PCMU":
            self._decode = ulaw_decode
        elif name == "PCMA":
            self._decode = alaw_decode
        else:
            raise RtpError(f"no RTP payload decoder for codec {codec!r}; expected PCMU or PCMA")
        self.codec = name

    @classmethod
    def for_payload_type(cls, payload_type: int) -> RtpPayloadDecoder:
        """The decoder of a static G.711 payload type (0 = PCMU, 8 = PCMA)."""
        if payload_type == PAYLOAD_TYPE_PCMU:
            return cls("PCMU")
        if payload_type == PAYLOAD_TYPE_PCMA:
            return cls("PCMA")
        raise RtpError(f"payload type {payload_type} is not a static G.711 type (0 or 8)")

    def decode(self, payload: bytes) -> npt.NDArray[np.int16]:
        """One sample per payload byte, as int16."""
        return self._decode(payload)
