"""ConversationRelay's WebSocket messages, sans-I/O: typed values in both directions.

Twilio's ConversationRelay (and Telnyx's copy of its message set) is how most companies put a
bot behind a phone line: the platform opens a WebSocket to the bot, tells it about the call
(``setup``), sends the caller's words (``prompt``), keys (``dtmf``) and barge-ins
(``interrupt``), and speaks the ``text`` tokens the bot streams back. Documented at
https://www.twilio.com/docs/voice/conversationrelay/websocket-messages; the gateway speaks it
so that a bot written for ConversationRelay talks to our voices unchanged.

Gateway -> bot: :class:`Setup`, :class:`Prompt`, :class:`DtmfOut`, :class:`Interrupt`,
:class:`ErrorOut`, each with :meth:`serialize` (one JSON text frame).

Bot -> gateway: :func:`parse_message` turns one frame into :class:`Text`, :class:`Play`,
:class:`SendDigits`, :class:`Language` or :class:`End`, or raises :class:`BotMessageError`
saying precisely what is wrong. The gateway answers such a message with an ``error`` message
and logs it; the call goes on (a bad message never ends a call). Fields a message type does
not define are ignored, as new ConversationRelay releases add fields a bot may send to either.

The handshake is signed as ConversationRelay signs it (:func:`signature`): ``X-Twilio-Signature``
is the base64 HMAC-SHA1 of the WebSocket URL with the account's auth token, the scheme used for
Twilio's webhooks (https://www.twilio.com/docs/usage/security#validating-requests), so a bot's
``RequestValidator(token).validate(url, {}, signature)`` accepts us.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from twilio.request_validator import RequestValidator

from gateway.errors import BotMessageError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_TOKEN_CHARS",
    "SIGNATURE_HEADER",
    "BotMessage",
    "DtmfOut",
    "End",
    "ErrorOut",
    "Interrupt",
    "Language",
    "Play",
    "Prompt",
    "SendDigits",
    "Setup",
    "Text",
    "parse_message",
    "signature",
]

SIGNATURE_HEADER = "X-Twilio-Signature"
#: Largest frame a bot may send (a long ``text`` token or an ``end`` with handoff data fits).
MAX_MESSAGE_BYTES = 64 * 1024
#: Longest ``token`` of one ``text`` message (an LLM streams a few characters at a time).
MAX_TOKEN_CHARS = 4000
#: Keys ``sendDigits`` may send, and ``w`` (half a second's pause), as Twilio's ``sendDigits``.
_DIGITS = re.compile(r"[0-9*#A-Dw]{1,64}")
#: A BCP 47 tag as ConversationRelay uses them (``en-US``, ``es-MX``, ``multi``).
_LANG = re.compile(r"[A-Za-z]{2,8}(?:-[A-Za-z0-9]{1,8})*")


def signature(url: str, auth_token: str) -> str:
    """``X-Twilio-Signature`` of the WebSocket upgrade to ``url``, as ConversationRelay sends it."""
    return str(RequestValidator(auth_token).compute_signature(url, {}))


# --- gateway -> bot ------------------------------------------------------------------------------


def _dump(message: dict[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Setup:
    """The first message: who calls whom, and the script's custom parameters."""

    session_id: str
    call_sid: str
    from_: str
    to: str
    account_sid: str = ""
    direction: str = "inbound"
    #: ``PSTN`` for Twilio calls, ``SIP`` for SIP calls (ConversationRelay's values).
    call_type: str = "PSTN"
    custom_parameters: dict[str, str] = field(default_factory=dict)

    def serialize(self) -> str:
        return _dump({
            "type": "setup", "sessionId": self.session_id, "callSid": self.call_sid,
            "parentCallSid": "", "from": self.from_, "to": self.to, "forwardedFrom": "",
            "callerName": "", "direction": self.direction, "callType": self.call_type,
            "callStatus": "IN-PROGRESS", "accountSid": self.account_sid,
            "customParameters": dict(self.custom_parameters),
        })


@dataclass(frozen=True)
class Prompt:
    """What the caller said (the recogniser's transcript of one turn)."""

    voice_prompt: str
    lang: str
    last: bool = True

    def serialize(self) -> str:
        return _dump({"type": "prompt", "voicePrompt": self.voice_prompt, "lang": self.lang,
                      "last": self.last})


@dataclass(frozen=True)
class DtmfOut:
    """A key the caller pressed."""

    digit: str

    def serialize(self) -> str:
        return _dump({"type": "dtmf", "digit": self.digit})


@dataclass(frozen=True)
class Interrupt:
    """The caller cut the bot off: what they had heard of its answer, and for how long."""

    utterance_until_interrupt: str
    duration_until_interrupt_ms: int

    def serialize(self) -> str:
        # A string of milliseconds, as in ConversationRelay's documented example: a bot that
        # parses it (int(...), Number(...)) reads ours the same.
        return _dump({"type": "interrupt",
                      "utteranceUntilInterrupt": self.utterance_until_interrupt,
                      "durationUntilInterruptMs": str(self.duration_until_interrupt_ms)})


@dataclass(frozen=True)
class ErrorOut:
    """Something the bot sent could not be done (the call goes on)."""

    description: str

    def serialize(self) -> str:
        return _dump({"type": "error", "description": self.description})


# --- bot -> gateway ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """Words to speak: a token of a streamed answer; ``last`` ends the answer (a talk)."""

    token: str
    last: bool = False
    lang: str | None = None
    #: None: the node's setting.
    interruptible: bool | None = None
    preemptible: bool | None = None


