"""SDP parsing (RFC 4566) and offer/answer (RFC 3264): baresip's offer, codec choice, holds,
rejected streams, strictness, fuzzing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import GatewayError
from gateway.sip.message import parse_message
from gateway.sip.sdp import (
    MAX_SDP_BYTES,
    Answer,
    Connection,
    RtpMap,
    SdpError,
    SessionDescription,
    negotiate,
    parse_sdp,
)
from tests.support.paths import GOLDEN as GOLDEN_ROOT

GOLDEN = GOLDEN_ROOT / "sip"


def body_of(name: str) -> bytes:
    return parse_message((GOLDEN / name).read_bytes()).body


BARESIP_OFFER = body_of("invite_baresip.sip")


def sdp(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n").encode()


def offer(*media_lines: str, session: tuple[str, ...] = ("c=IN IP4 192.0.2.7",)) -> bytes:
    return sdp("v=0", "o=alice 2890844526 2890844526 IN IP4 192.0.2.7", "s=call", *session,
               "t=0 0", *media_lines)


def answer(data: bytes, **kwargs: object) -> Answer:
    params: dict[str, object] = dict(local_ip="203.0.113.5", local_port=20000, session_id=4126)
    params.update(kwargs)
    return negotiate(parse_sdp(data), **params)  # type: ignore[arg-type]


def m_lines(data: bytes) -> list[str]:
    return [line for line in data.decode().split("\r\n") if line.startswith("m=")]


# --- baresip and codec choice ------------------------------------------------------------------


def test_baresip_offer_parses() -> None:
    session = parse_sdp(BARESIP_OFFER)
    assert session.origin.username == "-" and session.origin.session_id == 3836531907
    assert session.origin.address == "127.0.0.1"
    assert session.connection == Connection("127.0.0.1", "IP4")
    (audio,) = session.media
    assert (audio.kind, audio.port, audio.proto) == ("audio", 16008, "RTP/AVP")
    assert audio.formats == [0, 101]
    assert audio.rtpmap == {0: RtpMap("PCMU", 8000), 101: RtpMap("telephone-event", 8000)}
    assert audio.fmtp == {101: "0-15"}
    assert audio.ptime == 20 and audio.direction == "sendrecv"
    assert ("rtcp-rsize", None) in audio.attributes
    assert SessionDescription.parse(BARESIP_OFFER) == session


def test_baresip_offer_gets_a_pcmu_answer_echoing_telephone_event_101() -> None:
    result = answer(BARESIP_OFFER, local_ip="127.0.0.1")
    assert (result.codec, result.payload_type, result.telephone_event_pt) == ("PCMU", 0, 101)
    assert result.remote_rtp == ("127.0.0.1", 16008)
    assert result.direction == "sendrecv" and not result.on_hold
    assert result.remote_ptime == 20
    assert result.sdp == sdp(
        "v=0",
        "o=- 4126 1 IN IP4 127.0.0.1",
        "s=-",
        "c=IN IP4 127.0.0.1",
        "t=0 0",
        "m=audio 20000 RTP/AVP 0 101",
        "a=rtpmap:0 PCMU/8000",
        "a=rtpmap:101 telephone-event/8000",
        "a=fmtp:101 0-15",
        "a=ptime:20",
        "a=sendrecv",
    )
    # Our answer is itself valid SDP that a re-offer round would accept.
    again = answer(result.sdp)
    assert (again.codec, again.telephone_event_pt) == ("PCMU", 101)


def test_offer_order_wins_pcma_first() -> None:
    result = answer(offer("m=audio 4000 RTP/AVP 8 0 101", "a=rtpmap:101 telephone-event/8000"))
    assert (result.codec, result.payload_type) == ("PCMA", 8)
    assert m_lines(result.sdp) == ["m=audio 20000 RTP/AVP 8 101"]
    assert b"a=rtpmap:8 PCMA/8000\r\n" in result.sdp
    only_pcmu = answer(offer("m=audio 4000 RTP/AVP 8 0"), codecs=("PCMU",))
    assert only_pcmu.codec == "PCMU" and b"telephone-event" not in only_pcmu.sdp


def test_g729_only_is_488_with_a_clear_message() -> None:
    with pytest.raises(SdpError) as info:
        answer(offer("m=audio 4000 RTP/AVP 18 101", "a=rtpmap:101 telephone-event/8000"))
    assert info.value.status == 488 and isinstance(info.value, GatewayError)
    message = str(info.value)
    assert message.startswith("no common codec: offer has G729/8000, telephone-event/8000")
    assert "we speak PCMU, PCMA" in message


def test_no_audio_or_only_unusable_audio_is_488() -> None:
    cases = [
        offer("m=video 5000 RTP/AVP 31"),
        offer("m=audio 0 RTP/AVP 0"),  # already rejected stream
        offer("m=audio 4000 RTP/SAVP 0"),  # SRTP: we do plain RTP only
        offer("m=audio 4000 RTP/AVP 0", "a=rtpmap:0 PCMU/16000"),  # wrong clock rate
    ]
    for data in cases:
        with pytest.raises(SdpError) as info:
            answer(data)
        assert info.value.status == 488


def test_dynamic_payload_type_for_pcmu_is_echoed() -> None:
    result = answer(offer("m=audio 4000 RTP/AVP 96 97", "a=rtpmap:96 pcmu/8000",
                          "a=rtpmap:97 telephone-event/16000"))
    # RFC 3264 6.1: the answer uses the offer's payload type numbers.
    assert (result.codec, result.payload_type) == ("PCMU", 96)
    assert result.telephone_event_pt is None  # only an 8 kHz telephone-event matches G.711
    assert b"a=rtpmap:96 pcmu/8000\r\n" in result.sdp


def test_non_audio_streams_are_rejected_with_port_0_and_kept_in_order() -> None:
    data = offer(
        "m=video 5000 RTP/AVP 31 34",
        "a=rtpmap:31 H261/90000",
        "m=audio 4000 RTP/AVP 0",
        "m=application 5002 UDP/BFCP *",
        "m=audio 4002 RTP/AVP 0",
    )
    result = answer(data)
    # RFC 3264 6: same number of m-lines, rejected ones with port 0.
    assert m_lines(result.sdp) == [
        "m=video 0 RTP/AVP 31 34",
        "m=audio 20000 RTP/AVP 0",
        "m=application 0 UDP/BFCP *",
        "m=audio 0 RTP/AVP 0",
    ]
    assert result.remote_rtp == ("192.0.2.7", 4000)
    parsed = parse_sdp(result.sdp)
    assert [m.port for m in parsed.media] == [0, 20000, 0, 0]


def test_rfc4475_wsinv_offer() -> None:
    # a=rtpmap:31 LPC (no clock rate) is tolerated; the video stream is rejected.
    result = answer(body_of("torture_wsinv.sip"))
    assert (result.codec, result.remote_rtp) == ("PCMU", ("192.0.2.4", 49217))
    assert m_lines(result.sdp) == ["m=audio 20000 RTP/AVP 0", "m=video 0 RTP/AVP 31"]


# --- direction and hold ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attribute", "direction", "on_hold"),
    [
        ("a=sendrecv", "sendrecv", False),
        ("a=sendonly", "recvonly", True),
        ("a=inactive", "inactive", True),
        ("a=recvonly", "sendonly", False),
    ],
)
def test_direction_is_mirrored(attribute: str, direction: str, on_hold: bool) -> None:
    result = answer(offer("m=audio 4000 RTP/AVP 0", attribute))
    assert (result.direction, result.on_hold) == (direction, on_hold)
    assert f"a={direction}\r\n".encode() in result.sdp


def test_rfc2543_hold_with_null_connection_address() -> None:
    # RFC 3264 8.4: c=0.0.0.0 means nothing is to be sent to the peer.
    result = answer(offer("m=audio 4000 RTP/AVP 0", session=("c=IN IP4 0.0.0.0",)))
    assert result.on_hold and result.remote_rtp == ("0.0.0.0", 4000)
    assert result.direction == "recvonly"
    held = answer(offer("m=audio 4000 RTP/AVP 0", "a=recvonly",
                        session=("c=IN IP4 0.0.0.0",)))
    assert held.direction == "inactive"


def test_media_level_connection_and_direction_override_session_level() -> None:
    data = offer(
        "m=audio 4000 RTP/AVP 0",
        "c=IN IP4 198.51.100.9",
        "a=sendrecv",
        "m=video 5000 RTP/AVP 31",
        session=("c=IN IP4 0.0.0.0", "a=sendonly"),
    )
    session = parse_sdp(data)
    assert session.direction == "sendonly"
    audio, video = session.media
    assert audio.connection == Connection("198.51.100.9") and audio.direction == "sendrecv"
    assert video.connection == Connection("0.0.0.0") and video.direction == "sendonly"
    result = negotiate(session, local_ip="203.0.113.5", local_port=20000, session_id=1)
    assert result.remote_rtp == ("198.51.100.9", 4000)
    assert result.direction == "sendrecv" and not result.on_hold

    inherited = answer(offer("m=audio 4000 RTP/AVP 0", session=("c=IN IP4 192.0.2.7",
                                                                  "a=sendonly")))
    assert inherited.direction == "recvonly" and inherited.on_hold


def test_ipv6_and_missing_connection() -> None:
    v6 = answer(offer("m=audio 4000 RTP/AVP 0", session=("c=IN IP6 2001:db8::7",)),
                local_ip="2001:db8::1")
    assert v6.remote_rtp == ("2001:db8::7", 4000)
    assert b"c=IN IP6 2001:db8::1\r\n" in v6.sdp and b"IN IP6 2001:db8::1\r\n" in v6.sdp
    with pytest.raises(SdpError) as info:
        answer(offer("m=audio 4000 RTP/AVP 0", session=()))
    assert info.value.status == 400 and "c=" in str(info.value)


def test_session_id_version_and_ptime_go_into_the_answer() -> None:
    result = answer(BARESIP_OFFER, session_id=77, version=3, ptime=30)
    assert b"o=- 77 3 IN IP4 203.0.113.5\r\n" in result.sdp
    assert b"a=ptime:30\r\n" in result.sdp and result.ptime == 30


# --- parser strictness -------------------------------------------------------------------------


def test_parser_tolerates_lf_unknown_lines_and_attributes() -> None:
    text = ("v=0\no=- 1 2 IN IP4 10.0.0.1\ns=-\ni=info\nu=http://x\nb=AS:64\nt=0 0\n"
            "a=group:BUNDLE 0\na=ice-ufrag:abc\nm=audio 4000/2 RTP/AVP 0 8\n"
            "c=IN IP4 224.2.1.1/127/3\na=rtcp:4001\na=x-unknown\na=ptime:20.5\n"
            "a=fmtp:8 whatever=1\na=rtpmap:8 bad\n\n")
    session = parse_sdp(text)
    (audio,) = session.media
    assert audio.port_count == 2 and audio.connection == Connection("224.2.1.1")
    assert audio.ptime == 20 and audio.fmtp == {8: "whatever=1"}
    assert audio.rtpmap[8] == RtpMap("PCMA", 8000)  # malformed rtpmap ignored, static type kept
    assert ("group", "BUNDLE 0") in session.attributes
    assert ("x-unknown", None) in audio.attributes


@pytest.mark.parametrize(
    ("data", "status", "words"),
    [
        (b"", 400, "empty"),
        (b"o=- 1 1 IN IP4 1.2.3.4\r\n", 400, "v=0"),
        (b"v=1\r\no=- 1 1 IN IP4 1.2.3.4\r\n", 400, "v=0"),
        (b"v=0\r\ns=-\r\n", 400, "o="),
        (b"v=0\r\no=- 1 1 IN IP4 1.2.3.4\r\nm = audio 4000 RTP/AVP 0\r\n", 400, "<type>="),
        (b"v=0\r\no=- 1 1 IN IP4 1.2.3.4\r\nno equals sign\r\n", 400, "<type>="),
        (b"v=0\r\no=- 1 1 IN IP4 1.2.3.4\r\nM=audio 4000 RTP/AVP 0\r\n", 400, "<type>="),
        (b"v=0\r\no=- 1 1 IN IP4 1.2.3.4\r\n\r\nm=audio 4000 RTP/AVP 0\r\n", 400, "line 3"),
        (b"v=0\r\no=- x 1 IN IP4 1.2.3.4\r\n", 400, "numbers"),
        (b"v=0\r\no=- 1 1 IN\r\n", 400, "o="),
        (b"v=0\r\no=- 1 1 IN IP4 h\r\nc=IN IPX 1.2.3.4\r\n", 400, "c=IN"),
        (b"v=0\r\no=- 1 1 IN IP4 h\r\nm=audio 70000 RTP/AVP 0\r\n", 400, "port"),
        (b"v=0\r\no=- 1 1 IN IP4 h\r\nm=audio 4000 RTP/AVP\r\n", 400, "m="),
        (b"v=0\r\no=- 1 1 IN IP4 h\r\nm=audio 4000 RTP/AVP 0 128\r\n", 400, "0-127"),
        (b"v=0\r\no=- 1 1 IN IP4 h\r\nm=audio 4000 RTP/AVP PCMU\r\n", 400, "0-127"),
        (b"v=0\r\no=- 1 1 IN IP4 h\r\na=\r\n", 400, "attribute"),
        (b"v=0\r\no=- 1 1 IN IP4 h\r\ns=caf\xe9\r\n", 400, "UTF-8"),
        (b"v=0\r\no=- 1 1 IN IP4 h\r\ns=a\x00b\r\n", 400, "control"),
        (b"v=0\r\nv=0\r\n", 400, "second v="),
        (b"v=0\r\n" + b"a=x\r\n" * 600, 413, "lines"),
        (b"v=0\r\n" + b"a=" + b"x" * MAX_SDP_BYTES + b"\r\n", 413, "bytes"),
    ],
)
def test_malformed_sdp_is_400_and_oversized_413(data: bytes, status: int, words: str) -> None:
    with pytest.raises(SdpError) as info:
        parse_sdp(data)
    assert info.value.status == status
    assert words in str(info.value)


def test_str_input_and_size_limit_on_text() -> None:
    assert parse_sdp(BARESIP_OFFER.decode()).media[0].port == 16008
    with pytest.raises(SdpError) as info:
        parse_sdp("v=0\r\na=" + "é" * MAX_SDP_BYTES)
    assert info.value.status == 413


# --- fuzzing -----------------------------------------------------------------------------------

_OFFER_LINES = [
    *BARESIP_OFFER.decode().split("\r\n")[:-1],
    "m=video 5000 RTP/AVP 31", "a=sendonly", "a=inactive", "c=IN IP4 0.0.0.0",
    "m=audio 4002 RTP/AVP 8 0 96", "a=rtpmap:96 telephone-event/8000", "c=IN IP6 ::1",
    "a=rtpmap:0 PCMU", "a=ptime:x", "m=audio 0 RTP/AVP 0", "m=message 7394 TCP/MSRP *",
]


@st.composite
def offer_like(draw: st.DrawFn) -> str:
    lines = draw(st.lists(st.sampled_from(_OFFER_LINES) | st.text(max_size=20), max_size=20))
    head = draw(st.sampled_from([["v=0", "o=- 1 1 IN IP4 1.2.3.4"], ["v=0"], []]))
    return draw(st.sampled_from(["\r\n", "\n"])).join(head + lines)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300), offer_like()))
def test_any_text_parses_or_raises_sdperror(data: str | bytes) -> None:
    try:
        session = parse_sdp(data)
    except SdpError as exc:
        assert exc.status in (400, 413) and str(exc)
        return
    try:
        result = negotiate(session, local_ip="192.0.2.1", local_port=30000, session_id=9)
    except SdpError as exc:
        assert exc.status in (400, 488) and str(exc)
        return
    # Every answer we write parses back with the same number of m-lines (RFC 3264 6).
    assert len(parse_sdp(result.sdp).media) == len(session.media)
    assert result.codec in ("PCMU", "PCMA")
