"""The engine core's scheduling policy, on virtual time (gateway/tts/scheduler.py).

The scheduler is pure: these tests hand it turns whose consumer side (lead, backlog, stopped)
and engine row (prefilling, ready, frames to the next chunk) are plain values, and a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from gateway.tts.scheduler import Scheduler, SchedulerConfig, Turn


@dataclass
class Sink:
    """A consumer: ``lead`` seconds of audio ahead of playback from ``at`` on."""

    lead_s: float = 0.0
    at: float = 0.0
    playing: bool = False
    backlog: int = 0
    stopping: bool = False
    cancelled: bool = False

    def lead(self, now: float) -> float:
        return self.lead_s - (now - self.at) if self.playing else 0.0


@dataclass
class Row:
    prompt: int = 70
    prefilled: int = 0
    ready: bool = False
    finished: str | None = None
    to_chunk: int = 1
    waiting_for_text: bool = False

    @property
    def prompt_tokens(self) -> int:
        return self.prompt

    @property
    def prefilling(self) -> bool:
        return not self.ready

    @property
    def frames_to_chunk(self) -> int:
        return self.to_chunk


def _config(**kwargs: object) -> SchedulerConfig:
    values: dict[str, object] = {"max_rows": 4}
    values.update(kwargs)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def _turn(deadline: float, sink: Sink | None = None, row: Row | None = None) -> Turn:
    return Turn(sink=sink or Sink(), deadline=deadline, row=row)


def _playing(lead: float, **row: object) -> Turn:
    return _turn(0.0, Sink(lead_s=lead, playing=True), Row(ready=True, **row))  # type: ignore[arg-type]


# --- admission ----------------------------------------------------------------------------------


def test_waiting_turns_take_free_rows_in_deadline_order_first_come_first_served_on_ties() -> None:
    scheduler = Scheduler(_config(max_rows=2))
    late, early, tie_first, tie_second = _turn(5.0), _turn(1.0), _turn(3.0), _turn(3.0)
    for turn in (late, early, tie_first, tie_second):
        scheduler.add(turn)
    admitted = scheduler.admit(0.0, free_rows=2)
    assert admitted.admit == [early, tie_first]
    assert scheduler.waiting == 2 and scheduler.running == [early, tie_first]
    # Both get their rows; then one leaves: the next in deadline order, the earlier of the tie.
    early.row, tie_first.row = Row(), Row()
    scheduler.remove(early)
    assert scheduler.admit(0.1, free_rows=1).admit == [tie_second]


def test_a_turn_admitted_but_not_opened_yet_holds_its_row() -> None:
    scheduler = Scheduler(_config())
    first = _turn(1.0)
    scheduler.add(first)
    assert scheduler.admit(0.0, free_rows=1).admit == [first]
    scheduler.add(_turn(2.0))
    # The engine still says one row is free (first has none yet): it is first's.
    assert scheduler.admit(0.0, free_rows=1).admit == []


def test_stopped_turns_leave_running_and_never_start_from_the_queue() -> None:
    scheduler = Scheduler(_config())
    hung_up = _turn(1.0, Sink(stopping=True, cancelled=True))
    failed = _turn(1.0, Sink(stopping=True))
    queued_then_cancelled = _turn(0.5, Sink(stopping=True, cancelled=True))
    scheduler.running += [hung_up, failed]
    scheduler.add(queued_then_cancelled)
    out = scheduler.admit(0.0, free_rows=4)
    assert out.leave == [(hung_up, True), (failed, False)]
    assert out.dropped == [queued_then_cancelled] and out.admit == []
    assert scheduler.running == [] and scheduler.waiting == 0


def test_a_consumer_that_takes_nothing_for_the_stall_limit_is_reported_once_past_it() -> None:
    scheduler = Scheduler(_config(consumer_stall_s=30.0))
    turn = _playing(2.0)
    turn.blocked_since = 10.0
    scheduler.running.append(turn)
    assert scheduler.admit(39.9, free_rows=0).stalled == []
    assert scheduler.admit(40.1, free_rows=0).stalled == [turn]


def test_take_waiting_hands_back_the_queue_most_urgent_first() -> None:
    scheduler = Scheduler(_config())
    a, b = _turn(2.0), _turn(1.0)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.take_waiting() == [b, a] and scheduler.waiting == 0


# --- prefill --------------------------------------------------------------------------------------


def test_with_nobody_playing_every_prefill_chunk_runs_before_the_step() -> None:
    scheduler = Scheduler(_config(prefill_chunk=32))
    scheduler.prefilled(100, 1.0)  # 10 ms a token: the budget does not matter, it is inf
    newcomer = _turn(1.0, row=Row(prompt=80))
    scheduler.running.append(newcomer)
    plan = scheduler.plan_prefill(0.0)
    assert plan.budget_s == math.inf and plan.together == []
    assert plan.chunks == [(newcomer, 32), (newcomer, 32), (newcomer, 16)]


def test_prefill_spends_only_the_playing_rows_slack_but_always_one_chunk() -> None:
    scheduler = Scheduler(_config(prefill_chunk=32, prefill_safety_s=0.02))
    scheduler.prefilled(100, 0.1)  # 1 ms a token: a 32-token chunk costs 32 ms
    scheduler.stepped(2, 0.05)  # 50 ms a step at two rows
    scheduler.decoded(0.1)  # decode: 0.7 * 0 + 0.3 * 0.1 = 30 ms
    # Lead 0.3 s, 2 frames still missing from its next chunk: slack 0.3 - 2*0.05 - 0.03 = 0.17;
    # the budget keeps 20 ms: 0.15 s, four chunks of 32 ms fit (128 ms), the fifth does not.
    player = _playing(0.3, to_chunk=2)
    newcomer = _turn(1.0, row=Row(prompt=200))
    scheduler.running += [player, newcomer]
    plan = scheduler.plan_prefill(0.0)
    assert plan.budget_s == pytest.approx(0.15)
    assert plan.chunks == [(newcomer, 32)] * 4
    # A row about to run dry leaves no slack: one chunk still runs (never starved).
    player.sink.lead_s = 0.05
    assert scheduler.plan_prefill(0.0).chunks == [(newcomer, 32)]


def test_a_burst_of_one_chunk_prompts_is_prefilled_together_within_the_budget() -> None:
    scheduler = Scheduler(_config())
    scheduler.prefilled(100, 0.1)  # 1 ms a token
    player = _playing(0.325)  # budget 0.325 - 0 - 0 - 0.02 = 0.305 s: 300 tokens, not 400
    burst = [_turn(float(i), row=Row(prompt=100)) for i in range(4)]
    scheduler.running += [player, *burst]
    plan = scheduler.plan_prefill(0.0)
    # Three prompts (300 tokens) fit together; the fourth would not, and no chunk follows the
    # group once the budget is spent.
    assert plan.together == burst[:3] and plan.chunks == []
    # Alone, a newcomer is never grouped; without grouping the most urgent goes first.
    assert scheduler.plan_prefill(0.0, together=False).chunks == [(burst[0], 100),
                                                                  (burst[1], 100),
                                                                  (burst[2], 100)]


def test_a_prompt_already_started_or_longer_than_a_chunk_is_not_grouped() -> None:
    scheduler = Scheduler(_config(prefill_chunk=64))
    started = _turn(0.0, row=Row(prompt=50, prefilled=10))
    other = _turn(1.0, row=Row(prompt=50))
    scheduler.running += [started, other]
    plan = scheduler.plan_prefill(0.0)
    assert plan.together == [] and plan.chunks == [(started, 40), (other, 50)]


# --- the step -----------------------------------------------------------------------------------


def test_a_row_whose_consumer_holds_its_chunks_sits_out_and_the_wait_is_counted_once() -> None:
    scheduler = Scheduler(_config(max_backlog=2))
    held = _playing(0.6)
    held.sink.backlog = 2
    free = _playing(0.6)
    scheduler.running += [held, free]
    plan = scheduler.plan_step(1.0)
    assert plan.rows == [free] and plan.blocked == [held]
    assert plan.backpressure == 1 and plan.new_backpressure_waits == 1
    assert held.blocked_since == 1.0
    assert scheduler.plan_step(1.1).new_backpressure_waits == 0
    assert scheduler.work_appeared(free_rows=0) is False
    held.sink.backlog = 1  # the consumer took a chunk
    assert scheduler.work_appeared(free_rows=0) is True
    plan = scheduler.plan_step(1.2)
    assert held in plan.rows and held.blocked_since is None


def test_a_far_ahead_row_pauses_for_a_newcomer_and_resumes_at_the_low_mark() -> None:
    scheduler = Scheduler(_config(ahead_high_s=1.0, ahead_low_s=0.5))
    ahead = _playing(1.5)
    newcomer = _turn(2.0, row=Row(ready=True))  # ready, waiting for its first audio
    scheduler.running += [ahead, newcomer]
    plan = scheduler.plan_step(0.0)
    assert plan.rows == [newcomer] and plan.urgency == 1 and plan.new_pauses == 1
    # Still above the low mark while the newcomer waits: stays paused (hysteresis).
    assert scheduler.plan_step(0.7).rows == [newcomer]
    assert scheduler.idle_timeout(0.7) == pytest.approx(1.5 - 0.7 - 0.5)
    # Its lead fell to the low mark: it advances again even though the newcomer still waits.
    assert ahead in scheduler.plan_step(1.0).rows
    assert not ahead.paused


def test_a_row_about_to_run_dry_makes_far_ahead_rows_wait() -> None:
    scheduler = Scheduler(_config(ahead_high_s=1.0, ahead_low_s=0.5))
    ahead, dry = _playing(2.0), _playing(0.2)
    scheduler.running += [ahead, dry]
    assert scheduler.plan_step(0.0).rows == [dry]
    # Nobody needs the room any more: the paused row resumes at once.
    dry.sink.lead_s = 0.9
    assert scheduler.plan_step(0.0).rows == [ahead, dry]


def test_a_row_that_read_all_its_streamed_text_sits_out_and_the_underrun_is_counted_once(
) -> None:
    scheduler = Scheduler(_config())
    talking, starved = _playing(0.6), _playing(0.6, waiting_for_text=True)
    scheduler.running += [talking, starved]
    plan = scheduler.plan_step(0.0)
    assert plan.rows == [talking] and plan.text == 1 and plan.new_text_underruns == 1
    assert scheduler.plan_step(0.02).new_text_underruns == 0  # the same wait goes on
    starved.row.waiting_for_text = False  # type: ignore[union-attr]
    assert scheduler.plan_step(0.04).rows == [talking, starved]
    starved.row.waiting_for_text = True  # type: ignore[union-attr]
    assert scheduler.plan_step(0.06).new_text_underruns == 1  # a new wait


def test_due_chunks_are_decoded_first_audio_first_then_by_lead() -> None:
    scheduler = Scheduler(_config())
    rich, poor = _playing(0.9), _playing(0.1)
    newcomer = _turn(1.0, row=Row(ready=True))
    prefilling = _turn(1.0, row=Row())
    scheduler.running += [rich, poor, newcomer, prefilling]
    plan = scheduler.plan_step(0.0)
    assert plan.decode == [newcomer, poor, rich] and plan.prefilling == 1


def test_finished_and_stopped_rows_do_not_step() -> None:
    scheduler = Scheduler(_config())
    done = _playing(0.5, finished="eos")
    stopped = _playing(0.5)
    stopped.sink.stopping = True
    scheduler.running += [done, stopped]
    plan = scheduler.plan_step(0.0)
    assert plan.rows == [] and plan.decode == [done]


# --- costs and restarts ---------------------------------------------------------------------------


def test_measured_costs_are_moving_averages_and_steps_are_looked_up_by_bucket() -> None:
    scheduler = Scheduler(_config())
    scheduler.stepped(4, 0.04)
    scheduler.stepped(4, 0.08)
    scheduler.stepped(16, 0.2)
    assert scheduler.costs.step_s[4] == pytest.approx(0.7 * 0.04 + 0.3 * 0.08)
    assert scheduler.costs.step_for(3) == scheduler.costs.step_s[4]
    assert scheduler.costs.step_for(9) == 0.2 and scheduler.costs.step_for(64) == 0.2
    scheduler.prefilled(0, 1.0)  # nothing measured from an empty call
    assert scheduler.costs.prefill_s_per_token is None


def test_the_next_chunk_estimate_is_the_frames_at_the_measured_step_and_a_decode() -> None:
    """What the start buffer is told (through the stream): nothing before a step and a decode
    were measured (a zero would drop the hold on a cold engine); then the turn's frames at the
    step time of the rows running, plus a decode."""
    scheduler = Scheduler(_config())
    assert scheduler.next_chunk_eta(2) is None
    scheduler.stepped(4, 0.01)
    assert scheduler.next_chunk_eta(2) is None  # no decode measured yet
    scheduler.decoded(0.005)
    assert scheduler.next_chunk_eta(2) == pytest.approx(2 * 0.01 + 0.3 * 0.005)
    scheduler.stepped(16, 0.03)
    for _ in range(6):  # six rows running: the 16-row bucket's time
        scheduler.add(_turn(0.0))
    scheduler.admit(0.0, free_rows=6)
    assert scheduler.next_chunk_eta(4) == pytest.approx(4 * 0.03 + 0.3 * 0.005)


def test_a_restart_forgets_rows_pauses_and_waits() -> None:
    scheduler = Scheduler(_config())
    turn = _playing(2.0)
    turn.paused, turn.blocked_since = True, 3.0
    scheduler.restart([turn])
    assert (turn.row, turn.paused, turn.blocked_since, turn.restarted) == (None, False, None, True)


def test_configuration_is_checked() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_rows=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_rows=1, ahead_low_s=2.0, ahead_high_s=1.0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_rows=1, max_backlog=0)
