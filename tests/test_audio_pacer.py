"""Pacer: 20 ms deadlines against an injected clock, drift-free, re-anchoring after stalls."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.audio.pacer import Pacer


class FakeClock:
    """A virtual monotonic clock the test advances by hand (STYLE.md rule 8)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_pacer_deadlines_advance_by_exactly_one_frame() -> None:
    clock = FakeClock()
    pacer = Pacer(clock)
    pacer.start(5.0)
    clock.now = 5.0
    deadlines = []
    for _ in range(5):
        deadlines.append(pacer.next_deadline())
        clock.now = deadlines[-1]
    assert deadlines == [5.0 + k * 0.02 for k in range(5)]
    assert pacer.frames == 5


def test_pacer_does_not_drift_with_sleep_overshoot() -> None:
    # Every simulated sleep overshoots by 0-4 ms; a sleep(0.02) loop would end ~20 s late here.
    clock = FakeClock(0.0)
    rng = np.random.default_rng(0)
    pacer = Pacer(clock, frame_s=0.02)
    pacer.start()
    frames = 10_000
    for _ in range(frames):
        deadline = pacer.next_deadline()
        clock.now = max(clock.now, deadline) + float(rng.uniform(0, 0.004))
    assert pacer.next_deadline() == pytest.approx(frames * 0.02, abs=1e-9)
    assert pacer.reanchors == 0


def test_pacer_catches_up_short_stalls() -> None:
    clock = FakeClock(0.0)
    pacer = Pacer(clock, max_lag_frames=5)
    pacer.start()
    assert pacer.next_deadline() == 0.0
    clock.now = 0.09  # stalled 90 ms: 4.5 frames late, within the 5-frame budget
    burst = [pacer.next_deadline() for _ in range(4)]
    assert burst == pytest.approx([0.02, 0.04, 0.06, 0.08])  # due now: sent back-to-back
    assert pacer.reanchors == 0


def test_pacer_reanchors_after_long_stall() -> None:
    clock = FakeClock(0.0)
    pacer = Pacer(clock, max_lag_frames=5)
    pacer.start()
    pacer.next_deadline()
    clock.now = 3.0  # e.g. the TTS stalled for 3 s: do not burst 150 frames
    assert pacer.next_deadline() == 3.0
    assert pacer.reanchors == 1
    assert pacer.next_deadline() == pytest.approx(3.02)
    assert pacer.frames == 2


def test_pacer_requires_start_and_validates() -> None:
    with pytest.raises(RuntimeError, match="before start"):
        Pacer(FakeClock()).next_deadline()
    with pytest.raises(ValueError, match="frame_s"):
        Pacer(FakeClock(), frame_s=0)
    with pytest.raises(ValueError, match="max_lag_frames"):
        Pacer(FakeClock(), max_lag_frames=-1)


def test_pacer_start_defaults_to_clock() -> None:
    clock = FakeClock(42.0)
    pacer = Pacer(clock)
    pacer.start()
    assert pacer.next_deadline() == 42.0
    assert pacer.frame_s == 0.02
