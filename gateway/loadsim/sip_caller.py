"""A simulated phone for load tests: a SIP UAC and an RTP endpoint over UDP, on the gateway's
own wire formats.

One SIP stack: every message is parsed and built by :mod:`gateway.sip.message`, the SDP answer
is read by :func:`gateway.sip.sdp.parse_sdp` and a re-INVITE answered by
:func:`gateway.sip.sdp.negotiate`, RTP packets are parsed and built by :mod:`gateway.sip.rtp`
(:class:`~gateway.sip.rtp.RtpPacket`, :class:`~gateway.sip.rtp.RtpSender`,
:class:`~gateway.sip.rtp.TelephoneEvent`), reception statistics come from
:class:`~gateway.sip.rtp.RtpReceiverStats`, and send deadlines from
:class:`gateway.audio.pacer.Pacer`. Those wire formats are checked independently by real peers
in the test suite (baresip, SIPp and Kamailio), not by a second implementation here. What is
the phone's own: the UAC side of the transactions, answering in-dialog requests like a desk
phone, and the receive-side analysis the load simulator reports.

What a :class:`SipCaller` does, like a desk phone calling an IVR:

- **Signalling** (RFC 3261 over UDP): INVITE with an SDP offer (PCMU/8000 on PT 0 and
  telephone-event/8000 on PT 101, ``fmtp 0-15``, ``ptime 20``, ``sendrecv``; RFC 3264/4566);
  Timer A retransmission (T1 = 500 ms, doubling, stopped by any response, section 17.1.1.2);
  ACK for the 2xx, re-sent for every retransmitted 2xx (13.2.2.4); ACK for non-2xx finals in the
  INVITE transaction (17.1.1.3) and a clear :class:`CallFailed`; BYE with Timer E (17.1.2.2);
  CANCEL when the setup times out after a provisional response (9.1); :meth:`SipCaller.hold`
  and :meth:`SipCaller.resume` re-INVITE with ``a=sendonly`` / ``a=sendrecv`` (RFC 3264 8.4).
- **Incoming requests**: BYE (200, ``remote_hangup_at`` recorded, our media stops), OPTIONS
  (200), REFER (202, then a NOTIFY whose ``message/sipfrag`` body says
  ``SIP/2.0 503 Service Unavailable``: a load simulator cannot follow a transfer, so it accepts the
  request - the gateway's REFER transaction succeeds as it would with a real phone - and then
  reports the transfer as failed, RFC 3515 section 2.4.4/2.4.5; the target is kept in
  ``transferred_to``), re-INVITE (200 with our SDP, honouring hold). Anything else gets an
  error response and is recorded in ``errors``. Retransmitted requests get the cached response.
- **RTP out** (RFC 3550/3551): one 20 ms PCMU packet per deadline of a monotonic schedule
  (STYLE.md 5; never ``sleep(0.02)``), random SSRC, sequence and timestamp bases, marker bit on
  the first packet (:class:`~gateway.sip.rtp.RtpSender`). Silence (0xFF) unless frames are
  supplied. Each packet's scheduling lateness goes to :attr:`SipCaller.pacing`.
- **DTMF** (RFC 4733): :meth:`SipCaller.send_dtmf` sends the event on PT 101 in place of audio,
  as phones do: a start packet with the marker bit, updates every 20 ms with a growing duration,
  then three end packets with the E bit, all carrying the event's start timestamp.
- **RTP in**: every datagram on the RTP socket is timestamped on arrival and logged by
  :class:`RtpReceiveLog`, which keeps RFC 3550 statistics per source, finds speech, the end of
  speech and the start of a new talkspurt after a given time, and runs a playout model that
  counts audible gaps.

Measurement definitions (the simulator reports these):

- *silent* packet: every sample, after mu-law decoding, has ``|x| <= SILENCE_THRESHOLD`` (128 of
  32768, about -48 dBFS peak). For mu-law that is exactly the 32 codes of the lowest segment
  (``|x| <= 120``): the gateway's idle fill is 0xFF (linear 0) and a codec's near-zero noise stays
  in that segment, while any speech or tone leaves it within a few milliseconds.
- *stream stopped* (how a barge-in is seen over RTP): the first silent audio packet after ``t``
  that is followed only by silent audio packets for at least ``STOP_HOLD_S`` (100 ms); also, when
  audio packets stop arriving altogether for 100 ms after speech, the time the next packet was
  due. A pause inside speech longer than 100 ms counts as a stop too; choose ``t`` accordingly.
- *cut* (a new talkspurt, RFC 3551 section 4.1): an audio packet with the marker bit, or one
  whose timestamp does not follow its predecessor's (a jump), or the first of a new SSRC. The
  gateway sends RTP continuously (silence between utterances) and sets the marker bit on the
  first packet after a barge-in flushed its queue (``RtpSender.start_talkspurt`` in
  ``gateway/sip/endpoint.py``); its timestamps never jump.
- *first audio of the answer to a turn at t* (:meth:`RtpReceiveLog.utterance_after`): when no
  speech arrived in the 100 ms before ``t``, the first speech packet after ``t``. When speech
  was still arriving (a key pressed mid-prompt), the packets that follow may still be the
  interrupted prompt's: the answer is the first speech packet at or after the first cut after
  ``t``; without a cut, the first speech packet after the interrupted speech stopped.
- *idle fill*: an audio packet whose every byte is the codec's silence code (0xFF for PCMU:
  linear 0), what the gateway sends on a beat it has nothing to say on. Speech through the
  gateway's phone path does not yield 20 ms of it (a codec's quietest noise has both signs,
  and no negative sample encodes to 0xFF), so idle fill between two audio packets of an
  utterance is a dropout the caller hears, whatever their jitter buffer holds.
- *playout gaps*: see :class:`PlayoutStats` (a fixed 40 ms jitter buffer, ``JITTER_BUFFER_S``).

SIP timers run on the event loop's clock; every measurement uses the caller's injected clock
(``time.monotonic`` by default, which is also what asyncio's loop uses, so the two agree).

Exceptions: :class:`LoadSimError` (a :class:`~gateway.errors.GatewayError`) for misuse (a second
``call()``, DTMF without a call), with :class:`CallFailed` (a final response >= 300 to the
INVITE: ``.status``, ``.reason``) and :class:`CallTimeout` (no final response in time) below it.
What the network sends is never raised out of a datagram handler: an unparseable SIP datagram
(:class:`~gateway.sip.message.SipParseError`) or RTP packet (:class:`~gateway.sip.rtp.RtpError`)
is recorded in ``errors`` and dropped; an unusable SDP answer
(:class:`~gateway.sip.sdp.SdpError`) gets the 2xx ACKed, the call hung up with BYE
(RFC 3261 13.2.2.4) and is raised by :meth:`SipCaller.call`; in a re-INVITE it gets a 488.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import secrets
import time
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from gateway.audio.g711 import ALAW_SILENCE, ULAW_SILENCE, ulaw_decode
from gateway.audio.pacer import Pacer
from gateway.errors import GatewayError
from gateway.sip.message import (
    SipKeepalive,
    SipParseError,
    SipRequest,
    SipResponse,
    build_request,
    new_branch,
    new_call_id,
    new_tag,
    parse_message,
    parse_name_addr,
    response_to,
    stamp_via,
)
from gateway.sip.rtp import (
    DIGIT_TO_EVENT,
    DtmfReceiver,
    RtpError,
    RtpPacket,
    RtpReceiverStats,
    RtpSender,
    TelephoneEvent,
    seq_add,
    seq_diff,
    ts_add,
    ts_diff,
)
from gateway.sip.sdp import Answer, SdpError, negotiate, parse_sdp

__all__ = [
    "CLOCK_RATE",
    "FRAME_S",
    "FRAME_SAMPLES",
    "JITTER_BUFFER_S",
    "PT_PCMU",
    "PT_TELEPHONE_EVENT",
    "REFUSAL_STATUSES",
    "SILENCE_THRESHOLD",
    "STOP_HOLD_S",
    "T1",
    "T2",
    "CallFailed",
    "CallTimeout",
    "FramePacer",
    "LoadSimError",
    "MediaAnswer",
    "PacingStats",
    "PlayoutStats",
    "RtpReceiveLog",
    "SipCaller",
    "StreamStats",
    "is_silent",
    "offer_sdp",
    "read_answer",
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
PT_PCMA: Final[int] = 8
PT_TELEPHONE_EVENT: Final[int] = 101
SILENCE_THRESHOLD: Final[int] = 128
"""A packet is silent when every decoded sample has ``|x| <=`` this (int16 scale)."""
JITTER_BUFFER_S: Final[float] = 0.040
"""The playout model's fixed jitter buffer: playback starts this long after the first packet."""
STOP_HOLD_S: Final[float] = 0.100
"""How long received audio must stay silent (or absent) to count as "the stream stopped"."""
REFUSAL_STATUSES: Final = frozenset({486, 503, 600})
"""Final responses that mean "not now" (busy here, unavailable or draining, busy everywhere):
the load simulator counts them as refused calls, not failures (RFC 3261 21.4.24, 21.5.4,
21.6.1)."""

