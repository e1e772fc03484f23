"""The call's playout (gateway/call/playout.py) under both transports' policies, on a virtual
clock (no model, no sockets, no real waiting).

- RTP's policy: one frame per 20 ms beat, silence when idle, a mark played once the frame
  before it has gone, re-anchoring after a stall, backpressure, nothing sent while on hold, and
  a barge-in that fades out instead of clicking (the click measured before and after);
- Twilio's policy: how far ahead of the caller's playback audio goes to Twilio. Twilio buffers
  whatever it is sent; the playout keeps at most ``max_lead_s`` of unplayed audio there,
  estimates playback from its clock, and corrects the estimate from echoed marks (a mark comes
  back once everything sent before it has played) and from ``clear``.

The start buffer of a live utterance and the underruns are tests/unit/call/test_playout_start.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from gateway.audio.g711 import ulaw_decode, ulaw_encode
from gateway.call import Playout
from gateway.sip.endpoint import RTP_PLAYOUT
from gateway.twilio.stream import TwilioConfig
from tests.support.clocks import VirtualClock
from tests.support.transports import MemoryTransport, RecordingOwner

SILENCE = b"\xff" * 160
FRAME = SILENCE


class _RtpSink(MemoryTransport):
    """An RTP far end: frames stamped with the clock; RTP has no far-end marks."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(RTP_PLAYOUT, echo_marks=False, clock=clock, record_aborts=True)

    async def send_mark(self, name: str) -> None:
        raise AssertionError("RTP has no far-end marks")


# --- RTP's policy: a frame every 20 ms --------------------------------------------------------


