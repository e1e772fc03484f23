"""The transport-agnostic call and its one lifecycle (see DESIGN.md, "gateway/call").

- :mod:`gateway.call.events`: inbound events (:class:`Dtmf`, :class:`PlaybackDone`,
  :class:`SpeechStarted`, :class:`SpeechPaused`, :class:`SpeechFailed`, :class:`Hangup`) and
  outcomes (:class:`TransferTo`, :class:`HangUp`).
- :mod:`gateway.call.session`: :class:`Call`, the media session a dialog talks to, and the
  :class:`CallTransport` protocol a transport adapter implements.
- :mod:`gateway.call.playout`: pacing and backpressure of outbound frames, per
  :class:`PlayoutPolicy`.
- :mod:`gateway.call.frames`: :class:`PromptFrames`, the frames of what calls play, encoded
  once per lifecycle.
- :mod:`gateway.call.inactivity`: the inbound-media watchdog.
- :mod:`gateway.call.inbound`: the cap on a call's inbound media rate.
- :mod:`gateway.call.admission`, :mod:`gateway.call.registry`: the replica's call budget and
  the calls in progress.
- :mod:`gateway.call.lifecycle`: :class:`CallLifecycle`, what every transport asks to admit,
  start and finish a call, and the drain.
"""

from gateway.call.admission import Admission, Refusal
from gateway.call.events import (
    CallEvent,
    CallOutcome,
    Codec,
    Dtmf,
    HangUp,
    Hangup,
    PlaybackDone,
    SpeechFailed,
    SpeechPaused,
    SpeechStarted,
    TransferTo,
)
from gateway.call.frames import PromptFrames
from gateway.call.inactivity import InactivityWatch
from gateway.call.inbound import InboundRate
from gateway.call.lifecycle import CallLifecycle, DetectorFactory, DialogFactory
from gateway.call.playout import FrameSink, Playout, PlayoutPolicy
from gateway.call.registry import CallRegistry
from gateway.call.session import (
    AudioStream,
    Call,
    CallTransport,
    Dialog,
    InboundListener,
    SpeechDetector,
    StreamOpener,
    Utterance,
)

__all__ = [
    "Admission",
    "AudioStream",
    "Call",
    "CallEvent",
    "CallLifecycle",
    "CallOutcome",
    "CallRegistry",
    "CallTransport",
    "Codec",
    "DetectorFactory",
    "Dialog",
    "DialogFactory",
    "Dtmf",
    "FrameSink",
    "HangUp",
    "Hangup",
    "InactivityWatch",
    "InboundListener",
    "InboundRate",
    "PlaybackDone",
    "Playout",
    "PlayoutPolicy",
    "PromptFrames",
    "Refusal",
    "SpeechDetector",
    "SpeechFailed",
    "SpeechPaused",
    "SpeechStarted",
    "StreamOpener",
    "TransferTo",
    "Utterance",
]
