"""SDP (RFC 4566) and the offer/answer model (RFC 3264) for one G.711 audio stream, sans-I/O.

:func:`parse_sdp` reads an offer into :class:`SessionDescription`; :func:`negotiate` answers it
(RFC 3264 section 6): the offer's first audio codec we speak, RFC 4733 telephone-event echoed,
the direction mirrored, every other m-line rejected with port 0 but kept in place. The
offerer's side (a phone calling in, :mod:`gateway.sip.uac`): :func:`offer` writes an offer and
:func:`read_answer` reads the answer's audio stream (RFC 3264 sections 5 and 7).

Errors: :class:`SdpError` (a :class:`gateway.errors.GatewayError`) whose ``status`` is the SIP
response to send: 400 for a malformed description, 413 for one over the size/line limits,
488 (Not Acceptable Here) when nothing in a well-formed offer can be accepted.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.errors import GatewayError

__all__ = [
    "STATIC_PAYLOAD_TYPES",
    "Answer",
    "Connection",
    "MediaAnswer",
    "MediaDescription",
    "Origin",
    "RtpMap",
    "SdpError",
    "SessionDescription",
    "negotiate",
    "offer",
    "parse_sdp",
    "read_answer",
]

#: Size limits: an audio offer is a few hundred bytes; these leave room for video and ICE.
MAX_SDP_BYTES = 16 * 1024
MAX_SDP_LINES = 512

DIRECTIONS = ("sendrecv", "sendonly", "recvonly", "inactive")
# RFC 3264 6.1: the answer's direction given the offer's.
_MIRROR = {
    "sendrecv": "sendrecv",
    "sendonly": "recvonly",
    "recvonly": "sendonly",
    "inactive": "inactive",
}


class SdpError(GatewayError):
    """An SDP body that cannot be used; ``status`` is the SIP response (400, 413 or 488)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RtpMap:
    """``a=rtpmap:<pt> <name>/<clock_rate>[/<channels>]`` (RFC 4566 6)."""

    name: str
    clock_rate: int
    channels: int = 1

    def serialize(self) -> str:
        """``name/rate`` or ``name/rate/channels`` as in an rtpmap attribute."""
        tail = f"/{self.channels}" if self.channels != 1 else ""
        return f"{self.name}/{self.clock_rate}{tail}"


#: RFC 3551 table 4: static audio payload types, usable without an rtpmap.
STATIC_PAYLOAD_TYPES: dict[int, RtpMap] = {
    0: RtpMap("PCMU", 8000),
    3: RtpMap("GSM", 8000),
    4: RtpMap("G723", 8000),
    5: RtpMap("DVI4", 8000),
    6: RtpMap("DVI4", 16000),
    7: RtpMap("LPC", 8000),
    8: RtpMap("PCMA", 8000),
    9: RtpMap("G722", 8000),
    10: RtpMap("L16", 44100, 2),
    11: RtpMap("L16", 44100),
    12: RtpMap("QCELP", 8000),
    13: RtpMap("CN", 8000),
    14: RtpMap("MPA", 90000),
    15: RtpMap("G728", 8000),
    16: RtpMap("DVI4", 11025),
    17: RtpMap("DVI4", 22050),
    18: RtpMap("G729", 8000),
}


@dataclass(frozen=True)
class Origin:
    """``o=<username> <sess-id> <sess-version> IN <addrtype> <address>`` (RFC 4566 5.2)."""

    username: str
    session_id: int
    version: int
    address: str
    addrtype: str = "IP4"


@dataclass(frozen=True)
class Connection:
    """``c=IN <addrtype> <address>`` (RFC 4566 5.7), TTL / address count dropped."""

    address: str
    addrtype: str = "IP4"

    @property
    def is_null(self) -> bool:
        """The RFC 2543 hold address (RFC 3264 8.4): nothing is to be sent to the peer."""
        return self.address in ("0.0.0.0", "::")