_DTMF_VOLUME: Final[int] = 10  # -10 dBm0, the level RFC 4733 section 2.3.4 uses in examples
_DTMF_END_PACKETS: Final[int] = 3  # RFC 4733 section 2.5.1.4: the final packet is sent 3 times
_MAX_ERRORS: Final[int] = 1000
_EPSILON_S: Final[float] = 1e-6  # arrival-time comparisons ignore float rounding below this
_REPLY_CACHE: Final[int] = 64
_ALLOW: Final[str] = "INVITE, ACK, BYE, CANCEL, OPTIONS, REFER"
_USER_AGENT: Final[str] = "gateway-loadsim/0.2"
_SILENT_FRAME: Final[bytes] = bytes([ULAW_SILENCE]) * FRAME_SAMPLES
#: A phone's sound card keeps producing samples while the process stalls: the send schedule
#: never re-anchors, late deadlines go out at once (Pacer's max_lag_frames, effectively off).
_NEVER_REANCHOR: Final[int] = 1 << 30

# Packet kinds in RtpReceiveLog.kinds (a bytearray, so bytearray.find scans them in C).
_SILENT: Final[int] = 0
_SPEECH: Final[int] = 1
_EVENT: Final[int] = 2
_OTHER: Final[int] = 3


# --- errors -----------------------------------------------------------------------------------


class LoadSimError(GatewayError):
    """Root of the simulated phone's own errors; raised directly for misuse."""


