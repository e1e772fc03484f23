"""Twilio's playout policy and the outcomes a stream leaves for the after-stream webhook.

How the shared playout paces audio under this policy (the lead held back to ``max_lead_s``,
echoed marks, ``clear``) is tested with the playout itself: tests/unit/call/test_playout.py.
"""

from __future__ import annotations

from gateway.call.events import EndCall
from gateway.twilio.stream import MAX_OUTCOMES, Outcomes, TwilioConfig


def test_twilios_policy_sends_few_large_messages() -> None:
    policy = TwilioConfig(max_lead_s=1.0, frames_per_message=50).playout()
    assert policy.far_end_marks and not policy.keepalive and not policy.fade_on_interrupt
    assert policy.max_frames_per_send == 50 and policy.min_frames_per_send == 25


def test_outcomes_left_behind_by_other_replicas_are_bounded() -> None:
    """/twilio/after-stream may reach another replica: its outcome must not stay forever."""
    outcomes = Outcomes()
    for i in range(MAX_OUTCOMES):
        outcomes.record(f"CA{i:032d}", EndCall())
    outcomes.record("CA" + "f" * 32, EndCall())
    assert len(outcomes) == MAX_OUTCOMES
    assert "CA" + "f" * 32 in outcomes and f"CA{0:032d}" not in outcomes