@dataclass
class MediaDescription:
    """One ``m=`` section, with session-level defaults already applied.

    ``formats`` are the RTP payload types in offer order (empty for non-RTP protocols, whose
    formats stay in ``raw_formats``); ``rtpmap`` includes RFC 3551 static types the offer used
    without an rtpmap line; ``direction`` and ``connection`` fall back to the session level
    (RFC 4566 5.7, 6).
    """

    kind: str
    port: int
    proto: str
    formats: list[int] = field(default_factory=list)
    rtpmap: dict[int, RtpMap] = field(default_factory=dict)
    fmtp: dict[int, str] = field(default_factory=dict)
    ptime: int | None = None
    direction: str = "sendrecv"
    connection: Connection | None = None
    raw_formats: list[str] = field(default_factory=list)
    port_count: int = 1
    attributes: list[tuple[str, str | None]] = field(default_factory=list)

    @property
    def is_rtp(self) -> bool:
        """RTP profiles (RTP/AVP, RTP/SAVP, ...): formats are payload types (RFC 4566 5.14)."""
        return "RTP/" in self.proto.upper()


@dataclass
class SessionDescription:
    """A parsed session description (RFC 4566 5)."""

    origin: Origin
    name: str = "-"
    connection: Connection | None = None
    direction: str = "sendrecv"
    media: list[MediaDescription] = field(default_factory=list)
    attributes: list[tuple[str, str | None]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str | bytes) -> SessionDescription:
        """Same as :func:`parse_sdp`."""
        return parse_sdp(text)


_DIGITS = re.compile(r"[0-9]{1,32}")
_PT_RE = re.compile(r"[0-9]{1,3}")
_ATTR_NAME = re.compile(r"[A-Za-z0-9\-.!%*_+`'~]+")
_RTPMAP_RE = re.compile(r"([0-9]{1,3})[ \t]+([^/ \t]+)/([0-9]{1,9})(?:/([0-9]{1,2}))?[ \t]*")
_FMTP_RE = re.compile(r"([0-9]{1,3})[ \t]+(.*)")
_PTIME_RE = re.compile(r"[ \t]*([0-9]{1,5})(?:\.[0-9]{1,6})?[ \t]*")
_CTL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_ADDRTYPES = ("IP4", "IP6")


def _connection(value: str, line: int) -> Connection:
    parts = value.split()
    if len(parts) != 3 or parts[0] != "IN" or parts[1] not in _ADDRTYPES:
        raise SdpError(400, f"line {line}: expected c=IN IP4|IP6 <address>, got {value!r}")
    # RFC 4566 5.7: IP4 multicast carries /ttl[/count]; the address is what precedes it.
    return Connection(parts[2].split("/", 1)[0], parts[1])


def _origin(value: str, line: int) -> Origin:
    parts = value.split()
    if len(parts) != 6 or parts[3] != "IN" or parts[4] not in _ADDRTYPES:
        raise SdpError(400, f"line {line}: expected o=<user> <id> <version> IN IP4|IP6 <address>")
    if not (_DIGITS.fullmatch(parts[1]) and _DIGITS.fullmatch(parts[2])):
        raise SdpError(400, f"line {line}: o= session id and version must be numbers")
    return Origin(parts[0], int(parts[1]), int(parts[2]), parts[5], parts[4])


def _media(value: str, line: int) -> MediaDescription:
    parts = value.split()
    if len(parts) < 4:
        raise SdpError(400, f"line {line}: expected m=<media> <port> <proto> <fmt> ...")
    kind, port_text, proto = parts[0], parts[1], parts[2]
    port_part, _, count_part = port_text.partition("/")
    if not _DIGITS.fullmatch(port_part) or int(port_part) > 65535:
        raise SdpError(400, f"line {line}: bad m= port {port_text!r}")
    if count_part and not (_DIGITS.fullmatch(count_part) and int(count_part) > 0):
        raise SdpError(400, f"line {line}: bad m= port count {port_text!r}")
    media = MediaDescription(
        kind=kind.lower(),
        port=int(port_part),
        proto=proto,
        raw_formats=parts[3:],
        port_count=int(count_part) if count_part else 1,
    )
    if media.is_rtp:
        for fmt in parts[3:]:
            if not _PT_RE.fullmatch(fmt) or int(fmt) > 127:
                raise SdpError(400, f"line {line}: RTP payload type {fmt!r} is not 0-127")
            media.formats.append(int(fmt))
    return media