class CallFailed(LoadSimError):
    """The INVITE got a final response >= 300."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"call failed: {status} {reason}")
        self.status = status
        self.reason = reason

    @property
    def refused(self) -> bool:
        """Whether the response says "busy / not now" rather than "broken"."""
        return self.status in REFUSAL_STATUSES


class CallTimeout(LoadSimError):
    """The INVITE got no final response in time."""


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


# --- SDP: our offer, and what we read from the answer ----------------------------------------


def offer_sdp(
    ip: str,
    port: int,
    *,
    session_id: int,
    version: int,
    event_pt: int = PT_TELEPHONE_EVENT,
    direction: str = "sendrecv",
) -> bytes:
    """Our offer (RFC 4566, RFC 3264 section 5): PCMU PT 0 + telephone-event (0-15), ptime 20."""
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


def read_answer(body: bytes) -> MediaAnswer:
    """Read the audio stream of an SDP answer with the gateway's SDP parser.

    Raises :class:`~gateway.sip.sdp.SdpError` when the body is not SDP, has no audio stream,
    rejected it (port 0, RFC 3264 section 6) or gives it no connection address.
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
                     and media.rtpmap[pt].name.upper() == "PCMU"
                     and media.rtpmap[pt].clock_rate == CLOCK_RATE), None)
    event_pt = next((pt for pt in media.formats if pt in media.rtpmap
                     and media.rtpmap[pt].name.lower() == "telephone-event"
                     and media.rtpmap[pt].clock_rate == CLOCK_RATE), None)
    return MediaAnswer(media.connection.address, media.port, tuple(media.formats), audio_pt,
                       event_pt, media.direction, media.ptime)


# --- receive analysis -------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamStats:
    """Receive statistics of one SSRC (RFC 3550 appendix A.1 and A.8)."""

    ssrc: int
    received: int
    expected: int
    lost: int
    jitter_ms: float


