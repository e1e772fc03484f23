"""Chunk planning: the schedule sets growth, measured cost shrinks chunks that would be late."""

from __future__ import annotations

import pytest
from clocks import ManualClock

from gateway.tts.chunking import FRAME_S, ChunkPlanner


def _play(planner: ChunkPlanner, clock: ManualClock, per_frame_s: float,
          chunks: int) -> list[int]:
    sizes = []
    for _ in range(chunks):
        size = planner.next_size()
        clock.t += size * per_frame_s
        planner.chunk_done(size)
        sizes.append(size)
    return sizes


def test_fixed_schedule_repeats_its_last_entry() -> None:
    clock = ManualClock(100.0)
    planner = ChunkPlanner((1, 2, 4, 8), adaptive=False, clock=clock)
    assert _play(planner, clock, per_frame_s=0.07, chunks=6) == [1, 2, 4, 8, 8, 8]


def test_a_fast_device_follows_the_schedule() -> None:
    clock = ManualClock(100.0)
    planner = ChunkPlanner((1, 2, 4, 8), clock=clock)
    # 10 ms per 80 ms frame (a GPU): every scheduled chunk arrives in time.
    assert _play(planner, clock, per_frame_s=0.01, chunks=6) == [1, 2, 4, 8, 8, 8]


def test_a_slow_device_gets_smaller_chunks_that_arrive_before_playback_runs_out() -> None:
    clock = ManualClock(100.0)
    planner = ChunkPlanner((1, 2, 4, 8), clock=clock, safety_s=0.01)
    per_frame = 0.05  # 62% of real time: a 2-frame second chunk would arrive 20 ms late
    sizes = _play(planner, clock, per_frame_s=per_frame, chunks=12)
    assert sizes[1] == 1  # shrunk from 2
    # Every chunk arrives while earlier audio is still playing: the lead never goes negative.
    clock2 = ManualClock(100.0)
    replay = ChunkPlanner((1, 2, 4, 8), adaptive=False, clock=clock2)
    for size in sizes:
        clock2.t += size * per_frame
        assert replay.lead_s() >= 0 or replay._origin is None
        replay.chunk_done(size)
    assert max(sizes) <= 8 and sum(sizes) > 12


def test_the_first_estimate_includes_prefill_so_it_is_conservative() -> None:
    clock = ManualClock(100.0)
    planner = ChunkPlanner((1, 4), clock=clock)
    clock.t += 0.075  # prefill + first frame: 75 ms for 80 ms of audio
    planner.chunk_done(planner.next_size())
    assert planner.next_size() == 1  # 4 frames at ~75 ms each would be far too late


def test_lead_is_audio_delivered_minus_time_played() -> None:
    clock = ManualClock(100.0)
    planner = ChunkPlanner((2,), clock=clock)
    assert planner.lead_s() == 0
    planner.chunk_done(2)
    clock.t += 0.05
    assert planner.lead_s() == pytest.approx(2 * FRAME_S - 0.05)


def test_rejects_a_bad_schedule() -> None:
    with pytest.raises(ValueError):
        ChunkPlanner(())
    with pytest.raises(ValueError):
        ChunkPlanner((1, 0))


def test_slower_than_real_time_keeps_the_schedule_for_throughput() -> None:
    clock = ManualClock(100.0)
    planner = ChunkPlanner((1, 2, 4, 8), clock=clock)
    # 100 ms per 80 ms frame: gaps are unavoidable, shrinking would only add overhead.
    assert _play(planner, clock, per_frame_s=0.1, chunks=5) == [1, 2, 4, 8, 8]