def _media_attribute(media: MediaDescription, name: str, value: str | None) -> None:
    """Interpret the attributes negotiation needs; any other attribute is only kept.

    A malformed rtpmap/fmtp/ptime value is ignored rather than fatal (RFC 4475 3.1.1.1 sends
    ``a=rtpmap:31 LPC``): it stays in ``attributes``, and a static payload type still resolves.
    """
    if not media.is_rtp or value is None:
        return
    if name == "rtpmap":
        m = _RTPMAP_RE.fullmatch(value)
        if m is not None and int(m.group(1)) <= 127:
            channels = int(m.group(4)) if m.group(4) else 1
            media.rtpmap[int(m.group(1))] = RtpMap(m.group(2), int(m.group(3)), channels)
    elif name == "fmtp":
        m = _FMTP_RE.fullmatch(value)
        if m is not None and int(m.group(1)) <= 127:
            media.fmtp[int(m.group(1))] = m.group(2).strip()
    elif name == "ptime":
        m = _PTIME_RE.fullmatch(value)
        if m is not None:
            media.ptime = int(m.group(1))


def parse_sdp(text: str | bytes) -> SessionDescription:
    """Parse a session description (RFC 4566).

    Strict on line syntax (``<type>=<value>``, one lower-case letter, no space around ``=``;
    ``v=0`` first; well-formed ``o=``, ``c=`` and ``m=``), tolerant of unknown lines and
    attributes, of malformed values of attributes it reads, of bare LF line ends (RFC 4566 5)
    and of a missing ``s=``/``t=``. Raises :class:`SdpError`.
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        raw = bytes(text)
        if len(raw) > MAX_SDP_BYTES:
            raise SdpError(413, f"SDP is {len(raw)} bytes; the limit is {MAX_SDP_BYTES}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SdpError(400, f"SDP is not valid UTF-8 (byte offset {exc.start})") from None
    elif len(text.encode("utf-8", "surrogatepass")) > MAX_SDP_BYTES:
        raise SdpError(413, f"SDP is over the {MAX_SDP_BYTES}-byte limit")

    lines = text.split("\n")
    while lines and lines[-1] in ("", "\r"):
        lines.pop()
    if len(lines) > MAX_SDP_LINES:
        raise SdpError(413, f"SDP has {len(lines)} lines; the limit is {MAX_SDP_LINES}")
    if not lines:
        raise SdpError(400, "SDP is empty")

    origin: Origin | None = None
    session = SessionDescription(origin=Origin("-", 0, 0, "0.0.0.0"))
    session_direction: str | None = None
    media_directions: list[str | None] = []
    current: MediaDescription | None = None
    for number, line in enumerate(lines, 1):
        if line.endswith("\r"):
            line = line[:-1]
        ctl = _CTL_RE.search(line)
        if ctl is not None:
            raise SdpError(400, f"line {number}: control character 0x{ord(ctl.group()):02x}")
        if len(line) < 2 or line[1] != "=" or not ("a" <= line[0] <= "z"):
            raise SdpError(400, f"line {number}: expected <type>=<value>, got {line[:40]!r}")
        kind, value = line[0], line[2:]
        if number == 1:
            if kind != "v" or value != "0":
                raise SdpError(400, "SDP must start with v=0")
            continue
        if kind == "v":
            raise SdpError(400, f"line {number}: second v= line")
        if kind == "m":
            current = _media(value, number)
            session.media.append(current)
            media_directions.append(None)
        elif kind == "c":
            conn = _connection(value, number)
            if current is None:
                session.connection = conn
            else:
                current.connection = conn
        elif kind == "o" and current is None:
            if origin is not None:
                raise SdpError(400, f"line {number}: second o= line")
            origin = _origin(value, number)
        elif kind == "s" and current is None:
            session.name = value
        elif kind == "a":
            name, sep, attr_value = value.partition(":")
            name = name.rstrip(" \t")
            if not _ATTR_NAME.fullmatch(name):
                raise SdpError(400, f"line {number}: malformed attribute {value[:40]!r}")
            parsed: str | None = attr_value if sep else None
            if current is None:
                session.attributes.append((name, parsed))
                if name in DIRECTIONS:
                    session_direction = name
            else:
                current.attributes.append((name, parsed))
                if name in DIRECTIONS:
                    media_directions[-1] = name
                _media_attribute(current, name, parsed)
        # i=, u=, e=, p=, b=, t=, r=, z=, k= and unknown letters: syntax checked, not used.

    if origin is None:
        raise SdpError(400, "SDP has no o= line")
    session.origin = origin
    session.direction = session_direction or "sendrecv"
    for media, direction in zip(session.media, media_directions, strict=True):
        media.direction = direction or session.direction
        if media.connection is None:
            media.connection = session.connection
        if media.is_rtp:
            for pt in media.formats:
                if pt not in media.rtpmap and pt in STATIC_PAYLOAD_TYPES:
                    media.rtpmap[pt] = STATIC_PAYLOAD_TYPES[pt]
    return session


@dataclass(frozen=True)
class Answer:
    """The outcome of :func:`negotiate`: what to send, where, and the answer body.

    ``direction`` is the answer's (ours); ``on_hold`` says the far end put us on hold
    (offer sendonly/inactive or c=0.0.0.0, RFC 3264 8.4); ``remote_rtp`` is where to send RTP
    (with ``0.0.0.0`` meaning: send nothing).
    """

    codec: str
    payload_type: int
    telephone_event_pt: int | None
    remote_rtp: tuple[str, int]
    direction: str
    on_hold: bool
    sdp: bytes
    ptime: int = 20
    remote_ptime: int | None = None


def _describe_offer(offer: SessionDescription) -> str:
    names: list[str] = []
    for media in offer.media:
        if media.kind != "audio":
            continue
        if not media.is_rtp or media.proto.upper() != "RTP/AVP":
            names.append(f"m=audio over {media.proto}")
            continue
        for pt in media.formats:
            rtpmap = media.rtpmap.get(pt)
            names.append(f"{rtpmap.name}/{rtpmap.clock_rate}" if rtpmap else f"PT {pt}")
    return ", ".join(names) if names else "no audio stream"


def _choose(media: MediaDescription, wanted: Sequence[str]) -> tuple[int, str] | None:
    """The offer's first payload type (offer order, RFC 3264 6.1) we can send, and its name."""
    upper = {name.upper(): name for name in wanted}
    for pt in media.formats:
        rtpmap = media.rtpmap.get(pt)
        if rtpmap is None or rtpmap.channels != 1 or rtpmap.clock_rate != 8000:
            continue
        if rtpmap.name.upper() in upper:
            return pt, rtpmap.name.upper()
    return None