@dataclass(frozen=True)
class PlayoutStats:
    """What a phone with a fixed jitter buffer would have played in one utterance window.

    The model: the playback clock starts at the arrival of the first non-silent audio packet in
    ``[start, end)`` plus the fixed jitter buffer (:data:`JITTER_BUFFER_S`, 40 ms); from then on
    each audio packet is needed at that start plus its RTP timestamp offset from the first
    packet. A packet arriving after it is needed is a *gap*: the phone plays nothing for
    ``arrival - needed`` and resumes with that packet, so the schedule slips by the gap (no
    re-buffering; later packets are judged against the slipped clock, so one stall counts once).
    Idle fill (module docstring) between two audio packets is a gap too, as long as the fill
    (and any stall within it) lasted: the sender had nothing to send, and packets of silence
    arriving on time are silence all the same. Fill after the last audio packet of the window
    is the utterance's end, not a gap. (This is how a Twilio caller's gaps are counted too:
    any silence between audio within the window, :meth:`Heard.gaps_between`.)
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
    ``kinds`` (0 silent audio, 1 non-silent audio, 2 telephone-event, 3 other), ``cuts`` (1 where
    an audio packet starts a new talkspurt: marker bit, timestamp jump or new SSRC) and
    ``source_ids`` indexing ``sources``. Loss and jitter per SSRC come from
    :class:`~gateway.sip.rtp.RtpReceiverStats`: loss over every packet of a source (audio and
    events share the sequence space), jitter only over audio packets (event packets repeat the
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
        self.cuts = bytearray()
        #: 1 where an audio packet is idle fill: every byte the codec's silence code.
        self.fills = bytearray()
        self._fill = bytes([ALAW_SILENCE if audio_pt == PT_PCMA else ULAW_SILENCE])
        self.source_ids = array("H")
        self.sources: list[tuple[str, int]] = []
        self._source_index: dict[tuple[str, int], int] = {}
        self._stats: dict[int, RtpReceiverStats] = {}
        self._last_audio: tuple[int, int, int, int] | None = None  # ssrc, seq, ts, samples
        self.malformed = 0
        self.rtcp = 0
        #: Keys the far end sent as RFC 4733 events: (arrival of the first packet, key).
        self.digits: list[tuple[float, str]] = []
        self._dtmf = DtmfReceiver(event_pt)

    def record(self, data: bytes, source: tuple[str, int], arrival: float) -> None:
        """Log one datagram. Raises :class:`~gateway.sip.rtp.RtpError` (after counting it) if
        it is not RTP."""
        try:
            packet = RtpPacket.parse(data)
        except RtpError:
            self.malformed += 1
            raise
        pt = packet.payload_type
        if packet.marker and 72 <= pt <= 76:
            self.rtcp += 1  # RTCP SR/RR/SDES/BYE/APP multiplexed here (RFC 5761 section 4)
            return
        payload = packet.payload
        cut = 0
        fill = 0
        if pt == self.audio_pt:
            kind = _SPEECH if payload.translate(None, self._silent) else _SILENT
            fill = kind == _SILENT and bool(payload) and not payload.rstrip(self._fill)
            last = self._last_audio
            # RFC 3551 4.1: the marker bit opens a talkspurt; a timestamp that does not follow
            # the previous packet's (its samples times the packets between) does too.
            if packet.marker or last is None or last[0] != packet.ssrc or ts_diff(
                    packet.timestamp, last[2]) != last[3] * seq_diff(packet.sequence, last[1]):
                cut = 1
            self._last_audio = (packet.ssrc, packet.sequence, packet.timestamp, len(payload))
        elif pt == self.event_pt:
            kind = _EVENT
            try:
                digit = self._dtmf.feed(packet)
            except RtpError:
                digit = None
            if digit is not None:
                self.digits.append((arrival, digit))
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
        self.cuts.append(cut)
        self.fills.append(fill)
        self.source_ids.append(index)
        stats = self._stats.get(packet.ssrc)
        if stats is None:
            stats = self._stats[packet.ssrc] = RtpReceiverStats(min_sequential=1)
        stats.update(packet, arrival, CLOCK_RATE, update_jitter=kind <= _SPEECH)

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
                lost=max(0, s.lost),
                jitter_ms=s.jitter_ms,
            )
            for ssrc, s in self._stats.items()
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

    def first_audio_after(self, t: float, until: float | None = None) -> float | None:
        """Arrival time of the first non-silent audio packet that arrived after ``t`` (and
        before ``until``)."""
        lo = bisect_right(self.arrivals, t)
        hi = len(self.arrivals) if until is None else bisect_left(self.arrivals, until)
        index = self.kinds.find(_SPEECH, lo, hi) if lo < hi else -1
        return self.arrivals[index] if index >= 0 else None

    def speaking_at(self, t: float, hold_s: float = STOP_HOLD_S) -> bool:
        """Whether speech was still arriving at ``t``: a speech packet in the ``hold_s`` before
        it (a shorter silence is a pause inside the utterance, see the module docstring)."""
        lo = bisect_left(self.arrivals, t - hold_s)
        hi = bisect_right(self.arrivals, t)
        return lo < hi and self.kinds.find(_SPEECH, lo, hi) >= 0

    def utterance_after(
        self, t: float, until: float | None = None, *, now: float | None = None
    ) -> float | None:
        """Arrival of the first speech packet of the audio that answers a turn at ``t``.

        When no speech arrived in the 100 ms before ``t``, that is the first speech packet after
        ``t``. When speech was still arriving (a key pressed mid-prompt), the next packets may be
        the interrupted utterance's; the answer starts at the first cut after ``t`` (the marker
        bit the gateway sets when barge-in flushed its queue, or a timestamp jump), or, with no
        cut, after the interrupted speech stopped (see :meth:`stream_stopped_after`; ``now``
        lets the end of the log count as evidence). None while not (yet) found before
        ``until``.
        """
        if not self.speaking_at(t):
            return self.first_audio_after(t, until)
        arrivals = self.arrivals
        lo = bisect_right(arrivals, t)
        hi = len(arrivals) if until is None else bisect_left(arrivals, until)
        cut = self.cuts.find(1, lo, hi) if lo < hi else -1
        if cut >= 0:
            index = self.kinds.find(_SPEECH, cut, hi)
            return arrivals[index] if index >= 0 else None
        stopped = self.stream_stopped_after(t, now=now)
        if stopped is None or (until is not None and stopped >= until):
            return None
        return self.first_audio_after(stopped, until)

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
        first = kinds.find(_SPEECH, lo, hi) if lo < hi else -1
        if first < 0:
            return PlayoutStats(None, 0, 0, 0.0, 0.0, 0, 0)
        seqs, stamps, ssrcs, sizes = self.sequences, self.timestamps, self.ssrcs, self.sizes
        origin = arrivals[first] + jitter_buffer_s  # when the first packet plays
        ts0 = stamps[first]
        ssrc = ssrcs[first]
        last_seq = seqs[first]
        played_until = origin + sizes[first] / CLOCK_RATE
        fills = self.fills
        packets, gaps, lost, discarded = 1, 0, 0, 0
        gap_s = max_gap_s = 0.0
        dropout = 0.0  # idle fill (and stalls within it) since the last audio packet
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
            stall = 0.0
            if late > _EPSILON_S:
                stall = late
                origin += late
                needed = arrivals[i]
            duration = sizes[i] / CLOCK_RATE
            if fills[i]:
                dropout += stall + duration
            else:
                silence = dropout + stall
                if silence > _EPSILON_S:
                    gaps += 1
                    gap_s += silence
                    max_gap_s = max(max_gap_s, silence)
                dropout = 0.0
            played_until = needed + duration
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
    """Sleeps to the deadlines of :class:`gateway.audio.pacer.Pacer` (``t0 + n * frame_s``) on
    an injected clock, and records each wake-up's lateness.

    When a wake-up is late by more than a frame the following deadlines are already due and go
    out at once (a sound card that kept producing samples while the process stalled); the
    timeline never drifts and never re-anchors.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        frame_s: float = FRAME_S,
    ) -> None:
        self.clock = clock
        self.sleep = sleep
        self.stats = PacingStats()
        self._pacer = Pacer(clock, frame_s, max_lag_frames=_NEVER_REANCHOR)
        self._started = False

    def start(self, t0: float | None = None) -> None:
        self._pacer.start(t0)
        self._started = True

    async def next(self) -> float:
        """Wait for the next deadline; returns the time it woke up."""
        if not self._started:
            self.start()
        deadline = self._pacer.next_deadline()
        delay = deadline - self.clock()
        if delay > 0:
            await self.sleep(delay)
        now = self.clock()
        self.stats.record(now - deadline)
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

    def payload(self, ts: int, now: float) -> tuple[bytes, int, bool]:
        """Payload, RTP timestamp and marker of the next packet of this event."""
        first = self.sent == 0
        if first:
            self.start_ts = ts
            self.first_at = now
        self.sent += 1
        end = self.sent * FRAME_SAMPLES >= self.total
        self.ends += end
        duration = min(self.sent * FRAME_SAMPLES, self.total)
        event = TelephoneEvent(self.event, end, _DTMF_VOLUME, duration)
        return event.serialize(), self.start_ts, first

    @property
    def finished(self) -> bool:
        return self.ends >= _DTMF_END_PACKETS


