"""Pacer: 20 ms deadlines against an injected clock, drift-free, re-anchoring after stalls;
the lead arithmetic the call playout sends by and the waits the simulator's clock ticks on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from clocks import ManualClock, VirtualClock

from gateway.audio.pacer import Pacer


def test_pacer_deadlines_advance_by_exactly_one_frame() -> None:
    clock = ManualClock(1000.0)
    pacer = Pacer(clock)
    pacer.start(5.0)
    clock.t = 5.0
    deadlines = []
    for _ in range(5):
        deadlines.append(pacer.next_deadline())
        clock.t = deadlines[-1]
    assert deadlines == [5.0 + k * 0.02 for k in range(5)]
    assert pacer.frames == 5


def test_pacer_does_not_drift_with_sleep_overshoot() -> None:
    # Every simulated sleep overshoots by 0-4 ms; a sleep(0.02) loop would end ~20 s late here.
    clock = ManualClock(0.0)
    rng = np.random.default_rng(0)
    pacer = Pacer(clock, frame_s=0.02)
    pacer.start()
    frames = 10_000
    for _ in range(frames):
        deadline = pacer.next_deadline()
        clock.t = max(clock.t, deadline) + float(rng.uniform(0, 0.004))
    assert pacer.next_deadline() == pytest.approx(frames * 0.02, abs=1e-9)
    assert pacer.reanchors == 0


def test_pacer_catches_up_short_stalls() -> None:
    clock = ManualClock(0.0)
    pacer = Pacer(clock, max_lag_frames=5)
    pacer.start()
    assert pacer.next_deadline() == 0.0
    clock.t = 0.09  # stalled 90 ms: 4.5 frames late, within the 5-frame budget
    burst = [pacer.next_deadline() for _ in range(4)]
    assert burst == pytest.approx([0.02, 0.04, 0.06, 0.08])  # due now: sent back-to-back
    assert pacer.reanchors == 0


def test_pacer_reanchors_after_long_stall() -> None:
    clock = ManualClock(0.0)
    pacer = Pacer(clock, max_lag_frames=5)
    pacer.start()
    pacer.next_deadline()
    clock.t = 3.0  # e.g. the TTS stalled for 3 s: do not burst 150 frames
    assert pacer.next_deadline() == 3.0
    assert pacer.reanchors == 1
    assert pacer.next_deadline() == pytest.approx(3.02)
    assert pacer.frames == 2


def test_pacer_requires_start_and_validates() -> None:
    with pytest.raises(RuntimeError, match="before start"):
        Pacer(ManualClock(1000.0)).next_deadline()
    with pytest.raises(ValueError, match="frame_s"):
        Pacer(ManualClock(1000.0), frame_s=0)
    with pytest.raises(ValueError, match="max_lag_frames"):
        Pacer(ManualClock(1000.0), max_lag_frames=-1)


def test_pacer_start_defaults_to_clock() -> None:
    clock = ManualClock(42.0)
    pacer = Pacer(clock)
    pacer.start()
    assert pacer.next_deadline() == 42.0
    assert pacer.frame_s == 0.02


def test_a_pacer_with_no_lag_rule_never_reanchors() -> None:
    clock = ManualClock(0.0)
    pacer = Pacer(clock, max_lag_frames=None)
    pacer.start()
    pacer.next_deadline()
    clock.t = 30.0  # a phone's sound card keeps its timeline: every late frame goes at once
    assert pacer.next_deadline() == pytest.approx(0.02)
    assert pacer.reanchors == 0 and not pacer.catch_up(1e6)


def test_room_and_due_release_frames_a_lead_ahead_of_their_deadline() -> None:
    # Twilio's schedule: frame k may go 100 ms (5 frames) before origin + k * 20 ms.
    pacer = Pacer(ManualClock(1000.0), max_lag_frames=None)
    pacer.start(10.0)
    assert pacer.room(10.0, lead_frames=5) == 6  # frames 0-5 may go at once
    pacer.sent(6)
    assert pacer.room(10.0, lead_frames=5) == 0
    assert pacer.due(0, 5) == pytest.approx(10.02)  # frame 6, 100 ms early
    assert pacer.due(2, 5) == pytest.approx(10.06)  # a batch of three: its last frame's time
    assert pacer.room(10.02 - 1e-9, lead_frames=5) == 1  # within the float slack
    assert pacer.lead_s(10.0) == pytest.approx(0.12) and pacer.elapsed(10.05) == pytest.approx(2.5)
    assert pacer.lead_s(10.2) == pytest.approx(-0.08)  # the far end has run dry by then


def test_a_far_end_report_moves_the_schedule_earlier_never_later() -> None:
    pacer = Pacer(ManualClock(1000.0), max_lag_frames=None)
    pacer.start(0.0)
    pacer.sent(50)
    pacer.played_at(10, 0.1)  # frame 10 played by 0.1 s: playback began at -0.1 s
    assert pacer.due() == pytest.approx(-0.1 + 50 * 0.02)
    pacer.played_at(10, 0.5)  # a late report: playback is at least there, not later
    assert pacer.due() == pytest.approx(-0.1 + 50 * 0.02)


def test_a_slip_delays_every_later_deadline() -> None:
    pacer = Pacer(ManualClock(1000.0), max_lag_frames=None)
    pacer.start(0.0)
    pacer.sent(3)
    pacer.slip(0.05)
    assert pacer.due() == pytest.approx(0.11) and pacer.frames == 3


def test_stop_ends_the_run_until_the_next_start() -> None:
    pacer = Pacer(ManualClock(5.0))
    pacer.start()
    pacer.sent(4)
    pacer.stop()
    assert not pacer.anchored
    with pytest.raises(RuntimeError, match="before start"):
        pacer.next_deadline()
    pacer.start(7.0)
    assert pacer.anchored and pacer.frames == 0 and pacer.next_deadline() == 7.0


async def test_wait_sleeps_on_the_injected_clock_to_each_deadline() -> None:
    clock = VirtualClock(100.0)
    pacer = Pacer(clock)
    pacer.start()
    woke: list[tuple[float, float]] = []

    async def ticks() -> None:
        for _ in range(4):
            deadline = await pacer.wait()
            woke.append((deadline, clock.now()))

    task = asyncio.create_task(ticks())
    await asyncio.sleep(0)  # frame 0 is due at once: no sleep
    await clock.advance(0.065)
    await task
    assert woke == [(100.0, 100.0), (100.02, 100.02), (100.04, 100.04), (100.06, 100.06)]
    # A bare callable (the SIP phone's, until it hands a Clock) reads the time but cannot wait.
    with pytest.raises(TypeError, match="needs a Clock"):
        bare = Pacer(lambda: 0.0)
        bare.start()
        await bare.wait()


async def test_wait_after_a_stall_returns_when_the_frame_was_due_before_the_reanchor() -> None:
    clock = ManualClock(0.0)
    pacer = Pacer(clock, max_lag_frames=5)
    pacer.start()
    assert await pacer.wait() == 0.0
    clock.t = 0.5  # the loop stalled: frame 1 (due at 0.02) is 24 frames late
    assert await pacer.wait() == pytest.approx(0.02)  # lateness 480 ms, as the shell sees it
    assert pacer.reanchors == 1 and pacer.due() == pytest.approx(0.52)  # sent at once, re-anchored