def _telephone_event(media: MediaDescription, clock_rate: int) -> int | None:
    for pt in media.formats:
        rtpmap = media.rtpmap.get(pt)
        if (
            rtpmap is not None
            and rtpmap.name.lower() == "telephone-event"
            and rtpmap.clock_rate == clock_rate
        ):
            return pt
    return None


def _check_reachable(conn: Connection, local_ip: str) -> None:
    """Refuse a media address RTP could never be sent to from ``local_ip``'s socket.

    RFC 4566 5.7 allows a host name in ``c=``, but resolving one would block the pacer (or, on
    uvloop, make every ``sendto`` raise) and a hostile offer could name any host; trunks and
    PBXs send IP addresses. An address of the other IP version cannot be reached from the
    call's RTP socket either.
    """
    try:
        address = ipaddress.ip_address(conn.address)
    except ValueError:
        raise SdpError(488, f"c= address {conn.address[:60]!r} is not an IP address") from None
    if ("IP6" if address.version == 6 else "IP4") != conn.addrtype:
        raise SdpError(488, f"c= address {conn.address[:60]!r} is not {conn.addrtype}")
    try:
        local = ipaddress.ip_address(local_ip)
    except ValueError:
        return  # a host name we advertise ourselves: nothing to compare with
    if local.version != address.version:
        raise SdpError(488, f"c= address {conn.address[:60]!r} is IPv{address.version}; "
                            f"our media is on IPv{local.version}")