def _frames(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    pcm = (8000 * rng.standard_normal(160 * n)).astype(np.int16)
    data = ulaw_encode(pcm)
    return [data[i * 160:(i + 1) * 160] for i in range(n)]


@pytest.fixture
async def rtp() -> AsyncIterator[tuple[VirtualClock, _RtpSink, Playout, list[str]]]:
    clock = VirtualClock(start=10.0)
    sink = _RtpSink(clock)
    played: list[str] = []
    playout = Playout(sink, clock, RTP_PLAYOUT, silence=SILENCE, on_played=played.append)
    playout.start()
    await clock.advance(0)  # the first beat, at the start
    yield clock, sink, playout, played
    await playout.close()


async def test_rtp_goes_out_one_frame_per_20_ms_with_silence_between(rtp) -> None:  # type: ignore[no-untyped-def]
    clock, sink, playout, played = rtp
    await clock.advance(0.1)  # nothing to say: silence every beat
    assert [f for _, f in sink.frames] == [SILENCE] * 6
    owner = RecordingOwner()
    playout.begin(owner)
    audio = _frames(10)
    await playout.push(audio)
    playout.mark("u1")
    await clock.advance(0.25)
    sent = [f for _, f in sink.frames]
    start = sent.index(audio[0])
    assert sent[start:start + 10] == audio and sent[start + 10] == SILENCE
    times = [t for t, _ in sink.frames]
    assert np.allclose(np.diff(times), 0.02)  # on the beat, no drift
    assert played == ["u1"] and owner.released == 10
    assert owner.first == pytest.approx(times[start])


async def test_a_stalled_stream_re_anchors_instead_of_bursting(rtp) -> None:  # type: ignore[no-untyped-def]
    clock, sink, _playout, _ = rtp
    await clock.advance(0.04)
    before = len(sink.frames)
    clock._now += 1.0  # the event loop stalled for a second
    await clock.advance(0.0)
    # Not 50 frames at once (a jitter buffer would drop them): one, then back on the beat.
    assert len(sink.frames) - before == 1
    await clock.advance(0.1)
    assert len(sink.frames) - before == 6


async def test_push_waits_while_the_buffer_is_full(rtp) -> None:  # type: ignore[no-untyped-def]
    clock, _, playout, _ = rtp
    playout.begin(RecordingOwner())
    frames = _frames(150)
    pushing = asyncio.create_task(playout.push(frames))
    await clock.advance(0)
    # Never more than the bound is queued: a whole prompt goes in as it plays.
    bound = RTP_PLAYOUT.buffer_frames
    assert not pushing.done() and playout.buffered == bound
    most = bound
    while not pushing.done():
        await clock.advance(0.02)
        most = max(most, playout.buffered)
    assert most == bound and playout.buffered <= bound
    await clock.advance(bound * 0.02 + 0.1)
    sent = [f for _, f in _sink_frames(playout)]
    assert [f for f in sent if f != SILENCE] == frames  # all of it, in order


def _sink_frames(playout: Playout) -> list[tuple[float, bytes]]:
    return playout._sink.frames  # type: ignore[attr-defined,no-any-return]


async def test_nothing_is_sent_on_hold(rtp) -> None:  # type: ignore[no-untyped-def]
    clock, sink, playout, _ = rtp
    playout.paused = True
    before = len(sink.frames)
    await clock.advance(1.0)
    assert len(sink.frames) == before
    playout.paused = False
    await clock.advance(0.02)
    assert len(sink.frames) == before + 1


def click(stream: np.ndarray, cut: int) -> float:
    """The click at sample ``cut`` of what the caller hears: the largest sample-to-sample step
    from just before the cut to 20 ms after it, relative to the largest step of the signal's
    own waveform before the cut. 1.0 or less: no step the audio did not already have; a cut
    straight to silence steps by the whole sample value (up to 2.9x for a 440 Hz tone)."""
    x = stream.astype(np.float64)
    own = np.abs(np.diff(x[cut - 800:cut])).max()
    return float(np.abs(np.diff(x[cut - 1:cut + 161])).max() / own)


async def cut_tone(cut_after: int, *, fade: bool) -> tuple[float, int]:
    """A 440 Hz tone played over RTP, barged in on after ``cut_after`` frames: the click at the
    cut, and the fades the playout sent."""
    from dataclasses import replace

    clock = VirtualClock(start=10.0)
    sink = _RtpSink(clock)
    policy = replace(RTP_PLAYOUT, fade_on_interrupt=fade)
    playout = Playout(sink, clock, policy, silence=SILENCE, on_played=lambda name: None)
    playout.start()
    await clock.advance(0)
    t = np.arange(160 * 50) / 8000
    data = ulaw_encode((12000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16))
    frames = [data[i * 160:(i + 1) * 160] for i in range(50)]
    playout.begin(RecordingOwner())
    await playout.push(frames)
    while sum(1 for _, f in sink.frames if f in frames) < cut_after:
        await clock.advance(0.02)
    await playout.interrupt()
    await clock.advance(0.2)
    await playout.close()
    sent = [f for _, f in sink.frames]
    last = max(i for i, f in enumerate(sent) if f in frames)
    stream = ulaw_decode(b"".join(sent))
    return click(stream, (last + 1) * 160), playout.fades


async def test_a_barge_in_fades_the_prompt_out_instead_of_clicking() -> None:
    """The click at the cut, before (a cut straight to silence) and after (the next 20 ms faded
    out), at cuts spread over the tone's phase. bench/bargein_click.py measures it on speech."""
    cuts = [5, 8, 11, 14, 17, 20, 23]
    abrupt = [(await cut_tone(n, fade=False))[0] for n in cuts]
    faded = [await cut_tone(n, fade=True) for n in cuts]
    print(f"\nbarge-in click (440 Hz tone, {len(cuts)} cuts): step at the cut / the tone's own "
          f"largest step: without the fade mean {np.mean(abrupt):.2f}, max {max(abrupt):.2f}; "
          f"with it mean {np.mean([c for c, _ in faded]):.2f}, max {max(c for c, _ in faded):.2f}")
    assert all(fades == 1 for _, fades in faded)
    assert max(c for c, _ in faded) <= 1.05  # no step the waveform did not already have
    assert np.mean(abrupt) > 1.5


# --- Twilio's policy: at most max_lead_s ahead of the caller's playback ---------------------------


class _Sink:
    """What Twilio would be sent, stamped with the virtual clock."""

    codec = "pcmu"

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.sent: list[tuple[float, str, int]] = []

    async def send_frames(self, frames: list[bytes]) -> None:
        self.sent.append((self.clock.now(), "media", len(frames)))

    async def send_mark(self, name: str) -> None:
        self.sent.append((self.clock.now(), f"mark:{name}", 0))

    async def clear(self) -> None:
        self.sent.append((self.clock.now(), "clear", 0))

    def frames(self) -> int:
        return sum(n for _, kind, n in self.sent if kind == "media")


@pytest.fixture
async def rig() -> AsyncIterator[tuple[VirtualClock, _Sink, list[Playout]]]:
    clock = VirtualClock(start=100.0)
    sink = _Sink(clock)
    playouts: list[Playout] = []
    yield clock, sink, playouts
    for playout in playouts:
        await playout.close()


def _playout(rig: tuple[VirtualClock, _Sink, list[Playout]], max_lead_s: float) -> Playout:
    clock, sink, playouts = rig
    policy = TwilioConfig(max_lead_s=max_lead_s, frames_per_message=50).playout()
    playout = Playout(sink, clock, policy, silence=FRAME, on_played=lambda name: None)
    playout.start()
    playouts.append(playout)
    return playout


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_sending_is_held_back_to_the_maximum_lead(rig) -> None:  # type: ignore[no-untyped-def]
    clock, sink, _ = rig
    playout = _playout(rig, max_lead_s=0.1)
    t0 = clock.now()
    await playout.push([FRAME] * 20)  # 400 ms of audio
    await _settle()
    # The first 100 ms go out at once; the other 300 ms follow playback.
    assert sink.frames() == 5
    assert playout.unplayed_s() <= 0.1 + 0.02 + 0.005
    while sink.frames() < 20:
        await clock.advance(0.02)
        assert playout.unplayed_s() <= 0.1 + 0.02 + 0.005
    assert clock.now() - t0 >= 0.28
    assert [kind for _, kind, _ in sink.sent] == ["media"] * len(sink.sent)


async def test_a_short_prompt_goes_out_at_once(rig) -> None:  # type: ignore[no-untyped-def]
    clock, sink, _ = rig
    playout = _playout(rig, max_lead_s=1.0)
    t0 = clock.now()
    await playout.push([FRAME] * 25)  # 500 ms
    await playout.push([FRAME] * 20)  # 900 ms in all
    await _settle()
    assert clock.now() == t0 and sink.frames() == 45
    assert playout.unplayed_s() == pytest.approx(0.9, abs=0.05)


async def test_an_echoed_mark_says_playback_is_further_along_than_the_clock(rig) -> None:  # type: ignore[no-untyped-def]
    """A caller whose playback ran ahead (or a test client playing 20x fast) echoes the mark
    early: the next prompt must not wait for audio the playout thinks is still queued."""
    clock, sink, _ = rig
    playout = _playout(rig, max_lead_s=1.0)
    await playout.push([FRAME] * 100)  # 2 s; 1 s of it held back
    playout.mark("prompt-1")
    while not any(kind == "mark:prompt-1" for _, kind, _ in sink.sent):
        await clock.advance(0.02)
    assert playout.unplayed_s() > 0.9
    playout.far_end_played("prompt-1")
    assert playout.unplayed_s() < 0.01
    t0, before = clock.now(), sink.frames()
    await playout.push([FRAME] * 50)
    await playout.push([FRAME])
    await _settle()
    assert clock.now() == t0 and sink.frames() == before + 51  # Twilio's buffer is empty


async def test_a_late_mark_never_makes_the_lead_grow(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _sink, _ = rig
    playout = _playout(rig, max_lead_s=1.0)
    await playout.push([FRAME] * 5)  # 100 ms
    playout.mark("short")
    await _settle()
    await clock.advance(0.15)  # the clock says it has all played...
    await playout.push([FRAME] * 10)  # ...so this restarts playback: 200 ms ahead
    await _settle()
    playout.far_end_played("short")  # the mark of the old prompt, echoed late
    assert playout.unplayed_s() == pytest.approx(0.2, abs=0.03)


async def test_clear_empties_the_buffer_and_forgets_outstanding_marks(rig) -> None:  # type: ignore[no-untyped-def]
    _clock, sink, _ = rig
    playout = _playout(rig, max_lead_s=1.0)
    await playout.push([FRAME] * 40)
    playout.mark("old")
    await _settle()
    await playout.interrupt()
    assert playout.unplayed_s() == 0
    assert sink.sent[-1][1] == "clear"
    await playout.push([FRAME] * 25)
    await _settle()
    playout.far_end_played("old")  # Twilio echoes cleared marks at once
    assert playout.unplayed_s() == pytest.approx(0.5, abs=0.03)


async def test_a_barge_in_does_not_wait_for_the_room_the_cleared_audio_took(rig) -> None:  # type: ignore[no-untyped-def]
    """The playout sleeps until Twilio has room; a clear empties Twilio's buffer, so the next
    prompt's first frame goes at once, not when the cleared audio would have played."""
    clock, sink, _ = rig
    playout = _playout(rig, max_lead_s=1.0)
    await playout.push([FRAME] * 100)  # 1 s out, 1 s waiting for room
    await _settle()
    await playout.interrupt()
    t0 = clock.now()
    await playout.push([FRAME] * 3)
    await _settle()
    assert sink.sent[-1] == (t0, "media", 3)


async def test_unknown_mark_names_are_ignored(rig) -> None:  # type: ignore[no-untyped-def]
    _clock, _sink, _ = rig
    playout = _playout(rig, max_lead_s=1.0)
    await playout.push([FRAME] * 25)
    await _settle()
    playout.far_end_played("never-sent")
    assert playout.unplayed_s() == pytest.approx(0.5, abs=0.03)