def _uri_of(value: str) -> str:
    """The URI of a name-addr or addr-spec header value (Contact, Record-Route, Refer-To)."""
    return parse_name_addr(value).uri


def _hostport(uri: str) -> tuple[str, int]:
    """Host and port (default 5060) of a SIP URI such as ``sip:user@127.0.0.1:5062;lr``."""
    rest = uri.split(":", 1)[1] if uri.lower().startswith(("sip:", "sips:")) else uri
    rest = rest.split(";", 1)[0].split("?", 1)[0].rpartition("@")[2]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = rest.partition(":")
    if not host or (port and not (port.isascii() and port.isdigit())):
        raise SipParseError(0, f"no host:port in URI {uri!r}")
    return host, int(port) if port else 5060


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
      ``utterance_after``, ``stream_stopped_after``, ``playout``/``gaps`` delegate to it);
      ``pacing``: :class:`PacingStats` of our sends; ``packets_sent``; ``dtmf_sent``:
      ``(digit, first packet time)``.
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
        rng: random.Random | None = None,
        on_audio: Callable[[float, bytes, bool], None] | None = None,
    ) -> None:
        self.caller_id = caller_id
        #: Told of every audio packet received, in arrival order: (arrival, mu-law payload,
        #: marker bit). The softphone plays from it; the load simulator leaves it unset.
        self.on_audio = on_audio
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
        self.dtmf_sent: list[tuple[str, float]] = []
        self.requests_received: dict[str, int] = {}
        self.errors: list[str] = []
        self.errors_dropped = 0
        self.answer: MediaAnswer | None = None
        self.remote_rtp: tuple[str, int] | None = None
        self.local_sip: tuple[str, int] | None = None
        self.local_rtp: tuple[str, int] | None = None

        self._audio: Iterator[bytes] | None = iter(audio) if audio is not None else None
        self._spoken: asyncio.Future[float] | None = None
        self._audio_at = 0.0  # when the latest frame of ``_audio`` went out
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sip: asyncio.DatagramTransport | None = None
        self._rtp_transport: asyncio.DatagramTransport | None = None
        self._rtcp_transport: asyncio.DatagramTransport | None = None
        self._rtp_closed_at: float | None = None
        self._state = "idle"  # idle, calling, confirmed, terminated
        self._target: tuple[str, int] = ("", 0)
        self._local_ip = ""
        self._call_id = ""
        self._local_tag = new_tag()
        self._from = ""
        self._to = ""
        self._request_uri = ""
        self._contact = ""
        self._cseq = 0
        self._invite: SipRequest | None = None
        self._invite_branch = ""
        self._final: asyncio.Future[SipResponse] | None = None
        self._ack: tuple[bytes, tuple[str, int]] | None = None
        self._remote_tag: str | None = None
        self._remote_to = ""
        self._remote_target = ""
        self._route_set: list[str] = []
        self._dest: tuple[str, int] = ("", 0)
        self._pending: dict[tuple[str, str], asyncio.Future[SipResponse]] = {}
        self._replies: dict[tuple[str, int, str, str], bytes] = {}
        self._finished: dict[tuple[str, str], None] = {}  # ended client transactions, in order
        self._sdp_session = secrets.randbelow(1 << 31)
        self._sdp_version = 1
        self._reinvite_acked: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._sender: asyncio.Task[None] | None = None
        self._dtmf: deque[_DtmfJob] = deque()
        self._event_pt: int | None = None
        self._send_enabled = True
        # Random SSRC, sequence and timestamp bases (RFC 3550 5.1); the marker opens the stream.
        self._rtp_out = RtpSender(PT_PCMU, rng=rng)

    # --- public API ---------------------------------------------------------------------------

    @property
    def pacing(self) -> PacingStats:
        """Scheduling lateness of every RTP packet sent (ms)."""
        return self.pacer.stats

    @property
    def call_id(self) -> str:
        """The SIP Call-ID of the call ("" before :meth:`call`)."""
        return self._call_id

    @property
    def packets_sent(self) -> int:
        """RTP packets sent (audio and telephone events)."""
        return self._rtp_out.packets_sent

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
        response within ``timeout_s``; a CANCEL follows a provisional) or
        :class:`~gateway.sip.sdp.SdpError`.
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
        self._call_id = new_call_id(local_ip)
        self._from = f"<sip:{self.caller_id}@{local_ip}>;tag={self._local_tag}"
        self._to = f"<{self._request_uri}>"
        self._contact = f"<sip:{self.caller_id}@{local_ip}:{self.local_sip[1]}>"
        self._cseq = 1
        self._invite_branch = new_branch()
        sdp = offer_sdp(
            local_ip, self.local_rtp[1], session_id=self._sdp_session, version=self._sdp_version
        )
        self._invite = self._request(
            "INVITE", self._request_uri, self._to, self._cseq, self._invite_branch,
            contact=True, body=sdp,
            headers=[("Allow", _ALLOW), ("User-Agent", _USER_AGENT)],
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
                f"no final response to INVITE within {timeout_s:g} s "
                f"(provisional: {self.provisional or 'none'})"
            )
        response = final.result()
        if response.status >= 300:
            self._state = "terminated"
            raise CallFailed(response.status, response.reason)
        try:
            answer = read_answer(response.body)
            if answer.audio_pt is None:
                raise SdpError(488, f"the answer has no PCMU payload type "
                                    f"({answer.payload_types})")
        except SdpError as exc:
            self._error(f"unusable SDP answer: {exc}")
            await self.hangup()
            raise
        self.answer = answer
        self._apply_media(answer.address, answer.port, answer.audio_pt, answer.event_pt,
                          answer.direction in ("sendrecv", "recvonly"))
        self._sender = loop.create_task(self._send_media(), name="loadsim-rtp")

    async def hold(self, timeout_s: float = 5.0) -> int | None:
        """Put the call on hold as a phone does: a re-INVITE offering ``a=sendonly`` (RFC 3264
        section 8.4; we keep sending, the gateway stops). Returns the final status (a 2xx is
        ACKed), None without one within ``timeout_s``."""
        return await self._reinvite("sendonly", timeout_s)

    async def resume(self, timeout_s: float = 5.0) -> int | None:
        """Take the call off hold: a re-INVITE offering ``a=sendrecv``."""
        return await self._reinvite("sendrecv", timeout_s)

    def play(self, frames: Iterable[bytes]) -> None:
        """Send these 160-byte mu-law frames from the next 20 ms tick on, then silence."""
        self._audio = iter(frames)

    async def speak(self, frames: Iterable[bytes]) -> float:
        """:meth:`play` ``frames`` and return the time (the caller's clock) the last one was
        sent: the end of the caller's speech."""
        done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._spoken = done
        self.play(frames)
        return await done

    async def send_dtmf(self, digit: str, duration_ms: int = 100) -> float:
        """Send one RFC 4733 event; returns the monotonic time its first packet was sent.

        Audio pauses while the event is on the wire. Returns after the last end packet, so
        consecutive calls press keys one after the other.
        """
        event = DIGIT_TO_EVENT.get(digit.upper())
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

    def utterance_after(self, t: float, until: float | None = None) -> float | None:
        """First audio of the utterance answering a turn at ``t`` (see
        :meth:`RtpReceiveLog.utterance_after`)."""
        return self.rtp.utterance_after(t, until, now=self._observed_now())

    def stream_stopped_after(self, t: float) -> float | None:
        """When received speech stopped after ``t``; None while it has not (yet)."""
        return self.rtp.stream_stopped_after(t, now=self._observed_now())

    def _observed_now(self) -> float:
        return self._rtp_closed_at if self._rtp_closed_at is not None else self._clock()

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

    def _request(
        self,
        method: str,
        uri: str,
        to: str,
        cseq: int,
        branch: str,
        *,
        contact: bool = False,
        routes: Iterable[str] = (),
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        content_type: str | None = None,
    ) -> SipRequest:
        assert self.local_sip is not None
        return build_request(
            method, uri, call_id=self._call_id, from_=self._from, to=to,
            cseq=cseq, via_host=self.local_sip[0], via_port=self.local_sip[1], branch=branch,
            contact=self._contact if contact else None,
            headers=[*(("Route", route) for route in routes), *headers],
            body=body,
            content_type=content_type or ("application/sdp" if body else None),
        )

    def _send_sip(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._sip is not None and not self._sip.is_closing():
            self._sip.sendto(data, addr)

    def _on_sip(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            message = parse_message(data)
        except SipKeepalive:
            return  # CRLF keep-alive (RFC 5626 section 4.4.1)
        except SipParseError as exc:
            self._error(f"sip: unparseable datagram from {addr}: {exc}")
            return
        if isinstance(message, SipRequest):
            self._on_request(message, addr)
        else:
            self._on_response(message)

    def _on_response(self, response: SipResponse) -> None:
        _, method = response.cseq
        branch = response.top_via_branch or ""
        if response.call_id != self._call_id:
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

    def _on_invite_response(self, response: SipResponse) -> None:
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
            tag = response.to_tag
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
        to = response.headers.get("To") or self._to
        if status < 300:
            now = self._clock()
            self.answered_at = now
            assert self.invite_sent_at is not None
            self.setup_ms = 1000 * (now - self.invite_sent_at)
            self._state = "confirmed"
            self._remote_to = to
            self._remote_tag = response.to_tag
            contacts = response.headers.get_all("Contact")
            contact = contacts[0] if contacts else None
            try:
                self._remote_target = _uri_of(contact) if contact else self._request_uri
            except SipParseError as exc:
                self._error(f"sip: unreadable Contact in the 2xx: {exc}")
                self._remote_target = self._request_uri
            # RFC 3261 12.1.2: the route set is the Record-Route list, reversed, for a UAC.
            self._route_set = list(reversed(response.headers.get_all("Record-Route")))
            try:
                next_hop = _uri_of(self._route_set[0]) if self._route_set else \
                    self._remote_target
                self._dest = _hostport(next_hop)
            except SipParseError as exc:
                self._error(f"sip: {exc}; sending in-dialog requests to {self._target}")
                self._dest = self._target
            ack, _ = self._dialog_request("ACK", cseq=self._cseq)
            self._ack = (ack.serialize(), self._dest)
        else:
            # RFC 3261 17.1.1.3: the transaction's own ACK: the INVITE's Request-URI, top Via
            # (same branch), From, Call-ID and CSeq number; To from the response.
            ack = self._request("ACK", invite.uri, to, invite.cseq[0], self._invite_branch)
            self._ack = (ack.serialize(), self._target)
        self._send_sip(*self._ack)
        final.set_result(response)

    def _dialog_request(
        self,
        method: str,
        *,
        cseq: int | None = None,
        body: bytes = b"",
        content_type: str | None = None,
        extra: Iterable[tuple[str, str]] = (),
    ) -> tuple[SipRequest, str]:
        """A request inside our dialog (RFC 3261 12.2.1.1) and its Via branch."""
        if cseq is None:
            self._cseq += 1
            cseq = self._cseq
        branch = new_branch()
        request = self._request(
            method, self._remote_target, self._remote_to, cseq, branch,
            contact=method not in ("ACK", "BYE"), routes=self._route_set,
            headers=extra, body=body, content_type=content_type,
        )
        return request, branch

    async def _transact(
        self,
        data: bytes,
        branch: str,
        method: str,
        timeout_s: float,
        dest: tuple[str, int] | None = None,
    ) -> SipResponse | None:
        """A non-INVITE client transaction: Timer E (T1 doubling up to T2) until a final."""
        assert self._loop is not None
        future: asyncio.Future[SipResponse] = self._loop.create_future()
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

    async def _reinvite(self, direction: str, timeout_s: float) -> int | None:
        if self._state != "confirmed" or self.local_rtp is None:
            raise LoadSimError("no call in progress")
        self._sdp_version += 1
        sdp = offer_sdp(self._local_ip, self.local_rtp[1], session_id=self._sdp_session,
                        version=self._sdp_version, direction=direction)
        invite, branch = self._dialog_request("INVITE", body=sdp, extra=[("Allow", _ALLOW)])
        response = await self._transact(invite.serialize(), branch, "INVITE", timeout_s)
        if response is None:
            self._error(f"re-INVITE ({direction}): no final response within {timeout_s} s")
            return None
        if response.status < 300:
            # RFC 3261 13.2.2.4: the 2xx to a re-INVITE is ACKed in the dialog, same CSeq.
            ack, _ = self._dialog_request("ACK", cseq=invite.cseq[0])
            self._send_sip(ack.serialize(), self._dest)
            try:
                answer = read_answer(response.body)
            except SdpError as exc:
                self._error(f"re-INVITE ({direction}): unusable SDP answer: {exc}")
            else:
                self._apply_media(answer.address, answer.port, answer.audio_pt,
                                  answer.event_pt, direction in ("sendrecv", "sendonly"))
        else:
            self._error(f"re-INVITE ({direction}) answered {response.status} "
                        f"{response.reason}")
        return response.status

    async def _cancel_invite(self) -> None:
        """CANCEL the pending INVITE (RFC 3261 9.1); the 487 that follows is ACKed as usual."""
        invite = self._invite
        assert invite is not None and self._loop is not None
        # RFC 3261 9.1: Request-URI, Call-ID, To, From, CSeq number and the top Via (its branch)
        # of the request being cancelled.
        cancel = self._request("CANCEL", invite.uri, self._to, invite.cseq[0],
                               self._invite_branch)
        bound = 4 * self.t1 * 2
        response = await self._transact(
            cancel.serialize(), self._invite_branch, "CANCEL", bound, self._target
        )
        if response is None:
            self._error("CANCEL: no response")
        assert self._final is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._final), bound)

    def _on_request(self, request: SipRequest, addr: tuple[str, int]) -> None:
        method = request.method
        self.requests_received[method] = self.requests_received.get(method, 0) + 1
        number, _ = request.cseq
        branch = request.top_via_branch or ""
        call_id = request.call_id
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
                request, addr, 200, headers=[("Allow", _ALLOW), ("Accept", "application/sdp")]
            )
            return
        in_dialog = (
            call_id == self._call_id
            and self._remote_tag is not None
            and request.from_tag == self._remote_tag
        )
        if not in_dialog:
            self._error(f"sip: {method} outside our dialog from {addr}")
            self._reply(request, addr, 481)
            return
        if method == "BYE":
            self._reply(request, addr, 200)
            if self.remote_hangup_at is None:
                self.remote_hangup_at = self._clock()
            self._state = "terminated"
            if self._sender is not None:
                self._sender.cancel()  # a phone stops its media when the far end hangs up
        elif method == "REFER":
            refer_to = request.headers.get("Refer-To")
            if not refer_to:
                self._error("sip: REFER without Refer-To")
                self._reply(request, addr, 400, "Missing Refer-To")
                return
            try:
                target = _uri_of(refer_to)
            except SipParseError as exc:
                self._error(f"sip: REFER with an unreadable Refer-To: {exc}")
                self._reply(request, addr, 400, "Bad Refer-To")
                return
            self._reply(request, addr, 202)
            self.transferred_to = target
            self._spawn(self._report_transfer_failed())
        elif method == "INVITE":
            self._on_reinvite(request, addr)
        else:
            self._error(f"sip: unexpected {method} in the dialog")
            self._reply(request, addr, 405, headers=[("Allow", _ALLOW)])

    def _reply(
        self,
        request: SipRequest,
        addr: tuple[str, int],
        status: int,
        reason: str | None = None,
        *,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> bytes:
        """Send (and cache for retransmissions) a response, RFC 3261 section 8.2.6."""
        # Our dialog's tag for requests in it; a fresh one for anything else (8.2.6.2).
        to_tag = self._local_tag if request.call_id == self._call_id else new_tag()
        # RFC 3581: the response goes back to the packet's source, recorded on the top Via.
        stamp_via(request, addr[0], addr[1])
        response = response_to(
            request, status, reason, to_tag=to_tag,
            headers=[("User-Agent", _USER_AGENT), *headers], body=body,
            content_type="application/sdp" if body else None,
        )
        data = response.serialize()
        self._send_sip(data, addr)
        number, method = request.cseq
        key = (request.call_id, number, method, request.top_via_branch or "")
        self._replies[key] = data
        if len(self._replies) > _REPLY_CACHE:
            self._replies.pop(next(iter(self._replies)))
        return data

    def _on_reinvite(self, request: SipRequest, addr: tuple[str, int]) -> None:
        """Answer a re-INVITE like a phone: same codecs, hold honoured (RFC 3264 section 8.4)."""
        assert self.local_rtp is not None
        try:
            answer: Answer = negotiate(
                parse_sdp(request.body), local_ip=self._local_ip, local_port=self.local_rtp[1],
                session_id=self._sdp_session, version=self._sdp_version + 1, codecs=("PCMU",),
            )
        except SdpError as exc:
            self._error(f"sip: re-INVITE: {exc}")
            self._reply(request, addr, 488)
            return
        self._sdp_version += 1
        # We send unless our answer says we will not (RFC 3264 section 6.1).
        self._apply_media(answer.remote_rtp[0], answer.remote_rtp[1], answer.payload_type,
                          answer.telephone_event_pt, answer.direction in ("sendrecv", "sendonly"))
        data = self._reply(request, addr, 200, headers=[("Contact", self._contact)],
                           body=answer.sdp)
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
            content_type="message/sipfrag;version=2.0",
            extra=[("Event", "refer"), ("Subscription-State", "terminated;reason=noresource")],
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
        except RtpError as exc:
            self._error(f"rtp: malformed packet from {addr}: {exc}")
            return
        if self.on_audio is not None:
            packet = RtpPacket.parse(data)
            if packet.payload_type == self.rtp.audio_pt:
                self.on_audio(arrival, packet.payload, packet.marker)

    def _on_rtcp(self, data: bytes, addr: tuple[str, int]) -> None:
        self.rtp.rtcp += 1

    def _apply_media(self, address: str, port: int, audio_pt: int | None, event_pt: int | None,
                     send: bool) -> None:
        self.remote_rtp = (address, port)
        self._rtp_out.payload_type = audio_pt if audio_pt is not None else PT_PCMU
        self._event_pt = event_pt
        self.rtp.audio_pt = self._rtp_out.payload_type
        self.rtp.event_pt = event_pt
        self._send_enabled = send

    def _next_frame(self) -> bytes:
        if self._audio is not None:
            frame = next(self._audio, None)
            if frame is None:
                self._audio = None
                spoken, self._spoken = self._spoken, None
                if spoken is not None and not spoken.done():
                    spoken.set_result(self._audio_at)
            elif len(frame) == FRAME_SAMPLES:
                self._audio_at = self._clock()
                return frame
            else:
                self._error(f"rtp: audio frame of {len(frame)} bytes, expected {FRAME_SAMPLES}")
                return (bytes(frame) + _SILENT_FRAME)[:FRAME_SAMPLES]
        return _SILENT_FRAME

    def _advance(self, sent: bytes | None) -> None:
        """One 20 ms tick of our stream: the timestamp always advances (it is the sampling
        clock), the sequence number only for a packet sent (RFC 3550 5.1)."""
        sender = self._rtp_out
        sender.timestamp = ts_add(sender.timestamp, FRAME_SAMPLES)
        if sent is not None:
            sender.sequence = seq_add(sender.sequence, 1)
            sender.packets_sent += 1
            sender.octets_sent += len(sent)

    async def _send_media(self) -> None:
        """The sender: one packet per 20 ms deadline; DTMF events replace audio while active.

        Audio goes through :meth:`RtpSender.packet`. An RFC 4733 packet carries the stream's
        next sequence number, the event's start timestamp (2.5.1.2) and the marker bit on its
        first packet only (2.5.1.1), while the audio timeline advances under it, so audio
        resumes at the timestamp it would have had.
        """
        transport = self._rtp_transport
        assert transport is not None
        pacer = self.pacer
        pacer.start()
        sender = self._rtp_out
        job: _DtmfJob | None = None
        try:
            while True:
                now = await pacer.next()
                if job is None and self._dtmf:
                    job = self._dtmf.popleft()
                remote = self.remote_rtp if self._send_enabled else None
                if job is not None and self._event_pt is not None:
                    payload, stamp, first = job.payload(sender.timestamp, now)
                    if remote is not None:
                        transport.sendto(RtpPacket(self._event_pt, sender.sequence, stamp,
                                                   sender.ssrc, payload, first).serialize(),
                                         remote)
                    self._advance(payload if remote is not None else None)
                    if job.finished:
                        if not job.done.done():
                            job.done.set_result(job.first_at)
                        job = None
                elif remote is not None:
                    transport.sendto(sender.packet(self._next_frame()), remote)
                else:
                    self._next_frame()
                    self._advance(None)
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