def negotiate(
    offer: SessionDescription,
    *,
    local_ip: str,
    local_port: int,
    session_id: int,
    version: int = 1,
    codecs: Sequence[str] = ("PCMU", "PCMA"),
    ptime: int = 20,
) -> Answer:
    """Answer ``offer`` per RFC 3264 section 6.

    Accepts the first RTP/AVP audio m-line (non-zero port, with a connection address) that
    holds a codec from ``codecs``; picks the offer's first such codec, echoes its
    telephone-event/8000 payload type (RFC 4733) with ``0-15``, mirrors the direction, and
    rejects every other m-line with port 0 while keeping it in place. Raises SdpError(488)
    when no audio stream is acceptable or its address is not an IP address of our IP version,
    SdpError(400) when the chosen stream has no address.
    """
    chosen: tuple[int, MediaDescription, int, str] | None = None
    for index, media in enumerate(offer.media):
        if media.kind != "audio" or media.port == 0 or media.proto.upper() != "RTP/AVP":
            continue
        pick = _choose(media, codecs)
        if pick is not None:
            chosen = (index, media, pick[0], pick[1])
            break
    if chosen is None:
        raise SdpError(
            488,
            f"no common codec: offer has {_describe_offer(offer)}; "
            f"we speak {', '.join(name.upper() for name in codecs)} over RTP/AVP",
        )
    index, media, pt, codec = chosen
    conn = media.connection
    if conn is None:
        raise SdpError(400, "the audio m-line has no c= line at session or media level")
    _check_reachable(conn, local_ip)
    te_pt = _telephone_event(media, 8000)

    offered = media.direction
    if conn.is_null:
        # RFC 3264 8.4: c=0.0.0.0 means send nothing to the peer; it receives nothing.
        offered = {"sendrecv": "sendonly", "recvonly": "inactive"}.get(offered, offered)
    on_hold = conn.is_null or media.direction in ("sendonly", "inactive")
    direction = _MIRROR.get(offered, "sendrecv")

    media_lines: list[str] = []
    for i, m in enumerate(offer.media):
        if i != index:
            # RFC 3264 6: rejected, same position, port 0, the offer's formats.
            media_lines.append(f"m={m.kind} 0 {m.proto} {' '.join(m.raw_formats)}")
            continue
        media_lines += _audio_lines(local_port, [(pt, m.rtpmap[pt])], te_pt, ptime, direction)
    sdp = _description("-", session_id, version, local_ip, "-", media_lines)
    return Answer(
        codec=codec,
        payload_type=pt,
        telephone_event_pt=te_pt,
        remote_rtp=(conn.address, media.port),
        direction=direction,
        on_hold=on_hold,
        sdp=sdp,
        ptime=ptime,
        remote_ptime=media.ptime,
    )


def _description(username: str, session_id: int, version: int, address: str, name: str,
                 media_lines: Sequence[str]) -> bytes:
    """A whole session description (RFC 4566 5): session lines, then ``media_lines``."""
    addrtype = "IP6" if ":" in address else "IP4"
    lines = [
        "v=0",
        f"o={username} {session_id} {version} IN {addrtype} {address}",
        f"s={name}",
        f"c=IN {addrtype} {address}",
        "t=0 0",
        *media_lines,
    ]
    return ("\r\n".join(lines) + "\r\n").encode("utf-8")


