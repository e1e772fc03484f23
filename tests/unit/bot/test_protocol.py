"""ConversationRelay's messages (gateway.bot.protocol): what the gateway sends, byte for byte as a
bot written for ConversationRelay reads it; what it accepts; every way a bot's message can be
malformed, refused with a message that says what is wrong; any frame at all either parsed or
refused, never a crash; and the handshake signed as ConversationRelay signs it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twilio.request_validator import RequestValidator

from gateway.bot.protocol import (
    MAX_MESSAGE_BYTES,
    DtmfOut,
    End,
    ErrorOut,
    Interrupt,
    Language,
    Play,
    Prompt,
    SendDigits,
    Setup,
    Text,
    parse_message,
    signature,
)
from gateway.errors import BotMessageError


def test_what_the_gateway_sends_reads_as_conversation_relays_messages() -> None:
    setup = json.loads(Setup(session_id="VX1", call_sid="CA1", from_="+15550001111",
                             to="+15550002222", account_sid="AC1", call_type="SIP",
                             custom_parameters={"line": "acme"}).serialize())
    assert setup == {
        "type": "setup", "sessionId": "VX1", "callSid": "CA1", "parentCallSid": "",
        "from": "+15550001111", "to": "+15550002222", "forwardedFrom": "", "callerName": "",
        "direction": "inbound", "callType": "SIP", "callStatus": "IN-PROGRESS",
        "accountSid": "AC1", "customParameters": {"line": "acme"}}
    assert json.loads(Prompt("I need an agent", "en-US").serialize()) == {
        "type": "prompt", "voicePrompt": "I need an agent", "lang": "en-US", "last": True}
    assert json.loads(DtmfOut("5").serialize()) == {"type": "dtmf", "digit": "5"}
    # durationUntilInterruptMs as ConversationRelay's documented example writes it: a string.
    assert json.loads(Interrupt("Your balance is", 460).serialize()) == {
        "type": "interrupt", "utteranceUntilInterrupt": "Your balance is",
        "durationUntilInterruptMs": "460"}
    assert json.loads(ErrorOut("no").serialize()) == {"type": "error", "description": "no"}
    # Not ASCII-escaped: a bot reads "¿Qué?" as the caller said it.
    assert "¿Qué?" in Prompt("¿Qué?", "es-ES").serialize()


@pytest.mark.parametrize(("frame", "message"), [
    ('{"type":"text","token":"Hello","last":false}', Text("Hello")),
    ('{"type":"text","token":"","last":true}', Text("", last=True)),
    ('{"type":"text","token":"Hola","last":true,"lang":"es-MX","interruptible":false,'
     '"preemptible":true}', Text("Hola", True, "es-MX", False, True)),
    ('{"type":"text","token":"x","future":"ignored"}', Text("x")),
    ('{"type":"play","source":"https://example.com/a.mp3","loop":2,"preemptible":true}',
     Play("https://example.com/a.mp3", 2, None, True)),
    ('{"type":"play","source":"hold"}', Play("hold")),
    ('{"type":"sendDigits","digits":"9ww1234#"}', SendDigits("9ww1234#")),
    ('{"type":"language","ttsLanguage":"sv-SE","transcriptionLanguage":"en-US"}',
     Language("sv-SE", "en-US")),
    ('{"type":"language","ttsLanguage":"fr-FR"}', Language("fr-FR", None)),
    ('{"type":"end","handoffData":"{\\"reasonCode\\":\\"live-agent-handoff\\"}"}',
     End('{"reasonCode":"live-agent-handoff"}')),
    ('{"type":"end","handoffData":{"reasonCode":"x"}}', End('{"reasonCode": "x"}')),
    ('{"type":"end"}', End(None)),
])
def test_what_a_bot_sends_is_parsed(frame: str, message: object) -> None:
    assert parse_message(frame) == message


@pytest.mark.parametrize(("frame", "reason"), [
    (b'{"type":"text","token":"x"}', "binary frames are not messages"),
    ("", "not JSON"),
    ("{", "not JSON"),
    ("[" * 20_000, "not JSON"),
    ('"text"', "a JSON object"),
    ("{}", "needs a 'type'"),
    ('{"type": null}', "needs a 'type'"),
    ('{"type": "prompt"}', "unknown message type 'prompt'"),
    ('{"type": "Text", "token": "x"}', "unknown message type 'Text'"),
    ('{"type": "text"}', "text: 'token' is required"),
    ('{"type": "text", "token": ["a"]}', "'token' must be a string, not list"),
    ('{"type": "text", "token": "a", "last": 1}', "'last' must be true or false, not 1"),
    ('{"type": "text", "token": "a", "interruptible": "any"}',
     "'interruptible' must be true or false"),
    ('{"type": "text", "token": "a", "lang": "en US"}', "not a language tag"),
    ('{"type": "text", "token": "' + "a" * 5000 + '"}', "over the limit of 4000"),
    ('{"type": "play", "source": "  "}', "'source' is empty"),
    ('{"type": "play", "source": "a", "loop": 1.5}', "'loop' must be a whole number"),
    ('{"type": "play", "source": "a", "loop": true}', "'loop' must be a whole number"),
    ('{"type": "play", "source": "a", "loop": 101}', "'loop' must be a whole number"),
    ('{"type": "sendDigits"}', "'digits' is required"),
    ('{"type": "sendDigits", "digits": ""}', "not a key sequence"),
    ('{"type": "sendDigits", "digits": "12e"}', "not a key sequence"),
    ('{"type": "language", "ttsLanguage": 5}', "'ttsLanguage' must be a string"),
    ('{"type": "language"}', "give 'ttsLanguage', 'transcriptionLanguage' or both"),
    ('{"type": "end", "handoffData": [1]}', "'handoffData' must be a string"),
])
def test_a_malformed_message_is_refused_saying_what_is_wrong(frame: str | bytes,
                                                             reason: str) -> None:
    with pytest.raises(BotMessageError, match=None) as caught:
        parse_message(frame)
    assert reason in str(caught.value)


def test_a_message_over_the_limit_is_refused_unread() -> None:
    frame = json.dumps({"type": "end", "handoffData": "x" * MAX_MESSAGE_BYTES})
    with pytest.raises(BotMessageError, match="over the limit"):
        parse_message(frame)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda children: st.lists(children, max_size=3)
                     | st.dictionaries(st.text(max_size=12), children, max_size=4), max_leaves=8)
_messages = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "play", "sendDigits", "language", "end", "x"])},
    optional={"token": _json, "last": _json, "lang": _json, "interruptible": _json,
              "preemptible": _json, "source": _json, "loop": _json, "digits": _json,
              "ttsLanguage": _json, "transcriptionLanguage": _json, "handoffData": _json})


@settings(max_examples=400, deadline=None)
@given(st.one_of(_messages.map(json.dumps), st.text(max_size=200),
                 st.binary(max_size=64), _json.map(json.dumps)))
def test_any_frame_is_parsed_or_refused_never_a_crash(frame: str | bytes) -> None:
    try:
        message = parse_message(frame)
    except BotMessageError as exc:
        assert str(exc)
    else:
        assert isinstance(message, (Text, Play, SendDigits, Language, End))


def test_the_handshake_is_signed_as_conversation_relay_signs_it() -> None:
    url = "wss://bot.example.com/relay?tenant=acme"
    token = "0123456789abcdef0123456789abcdef"
    assert RequestValidator(token).validate(url, {}, signature(url, token))
    assert not RequestValidator("another-token").validate(url, {}, signature(url, token))
