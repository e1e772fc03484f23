"""A simulated phone for load tests: a minimal SIP UAC plus an RTP endpoint over UDP (asyncio).

This is the load simulator's *own* client stack, deliberately independent of the gateway's
server side (``gateway.sip``): a parsing bug there cannot hide itself by being shared here. The
only gateway module used is :mod:`gateway.audio.g711` (the mu-law table).

What a :class:`SipCaller` does, like a desk phone calling an IVR:

- **Signalling** (RFC 3261 over UDP): INVITE with an SDP offer (PCMU/8000 on PT 0 and
  telephone-event/8000 on PT 101, ``fmtp 0-15``, ``ptime 20``, ``sendrecv``; RFC 3264/4566);
  Timer A retransmission (T1 = 500 ms, doubling, stopped by any response, section 17.1.1.2);
  ACK for the 2xx, re-sent for every retransmitted 2xx (13.2.2.4); ACK for non-2xx finals in the
  INVITE transaction (17.1.1.3) and a clear :class:`CallFailed`; BYE with Timer E (17.1.2.2);
  CANCEL when the setup times out after a provisional response (9.1).
- **Incoming requests**: BYE (200, ``remote_hangup_at`` recorded, our media stops), OPTIONS
  (200), REFER (202, then a NOTIFY whose ``message/sipfrag`` body says
  ``SIP/2.0 503 Service Unavailable``: a load simulator cannot follow a transfer, so it accepts the
  request - the gateway's REFER transaction succeeds as it would with a real phone - and then
  reports the transfer as failed, RFC 3515 section 2.4.4/2.4.5; the target is kept in
  ``transferred_to``), re-INVITE (200 with our SDP, honouring hold). Anything else gets an
  error response and is recorded in ``errors``. Retransmitted requests get the cached response.
- **RTP out** (RFC 3550/3551): one 20 ms PCMU packet per deadline of a monotonic schedule
  (STYLE.md 5; never ``sleep(0.02)``), random SSRC, sequence and timestamp bases, marker bit on
  the first packet. Silence (0xFF) unless frames are supplied. Each packet's scheduling lateness
  (actual send time minus its deadline) goes to :attr:`SipCaller.pacing` (:class:`PacingStats`).
- **DTMF** (RFC 4733): :meth:`SipCaller.send_dtmf` sends the event on PT 101 in place of audio,
  as phones do: a start packet with the marker bit, updates every 20 ms with a growing duration,
  then three end packets with the E bit, all carrying the event's start timestamp.
- **RTP in**: every datagram on the RTP socket is timestamped on arrival and logged by
  :class:`RtpReceiveLog` (source, sequence, timestamp, payload type and size, silent or not),
  which computes RFC 3550 appendix A.8 interarrival jitter and A.1 loss, finds the first speech
  and the end of speech after a given time, and runs a playout model that counts audible gaps.

Measurement definitions (the simulator reports these):

- *silent* packet: every sample, after mu-law decoding, has ``|x| <= SILENCE_THRESHOLD`` (128 of
  32768, about -48 dBFS peak). For mu-law that is exactly the 32 codes of the lowest segment
  (``|x| <= 120``): the gateway's idle fill is 0xFF (linear 0) and a codec's near-zero noise stays
  in that segment, while any speech or tone leaves it within a few milliseconds.
- *stream stopped* (how a barge-in is seen over RTP): the first silent audio packet after ``t``
  that is followed only by silent audio packets for at least ``STOP_HOLD_S`` (100 ms); also, when
  audio packets stop arriving altogether for 100 ms after speech, the time the next packet was
  due. A pause inside speech longer than 100 ms counts as a stop too; choose ``t`` accordingly.
- *playout gaps*: see :class:`PlayoutStats` (a fixed 40 ms jitter buffer, ``JITTER_BUFFER_S``).

Design (STYLE.md 1-3): wire formats are value objects (:class:`SipMessage`,
:class:`SessionDescription`, :class:`RtpPacket`), the receive-side analysis
(:class:`RtpReceiveLog`) and the pacing measurement (:class:`FramePacer` with an injected clock
and sleep) are sans-I/O, and :class:`SipCaller` is the I/O shell. SIP timers run on the event
loop's clock; every measurement uses the caller's injected clock (``time.monotonic`` by
default, which is also what asyncio's loop uses, so the two agree).

Exceptions (one tree, STYLE.md 10), all :class:`LoadSimError`:

- :class:`SipParseError`: a datagram on the SIP socket is not a SIP message: recorded in
  ``errors`` and dropped (there is nothing to answer).
- :class:`SdpError`: the SDP answer has no usable PCMU stream: the 2xx is ACKed, the call is hung
  up with BYE (RFC 3261 13.2.2.4) and :meth:`SipCaller.call` raises it; in a re-INVITE: 488.
- :class:`RtpParseError`: a datagram on the RTP socket is not RTP: counted, recorded, dropped.
- :class:`CallFailed`: a final response >= 300 to the INVITE (``.status``, ``.reason``).
- :class:`CallTimeout`: no final response within ``timeout_s``.
- :class:`LoadSimError` itself: misuse (a second ``call()``, DTMF without a call).

Datagram handlers never raise: every unexpected message or internal failure becomes a string in
:attr:`SipCaller.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import secrets
import struct
import time
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from gateway.audio.g711 import ULAW_SILENCE, ulaw_decode

__all__ = [
    "CLOCK_RATE",
    "DTMF_EVENTS",
    "FRAME_S",
    "FRAME_SAMPLES",
    "JITTER_BUFFER_S",
    "PT_PCMU",
    "PT_TELEPHONE_EVENT",
    "SILENCE_THRESHOLD",
    "STOP_HOLD_S",
    "T1",
    "T2",
    "CallFailed",
    "CallTimeout",
    "FramePacer",
    "LoadSimError",
    "PacingStats",
    "PlayoutStats",
    "RtpPacket",
    "RtpParseError",
    "RtpReceiveLog",
    "SdpError",
    "SessionDescription",
    "SipCaller",
    "SipMessage",
    "SipParseError",
    "StreamStats",
    "build_sdp",
    "is_silent",
    "seq_add",
    "seq_diff",
    "ts_add",
    "ts_diff",
]

T1: Final[float] = 0.5
"""RFC 3261 T1, the RTT estimate: first INVITE/BYE retransmission interval."""
T2: Final[float] = 4.0
"""RFC 3261 T2: the cap on non-INVITE retransmission intervals (Timer E)."""
CLOCK_RATE: Final[int] = 8000
"""RTP clock of PCMU and telephone-event (RFC 3551 table 4, RFC 4733 section 2.1)."""
FRAME_SAMPLES: Final[int] = 160
"""Samples (= mu-law bytes) in one 20 ms frame."""
FRAME_S: Final[float] = FRAME_SAMPLES / CLOCK_RATE
PT_PCMU: Final[int] = 0
PT_TELEPHONE_EVENT: Final[int] = 101
SILENCE_THRESHOLD: Final[int] = 128
"""A packet is silent when every decoded sample has ``|x| <=`` this (int16 scale)."""
JITTER_BUFFER_S: Final[float] = 0.040
"""The playout model's fixed jitter buffer: playback starts this long after the first packet."""
STOP_HOLD_S: Final[float] = 0.100
"""How long received audio must stay silent (or absent) to count as "the stream stopped"."""
DTMF_EVENTS: Final[Mapping[str, int]] = MappingProxyType(
    {digit: code for code, digit in enumerate("0123456789*#ABCD")}
)
"""RFC 4733 section 3.2 event codes of the DTMF keys."""

SEQ_MOD: Final[int] = 1 << 16
TS_MOD: Final[int] = 1 << 32
_MAX_DROPOUT: Final[int] = 3000  # RFC 3550 A.1: larger forward jumps restart the sequence count
_MAX_MISORDER: Final[int] = 100
_DTMF_VOLUME: Final[int] = 10  # -10 dBm0, the level RFC 4733 section 2.3.4 uses in examples
_DTMF_END_PACKETS: Final[int] = 3  # RFC 4733 section 2.5.1.4: the final packet is sent 3 times
_MAX_ERRORS: Final[int] = 1000
_EPSILON_S: Final[float] = 1e-6  # arrival-time comparisons ignore float rounding below this
_REPLY_CACHE: Final[int] = 64
_ALLOW: Final[str] = "INVITE, ACK, BYE, CANCEL, OPTIONS, REFER"
_USER_AGENT: Final[str] = "gateway-loadsim/0.1"
_SILENT_FRAME: Final[bytes] = bytes([ULAW_SILENCE]) * FRAME_SAMPLES
_RTP_HEADER: Final = struct.Struct("!BBHII")
_TELEPHONE_EVENT: Final = struct.Struct("!BBH")