def _audio_lines(port: int, codecs: Sequence[tuple[int, RtpMap]], te_pt: int | None,
                 ptime: int, direction: str) -> list[str]:
    """One audio m-line and its attributes: codecs in order, RFC 4733 events 0-15 (2.4.1)."""
    fmts = " ".join(str(pt) for pt, _ in codecs) + (f" {te_pt}" if te_pt is not None else "")
    lines = [f"m=audio {port} RTP/AVP {fmts}"]
    lines += [f"a=rtpmap:{pt} {rtpmap.serialize()}" for pt, rtpmap in codecs]
    if te_pt is not None:
        lines.append(f"a=rtpmap:{te_pt} telephone-event/8000")
        lines.append(f"a=fmtp:{te_pt} 0-15")
    lines.append(f"a=ptime:{ptime}")
    lines.append(f"a={direction}")
    return lines


#: The static payload type of each codec :func:`offer` can offer (RFC 3551 table 4).
_OFFERABLE = {rtpmap.name: pt for pt, rtpmap in STATIC_PAYLOAD_TYPES.items()
              if pt in (0, 8)}


def offer(
    local_ip: str,
    local_port: int,
    *,
    session_id: int,
    version: int = 1,
    codecs: Sequence[str] = ("PCMU",),
    telephone_event_pt: int | None = 101,
    ptime: int = 20,
    direction: str = "sendrecv",
    username: str = "-",
    name: str = "-",
) -> bytes:
    """An offer of one audio stream (RFC 3264 section 5, RFC 4566): ``codecs`` (G.711, on their
    static payload types, in preference order), telephone-event/8000 0-15 on
    ``telephone_event_pt`` (RFC 4733; None: no events), ``ptime`` and ``direction``.
    ``version`` goes up by one with each new offer of the session (RFC 3264 section 8)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not one of {', '.join(DIRECTIONS)}")
    chosen = []
    for codec in codecs:
        pt = _OFFERABLE.get(codec.upper())
        if pt is None:
            raise ValueError(f"cannot offer {codec!r}: only {', '.join(_OFFERABLE)}")
        chosen.append((pt, STATIC_PAYLOAD_TYPES[pt]))
    media = _audio_lines(local_port, chosen, telephone_event_pt, ptime, direction)
    return _description(username, session_id, version, local_ip, name, media)


@dataclass(frozen=True)
class MediaAnswer:
    """The first audio stream of an SDP answer, as far as a G.711 phone needs it."""

    address: str
    port: int
    payload_types: tuple[int, ...]
    audio_pt: int | None
    """The payload type carrying PCMU/8000, or None."""
    event_pt: int | None
    """The payload type of telephone-event/8000, or None when not accepted."""
    direction: str = "sendrecv"
    ptime: int | None = None


def read_answer(body: bytes, codec: str = "PCMU") -> MediaAnswer:
    """Read the audio stream of an SDP answer to our offer (RFC 3264 section 7).

    ``audio_pt`` is the answer's payload type for ``codec`` at 8 kHz (None when it has none).
    Raises :class:`SdpError` when the body is not SDP, has no audio stream, rejected it
    (port 0, RFC 3264 section 6) or gives it no connection address.
    """
    session = parse_sdp(body)
    media = next((m for m in session.media if m.kind == "audio"), None)
    if media is None:
        raise SdpError(488, "no m=audio stream in the answer")
    if media.port == 0:
        raise SdpError(488, "the audio stream is rejected (port 0)")
    if media.connection is None:
        raise SdpError(400, "no c= connection address for the audio stream")
    audio_pt = next((pt for pt in media.formats if pt in media.rtpmap
                     and media.rtpmap[pt].name.upper() == codec.upper()
                     and media.rtpmap[pt].clock_rate == 8000), None)
    return MediaAnswer(media.connection.address, media.port, tuple(media.formats), audio_pt,
                       _telephone_event(media, 8000), media.direction, media.ptime)
