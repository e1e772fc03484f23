"""What a simulated phone hears: every RTP packet received, timestamped on arrival, and the
measurements the load simulator reports from them (sans-I/O).

:class:`RtpReceiveLog` is fed by the phone's I/O shell (:mod:`gateway.loadsim.sip_caller`); it
keeps RFC 3550 statistics per source (:class:`~gateway.sip.rtp.RtpReceiverStats`), finds speech,
the end of speech and the start of a new talkspurt after a given time, and runs a playout model
that counts audible gaps (:class:`PlayoutStats`).

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
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Final

from gateway.audio.g711 import ALAW_SILENCE, ULAW_SILENCE, ulaw_decode
from gateway.audio.pacer import FRAME_S as PACER_FRAME_S
from gateway.sip.rtp import (
    PAYLOAD_TYPE_PCMA,
    PAYLOAD_TYPE_PCMU,
    SAMPLES_PER_FRAME,
    DtmfReceiver,
    RtpError,
    RtpPacket,
    RtpReceiverStats,
    seq_add,
    seq_diff,
    ts_diff,
)

__all__ = [
    "CLOCK_RATE",
    "FRAME_S",
    "FRAME_SAMPLES",
    "JITTER_BUFFER_S",
    "PT_PCMA",
    "PT_PCMU",
    "PT_TELEPHONE_EVENT",
    "SILENCE_THRESHOLD",
    "STOP_HOLD_S",
    "PlayoutStats",
    "RtpReceiveLog",
    "StreamStats",
    "is_silent",
]

CLOCK_RATE: Final[int] = 8000
"""RTP clock of PCMU and telephone-event (RFC 3551 table 4, RFC 4733 section 2.1)."""
FRAME_SAMPLES: Final[int] = SAMPLES_PER_FRAME
"""Samples (= mu-law bytes) in one 20 ms frame (the gateway's RTP frame)."""
FRAME_S: Final[float] = PACER_FRAME_S
PT_PCMU: Final[int] = PAYLOAD_TYPE_PCMU
PT_PCMA: Final[int] = PAYLOAD_TYPE_PCMA
PT_TELEPHONE_EVENT: Final[int] = 101
SILENCE_THRESHOLD: Final[int] = 128
"""A packet is silent when every decoded sample has ``|x| <=`` this (int16 scale)."""
JITTER_BUFFER_S: Final[float] = 0.040
"""The playout model's fixed jitter buffer: playback starts this long after the first packet."""
STOP_HOLD_S: Final[float] = 0.100
"""How long received audio must stay silent (or absent) to count as "the stream stopped"."""
_EPSILON_S: Final[float] = 1e-6  # arrival-time comparisons ignore float rounding below this

# Packet kinds in RtpReceiveLog.kinds (a bytearray, so bytearray.find scans them in C).
_SILENT: Final[int] = 0
_SPEECH: Final[int] = 1
_EVENT: Final[int] = 2
_OTHER: Final[int] = 3


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

