"""What a Twilio call does once its Media Stream is over, as TwiML (built with ``twilio``).

The same documents answer ``POST /twilio/after-stream`` and go to Twilio in a live-call update
(:mod:`gateway.twilio.rest`), so a call transferred on one replica hears the same ``<Dial>``
whichever way it reaches Twilio.
"""

from __future__ import annotations

from dataclasses import dataclass

from twilio.twiml.voice_response import Dial, VoiceResponse

from gateway.call.events import CallOutcome, TransferTo

__all__ = ["Busy", "StreamOutcome", "after_stream_retry", "busy", "outcome_twiml"]


@dataclass(frozen=True, slots=True)
class Busy:
    """A stream this replica had no seat for: the caller hears ``message``, then Twilio hangs up
    (the webhook's busy answer, given at the stream instead)."""

    message: str


#: How a stream's call continues: the dialog's outcome, or a refusal at the stream.
StreamOutcome = CallOutcome | Busy


def busy(message: str) -> VoiceResponse:
    """``<Say>`` the apology, then ``<Hangup/>``."""
    response = VoiceResponse()
    response.say(message)
    response.hangup()
    return response


def outcome_twiml(outcome: StreamOutcome) -> VoiceResponse:
    """``<Dial>`` the transfer target (a number, or ``<Sip>`` for a SIP URI), the busy
    apology, or ``<Hangup/>``."""
    if isinstance(outcome, Busy):
        return busy(outcome.message)
    response = VoiceResponse()
    if isinstance(outcome, TransferTo):
        if outcome.target.startswith(("sip:", "sips:")):
            dial = Dial()
            dial.sip(outcome.target)
            response.append(dial)
        else:
            response.dial(outcome.target)
    else:
        response.hangup()
    return response


def after_stream_retry(url: str, pause_s: int) -> VoiceResponse:
    """Wait ``pause_s`` seconds, then request ``url`` again (``<Pause>`` + ``<Redirect>``).

    For an ``after-stream`` request about a call this replica knows nothing of: the replica
    that ran its stream is delivering the outcome by REST (an update replaces whatever TwiML
    runs, this ``<Pause>`` included), or recorded it there because the update failed, and the
    next request through the load balancer may reach it.
    """
    response = VoiceResponse()
    response.pause(length=pause_s)
    response.redirect(url, method="POST")
    return response
