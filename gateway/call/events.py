"""What happens to a call, whatever carries it: inbound events and how a call ends.

Transport adapters turn their wire events into these (a Twilio ``dtmf`` message and an RFC 4733
telephone-event both become :class:`Dtmf`); dialogs read them from :attr:`Call.events
<gateway.call.session.Call.events>`. Every event carries ``at``, read from the gateway's
injected clock when the event arrived: first-audio latency is measured from it, so it must be on
the same clock as the frames going out (never a wall-clock default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "CallEvent",
    "CallOutcome",
    "CallerHungUp",
    "Codec",
    "Dtmf",
    "EndCall",
    "PlaybackDone",
    "SpeechFailed",
    "SpeechPaused",
    "SpeechStarted",
    "TransferTo",
]

Codec = Literal["pcmu", "pcma"]


@dataclass(frozen=True, slots=True)
class Dtmf:
    """A keypress (Twilio ``dtmf`` event or RFC 4733 telephone-event)."""

    digit: str
    at: float = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class PlaybackDone:
    """Everything before mark ``name`` has played to the caller."""

    name: str
    at: float = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    """Voice activity detection heard the caller start speaking (speech barge-in)."""

    at: float = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class SpeechPaused:
    """The caller stopped speaking, maybe for good: the detector heard a pause begin.

    ``since`` is when the pause began (``at`` is when it was heard, a window or two later): a
    speech gather that then decides the caller's turn is over measures their turn from
    ``since``, the end of their speech. Sent only while a listener is attached
    (:meth:`Call.listen <gateway.call.session.Call.listen>`).
    """

    since: float
    at: float = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class SpeechFailed:
    """An utterance could not be generated (engine error); the dialog decides what to say."""

    utterance_id: str
    reason: str
    at: float = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class CallerHungUp:
    """The caller (or the network) ended the call: an event the dialog reads, not to be
    confused with :class:`EndCall`, the outcome a dialog asks for."""

    reason: str = "hangup"
    at: float = field(kw_only=True)


CallEvent = Dtmf | PlaybackDone | SpeechStarted | SpeechPaused | SpeechFailed | CallerHungUp


@dataclass(frozen=True, slots=True)
class TransferTo:
    """Hand the caller to ``target``: an E.164 number or a SIP URI."""

    target: str


@dataclass(frozen=True, slots=True)
class EndCall:
    """End the call: the outcome a dialog asks for (``await call.end(EndCall())``)."""


CallOutcome = TransferTo | EndCall
