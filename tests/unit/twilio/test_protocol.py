"""The sans-I/O Media Streams protocol: golden samples, state machine, rejections, fuzzing."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import (
    CallProtocolError,
    InvalidMessage,
    MessageTooLarge,
    ProtocolViolation,
    UnsupportedData,
)
from gateway.twilio.protocol import (
    Connected,
    Dtmf,
    Mark,
    Media,
    MediaStreamProtocol,
    OutboundClear,
    OutboundMark,
    OutboundMedia,
    Start,
    Stop,
    StreamState,
)
from tests.support.paths import GOLDEN as GOLDEN_ROOT

GOLDEN = GOLDEN_ROOT / "twilio"
SID = "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"


def golden(name: str) -> str:
    return (GOLDEN / f"{name}.json").read_text()


def started() -> MediaStreamProtocol:
    protocol = MediaStreamProtocol()
    protocol.receive(golden("connected"))
    protocol.receive(golden("start"))
    return protocol


def test_golden_inbound_sequence_parses_into_typed_events() -> None:
    protocol = MediaStreamProtocol()
    connected = protocol.receive(golden("connected"))
    assert isinstance(connected, Connected) and connected.version == "1.0.0"

    start = protocol.receive(golden("start"))
    assert isinstance(start, Start)
    assert start.start.callSid == "CAXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
    assert start.start.mediaFormat.encoding == "audio/x-mulaw"
    assert start.start.mediaFormat.sampleRate == 8000
    assert start.start.customParameters == {
        "FirstName": "Jane", "LastName": "Doe", "RemoteParty": "Bob"
    }
    assert protocol.state is StreamState.STREAMING and protocol.stream_sid == SID

    media = protocol.receive(golden("media"))
    assert isinstance(media, Media)
    payload = json.loads(golden("media"))["media"]["payload"]
    assert media.audio == base64.b64decode(payload) and len(media.audio) == 1024

    dtmf = protocol.receive(golden("dtmf"))
    assert isinstance(dtmf, Dtmf) and dtmf.dtmf.digit == "1"

    mark = protocol.receive(golden("mark"))
    assert isinstance(mark, Mark) and mark.mark.name == "my label"

    stop = protocol.receive(golden("stop"))
    assert isinstance(stop, Stop) and stop.stop.callSid.startswith("CA")
    assert protocol.state is StreamState.STOPPED


def test_a_well_formed_media_message_is_read_without_pydantic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-frame path: the golden media message, and ours in the other key order the load
    simulator sends, are read by the stdlib parser. Anything unusual still goes through the full
    validation: an extra field is accepted there, a bad payload rejected with its reason."""
    import gateway.twilio.protocol as module

    protocol = started()
    full = module._INBOUND
    calls: list[str] = []

    class Counting:
        def validate_json(self, data: str) -> object:
            calls.append(data)
            return full.validate_json(data)

    monkeypatch.setattr(module, "_INBOUND", Counting())
    golden_media = golden("media")
    payload = json.loads(golden_media)["media"]["payload"]
    reordered = json.dumps({"event": "media", "streamSid": SID, "media": {
        "track": "inbound", "chunk": "2", "timestamp": "25", "payload": payload},
        "sequenceNumber": "4"}, separators=(",", ":"))
    for text in (golden_media, reordered):
        media = protocol.receive(text)
        assert isinstance(media, Media) and media.audio == base64.b64decode(payload)
        assert media.streamSid == SID and media.track == "inbound"
    assert calls == []
    extra = json.dumps({**json.loads(reordered), "futureField": {"x": 1}})
    assert protocol.receive(extra) == protocol.receive(reordered)
    assert calls == [extra]
    broken = reordered.replace(payload[:8], "!!!!!!!!")
    with pytest.raises(InvalidMessage, match="not valid base64"):
        protocol.receive(broken)
    other_stream = reordered.replace(SID, "MZ" + "0" * 32)
    with pytest.raises(ProtocolViolation, match="unknown streamSid"):
        protocol.receive(other_stream)
    assert calls == [extra, broken, other_stream]


@pytest.mark.parametrize("name", ["outbound_mark", "outbound_clear"])
def test_outbound_messages_match_the_documented_shape(name: str) -> None:
    protocol = started()
    expected = json.loads(golden(name))
    message = OutboundMark("my label") if name == "outbound_mark" else OutboundClear()
    assert json.loads(protocol.send(message)) == expected


