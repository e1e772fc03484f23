"""How far ahead of the caller's playback audio goes to Twilio (the shared playout, Twilio's
policy), on a virtual clock: no test here waits in real time.

Twilio buffers whatever it is sent; the call's playout keeps at most ``max_lead_s`` of unplayed
audio there, estimates playback from its clock, and corrects the estimate from echoed marks (a
mark comes back once everything sent before it has played) and from ``clear``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.call.events import HangUp
from gateway.call.playout import Playout
from gateway.twilio.session import MAX_OUTCOMES, Outcomes, TwilioConfig
from tests.support.clocks import VirtualClock

FRAME = b"\xff" * 160


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


def test_twilios_policy_sends_few_large_messages() -> None:
    policy = TwilioConfig(max_lead_s=1.0, frames_per_message=50).playout()
    assert policy.far_end_marks and not policy.keepalive and not policy.fade_on_interrupt
    assert policy.max_frames_per_send == 50 and policy.min_frames_per_send == 25


def test_outcomes_left_behind_by_other_replicas_are_bounded() -> None:
    """/twilio/after-stream may reach another replica: its outcome must not stay forever."""
    outcomes = Outcomes()
    for i in range(MAX_OUTCOMES):
        outcomes.record(f"CA{i:032d}", HangUp())
    outcomes.record("CA" + "f" * 32, HangUp())
    assert len(outcomes) == MAX_OUTCOMES
    assert "CA" + "f" * 32 in outcomes and f"CA{0:032d}" not in outcomes