# Packet kinds in RtpReceiveLog.kinds (a bytearray, so bytearray.find scans them in C).
_SILENT: Final[int] = 0
_SPEECH: Final[int] = 1
_EVENT: Final[int] = 2
_OTHER: Final[int] = 3


# --- errors -----------------------------------------------------------------------------------


class LoadSimError(Exception):
    """Root of the load simulator's errors; raised directly for misuse."""


class SipParseError(LoadSimError):
    """A datagram is not a well-formed SIP message."""


class SdpError(LoadSimError):
    """An SDP body is malformed or has no usable audio stream."""


class RtpParseError(LoadSimError):
    """A datagram is not a well-formed RTP packet."""


class CallFailed(LoadSimError):
    """The INVITE got a final response >= 300."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"call failed: {status} {reason}")
        self.status = status
        self.reason = reason


class CallTimeout(LoadSimError):
    """The INVITE got no final response in time."""


# --- wrap-around arithmetic (STYLE.md 4) -------------------------------------------------------


def seq_add(seq: int, n: int) -> int:
    """16-bit RTP sequence number ``seq + n``, wrapped."""
    return (seq + n) % SEQ_MOD


def seq_diff(a: int, b: int) -> int:
    """Signed distance ``a - b`` between two 16-bit sequence numbers, in [-32768, 32767]."""
    d = (a - b) % SEQ_MOD
    return d - SEQ_MOD if d >= SEQ_MOD // 2 else d


def ts_add(ts: int, n: int) -> int:
    """32-bit RTP timestamp ``ts + n``, wrapped."""
    return (ts + n) % TS_MOD


def ts_diff(a: int, b: int) -> int:
    """Signed distance ``a - b`` between two 32-bit RTP timestamps."""
    d = (a - b) % TS_MOD
    return d - TS_MOD if d >= TS_MOD // 2 else d


# --- silence ----------------------------------------------------------------------------------

_SILENT_CODES: dict[int, bytes] = {}


def _silent_codes(threshold: int) -> bytes:
    codes = _SILENT_CODES.get(threshold)
    if codes is None:
        decoded = ulaw_decode(bytes(range(256)))
        codes = bytes(c for c in range(256) if abs(int(decoded[c])) <= threshold)
        _SILENT_CODES[threshold] = codes
    return codes


def is_silent(payload: bytes, threshold: int = SILENCE_THRESHOLD) -> bool:
    """True when no mu-law sample of ``payload`` decodes to ``|x| > threshold`` (int16 scale)."""
    # Deleting every silent code leaves nothing exactly when the frame is silent: one C pass,
    # no decode per packet.
    return not payload.translate(None, _silent_codes(threshold))


# --- SIP messages -----------------------------------------------------------------------------

# RFC 3261 section 7.3.3 compact forms, plus RFC 3515 (r, Refer-To) and RFC 6665 (o, Event).
_COMPACT: Final[Mapping[str, str]] = MappingProxyType(
    {
        "i": "call-id",
        "m": "contact",
        "e": "content-encoding",
        "l": "content-length",
        "c": "content-type",
        "f": "from",
        "s": "subject",
        "k": "supported",
        "t": "to",
        "v": "via",
        "r": "refer-to",
        "o": "event",
        "b": "referred-by",
        "u": "allow-events",
    }
)
_REQUIRED: Final = ("via", "from", "to", "call-id", "cseq")


def _digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also accepts characters ``int()`` rejects (``'²'``)."""
    return text.isascii() and text.isdigit()


def _canonical(name: str) -> str:
    lowered = name.lower()
    return _COMPACT.get(lowered, lowered)


def _split_commas(value: str) -> list[str]:
    """Split a header value at commas outside quotes and ``<...>`` (RFC 3261 section 7.3.1)."""
    parts: list[str] = []
    depth = 0
    quoted = False
    start = 0
    for i, ch in enumerate(value):
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch == "<":
            depth += 1
        elif not quoted and ch == ">":
            depth -= 1
        elif ch == "," and not quoted and depth == 0:
            parts.append(value[start:i].strip())
            start = i + 1
    parts.append(value[start:].strip())
    return [p for p in parts if p]