def test_outbound_media_round_trips_payload_bytes() -> None:
    protocol = started()
    frame = bytes(range(160))
    sent = json.loads(protocol.send(OutboundMedia(frame)))
    shape = json.loads(golden("outbound_media"))
    assert sent.keys() == shape.keys() and sent["media"].keys() == shape["media"].keys()
    assert sent["event"] == "media" and sent["streamSid"] == SID
    assert base64.b64decode(sent["media"]["payload"]) == frame
    assert protocol.media_text(frame) == protocol.send(OutboundMedia(frame))


def test_mark_names_are_json_escaped() -> None:
    protocol = started()
    text = protocol.send(OutboundMark('a"b\\c'))
    assert json.loads(text)["mark"]["name"] == 'a"b\\c'


def test_send_before_start_is_refused() -> None:
    with pytest.raises(ProtocolViolation):
        MediaStreamProtocol().send(OutboundClear())


def _media(sid: str = SID, payload: str = "//8=") -> str:
    return json.dumps({"event": "media", "streamSid": sid, "media": {"payload": payload}})


@pytest.mark.parametrize(
    ("setup", "message", "error", "reason"),
    [
        ("fresh", "{not json", InvalidMessage, "not valid JSON"),
        ("fresh", "[1, 2]", InvalidMessage, "not a JSON object"),
        ("fresh", '{"event": "hello"}', InvalidMessage, "unknown event 'hello'"),
        ("fresh", '{"protocol": "Call"}', InvalidMessage, "no 'event' field"),
        ("started", _media(payload="@@@@"), InvalidMessage, "not valid base64"),
        ("started", _media(payload="AAA"), InvalidMessage, "not valid base64"),
        ("started", json.dumps({"event": "media", "streamSid": SID, "media": {}}),
         InvalidMessage, "media.media.payload"),
        ("started", json.dumps({"event": "dtmf", "streamSid": SID, "dtmf": {"digit": "x"}}),
         InvalidMessage, "not a DTMF key"),
        ("fresh", _media(), ProtocolViolation, "'media' before 'start'"),
        ("started", golden("start"), ProtocolViolation, "second 'start'"),
        ("started", _media(sid="MZunknown"), ProtocolViolation, "unknown streamSid"),
        ("fresh", golden("start").replace("audio/x-mulaw", "audio/l16"), ProtocolViolation,
         "unsupported mediaFormat"),
        ("fresh", golden("start").replace('"sampleRate": 8000', '"sampleRate": 16000'),
         ProtocolViolation, "unsupported mediaFormat"),
        ("fresh", b'{"event": "connected"}', UnsupportedData, "binary frame"),
    ],
)
def test_malformed_input_is_rejected_with_a_specific_error(
    setup: str, message: str | bytes, error: type[CallProtocolError], reason: str
) -> None:
    protocol = started() if setup == "started" else MediaStreamProtocol()
    with pytest.raises(error) as info:
        protocol.receive(message)
    assert reason in info.value.reason
    assert info.value.close_code == error.close_code


def test_oversize_message_is_rejected_before_parsing() -> None:
    protocol = started()
    big = _media(payload=base64.b64encode(b"\xff" * 60_000).decode())
    assert len(big) > 64 * 1024
    with pytest.raises(MessageTooLarge) as info:
        protocol.receive(big)
    assert info.value.close_code == 1009
    # A message just under the limit is fine.
    ok = _media(payload=base64.b64encode(b"\xff" * 48_000).decode())
    assert isinstance(protocol.receive(ok), Media)


def test_multibyte_text_counts_bytes_not_characters() -> None:
    protocol = MediaStreamProtocol(max_message_bytes=4096)
    text = json.dumps({"event": "connected", "protocol": "é" * 2100}, ensure_ascii=False)
    assert len(text) < 4096 < len(text.encode())
    with pytest.raises(MessageTooLarge):
        protocol.receive(text)


def test_close_codes_follow_rfc6455() -> None:
    assert MessageTooLarge.close_code == 1009
    assert UnsupportedData.close_code == 1003
    assert InvalidMessage.close_code == 1007
    assert ProtocolViolation.close_code == 1008


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.text(max_size=300),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda children: st.lists(children, max_size=4)
            | st.dictionaries(
                st.sampled_from(["event", "streamSid", "media", "payload", "start", "dtmf",
                                 "digit", "mark", "name", "stop", "mediaFormat"]),
                children,
                max_size=5,
            ),
            max_leaves=12,
        ).map(json.dumps),
    )
)
def test_any_input_is_parsed_or_rejected_with_the_documented_error(data: str) -> None:
    protocol = started()
    try:
        event = protocol.receive(data)
    except CallProtocolError as exc:
        assert exc.reason and exc.close_code in (1003, 1007, 1008, 1009)
    else:
        assert isinstance(event, (Connected, Start, Media, Dtmf, Mark, Stop))