@dataclass(frozen=True)
class Play:
    """Audio to play: an http(s) URL the gateway fetches, or the name of a script prompt or
    sound. ``loop`` times (0: until interrupted or preempted)."""

    source: str
    loop: int = 1
    interruptible: bool | None = None
    preemptible: bool | None = None


@dataclass(frozen=True)
class SendDigits:
    """Keys to send to the far end (``w``: a half-second pause)."""

    digits: str


@dataclass(frozen=True)
class Language:
    """Switch the voice's language and/or the recogniser's."""

    tts_language: str | None = None
    transcription_language: str | None = None


@dataclass(frozen=True)
class End:
    """The bot is done: ``handoff_data`` (a JSON object as text, by ConversationRelay's
    convention) goes back to the script."""

    handoff_data: str | None = None


BotMessage = Text | Play | SendDigits | Language | End

_TYPES = ("text", "play", "sendDigits", "language", "end")


def parse_message(data: str | bytes | bytearray | memoryview) -> BotMessage:
    """One WebSocket frame from the bot as a typed message; :class:`BotMessageError` with a
    precise reason otherwise (binary frame, not JSON, unknown type, a field of the wrong type)."""
    if not isinstance(data, str):
        raise BotMessageError("binary frames are not messages: send each message as a JSON "
                              "text frame")
    if len(data) > MAX_MESSAGE_BYTES:
        raise BotMessageError(f"message of {len(data)} characters is over the limit of "
                              f"{MAX_MESSAGE_BYTES}")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raise BotMessageError(f"not JSON: {_excerpt(data)}") from None
    if not isinstance(raw, dict):
        raise BotMessageError(f"a message is a JSON object with a 'type', not {_excerpt(data)}")
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise BotMessageError("a message needs a 'type' string (one of "
                              f"{', '.join(_TYPES)})")
    fields = _Fields(kind, raw)
    if kind == "text":
        token = fields.text("token", required=True, limit=MAX_TOKEN_CHARS)
        assert token is not None
        return Text(token=token, last=fields.flag("last") or False,
                    lang=fields.lang("lang"), interruptible=fields.flag("interruptible"),
                    preemptible=fields.flag("preemptible"))
    if kind == "play":
        source = fields.text("source", required=True, limit=2048)
        assert source is not None
        if not source.strip():
            raise BotMessageError("play: 'source' is empty")
        loop = raw.get("loop", 1)
        if isinstance(loop, bool) or not isinstance(loop, int) or not 0 <= loop <= 100:
            raise BotMessageError(f"play: 'loop' must be a whole number from 0 to 100, not "
                                  f"{json.dumps(loop)}")
        return Play(source=source.strip(), loop=loop, interruptible=fields.flag("interruptible"),
                    preemptible=fields.flag("preemptible"))
    if kind == "sendDigits":
        digits = fields.text("digits", required=True, limit=64)
        assert digits is not None
        if not _DIGITS.fullmatch(digits):
            raise BotMessageError(f"sendDigits: {digits!r} is not a key sequence (0-9, *, #, "
                                  "A-D, and w for a half-second pause; 1 to 64 of them)")
        return SendDigits(digits)
    if kind == "language":
        tts, transcription = fields.lang("ttsLanguage"), fields.lang("transcriptionLanguage")
        if tts is None and transcription is None:
            raise BotMessageError("language: give 'ttsLanguage', 'transcriptionLanguage' or both")
        return Language(tts, transcription)
    if kind == "end":
        handoff = raw.get("handoffData")
        if isinstance(handoff, dict):
            # ConversationRelay documents a string holding JSON; an object says the same.
            handoff = json.dumps(handoff)
        if handoff is not None and not isinstance(handoff, str):
            raise BotMessageError("end: 'handoffData' must be a string (JSON text, by "
                                  f"convention), not {type(handoff).__name__}")
        return End(handoff)
    raise BotMessageError(f"unknown message type {kind[:40]!r} (a bot sends "
                          f"{', '.join(_TYPES)})")


class _Fields:
    """Typed reads of one message's fields, with errors that name the message and field."""

    def __init__(self, kind: str, raw: dict[str, Any]) -> None:
        self.kind = kind
        self.raw = raw

    def text(self, name: str, *, required: bool = False, limit: int) -> str | None:
        value = self.raw.get(name)
        if value is None:
            if required:
                raise BotMessageError(f"{self.kind}: '{name}' is required")
            return None
        if not isinstance(value, str):
            raise BotMessageError(f"{self.kind}: '{name}' must be a string, not "
                                  f"{type(value).__name__}")
        if len(value) > limit:
            raise BotMessageError(f"{self.kind}: '{name}' of {len(value)} characters is over "
                                  f"the limit of {limit}")
        return value

    def flag(self, name: str) -> bool | None:
        value = self.raw.get(name)
        if value is None or isinstance(value, bool):
            return value
        raise BotMessageError(f"{self.kind}: '{name}' must be true or false, not "
                              f"{json.dumps(value)[:40]}")

    def lang(self, name: str) -> str | None:
        value = self.text(name, limit=35)
        if value is not None and not _LANG.fullmatch(value):
            raise BotMessageError(f"{self.kind}: '{name}' {value!r} is not a language tag "
                                  "(en-US, es-MX)")
        return value


def _excerpt(data: str) -> str:
    return repr(data[:60]) + ("..." if len(data) > 60 else "")