@dataclass
class SipMessage:
    """One SIP request or response (RFC 3261 section 7): a value object.

    Requests have ``method`` and ``uri``; responses have ``status`` and ``reason``. Header names
    keep their spelling; lookups are case-insensitive and understand compact forms.
    """

    method: str = ""
    uri: str = ""
    status: int = 0
    reason: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    @property
    def is_request(self) -> bool:
        return bool(self.method)

    @classmethod
    def parse(cls, data: bytes) -> SipMessage:
        """Parse one UDP datagram; raises :class:`SipParseError` naming what is wrong."""
        head, sep, body = data.partition(b"\r\n\r\n")
        if not sep:
            head, sep, body = data.partition(b"\n\n")
            if not sep:
                raise SipParseError("no empty line ends the header section")
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SipParseError(f"header section is not UTF-8: {exc}") from exc
        start, *lines = text.replace("\r\n", "\n").split("\n")
        headers: list[tuple[str, str]] = []
        for line in lines:
            if not line:
                continue
            if line[0] in " \t":  # folded continuation, RFC 3261 section 7.3.1
                if not headers:
                    raise SipParseError("continuation line before any header")
                name, value = headers[-1]
                headers[-1] = (name, f"{value} {line.strip()}")
                continue
            name, colon, value = line.partition(":")
            if not colon or not name.strip() or " " in name.strip():
                raise SipParseError(f"malformed header line {line[:60]!r}")
            headers.append((name.strip(), value.strip()))
        parts = start.split(" ", 2)
        if start.startswith("SIP/"):
            if len(parts) < 2 or parts[0] != "SIP/2.0":
                raise SipParseError(f"bad status line {start[:60]!r}")
            if len(parts[1]) != 3 or not _digits(parts[1]) or not 100 <= int(parts[1]) <= 699:
                raise SipParseError(f"bad status code in {start[:60]!r}")
            message = cls(status=int(parts[1]), reason=parts[2] if len(parts) > 2 else "")
        else:
            if len(parts) != 3 or parts[2] != "SIP/2.0" or not parts[0].isalpha():
                raise SipParseError(f"bad request line {start[:60]!r}")
            message = cls(method=parts[0], uri=parts[1])
        message.headers = headers
        for required in _REQUIRED:
            if message.header(required) is None:
                raise SipParseError(f"missing {required} header")
        message.cseq  # noqa: B018 - validates the CSeq header now, not in a handler later
        length = message.header("content-length")
        if length is not None:
            if not _digits(length):
                raise SipParseError(f"bad Content-Length {length!r}")
            if len(body) < int(length):
                raise SipParseError(f"body has {len(body)} bytes, Content-Length says {length}")
            body = body[: int(length)]
        message.body = body
        return message

    @classmethod
    def request(
        cls, method: str, uri: str, headers: list[tuple[str, str]], body: bytes = b""
    ) -> SipMessage:
        return cls(method=method, uri=uri, headers=headers, body=body)

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any spelling, compact forms included)."""
        wanted = _canonical(name)
        for key, value in self.headers:
            if _canonical(key) == wanted:
                return value
        return None

    def header_values(self, name: str) -> list[str]:
        """Every value of header ``name``, comma-separated lists split (Via, Record-Route)."""
        wanted = _canonical(name)
        values: list[str] = []
        for key, value in self.headers:
            if _canonical(key) == wanted:
                values.extend(_split_commas(value))
        return values

    @property
    def cseq(self) -> tuple[int, str]:
        """``(number, method)`` from the CSeq header."""
        number, _, method = (self.header("cseq") or "").partition(" ")
        if not _digits(number) or not method.strip():
            raise SipParseError(f"bad CSeq {self.header('cseq')!r}")
        return int(number), method.strip()

    def serialize(self) -> bytes:
        """Wire bytes; Content-Length is always written from the body."""
        if self.method:
            start = f"{self.method} {self.uri} SIP/2.0"
        else:
            start = f"SIP/2.0 {self.status} {self.reason}"
        lines = [start]
        lines.extend(f"{k}: {v}" for k, v in self.headers if _canonical(k) != "content-length")
        lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body

    __bytes__ = serialize


def _param(value: str, name: str) -> str | None:
    """Header parameter ``name`` (``tag``, ``branch``...) outside the ``<...>`` URI, if any."""
    tail = value[value.rfind(">") + 1 :] if "<" in value else value
    for part in tail.split(";")[1:]:
        key, _, val = part.partition("=")
        if key.strip().lower() == name:
            return val.strip()
    return None


def _uri(value: str) -> str:
    """The URI of a name-addr (``"x" <sip:...>;p``) or addr-spec (``sip:...;p``) header value."""
    if "<" in value:
        return value[value.index("<") + 1 : value.index(">")].strip()
    return value.split(";", 1)[0].strip()


def _hostport(uri: str) -> tuple[str, int]:
    """Host and port (default 5060) of a SIP URI such as ``sip:user@127.0.0.1:5062;lr``."""
    rest = uri.split(":", 1)[1] if uri.lower().startswith(("sip:", "sips:")) else uri
    rest = rest.split(";", 1)[0].split("?", 1)[0].rpartition("@")[2]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = rest.partition(":")
    if not host or (port and not _digits(port)):
        raise SipParseError(f"no host:port in URI {uri!r}")
    return host, int(port) if port else 5060


def _token() -> str:
    return secrets.token_hex(6)


# --- SDP --------------------------------------------------------------------------------------


def build_sdp(
    ip: str,
    port: int,
    *,
    session_id: int,
    version: int,
    event_pt: int = PT_TELEPHONE_EVENT,
    direction: str = "sendrecv",
) -> bytes:
    """Our offer/answer (RFC 4566): PCMU PT 0 + telephone-event (0-15), ptime 20."""
    lines = [
        "v=0",
        f"o=loadsim {session_id} {version} IN IP4 {ip}",
        "s=loadsim",
        f"c=IN IP4 {ip}",
        "t=0 0",
        f"m=audio {port} RTP/AVP {PT_PCMU} {event_pt}",
        f"a=rtpmap:{PT_PCMU} PCMU/{CLOCK_RATE}",
        f"a=rtpmap:{event_pt} telephone-event/{CLOCK_RATE}",
        f"a=fmtp:{event_pt} 0-15",
        "a=ptime:20",
        f"a={direction}",
    ]
    return ("\r\n".join(lines) + "\r\n").encode()


_DIRECTIONS: Final = ("sendrecv", "sendonly", "recvonly", "inactive")


@dataclass(frozen=True)
class SessionDescription:
    """The first audio stream of an SDP body (RFC 4566), as far as a G.711 phone needs it."""

    address: str
    port: int
    payload_types: tuple[int, ...]
    rtpmap: Mapping[int, str]
    """Payload type -> lower-case ``encoding/rate`` from ``a=rtpmap``."""
    direction: str = "sendrecv"
    ptime: int | None = None

    @property
    def audio_pt(self) -> int | None:
        """The payload type carrying PCMU/8000 (static PT 0 needs no rtpmap), or None."""
        for pt in self.payload_types:
            encoding = self.rtpmap.get(pt)
            if encoding == "pcmu/8000" or (encoding is None and pt == PT_PCMU):
                return pt
        return None

    @property
    def event_pt(self) -> int | None:
        """The payload type of telephone-event/8000, or None when not offered/accepted."""
        for pt in self.payload_types:
            if self.rtpmap.get(pt) == "telephone-event/8000":
                return pt
        return None

    @classmethod
    def parse(cls, body: bytes) -> SessionDescription:
        """Parse an SDP body; raises :class:`SdpError` when there is no usable audio stream."""
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SdpError(f"SDP is not UTF-8: {exc}") from exc
        session_address: str | None = None
        session_direction = "sendrecv"
        address: str | None = None
        port: int | None = None
        pts: tuple[int, ...] = ()
        rtpmap: dict[int, str] = {}
        direction: str | None = None
        ptime: int | None = None
        in_audio = False
        seen_audio = False
        for raw in text.splitlines():
            line = raw.strip()
            if len(line) < 2 or line[1] != "=":
                continue
            kind, value = line[0], line[2:]
            if kind == "m":
                if seen_audio:
                    break  # only the first audio stream matters
                fields = value.split()
                in_audio = bool(fields) and fields[0] == "audio"
                if not in_audio:
                    continue
                seen_audio = True
                if len(fields) < 4 or "RTP/AVP" not in fields[2]:
                    raise SdpError(f"bad m= line {line!r}")
                try:
                    port = int(fields[1].split("/")[0])
                    pts = tuple(int(f) for f in fields[3:])
                except ValueError as exc:
                    raise SdpError(f"bad m= line {line!r}") from exc
            elif kind == "c":
                fields = value.split()
                if len(fields) != 3 or fields[0] != "IN":
                    raise SdpError(f"bad c= line {line!r}")
                if in_audio:
                    address = fields[2].split("/")[0]
                elif not seen_audio:
                    session_address = fields[2].split("/")[0]
            elif kind == "a" and (in_audio or not seen_audio):
                name, _, rest = value.partition(":")
                if name in _DIRECTIONS:
                    if in_audio:
                        direction = name
                    else:
                        session_direction = name
                elif name == "rtpmap" and in_audio:
                    pt_text, _, encoding = rest.partition(" ")
                    if _digits(pt_text):
                        rtpmap[int(pt_text)] = encoding.strip().lower()
                elif name == "ptime" and in_audio and _digits(rest.strip()):
                    ptime = int(rest.strip())
        if port is None:
            raise SdpError("no m=audio stream")
        if port == 0:
            raise SdpError("the audio stream is rejected (port 0)")
        address = address or session_address
        if not address:
            raise SdpError("no c= connection address for the audio stream")
        return cls(
            address=address,
            port=port,
            payload_types=pts,
            rtpmap=MappingProxyType(rtpmap),
            direction=direction or session_direction,
            ptime=ptime,
        )


# --- RTP --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RtpPacket:
    """An RTP packet (RFC 3550 section 5.1): fixed header fields and the payload."""

    payload_type: int
    sequence: int
    timestamp: int
    ssrc: int
    payload: bytes
    marker: bool = False

    @classmethod
    def parse(cls, data: bytes) -> RtpPacket:
        """Parse a datagram (CSRCs, header extension and padding skipped)."""
        if len(data) < _RTP_HEADER.size:
            raise RtpParseError(f"{len(data)} bytes is shorter than the 12-byte RTP header")
        b0, b1, seq, ts, ssrc = _RTP_HEADER.unpack_from(data)
        if b0 >> 6 != 2:
            raise RtpParseError(f"RTP version {b0 >> 6}, expected 2")
        offset = _RTP_HEADER.size + 4 * (b0 & 0x0F)
        if b0 & 0x10:  # header extension, RFC 3550 section 5.3.1
            if len(data) < offset + 4:
                raise RtpParseError("header extension runs past the end")
            words = struct.unpack_from("!H", data, offset + 2)[0]
            offset += 4 + 4 * words
        end = len(data)
        if b0 & 0x20:  # padding: the last octet counts the padding octets
            padding = data[-1]
            if padding == 0:
                raise RtpParseError("padding bit set with a zero padding count")
            end -= padding
        if offset > end:
            raise RtpParseError("header fields and padding overrun the packet")
        return cls(b1 & 0x7F, seq, ts, ssrc, bytes(data[offset:end]), bool(b1 & 0x80))

    def serialize(self) -> bytes:
        """Wire bytes: version 2, no padding, no extension, no CSRC."""
        if not 0 <= self.payload_type <= 127:
            raise RtpParseError(f"payload type {self.payload_type} is outside 0..127")
        b1 = (0x80 if self.marker else 0) | self.payload_type
        return _RTP_HEADER.pack(0x80, b1, self.sequence, self.timestamp, self.ssrc) + self.payload

    __bytes__ = serialize


def _telephone_event(event: int, end: bool, duration: int) -> bytes:
    """RFC 4733 section 2.3 payload: event, E bit + volume, duration (samples)."""
    return _TELEPHONE_EVENT.pack(event, (0x80 if end else 0) | _DTMF_VOLUME, duration)


@dataclass(frozen=True)
class StreamStats:
    """Receive statistics of one SSRC (RFC 3550 appendix A.1 and A.8)."""

    ssrc: int
    received: int
    expected: int
    lost: int
    jitter_ms: float


class _SsrcState:
    __slots__ = (
        "base",
        "cycles",
        "jitter",
        "last_arrival",
        "last_ts",
        "max_seq",
        "prior_expected",
        "received",
    )

    def __init__(self, seq: int) -> None:
        self.base = seq
        self.max_seq = seq
        self.cycles = 0
        self.received = 0
        self.prior_expected = 0
        self.jitter = 0.0  # in timestamp units, as RFC 3550 A.8 keeps it
        self.last_arrival: float | None = None
        self.last_ts = 0

    def sequence(self, seq: int) -> None:
        delta = seq_diff(seq, self.max_seq)
        if 0 < delta < _MAX_DROPOUT:
            if seq < self.max_seq:
                self.cycles += SEQ_MOD
            self.max_seq = seq
        elif delta >= _MAX_DROPOUT or delta < -_MAX_MISORDER:
            # A jump A.1 would treat as a restart; restart at once (no probation) and keep the
            # packets expected so far.
            self.prior_expected = self.expected
            self.base = seq
            self.max_seq = seq
            self.cycles = 0
        self.received += 1

    def interarrival(self, arrival: float, ts: int, rate: int) -> None:
        # A.8: D(i-1, i) = (R_i - R_{i-1}) - (S_i - S_{i-1}) in timestamp units; J += (|D| - J)/16.
        if self.last_arrival is not None:
            d = (arrival - self.last_arrival) * rate - ts_diff(ts, self.last_ts)
            self.jitter += (abs(d) - self.jitter) / 16
        self.last_arrival = arrival
        self.last_ts = ts

    @property
    def expected(self) -> int:
        return self.prior_expected + self.cycles + self.max_seq - self.base + 1


@dataclass(frozen=True)
class PlayoutStats:
    """What a phone with a fixed jitter buffer would have played in one utterance window.

    The model: the playback clock starts at the arrival of the first non-silent audio packet in
    ``[start, end)`` plus the fixed jitter buffer (:data:`JITTER_BUFFER_S`, 40 ms); from then on
    each audio packet is needed at that start plus its RTP timestamp offset from the first
    packet. A packet arriving after it is needed is a *gap*: the phone plays nothing for
    ``arrival - needed`` and resumes with that packet, so the schedule slips by the gap (no
    re-buffering; later packets are judged against the slipped clock, so one stall counts once).
    Sequence-number holes are ``lost`` (concealed, not gaps); packets at or behind the highest
    sequence played are ``discarded``. Telephone-event packets keep the sequence count but are
    not audio. A change of SSRC continues the schedule where the previous stream ended.
    """

    start: float | None
    """Arrival of the first non-silent packet (the playback clock's origin), None if none."""
    packets: int
    gaps: int
    gap_ms: float
    max_gap_ms: float
    lost: int
    discarded: int


class RtpReceiveLog:
    """Every packet received on one call's RTP socket, timestamped on arrival (sans-I/O).

    ``record(data, source, arrival)`` is fed by the I/O shell; the per-packet columns are compact
    arrays (one entry per packet, in arrival order): ``arrivals`` (monotonic seconds),
    ``sequences``, ``timestamps``, ``ssrcs``, ``payload_types``, ``sizes`` (payload bytes),
    ``kinds`` (0 silent audio, 1 non-silent audio, 2 telephone-event, 3 other), and
    ``source_ids`` indexing ``sources``. Loss is counted over every packet of an SSRC (audio and
    events share the sequence space); jitter only over audio packets (event packets repeat the
    event's start timestamp, RFC 4733 section 2.5.1.2, which would read as jitter).
    """

    def __init__(
        self,
        *,
        audio_pt: int = PT_PCMU,
        event_pt: int | None = PT_TELEPHONE_EVENT,
        silence_threshold: int = SILENCE_THRESHOLD,
    ) -> None:
        self.audio_pt = audio_pt
        self.event_pt = event_pt
        self.silence_threshold = silence_threshold
        self._silent = _silent_codes(silence_threshold)
        self.arrivals = array("d")
        self.sequences = array("H")
        self.timestamps = array("L")
        self.ssrcs = array("L")
        self.payload_types = array("B")
        self.sizes = array("L")
        self.kinds = bytearray()
        self.source_ids = array("H")
        self.sources: list[tuple[str, int]] = []
        self._source_index: dict[tuple[str, int], int] = {}
        self._streams: dict[int, _SsrcState] = {}
        self.malformed = 0
        self.rtcp = 0

    def record(self, data: bytes, source: tuple[str, int], arrival: float) -> None:
        """Log one datagram. Raises :class:`RtpParseError` (after counting it) if not RTP."""
        try:
            packet = RtpPacket.parse(data)
        except RtpParseError:
            self.malformed += 1
            raise
        pt = packet.payload_type
        if packet.marker and 72 <= pt <= 76:
            self.rtcp += 1  # RTCP SR/RR/SDES/BYE/APP multiplexed here (RFC 5761 section 4)
            return
        payload = packet.payload
        if pt == self.audio_pt:
            kind = _SPEECH if payload.translate(None, self._silent) else _SILENT
        elif pt == self.event_pt:
            kind = _EVENT
        else:
            kind = _OTHER
        key = (source[0], source[1])
        index = self._source_index.get(key)
        if index is None:
            index = self._source_index[key] = len(self.sources)
            self.sources.append(key)
        self.arrivals.append(arrival)
        self.sequences.append(packet.sequence)
        self.timestamps.append(packet.timestamp)
        self.ssrcs.append(packet.ssrc)
        self.payload_types.append(pt)
        self.sizes.append(len(payload))
        self.kinds.append(kind)
        self.source_ids.append(index)
        stream = self._streams.get(packet.ssrc)
        if stream is None:
            stream = self._streams[packet.ssrc] = _SsrcState(packet.sequence)
        stream.sequence(packet.sequence)
        if kind <= _SPEECH:
            stream.interarrival(arrival, packet.timestamp, CLOCK_RATE)

    # --- whole-call statistics ----------------------------------------------------------------

    @property
    def packets(self) -> int:
        """RTP packets logged (RTCP and malformed datagrams excluded)."""
        return len(self.arrivals)

    @property
    def audio_packets(self) -> int:
        return self.kinds.count(_SILENT) + self.kinds.count(_SPEECH)

    def streams(self) -> list[StreamStats]:
        """Per-SSRC statistics, most packets first."""
        stats = [
            StreamStats(
                ssrc=ssrc,
                received=s.received,
                expected=s.expected,
                lost=max(0, s.expected - s.received),
                jitter_ms=1000 * s.jitter / CLOCK_RATE,
            )
            for ssrc, s in self._streams.items()
        ]
        return sorted(stats, key=lambda s: -s.received)

    @property
    def lost(self) -> int:
        """Packets lost (RFC 3550 A.3: expected - received, per SSRC, never negative), summed."""
        return sum(s.lost for s in self.streams())

    @property
    def jitter_ms(self) -> float:
        """RFC 3550 A.8 interarrival jitter of the main (most packets) stream, milliseconds."""
        streams = self.streams()
        return streams[0].jitter_ms if streams else 0.0

    # --- speech timing ------------------------------------------------------------------------

    def first_audio_after(self, t: float) -> float | None:
        """Arrival time of the first non-silent audio packet that arrived after ``t``."""
        index = self.kinds.find(_SPEECH, bisect_right(self.arrivals, t))
        return self.arrivals[index] if index >= 0 else None

    def stream_stopped_after(
        self, t: float, *, now: float | None = None, hold_s: float = STOP_HOLD_S
    ) -> float | None:
        """When received audio turned silent after ``t`` (see the module docstring).

        The first silent audio packet after ``t`` that only silent audio packets follow for
        ``hold_s``; or, if audio packets stop arriving after speech, the time the next one was
        due, once ``hold_s`` passed without any. ``now`` (the observer's clock) lets the end of
        the log count as evidence; without it, only later packets do. None while undecided.
        """
        arrivals, kinds, sizes = self.arrivals, self.kinds, self.sizes
        candidate: float | None = None  # first silent packet of the current silent run
        due: float | None = None  # when the packet after the last speech packet was due
        for i in range(bisect_right(arrivals, t), len(arrivals)):
            kind = kinds[i]
            if kind > _SPEECH:
                continue
            arrival = arrivals[i]
            if due is not None and arrival >= due + hold_s:
                return due
            due = None
            if kind == _SILENT:
                if candidate is None:
                    candidate = arrival
                elif arrival >= candidate + hold_s:
                    return candidate
            else:
                candidate = None
                due = arrival + sizes[i] / CLOCK_RATE
        if now is not None:
            if due is not None and now >= due + hold_s:
                return due
            if candidate is not None and now >= candidate + hold_s:
                return candidate
        return None

    def playout(
        self, start: float, end: float, *, jitter_buffer_s: float = JITTER_BUFFER_S
    ) -> PlayoutStats:
        """Run the playout model (:class:`PlayoutStats`) over packets arriving in [start, end)."""
        arrivals, kinds = self.arrivals, self.kinds
        lo = bisect_left(arrivals, start)
        hi = bisect_left(arrivals, end)
        first = kinds.find(_SPEECH, lo, hi)
        if first < 0:
            return PlayoutStats(None, 0, 0, 0.0, 0.0, 0, 0)
        seqs, stamps, ssrcs, sizes = self.sequences, self.timestamps, self.ssrcs, self.sizes
        origin = arrivals[first] + jitter_buffer_s  # when the first packet plays
        ts0 = stamps[first]
        ssrc = ssrcs[first]
        last_seq = seqs[first]
        played_until = origin + sizes[first] / CLOCK_RATE
        packets, gaps, lost, discarded = 1, 0, 0, 0
        gap_s = max_gap_s = 0.0
        for i in range(first + 1, hi):
            if ssrcs[i] != ssrc:
                # A new stream continues where the old one stopped playing.
                ssrc, ts0, origin = ssrcs[i], stamps[i], played_until
                last_seq = seq_add(seqs[i], -1)
            step = seq_diff(seqs[i], last_seq)
            if step <= 0:
                discarded += kinds[i] <= _SPEECH
                continue
            lost += step - 1
            last_seq = seqs[i]
            if kinds[i] > _SPEECH:
                continue
            needed = origin + ts_diff(stamps[i], ts0) / CLOCK_RATE
            late = arrivals[i] - needed
            if late > _EPSILON_S:
                gaps += 1
                gap_s += late
                max_gap_s = max(max_gap_s, late)
                origin += late
                needed = arrivals[i]
            played_until = needed + sizes[i] / CLOCK_RATE
            packets += 1
        return PlayoutStats(
            start=arrivals[first],
            packets=packets,
            gaps=gaps,
            gap_ms=1000 * gap_s,
            max_gap_ms=1000 * max_gap_s,
            lost=lost,
            discarded=discarded,
        )


# --- pacing -----------------------------------------------------------------------------------


class PacingStats:
    """Per-packet scheduling lateness of our RTP sender (actual send time minus its deadline)."""

    def __init__(self) -> None:
        self.lateness_ms = array("d")

    def record(self, lateness_s: float) -> None:
        self.lateness_ms.append(1000 * lateness_s)

    def __len__(self) -> int:
        return len(self.lateness_ms)

    @property
    def mean_ms(self) -> float:
        return sum(self.lateness_ms) / len(self.lateness_ms) if self.lateness_ms else 0.0

    @property
    def max_ms(self) -> float:
        return max(self.lateness_ms, default=0.0)

    def percentile(self, p: float) -> float:
        """Nearest-rank percentile (``p`` in 0..100) of the lateness, ms; 0 when empty."""
        if not self.lateness_ms:
            return 0.0
        ordered = sorted(self.lateness_ms)
        rank = min(len(ordered), max(1, math.ceil(p / 100 * len(ordered))))
        return ordered[rank - 1]

    def histogram(
        self, edges_ms: Iterable[float] = (0.5, 1, 2, 5, 10, 20)
    ) -> list[tuple[str, int]]:
        """Counts per bucket: ``("<0.5ms", n), ("0.5-1ms", n), ..., (">=20ms", n)``."""
        edges = sorted(edges_ms)
        counts = [0] * (len(edges) + 1)
        for value in self.lateness_ms:
            counts[bisect_right(edges, value)] += 1
        labels = [f"<{edges[0]:g}ms"]
        labels += [f"{a:g}-{b:g}ms" for a, b in itertools.pairwise(edges)]
        labels.append(f">={edges[-1]:g}ms")
        return list(zip(labels, counts, strict=True))


class FramePacer:
    """Deadlines ``t0 + n * frame_s`` on an injected clock; records each wake-up's lateness.

    When a wake-up is late by more than a frame the following deadlines are already due and
    go out at once (a sound card that kept producing samples while the process stalled); the
    timeline never drifts.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        frame_s: float = FRAME_S,
    ) -> None:
        self.clock = clock
        self.sleep = sleep
        self.frame_s = frame_s
        self.stats = PacingStats()
        self.t0: float | None = None
        self.n = 0

    def start(self, t0: float | None = None) -> None:
        self.t0 = self.clock() if t0 is None else t0
        self.n = 0

    async def next(self) -> float:
        """Wait for the next deadline; returns the time it woke up."""
        if self.t0 is None:
            self.start()
        assert self.t0 is not None
        deadline = self.t0 + self.n * self.frame_s
        delay = deadline - self.clock()
        if delay > 0:
            await self.sleep(delay)
        now = self.clock()
        self.stats.record(now - deadline)
        self.n += 1
        return now


# --- the phone --------------------------------------------------------------------------------


class _Datagrams(asyncio.DatagramProtocol):
    """Hands datagrams to a callback; nothing raised there escapes into the event loop."""

    def __init__(
        self,
        on_datagram: Callable[[bytes, tuple[str, int]], None],
        on_error: Callable[[str], None],
        name: str,
    ) -> None:
        self._on_datagram = on_datagram
        self._on_error = on_error
        self._name = name

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            self._on_datagram(data, addr)
        except Exception as exc:  # never out of a datagram handler
            self._on_error(f"{self._name}: handling a datagram from {addr} failed: {exc!r}")

    def error_received(self, exc: Exception) -> None:
        self._on_error(f"{self._name}: socket error {exc!r}")


@dataclass
class _DtmfJob:
    digit: str
    event: int
    total: int  # samples
    done: asyncio.Future[float]
    start_ts: int = 0
    first_at: float = 0.0
    sent: int = 0
    ends: int = 0

    def packet(self, ts: int, now: float) -> tuple[bytes, int, bool]:
        """Payload, RTP timestamp and marker of the next packet of this event."""
        first = self.sent == 0
        if first:
            self.start_ts = ts
            self.first_at = now
        self.sent += 1
        end = self.sent * FRAME_SAMPLES >= self.total
        self.ends += end
        duration = min(self.sent * FRAME_SAMPLES, self.total)
        return _telephone_event(self.event, end, duration), self.start_ts, first

    @property
    def finished(self) -> bool:
        return self.ends >= _DTMF_END_PACKETS


class SipCaller:
    """One simulated phone call (see the module docstring). Use once: ``call()``, then
    ``send_dtmf()`` / ``play()`` / the measurements, then ``hangup()`` and ``close()``.

    Measurements (all times from the injected ``clock``, monotonic seconds):

    - ``status``/``reason``: the INVITE's final response; ``provisional``: 1xx codes seen;
      ``invite_sent_at``; ``answered_at``: arrival of the 200; ``setup_ms``: INVITE -> 200;
      ``invite_retransmits`` (Timer A); ``final_retransmits``: retransmitted finals re-ACKed.
    - ``remote_hangup_at``: arrival of the gateway's BYE; ``hangup_status``/``hangup_ms``: our
      BYE's response and its round trip; ``transferred_to``: the Refer-To URI of a REFER.
    - ``rtp``: the :class:`RtpReceiveLog` (``jitter_ms``, ``loss_pct``, ``first_audio_after``,
      ``stream_stopped_after``, ``playout``/``gaps`` delegate to it); ``pacing``:
      :class:`PacingStats` of our sends; ``packets_sent``; ``dtmf_sent``: ``(digit, first
      packet time)``.
    - ``requests_received``: method -> count; ``errors``: every unexpected message or failure.
    """

    def __init__(
        self,
        *,
        audio: Iterable[bytes] | None = None,
        caller_id: str = "loadsim",
        t1: float = T1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        silence_threshold: int = SILENCE_THRESHOLD,
    ) -> None:
        self.caller_id = caller_id
        self.t1 = t1
        self._clock = clock
        self.pacer = FramePacer(clock, sleep)
        self.rtp = RtpReceiveLog(silence_threshold=silence_threshold)

        self.status: int | None = None
        self.reason = ""
        self.provisional: list[int] = []
        self.invite_sent_at: float | None = None
        self.answered_at: float | None = None
        self.setup_ms: float | None = None
        self.invite_retransmits = 0
        self.final_retransmits = 0
        self.remote_hangup_at: float | None = None
        self.bye_sent_at: float | None = None
        self.hangup_status: int | None = None
        self.hangup_ms: float | None = None
        self.transferred_to: str | None = None
        self.packets_sent = 0
        self.dtmf_sent: list[tuple[str, float]] = []
        self.requests_received: dict[str, int] = {}
        self.errors: list[str] = []
        self.errors_dropped = 0
        self.answer: SessionDescription | None = None
        self.remote_rtp: tuple[str, int] | None = None
        self.local_sip: tuple[str, int] | None = None
        self.local_rtp: tuple[str, int] | None = None

        self._audio: Iterator[bytes] | None = iter(audio) if audio is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sip: asyncio.DatagramTransport | None = None
        self._rtp_transport: asyncio.DatagramTransport | None = None
        self._rtcp_transport: asyncio.DatagramTransport | None = None
        self._rtp_closed_at: float | None = None
        self._state = "idle"  # idle, calling, confirmed, terminated
        self._target: tuple[str, int] = ("", 0)
        self._local_ip = ""
        self._call_id = ""
        self._from = ""
        self._to = ""
        self._request_uri = ""
        self._contact = ""
        self._cseq = 0
        self._invite: SipMessage | None = None
        self._invite_branch = ""
        self._final: asyncio.Future[SipMessage] | None = None
        self._ack: tuple[bytes, tuple[str, int]] | None = None
        self._remote_tag: str | None = None
        self._remote_to = ""
        self._remote_target = ""
        self._route_set: list[str] = []
        self._dest: tuple[str, int] = ("", 0)
        self._pending: dict[tuple[str, str], asyncio.Future[SipMessage]] = {}
        self._replies: dict[tuple[str, int, str, str], bytes] = {}
        self._finished: dict[tuple[str, str], None] = {}  # ended client transactions, in order
        self._sdp_session = secrets.randbelow(1 << 31)
        self._sdp_version = 1
        self._reinvite_acked: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._sender: asyncio.Task[None] | None = None
        self._dtmf: deque[_DtmfJob] = deque()
        self._audio_pt = PT_PCMU
        self._event_pt: int | None = None
        self._send_enabled = True
        self._ssrc = secrets.randbits(32)
        self._seq = secrets.randbits(16)
        self._ts = secrets.randbits(32)

    # --- public API ---------------------------------------------------------------------------

    @property
    def pacing(self) -> PacingStats:
        """Scheduling lateness of every RTP packet sent (ms)."""
        return self.pacer.stats

    async def __aenter__(self) -> SipCaller:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def call(
        self,
        target: tuple[str, int],
        *,
        local_ip: str = "127.0.0.1",
        user: str = "loadsim",
        timeout_s: float = 10,
    ) -> None:
        """Call ``sip:{user}@{target}`` and return once the 200 is ACKed and RTP flows.

        ``user`` is the Request-URI (dialled) user; ours (From/Contact) is ``caller_id``.
        Raises :class:`CallFailed` (>= 300, ``status`` set), :class:`CallTimeout` (no final
        response within ``timeout_s``; a CANCEL follows a provisional) or :class:`SdpError`.
        """
        if self._state != "idle":
            raise LoadSimError("a SipCaller places one call; create another")
        self._state = "calling"
        loop = self._loop = asyncio.get_running_loop()
        self._local_ip = local_ip
        self._target = target
        sip, _ = await loop.create_datagram_endpoint(
            lambda: _Datagrams(self._on_sip, self._error, "sip"), local_addr=(local_ip, 0)
        )
        self._sip = sip
        self.local_sip = sip.get_extra_info("sockname")[:2]
        await self._bind_rtp(local_ip)
        assert self.local_rtp is not None

        host, port = target
        self._request_uri = f"sip:{user}@{host}:{port}"
        self._call_id = f"{secrets.token_hex(8)}@{local_ip}"
        self._from = f"<sip:{self.caller_id}@{local_ip}>;tag={_token()}"
        self._to = f"<{self._request_uri}>"
        self._contact = f"<sip:{self.caller_id}@{local_ip}:{self.local_sip[1]}>"
        self._cseq = 1
        self._invite_branch = self._new_branch()
        sdp = build_sdp(
            local_ip, self.local_rtp[1], session_id=self._sdp_session, version=self._sdp_version
        )
        self._invite = SipMessage.request(
            "INVITE",
            self._request_uri,
            [
                ("Via", self._via(self._invite_branch)),
                ("Max-Forwards", "70"),
                ("From", self._from),
                ("To", self._to),
                ("Call-ID", self._call_id),
                ("CSeq", f"{self._cseq} INVITE"),
                ("Contact", self._contact),
                ("Allow", _ALLOW),
                ("User-Agent", _USER_AGENT),
                ("Content-Type", "application/sdp"),
            ],
            sdp,
        )
        invite = self._invite.serialize()
        final = self._final = loop.create_future()

        # Timer A (RFC 3261 17.1.1.2): T1, 2*T1, 4*T1... until any response; Timer B is
        # replaced by the caller's timeout_s.
        deadline = loop.time() + timeout_s
        interval = self.t1
        next_send = loop.time() + interval
        self.invite_sent_at = self._clock()
        self._send_sip(invite, target)
        while not final.done():
            now = loop.time()
            if now >= deadline:
                break
            wake = deadline if self.provisional else min(deadline, next_send)
            await asyncio.wait({final}, timeout=max(0.0, wake - now))
            if final.done() or self.provisional:
                continue
            if loop.time() >= next_send - 0.002 and loop.time() < deadline:
                self._send_sip(invite, target)
                self.invite_retransmits += 1
                interval *= 2
                next_send += interval
        if not final.done():
            if self.provisional:
                await self._cancel_invite()
            if self.status is not None and 200 <= self.status < 300:
                await self.hangup()  # the 200 crossed our CANCEL: end the call we got
            self._state = "terminated"
            raise CallTimeout(
                f"no final response to INVITE within {timeout_s} s "
                f"(provisional: {self.provisional or 'none'})"
            )
        response = final.result()
        if response.status >= 300:
            self._state = "terminated"
            raise CallFailed(response.status, response.reason)
        try:
            answer = SessionDescription.parse(response.body)
            audio_pt = answer.audio_pt
            if audio_pt is None:
                raise SdpError(f"the answer has no PCMU payload type ({answer.payload_types})")
        except SdpError as exc:
            self._error(f"unusable SDP answer: {exc}")
            await self.hangup()
            raise
        self._apply_sdp(answer)
        self._sender = loop.create_task(self._send_media(), name=f"loadsim-rtp-{self._ssrc}")

    def play(self, frames: Iterable[bytes]) -> None:
        """Send these 160-byte mu-law frames from the next 20 ms tick on, then silence."""
        self._audio = iter(frames)

    async def send_dtmf(self, digit: str, duration_ms: int = 100) -> float:
        """Send one RFC 4733 event; returns the monotonic time its first packet was sent.

        Audio pauses while the event is on the wire. Returns after the last end packet, so
        consecutive calls press keys one after the other.
        """
        event = DTMF_EVENTS.get(digit.upper())
        if event is None:
            raise ValueError(f"{digit!r} is not a DTMF key (0-9, *, #, A-D)")
        if not 0 < duration_ms <= 8000:
            raise ValueError(f"duration_ms {duration_ms} is outside 1..8000")
        if self._sender is None or self._sender.done() or self._loop is None:
            raise LoadSimError("no call in progress")
        if self._event_pt is None:
            raise LoadSimError("the SDP answer did not accept telephone-event")
        job = _DtmfJob(digit, event, duration_ms * CLOCK_RATE // 1000, self._loop.create_future())
        self._dtmf.append(job)
        packets = (job.total + FRAME_SAMPLES - 1) // FRAME_SAMPLES + _DTMF_END_PACKETS
        bound = len(self._dtmf) * (packets + 1) * FRAME_S + 2.0
        async with asyncio.timeout(bound):
            first_at = await asyncio.shield(job.done)
        self.dtmf_sent.append((job.digit, first_at))
        return first_at

    async def hangup(self, timeout_s: float = 5.0) -> int | None:
        """Send BYE (Timer E retransmissions) and wait for its final response.

        Returns the response's status (200 expected), or None when there is no call to end
        (never answered, or the gateway hung up first) or no response came in ``timeout_s``.
        """
        if self._state != "confirmed":
            return None
        self._state = "terminated"
        await self._stop_media()
        bye, branch = self._dialog_request("BYE")
        self.bye_sent_at = self._clock()
        response = await self._transact(bye.serialize(), branch, "BYE", timeout_s)
        if response is None:
            self._error(f"BYE: no final response within {timeout_s} s")
            return None
        self.hangup_status = response.status
        self.hangup_ms = 1000 * (self._clock() - self.bye_sent_at)
        if response.status != 200:
            self._error(f"BYE answered {response.status} {response.reason}")
        return response.status

    def first_audio_after(self, t: float) -> float | None:
        """Arrival of the first non-silent audio packet after ``t`` (see :class:`RtpReceiveLog`)."""
        return self.rtp.first_audio_after(t)

    def stream_stopped_after(self, t: float) -> float | None:
        """When received speech stopped after ``t``; None while it has not (yet)."""
        now = self._rtp_closed_at if self._rtp_closed_at is not None else self._clock()
        return self.rtp.stream_stopped_after(t, now=now)

    def playout(self, start: float, end: float) -> PlayoutStats:
        """Playout gaps of the utterance received in [start, end) (see :class:`PlayoutStats`)."""
        return self.rtp.playout(start, end)

    def gaps(self, start: float, end: float) -> tuple[int, float]:
        """``(gaps, gap_ms)`` of the playout model over the utterance in [start, end)."""
        stats = self.rtp.playout(start, end)
        return stats.gaps, stats.gap_ms

    @property
    def jitter_ms(self) -> float:
        """RFC 3550 A.8 interarrival jitter of the received stream, ms."""
        return self.rtp.jitter_ms

    @property
    def loss_pct(self) -> float:
        """Received packets lost (RFC 3550 A.3, from sequence gaps), percent of those expected."""
        expected = sum(s.expected for s in self.rtp.streams())
        return 100 * self.rtp.lost / expected if expected else 0.0

    def close(self) -> None:
        """Release the sockets and cancel background work (idempotent; no BYE is sent)."""
        for task in (self._sender, *self._tasks):
            if task is not None:
                task.cancel()
        for future in (self._final, *self._pending.values()):
            if future is not None and not future.done():
                future.cancel()
        for transport in (self._sip, self._rtp_transport, self._rtcp_transport):
            if transport is not None:
                transport.close()
        if self._rtp_transport is not None and self._rtp_closed_at is None:
            self._rtp_closed_at = self._clock()
        if self._state != "idle":
            self._state = "terminated"

    async def aclose(self) -> None:
        """:meth:`close`, then wait until every cancelled task has finished."""
        self.close()
        tasks = [t for t in (self._sender, *self._tasks) if t is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- SIP plumbing -------------------------------------------------------------------------

    def _error(self, text: str) -> None:
        if len(self.errors) < _MAX_ERRORS:
            self.errors.append(text)
        else:
            self.errors_dropped += 1

    def _new_branch(self) -> str:
        return f"z9hG4bK{secrets.token_hex(8)}"  # RFC 3261 8.1.1.7 magic cookie

    def _via(self, branch: str) -> str:
        assert self.local_sip is not None
        return f"SIP/2.0/UDP {self.local_sip[0]}:{self.local_sip[1]};branch={branch};rport"

    def _send_sip(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._sip is not None and not self._sip.is_closing():
            self._sip.sendto(data, addr)

    def _on_sip(self, data: bytes, addr: tuple[str, int]) -> None:
        if not data.strip():
            return  # CRLF keep-alive (RFC 5626 section 4.4.1)
        try:
            message = SipMessage.parse(data)
        except SipParseError as exc:
            self._error(f"sip: unparseable datagram from {addr}: {exc}")
            return
        if message.is_request:
            self._on_request(message, addr)
        else:
            self._on_response(message)

    def _on_response(self, response: SipMessage) -> None:
        _, method = response.cseq
        branch = _param(response.header("via") or "", "branch") or ""
        if response.header("call-id") != self._call_id:
            self._error(f"sip: response {response.status} for an unknown Call-ID")
            return
        if method == "INVITE" and branch == self._invite_branch:
            self._on_invite_response(response)
            return
        future = self._pending.get((branch, method))
        if future is None:
            if (branch, method) not in self._finished:  # else a retransmitted final: harmless
                self._error(f"sip: unexpected response {response.status} to {method}")
        elif response.status >= 200 and not future.done():
            future.set_result(response)

    def _on_invite_response(self, response: SipMessage) -> None:
        status = response.status
        final = self._final
        if status < 200:
            if final is not None and not final.done():
                self.provisional.append(status)
            return
        if final is None or final.cancelled():
            self._error(f"sip: INVITE response {status} after the transaction ended")
            return
        if final.done():
            # A retransmitted final: our ACK was lost or is still in flight; send it again.
            tag = _param(response.header("to") or "", "tag")
            if status < 300 and tag != self._remote_tag:
                self._error(f"sip: a second 2xx from another dialog (to-tag {tag}); ignored")
                return
            if self._ack is not None:
                self._send_sip(*self._ack)
                self.final_retransmits += 1
            return
        self.status = status
        self.reason = response.reason
        invite = self._invite
        assert invite is not None
        if status < 300:
            now = self._clock()
            self.answered_at = now
            assert self.invite_sent_at is not None
            self.setup_ms = 1000 * (now - self.invite_sent_at)
            self._state = "confirmed"
            self._remote_to = response.header("to") or self._to
            self._remote_tag = _param(self._remote_to, "tag")
            contact = response.header("contact")
            self._remote_target = _uri(contact) if contact else self._request_uri
            # RFC 3261 12.1.2: the route set is the Record-Route list, reversed, for a UAC.
            self._route_set = list(reversed(response.header_values("record-route")))
            next_hop = _uri(self._route_set[0]) if self._route_set else self._remote_target
            try:
                self._dest = _hostport(next_hop)
            except SipParseError as exc:
                self._error(f"sip: {exc}; sending in-dialog requests to {self._target}")
                self._dest = self._target
            ack, _ = self._dialog_request("ACK", cseq=self._cseq)
            self._ack = (ack.serialize(), self._dest)
        else:
            # RFC 3261 17.1.1.3: the transaction's own ACK: INVITE's Request-URI, top Via
            # (same branch), From, Call-ID and CSeq number; To from the response.
            ack = SipMessage.request(
                "ACK",
                invite.uri,
                [
                    ("Via", invite.header("via") or ""),
                    ("Max-Forwards", "70"),
                    ("From", self._from),
                    ("To", response.header("to") or self._to),
                    ("Call-ID", self._call_id),
                    ("CSeq", f"{invite.cseq[0]} ACK"),
                ],
            )
            self._ack = (ack.serialize(), self._target)
        self._send_sip(*self._ack)
        final.set_result(response)

    def _dialog_request(
        self,
        method: str,
        *,
        cseq: int | None = None,
        body: bytes = b"",
        extra: Iterable[tuple[str, str]] = (),
    ) -> tuple[SipMessage, str]:
        """A request inside our dialog (RFC 3261 12.2.1.1) and its Via branch."""
        if cseq is None:
            self._cseq += 1
            cseq = self._cseq
        branch = self._new_branch()
        headers = [("Via", self._via(branch)), ("Max-Forwards", "70")]
        headers += [("Route", route) for route in self._route_set]
        headers += [
            ("From", self._from),
            ("To", self._remote_to),
            ("Call-ID", self._call_id),
            ("CSeq", f"{cseq} {method}"),
        ]
        if method not in ("ACK", "BYE"):
            headers.append(("Contact", self._contact))
        headers.extend(extra)
        return SipMessage.request(method, self._remote_target, headers, body), branch

    async def _transact(
        self,
        data: bytes,
        branch: str,
        method: str,
        timeout_s: float,
        dest: tuple[str, int] | None = None,
    ) -> SipMessage | None:
        """A non-INVITE client transaction: Timer E (T1 doubling up to T2) until a final."""
        assert self._loop is not None
        future: asyncio.Future[SipMessage] = self._loop.create_future()
        key = (branch, method)
        self._pending[key] = future
        deadline = self._loop.time() + timeout_s
        interval = self.t1
        try:
            while True:
                self._send_sip(data, dest or self._dest)
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    return None
                await asyncio.wait({future}, timeout=min(interval, remaining))
                if future.done():
                    return None if future.cancelled() else future.result()
                interval = min(2 * interval, T2)
        finally:
            self._pending.pop(key, None)
            self._finished[key] = None
            if len(self._finished) > _REPLY_CACHE:
                self._finished.pop(next(iter(self._finished)))

    async def _cancel_invite(self) -> None:
        """CANCEL the pending INVITE (RFC 3261 9.1); the 487 that follows is ACKed as usual."""
        invite = self._invite
        assert invite is not None and self._loop is not None
        cancel = SipMessage.request(
            "CANCEL",
            invite.uri,
            [
                ("Via", invite.header("via") or ""),
                ("Max-Forwards", "70"),
                ("From", self._from),
                ("To", self._to),
                ("Call-ID", self._call_id),
                ("CSeq", f"{invite.cseq[0]} CANCEL"),
            ],
        )
        bound = 4 * self.t1 * 2
        response = await self._transact(
            cancel.serialize(), self._invite_branch, "CANCEL", bound, self._target
        )
        if response is None:
            self._error("CANCEL: no response")
        assert self._final is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._final), bound)

    def _on_request(self, request: SipMessage, addr: tuple[str, int]) -> None:
        method = request.method
        self.requests_received[method] = self.requests_received.get(method, 0) + 1
        number, _ = request.cseq
        branch = _param(request.header("via") or "", "branch") or ""
        call_id = request.header("call-id") or ""
        key = (call_id, number, method, branch)
        cached = self._replies.get(key)
        if cached is not None:
            self._send_sip(cached, addr)  # a retransmitted request gets the same answer
            return
        if method == "ACK":
            if self._reinvite_acked is not None and call_id == self._call_id:
                self._reinvite_acked.set()
            return  # ACKs get no response; stray ones are harmless
        if method == "OPTIONS":
            self._reply(
                request, addr, 200, "OK", [("Allow", _ALLOW), ("Accept", "application/sdp")]
            )
            return
        in_dialog = (
            call_id == self._call_id
            and self._remote_tag is not None
            and _param(request.header("from") or "", "tag") == self._remote_tag
        )
        if not in_dialog:
            self._error(f"sip: {method} outside our dialog from {addr}")
            self._reply(request, addr, 481, "Call/Transaction Does Not Exist")
            return
        if method == "BYE":
            self._reply(request, addr, 200, "OK")
            if self.remote_hangup_at is None:
                self.remote_hangup_at = self._clock()
            self._state = "terminated"
            if self._sender is not None:
                self._sender.cancel()  # a phone stops its media when the far end hangs up
        elif method == "REFER":
            refer_to = request.header("refer-to")
            if not refer_to:
                self._error("sip: REFER without Refer-To")
                self._reply(request, addr, 400, "Missing Refer-To")
                return
            self._reply(request, addr, 202, "Accepted")
            self.transferred_to = _uri(refer_to)
            self._spawn(self._report_transfer_failed())
        elif method == "INVITE":
            self._on_reinvite(request, addr)
        else:
            self._error(f"sip: unexpected {method} in the dialog")
            self._reply(request, addr, 405, "Method Not Allowed", [("Allow", _ALLOW)])

    def _reply(
        self,
        request: SipMessage,
        addr: tuple[str, int],
        status: int,
        reason: str,
        extra: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> bytes:
        """Send (and cache for retransmissions) a response, RFC 3261 section 8.2.6."""
        to = request.header("to") or ""
        if _param(to, "tag") is None and status > 100:
            local_tag = (
                _param(self._from, "tag") if request.header("call-id") == self._call_id else None
            )
            to = f"{to};tag={local_tag or _token()}"
        headers = [("Via", via) for via in request.header_values("via")]
        headers += [
            ("From", request.header("from") or ""),
            ("To", to),
            ("Call-ID", request.header("call-id") or ""),
            ("CSeq", request.header("cseq") or ""),
            ("User-Agent", _USER_AGENT),
        ]
        headers.extend(extra)
        data = SipMessage(status=status, reason=reason, headers=headers, body=body).serialize()
        # The source address, not the Via sent-by: what RFC 3581 rport asks for, and the only
        # address that works behind NAT; on loopback the two agree.
        self._send_sip(data, addr)
        number, method = request.cseq
        key = (
            request.header("call-id") or "",
            number,
            method,
            _param(request.header("via") or "", "branch") or "",
        )
        self._replies[key] = data
        if len(self._replies) > _REPLY_CACHE:
            self._replies.pop(next(iter(self._replies)))
        return data

    def _on_reinvite(self, request: SipMessage, addr: tuple[str, int]) -> None:
        """Answer a re-INVITE like a phone: same codecs, hold honoured (RFC 3264 section 8.4)."""
        try:
            offer = SessionDescription.parse(request.body)
            if offer.audio_pt is None:
                raise SdpError(f"no PCMU in the re-INVITE offer ({offer.payload_types})")
        except SdpError as exc:
            self._error(f"sip: re-INVITE: {exc}")
            self._reply(request, addr, 488, "Not Acceptable Here")
            return
        self._apply_sdp(offer)
        direction = {"sendonly": "recvonly", "recvonly": "sendonly", "inactive": "inactive"}.get(
            offer.direction, "sendrecv"
        )
        assert self.local_rtp is not None
        self._sdp_version += 1
        sdp = build_sdp(
            self._local_ip,
            self.local_rtp[1],
            session_id=self._sdp_session,
            version=self._sdp_version,
            event_pt=offer.event_pt or PT_TELEPHONE_EVENT,
            direction=direction,
        )
        data = self._reply(
            request,
            addr,
            200,
            "OK",
            [("Contact", self._contact), ("Content-Type", "application/sdp")],
            sdp,
        )
        self._reinvite_acked = asyncio.Event()
        self._spawn(self._retransmit_until_ack(data, addr, self._reinvite_acked))

    async def _retransmit_until_ack(
        self, data: bytes, addr: tuple[str, int], acked: asyncio.Event
    ) -> None:
        # RFC 3261 13.3.1.4: resend the 2xx at T1, 2*T1... capped at T2, for 64*T1 or an ACK.
        interval = self.t1
        waited = 0.0
        while waited < 64 * self.t1:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await acked.wait()
            if acked.is_set():
                return
            self._send_sip(data, addr)
            waited += interval
            interval = min(2 * interval, T2)
        self._error("sip: no ACK for our 200 to the re-INVITE")

    async def _report_transfer_failed(self) -> None:
        # RFC 3515 2.4.5: the implicit subscription's NOTIFY carries the outcome as a sipfrag.
        notify, branch = self._dialog_request(
            "NOTIFY",
            body=b"SIP/2.0 503 Service Unavailable\r\n",
            extra=[
                ("Event", "refer"),
                ("Subscription-State", "terminated;reason=noresource"),
                ("Content-Type", "message/sipfrag;version=2.0"),
            ],
        )
        response = await self._transact(notify.serialize(), branch, "NOTIFY", 64 * self.t1)
        if response is None:
            self._error("NOTIFY (transfer failed): no response")
        elif response.status >= 300:
            self._error(f"NOTIFY (transfer failed) answered {response.status} {response.reason}")

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- RTP plumbing -------------------------------------------------------------------------

    async def _bind_rtp(self, local_ip: str) -> None:
        """An even RTP port with RTCP on the next one (RFC 3550 11), so a peer's RTCP, sent to
        RTP + 1, lands on our socket and not on another caller's RTP port."""
        assert self._loop is not None
        for _ in range(32):
            rtp, _ = await self._loop.create_datagram_endpoint(
                lambda: _Datagrams(self._on_rtp, self._error, "rtp"), local_addr=(local_ip, 0)
            )
            port = rtp.get_extra_info("sockname")[1]
            if port % 2 == 0:
                try:
                    rtcp, _ = await self._loop.create_datagram_endpoint(
                        lambda: _Datagrams(self._on_rtcp, self._error, "rtcp"),
                        local_addr=(local_ip, port + 1),
                    )
                except OSError:
                    pass
                else:
                    self._rtp_transport, self._rtcp_transport = rtp, rtcp
                    self.local_rtp = (local_ip, port)
                    return
            rtp.close()
        raise LoadSimError("no even/odd UDP port pair free for RTP/RTCP")

    def _on_rtp(self, data: bytes, addr: tuple[str, int]) -> None:
        arrival = self._clock()
        try:
            self.rtp.record(data, addr, arrival)
        except RtpParseError as exc:
            self._error(f"rtp: malformed packet from {addr}: {exc}")

    def _on_rtcp(self, data: bytes, addr: tuple[str, int]) -> None:
        self.rtp.rtcp += 1

    def _apply_sdp(self, description: SessionDescription) -> None:
        self.answer = description
        self.remote_rtp = (description.address, description.port)
        self._audio_pt = description.audio_pt if description.audio_pt is not None else PT_PCMU
        self._event_pt = description.event_pt
        self.rtp.audio_pt = self._audio_pt
        self.rtp.event_pt = self._event_pt
        # We send unless the far end said it will not receive (RFC 3264 section 6.1).
        self._send_enabled = description.direction in ("sendrecv", "recvonly")

    def _next_frame(self) -> bytes:
        if self._audio is not None:
            frame = next(self._audio, None)
            if frame is None:
                self._audio = None
            elif len(frame) == FRAME_SAMPLES:
                return frame
            else:
                self._error(f"rtp: audio frame of {len(frame)} bytes, expected {FRAME_SAMPLES}")
                return (bytes(frame) + _SILENT_FRAME)[:FRAME_SAMPLES]
        return _SILENT_FRAME

    async def _send_media(self) -> None:
        """The sender: one packet per 20 ms deadline; DTMF events replace audio while active."""
        transport = self._rtp_transport
        assert transport is not None
        pacer = self.pacer
        pacer.start()
        seq, ts, ssrc = self._seq, self._ts, self._ssrc
        first = True
        job: _DtmfJob | None = None
        try:
            while True:
                now = await pacer.next()
                if job is None and self._dtmf:
                    job = self._dtmf.popleft()
                if job is not None and self._event_pt is not None:
                    payload, stamp, marker = job.packet(ts, now)
                    pt = self._event_pt
                    if job.finished:
                        if not job.done.done():
                            job.done.set_result(job.first_at)
                        job = None
                else:
                    payload, stamp, marker, pt = self._next_frame(), ts, False, self._audio_pt
                if self._send_enabled and self.remote_rtp is not None:
                    header = _RTP_HEADER.pack(
                        0x80, (0x80 if marker or first else 0) | pt, seq, stamp, ssrc
                    )
                    transport.sendto(header + payload, self.remote_rtp)
                    self.packets_sent += 1
                    first = False
                    seq = (seq + 1) & 0xFFFF
                ts = (ts + FRAME_SAMPLES) & 0xFFFFFFFF
        except Exception as exc:  # the sender dies loudly in errors, never silently
            self._error(f"rtp: the sender stopped: {exc!r}")
        finally:
            ended = LoadSimError("the call's media stopped before the DTMF event was sent")
            for pending in (job, *self._dtmf):
                if pending is not None and not pending.done.done():
                    pending.done.set_exception(ended)
            self._dtmf.clear()

    async def _stop_media(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.wait({self._sender})
