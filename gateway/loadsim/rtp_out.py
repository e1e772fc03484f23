"""What a simulated phone sends: its RTP stream one 20 ms beat at a time (sans-I/O), and how
late each beat went out.

:class:`OutboundStream` decides each beat's packet (RFC 3550/3551): 20 ms of PCMU from the frames
being played, else silence (0xFF); an RFC 4733 telephone-event in place of audio while a key is
pressed, as phones do: a start packet with the marker bit, updates every 20 ms with a growing
duration, then three end packets with the E bit, all carrying the event's start timestamp, while
the audio timeline advances under it. Random SSRC, sequence and timestamp bases, and the marker
bit on the stream's first packet, come from :class:`~gateway.sip.rtp.RtpSender`; the timestamp
is the sampling clock and advances every beat, sent or not (on hold), the sequence only with a
packet sent (RFC 3550 5.1), and the first packet after beats not sent opens a talkspurt (the
marker, RFC 3551 4.1). Every header is packed by that one sender, event packets included.

The beats are paced by the gateway's one pacer, :class:`gateway.audio.pacer.Pacer`, on the
phone's injected clock (a schedule that never drifts, STYLE.md 5; never ``sleep(0.02)``; the
shell owns it); :class:`PacingStats` records how late each beat went out.
"""

from __future__ import annotations

import itertools
import math
import random
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from gateway.audio.g711 import ULAW_SILENCE
from gateway.loadsim.rtp_log import FRAME_SAMPLES, PT_PCMU
from gateway.sip.rtp import DIGIT_TO_EVENT, RtpSender, TelephoneEvent
from gateway.sip.uac import MediaPlan

__all__ = ["DTMF_END_PACKETS", "DtmfKey", "OutboundStream", "PacingStats"]

DTMF_END_PACKETS: Final[int] = 3
"""RFC 4733 section 2.5.1.4: the final packet of an event is sent three times."""
_DTMF_VOLUME: Final[int] = 10  # -10 dBm0, the level RFC 4733 section 2.3.4 uses in examples
_SILENT_FRAME: Final[bytes] = bytes([ULAW_SILENCE]) * FRAME_SAMPLES


# --- pacing statistics ----------------------------------------------------------------------------


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


# --- the stream -------------------------------------------------------------------------------


@dataclass
class DtmfKey:
    """One key press on the wire (RFC 4733): ``on_done`` gets the time its first packet went
    out once its last end packet has, or None if the stream stopped before."""

    digit: str
    event: int
    total: int  # samples
    on_done: Callable[[float | None], None]
    start_ts: int = 0
    first_at: float = 0.0
    sent: int = 0
    ends: int = 0

    @classmethod
    def press(cls, digit: str, duration_ms: int,
              on_done: Callable[[float | None], None]) -> DtmfKey:
        """A key of ``duration_ms``; ValueError for a key that is not on a keypad (0-9, *, #,
        A-D) or a duration outside 1..8000 ms."""
        event = DIGIT_TO_EVENT.get(digit.upper())
        if event is None:
            raise ValueError(f"{digit!r} is not a DTMF key (0-9, *, #, A-D)")
        if not 0 < duration_ms <= 8000:
            raise ValueError(f"duration_ms {duration_ms} is outside 1..8000")
        return cls(digit, event, duration_ms * 8000 // 1000, on_done)

    @property
    def packets(self) -> int:
        """Packets the key takes on the wire: one a beat until its duration is covered, the
        last of them the first of its end packets, then the end packet's repeats."""
        return (self.total + FRAME_SAMPLES - 1) // FRAME_SAMPLES + DTMF_END_PACKETS - 1

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
        return self.ends >= DTMF_END_PACKETS


class OutboundStream:
    """Our RTP stream, one beat at a time (see the module docstring): :meth:`tick` returns the
    packet to send to :attr:`remote` now, or None when nothing goes out (no address yet, or on
    hold). Audio frames that are not 20 ms are padded or cut and reported to ``on_error``."""

    def __init__(self, *, rng: random.Random | None = None,
                 on_error: Callable[[str], None] = lambda text: None) -> None:
        # Random SSRC, sequence and timestamp bases (RFC 3550 5.1); the marker opens the stream.
        self.rtp = RtpSender(PT_PCMU, rng=rng)
        self.remote: tuple[str, int] | None = None
        self.event_pt: int | None = None
        self.send = True
        self._on_error = on_error
        self._audio: Iterator[bytes] | None = None
        self._on_spoken: Callable[[float], None] | None = None
        self._audio_at = 0.0  # when the latest frame being played went out
        self._keys: deque[DtmfKey] = deque()
        self._key: DtmfKey | None = None

    def apply(self, media: MediaPlan) -> None:
        """Send as the SDP (or a re-INVITE) says from the next beat on."""
        self.remote = media.remote
        self.rtp.payload_type = media.audio_pt
        self.event_pt = media.event_pt
        self.send = media.send

    def play(self, frames: Iterable[bytes],
             on_end: Callable[[float], None] | None = None) -> None:
        """Send these 160-byte mu-law frames from the next beat on, then silence; ``on_end``
        gets the time the last one went out."""
        self._audio = iter(frames)
        self._on_spoken = on_end

    def press(self, key: DtmfKey) -> int:
        """Queue a key press (after any pending ones); returns how many are queued now."""
        self._keys.append(key)
        return len(self._keys)

    def tick(self, now: float) -> bytes | None:
        """This beat's packet (``now`` is when it goes out). A beat not sent (on hold) still
        advances the sampling clock, and the next packet sent opens a talkspurt (marker)."""
        if self._key is None and self._keys:
            self._key = self._keys.popleft()
        key, rtp = self._key, self.rtp
        sending = self.remote is not None and self.send
        if key is not None and self.event_pt is not None:
            payload, stamp, first = key.payload(rtp.timestamp, now)
            packet = rtp.event_packet(payload, self.event_pt, stamp, first) if sending else None
            if key.finished:
                self._key = None
                key.on_done(key.first_at)
        else:
            frame = self._next_frame(now)
            packet = rtp.packet(frame) if sending else None
        if packet is None:
            rtp.skip()
        return packet

    def stop(self) -> None:
        """The stream ends: every key not yet sent is told so (``on_done(None)``)."""
        pending = [key for key in (self._key, *self._keys) if key is not None]
        self._key = None
        self._keys.clear()
        for key in pending:
            key.on_done(None)

    def _next_frame(self, now: float) -> bytes:
        if self._audio is not None:
            frame = next(self._audio, None)
            if frame is None:
                self._audio = None
                on_end, self._on_spoken = self._on_spoken, None
                if on_end is not None:
                    on_end(self._audio_at)
            elif len(frame) == FRAME_SAMPLES:
                self._audio_at = now
                return frame
            else:
                self._on_error(f"rtp: audio frame of {len(frame)} bytes, expected "
                               f"{FRAME_SAMPLES}")
                return (bytes(frame) + _SILENT_FRAME)[:FRAME_SAMPLES]
        return _SILENT_FRAME
