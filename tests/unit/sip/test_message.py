"""SIP message codec: golden captures, RFC 4475 torture cases, rejections, helpers, fuzzing."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import GatewayError
from gateway.sip.message import (
    Headers,
    NameAddr,
    SipKeepalive,
    SipParseError,
    SipRequest,
    SipResponse,
    Via,
    build_request,
    new_branch,
    new_call_id,
    new_tag,
    parse_cseq,
    parse_message,
    parse_name_addr,
    parse_via,
    reason_phrase,
    response_to,
    stamp_via,
)
from tests.support.paths import GOLDEN as GOLDEN_ROOT
from tests.support.sip_messages import assert_round_trips

GOLDEN = GOLDEN_ROOT / "sip"
GOLDEN_FILES = sorted(p.name for p in GOLDEN.glob("*.sip"))

#: Examples for the any-bytes fuzz test; SIP_FUZZ_EXAMPLES=100000 for a long soak.
FUZZ_EXAMPLES = int(os.environ.get("SIP_FUZZ_EXAMPLES", "2000"))


def golden(name: str) -> bytes:
    return (GOLDEN / name).read_bytes()


def base_request(*, drop: str = "", extra: str = "", method: str = "INVITE",
                 cseq_method: str | None = None, version: str = "SIP/2.0",
                 body: bytes = b"", length: int | None = None) -> bytes:
    """A minimal valid request with knobs to break it one way at a time."""
    rows = [
        ("Via", "SIP/2.0/UDP 192.0.2.10:5060;branch=z9hG4bK776asdhds;rport"),
        ("Max-Forwards", "70"),
        ("To", "<sip:ivr@gw.example.com>"),
        ("From", '"Caller" <sip:caller@example.com>;tag=1928301774'),
        ("Call-ID", "a84b4c76e66710@pc33.example.com"),
        ("CSeq", f"314159 {cseq_method or method}"),
    ]
    lines = [f"{method} sip:ivr@gw.example.com {version}"]
    lines += [f"{n}: {v}" for n, v in rows if n != drop]
    if extra:
        lines.append(extra)
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# --- golden captures ---------------------------------------------------------------------------

EXPECTED: dict[str, dict[str, Any]] = {
    "invite_baresip.sip": dict(
        method="INVITE", uri="sip:ivr@127.0.0.1:5080", call_id="8d3b0e6f1c2a4b5d",
        cseq=(13624, "INVITE"), from_tag="5b1a2f8e03c47d69", to_tag=None,
        branches=["z9hG4bK8f6c1d2e7a4b3c59"], body_start=b"v=0\r\no=- 3836531907", body_len=231,
    ),
    "invite_compact_folded.sip": dict(
        method="INVITE", uri="sip:ivr@gw.example.com",
        call_id="a84b4c76e66710@pc33.biloxi.example.com", cseq=(314159, "INVITE"),
        from_tag="a6c85cf", to_tag=None,
        branches=["z9hG4bK2d4790.1", "z9hG4bK77ef4c2312983.1", "z9hG4bKnashds8"],
        body_start=b"v=0\r\n", body_len=233,
    ),
    "bye.sip": dict(
        method="BYE", uri="sip:tester-0x5581c3a0@127.0.0.1:5062", call_id="8d3b0e6f1c2a4b5d",
        cseq=(13625, "BYE"), from_tag="5b1a2f8e03c47d69", to_tag="4f2a9c1e88b07d35",
        branches=["z9hG4bK3e9a77c1f0d24b18"], body_len=0,
    ),
    "cancel.sip": dict(
        method="CANCEL", uri="sip:ivr@127.0.0.1:5080", call_id="8d3b0e6f1c2a4b5d",
        cseq=(13624, "CANCEL"), from_tag="5b1a2f8e03c47d69", to_tag=None,
        branches=["z9hG4bK8f6c1d2e7a4b3c59"], body_len=0,
    ),
    "ack.sip": dict(
        method="ACK", uri="sip:ivr@127.0.0.1:5080", call_id="8d3b0e6f1c2a4b5d",
        cseq=(13624, "ACK"), from_tag="5b1a2f8e03c47d69", to_tag="4f2a9c1e88b07d35",
        branches=["z9hG4bK0c6d5e4f3a2b1908"], body_len=0,
    ),
    "options_lf.sip": dict(
        method="OPTIONS", uri="sip:ivr@127.0.0.1:5080", call_id="1-2811@127.0.0.1",
        cseq=(1, "OPTIONS"), from_tag="2811SIPpTag001", to_tag=None,
        branches=["z9hG4bK-2811-1-0"], body_len=0,
    ),
    "response_200_ok.sip": dict(
        status=200, reason="OK", call_id="a84b4c76e66710@pc33.biloxi.example.com",
        cseq=(314159, "INVITE"), from_tag="a6c85cf", to_tag="4f2a9c1e88b07d35",
        branches=["z9hG4bK2d4790.1", "z9hG4bK77ef4c2312983.1", "z9hG4bKnashds8"],
        body_start=b"v=0\r\n", body_len=193,
    ),
    "torture_wsinv.sip": dict(
        method="INVITE", uri="sip:vivekg@chair-dnrc.example.com;unknownparam",
        call_id="wsinv.ndaksdj@192.0.2.1", cseq=(9, "INVITE"), from_tag="98asjd8",
        to_tag="1918181833n", branches=["390skdjuw", "z9hG4bK9ikj8", "z9hG4bK30239"],
        body_start=b"v=0\r\n", body_len=150,
    ),
    "torture_intmeth.sip": dict(
        method="!interesting-Method0123456789_*+`.%indeed'~",
        uri=("sip:1_unusual.URI~(to-be!sure)&isn't+it$/crazy?,/;;*:&it+has=1,weird!*pas$wo~d_too"
             ".(doesn't-it)@example.com"),
        call_id="intmeth.word%ZK-!.*_+'@word`~)(><:\\/\"][?}{",
        cseq=(139122385, "!interesting-Method0123456789_*+`.%indeed'~"),
        from_tag="_token~1'+`*%!-.", to_tag=None, branches=["z9hG4bK-.!%66*_+`'~"], body_len=0,
    ),
    "torture_esc01.sip": dict(
        method="INVITE", uri="sip:sips%3Auser%40example.com@example.net",
        call_id="esc01.239409asdfakjkn23onasd0-3234", cseq=(234234, "INVITE"), from_tag="938",
        to_tag=None, branches=["z9hG4bKkdjuw"], body_start=b"v=0\r\n", body_len=105,
    ),
    "torture_lwsdisp.sip": dict(
        method="OPTIONS", uri="sip:user@example.com", call_id="lwsdisp.1234abcd@funky.example.com",
        cseq=(60, "OPTIONS"), from_tag="323", to_tag=None, branches=["z9hG4bKkdjuw"], body_len=0,
    ),
    "torture_longreq.sip": dict(
        method="INVITE", uri="sip:user@example.com", call_id="longreq.one" + "x" * 500,
        cseq=(3882340, "INVITE"), from_tag="12982424", to_tag=None,
        branches=[f"z9hG4bKkdj.{i}" for i in range(1, 41)], body_len=105,
    ),
    "torture_dblreq.sip": dict(
        method="REGISTER", uri="sip:example.com",
        call_id="dblreq.0ha0isndaksdj99sdfafnl3lk233412", cseq=(8, "REGISTER"),
        from_tag="43251j3j324", to_tag=None, branches=["z9hG4bKkdjuw23492"], body_len=0,
    ),
    "torture_transports.sip": dict(
        method="OPTIONS", uri="sip:user@example.com", call_id="transports.kijh4akdnaqjkwendsasfdj",
        cseq=(60, "OPTIONS"), from_tag="323", to_tag=None,
        branches=["z9hG4bKkdjuw", "z9hG4bKklasjdhf", "z9hG4bK2980unddj", "z9hG4bKasd0f3en",
                  "z9hG4bK0a9idfnee"],
        body_len=0,
    ),
    "torture_unreason.sip": dict(
        status=200, reason="= 2**3 * 5**2 но сто девяносто девять - простое",
        call_id="unreason.1234ksdfak3j2erwedfsASdf", cseq=(35, "INVITE"), from_tag="11141343",
        to_tag="2229", branches=["z9hG4bK1324923"], body_start=b"v=0\r\n", body_len=109,
    ),
    "torture_noreason.sip": dict(
        status=100, reason="", call_id="noreason.asndj203insdf99223ndf", cseq=(35, "INVITE"),
        from_tag="39ansfi3", to_tag="902jndnke3", branches=["z9hG4bK2398ndaoe"], body_len=0,
    ),
}


def test_every_golden_file_has_expectations() -> None:
    assert set(GOLDEN_FILES) == set(EXPECTED)


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_golden_parses_to_the_expected_fields(name: str) -> None:
    expected = EXPECTED[name]
    message = parse_message(golden(name))
    if "method" in expected:
        assert isinstance(message, SipRequest)
        assert message.method == expected["method"]
        assert message.uri == expected["uri"]
    else:
        assert isinstance(message, SipResponse)
        assert message.status == expected["status"]
        assert message.reason == expected["reason"]
    assert message.call_id == expected["call_id"]
    assert message.cseq == expected["cseq"]
    assert message.from_tag == expected["from_tag"]
    assert message.to_tag == expected["to_tag"]
    assert [via.branch for via in message.via] == expected["branches"]
    assert message.top_via_branch == expected["branches"][0]
    assert len(message.body) == expected["body_len"]
    assert message.body.startswith(expected.get("body_start", b""))


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_golden_round_trips(name: str) -> None:
    assert_round_trips(parse_message(golden(name)))


def test_baresip_invite_details() -> None:
    invite = parse_message(golden("invite_baresip.sip"))
    assert isinstance(invite, SipRequest)
    assert invite.content_type == "application/sdp"
    assert invite.headers.get_all("Allow") == [
        "INVITE", "ACK", "BYE", "CANCEL", "OPTIONS", "NOTIFY", "SUBSCRIBE", "INFO", "MESSAGE",
        "UPDATE",
    ]
    assert invite.headers.get_all("Supported") == ["replaces", "norefersub"]
    via = invite.top_via
    assert (via.transport, via.host, via.port) == ("UDP", "127.0.0.1", 5062)
    assert via.has_rport and via.rport is None
    contact = parse_name_addr(invite.headers.get("Contact") or "")
    assert contact.uri == "sip:tester-0x5581c3a0@127.0.0.1:5062" and contact.display is None
    assert b"a=rtpmap:101 telephone-event/8000\r\n" in invite.body


def test_compact_forms_folding_and_multiple_via() -> None:
    invite = parse_message(golden("invite_compact_folded.sip"))
    names = [name for name, _ in invite.headers]
    # Compact names expand to canonical ones (RFC 3261 7.3.3).
    assert names == [
        "Via", "Via", "Max-Forwards", "From", "To", "Call-ID", "CSeq", "Contact", "Subject",
        "Supported", "Content-Type", "Content-Length",
    ]
    # Two Via rows, the second comma-joined and folded: three Vias, in order.
    assert len(invite.headers.rows("Via")) == 2
    vias = invite.via
    assert [(v.host, v.port) for v in vias] == [
        ("proxy2.example.com", 5060), ("proxy1.example.com", None), ("192.0.2.10", 5060),
    ]
    assert vias[0].received == "198.51.100.7" and vias[2].rport == 5060
    # Folded values unfold to one line with a single SP at each fold (RFC 3261 7.3.1).
    assert invite.headers.get("Subject") == "A subject that goes on and continues on a folded line"
    from_ = parse_name_addr(invite.headers.get("f") or "")
    assert from_.display == 'Bob Smith, "the builder"'
    assert from_.tag == "a6c85cf"
    # The quoted comma in the second Contact's display name does not split it.
    contacts = [parse_name_addr(c) for c in invite.headers.get_all("m")]
    assert [c.uri for c in contacts] == [
        "sip:bob@192.0.2.10:5060;transport=udp", "sip:bob@mobile.example.com",
    ]
    assert contacts[0].params == {"expires": "3600"}
    assert contacts[1].display == "Second, Contact"
    assert invite.headers.get("Contact") == "<sip:bob@192.0.2.10:5060;transport=udp>;expires=3600"
    assert invite.headers.get_all("k") == ["replaces", "100rel"]
    assert invite.headers.get("l") == "233"


def test_rfc4475_wsinv_tortuous_whitespace() -> None:
    invite = parse_message(golden("torture_wsinv.sip"))
    headers = invite.headers
    assert headers.get("max-forwards") == "0068"
    assert headers.get("Subject") == ""
    assert headers.get("NewFangledHeader") == "newfangled value continued newfangled value"
    assert headers.get("UnknownHeaderWithUnusualValue") == ";;,,;;,;"
    from_ = parse_name_addr(headers.get("From") or "")
    assert from_.display == 'J Rosenberg \\"'
    assert from_.uri == "sip:jdrosen@example.com"
    to = parse_name_addr(headers.get("To") or "")
    assert to.display is None and to.uri == "sip:vivekg@chair-dnrc.example.com"
    assert headers.get_all("Route") == [
        "<sip:services.example.com;lr;unknownwith=value;unknown-no-value>"
    ]
    vias = invite.via
    assert [(v.transport, v.host) for v in vias] == [
        ("UDP", "192.0.2.2"), ("TCP", "spindle.example.com"), ("UDP", "192.168.255.111"),
    ]
    contact = parse_name_addr(headers.get("Contact") or "")
    assert contact.display == 'Quoted string ""'
    assert contact.params == {"newparam": "newvalue", "secondparam": None, "q": "0.33"}


def test_rfc4475_unusual_tokens_escapes_and_two_requests_in_one_datagram() -> None:
    intmeth = parse_message(golden("torture_intmeth.sip"))
    to = parse_name_addr(intmeth.headers.get("To") or "")
    assert to.display == "BEL:\\ NUL:\\ DEL:\\"
    assert to.uri == "sip:1_unusual.URI~(to-be!sure)&isn't+it$/crazy?,/;;*@example.com"
    from_ = parse_name_addr(intmeth.headers.get("From") or "")
    assert from_.display == "token1~` token2'+_ token3*%!.-"
    assert from_.params["fromparam''~+*_!.-%"] == "работающий"
    assert intmeth.headers.get("extensionHeader-!.%*+_`'~") == "\ufeff大停電"

    esc = parse_message(golden("torture_esc01.sip"))
    # Escapes are kept as sent: comparing URIs is the dialog layer's business.
    assert esc.headers.get("To") == "sip:%75se%72@example.com"
    contact = parse_name_addr(esc.headers.get("Contact") or "")
    assert contact.uri == "sip:cal%6Cer@host5.example.net;%6C%72;n%61me=v%61lue%25%34%31"

    double = parse_message(golden("torture_dblreq.sip"))
    assert double.body == b""  # Content-Length 0: the trailing INVITE is not part of it

    lws = parse_message(golden("torture_lwsdisp.sip"))
    assert parse_name_addr(lws.headers.get("From") or "").display == "caller"
    assert lws.headers.get("Max-Forwards") == "70"

    long = parse_message(golden("torture_longreq.sip"))
    assert len(long.headers.get_all("Via")) == 40
    assert len(long.headers.get("To") or "") > 500


# --- rejections --------------------------------------------------------------------------------

REJECTIONS: list[tuple[str, bytes, int, str]] = [
    ("missing Call-ID", base_request(drop="Call-ID"), 400, "Call-ID"),
    ("missing Via", base_request(drop="Via"), 400, "Via"),
    ("missing To", base_request(drop="To"), 400, "To"),
    ("missing From", base_request(drop="From"), 400, "From"),
    ("missing CSeq", base_request(drop="CSeq"), 400, "CSeq"),
    ("CSeq method mismatch (RFC 4475 3.1.2.16)", base_request(cseq_method="ACK"), 400,
     "CSeq method ACK does not match request method INVITE"),
    ("CSeq method case differs", base_request(cseq_method="invite"), 400, "does not match"),
    ("unknown version (RFC 4475 3.1.2.15)", base_request(version="SIP/7.0"), 505, "SIP/7.0"),
    ("malformed version", base_request(version="SIP/two"), 400, "SIP-Version"),
    ("body shorter than Content-Length (RFC 4475 3.1.2.2)", base_request(body=b"v=0\r\n",
                                                                         length=9999), 400,
     "shorter than Content-Length 9999"),
    ("negative Content-Length", base_request(length=-1), 400, "Content-Length"),
    ("conflicting Content-Length", base_request(extra="l: 5"), 400, "Content-Length"),
    ("Max-Forwards over 255 (RFC 4475 3.1.2.3)",
     base_request(drop="Max-Forwards", extra="Max-Forwards: 300"), 400, "Max-Forwards"),
    ("CSeq over 32 bits", base_request().replace(b"CSeq: 314159", b"CSeq: 36893488147419103232"),
     400, "CSeq"),
    ("non-UTF-8 header bytes", base_request(extra="Subject: caf\xe9").replace(
        "caf\xe9".encode(), b"caf\xe9"), 400, "not valid UTF-8"),
    ("NUL in a header", base_request(extra="Subject: a\x00b"), 400, "control character 0x00"),
    ("unterminated quote (RFC 4475 3.1.2.5)",
     base_request().replace(b'"Caller" <', b'"Caller <'), 400, "unterminated"),
    ("unquoted comma in display name (RFC 4475 3.1.2.14)",
     base_request().replace(b'"Caller"', b"Bell, Alexander"), 400, "display name"),
    ("spaces inside <> (RFC 4475 3.1.2.13)",
     base_request().replace(b"<sip:ivr@gw.example.com>", b"< sip:ivr@gw.example.com >"), 400,
     "malformed URI"),
    ("<> around the Request-URI (RFC 4475 3.1.2.6)",
     base_request().replace(b"INVITE sip:ivr@gw.example.com", b"INVITE <sip:ivr@gw.example.com>"),
     400, "Request-URI"),
    ("space in the Request-URI (RFC 4475 3.1.2.7)",
     base_request().replace(b"sip:ivr@gw.example.com SIP", b"sip:ivr@gw.example.com; lr SIP"),
     400, "Request-Line"),
    ("multiple SP in the Request-Line (RFC 4475 3.1.2.8)",
     base_request().replace(b"INVITE sip:ivr@gw.example.com SIP/2.0",
                            b"INVITE  sip:ivr@gw.example.com  SIP/2.0"), 400, "Request-Line"),
    ("trailing SP in the Request-Line (RFC 4475 3.1.2.9)",
     base_request().replace(b" SIP/2.0\r\n", b" SIP/2.0  \r\n", 1), 400, "Request-Line"),
    ("method not a token", base_request(method="IN(VITE", cseq_method="IN(VITE"), 400, "token"),
    ("Via without sent-by", base_request().replace(b"SIP/2.0/UDP 192.0.2.10:5060", b"SIP/2.0/UDP"),
     400, "Via"),
    ("Via port out of range", base_request().replace(b"192.0.2.10:5060", b"192.0.2.10:70000"),
     400, "port"),
    ("header line without a colon", base_request(extra="NoColonHere"), 400, "malformed header"),
    ("continuation line before any header",
     base_request().replace(b"SIP/2.0\r\nVia", b"SIP/2.0\r\n folded\r\nVia"), 400,
     "continuation"),
    ("no empty line ending the headers", base_request().rstrip(b"\r\n"), 400, "empty line"),
    ("a second Call-ID", base_request(extra="i: other@host"), 400, "more than one Call-ID"),
    ("empty tag", base_request().replace(b"tag=1928301774", b"tag"), 400, "tag"),
]


@pytest.mark.parametrize(("data", "status", "words"),
                         [pytest.param(d, s, w, id=i) for i, d, s, w in REJECTIONS])
def test_rejections_carry_the_documented_status(data: bytes, status: int, words: str) -> None:
    with pytest.raises(SipParseError) as info:
        parse_message(data)
    assert info.value.status == status
    assert words in str(info.value)
    assert isinstance(info.value, GatewayError)


def test_limits_map_to_413_400_and_414() -> None:
    big = base_request(body=b"x" * 70000)
    with pytest.raises(SipParseError, match=r"70[0-9]{3} bytes; the limit is 65535") as info:
        parse_message(big)
    assert info.value.status == 413
    with pytest.raises(SipParseError, match=r"the limit is 100$") as info:
        parse_message(base_request(), max_size=100)
    assert info.value.status == 413

    many = base_request(extra="\r\n".join(f"X-H{i}: {i}" for i in range(100)))
    with pytest.raises(SipParseError, match="more than 100 header fields") as info:
        parse_message(many)
    assert info.value.status == 400
    assert parse_message(many, max_headers=200).headers.get("X-H99") == "99"

    long_line = base_request(extra="X-Long: " + "a" * 9000)
    with pytest.raises(SipParseError, match="line 8 is 9008 bytes; the limit is 8192") as info:
        parse_message(long_line)
    assert info.value.status == 400

    long_uri = b"INVITE sip:" + b"a" * 9000 + b"@example.com SIP/2.0\r\n\r\n"
    with pytest.raises(SipParseError, match="over the 8192-byte limit") as info:
        parse_message(long_uri)
    assert info.value.status == 414


def test_unanswerable_messages_have_status_0() -> None:
    cases = [
        b"",  # nothing at all
        b"hello world\r\n\r\n",  # not a start line
        b"\x00\x01\x02garbage",
        # A malformed ACK: ACKs are never answered (RFC 3261 17.1.1.1).
        base_request(method="ACK", drop="Call-ID"),
        # A malformed response: responses are never answered (RFC 4475 3.1.2.18 bigcode).
        b"SIP/2.0 4294967301 better not break the receiver\r\nVia: SIP/2.0/UDP h;branch=z9hG4bK1"
        b"\r\n\r\n",
        b"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP h;branch=z9hG4bK1\r\n\r\n",  # no Call-ID
        b"SIP/3.0 200 OK\r\n\r\n",
    ]
    for data in cases:
        with pytest.raises(SipParseError) as info:
            parse_message(data)
        assert info.value.status == 0, data
        assert not isinstance(info.value, SipKeepalive)


@pytest.mark.parametrize("data", [b"\r\n", b"\r\n\r\n", b"\n", b"\n\n"])
def test_crlf_keepalives_raise_sipkeepalive(data: bytes) -> None:
    # RFC 5626 3.5.1: CRLFCRLF ping, CRLF pong.
    with pytest.raises(SipKeepalive) as info:
        parse_message(data)
    assert info.value.status == 0 and isinstance(info.value, SipParseError)


def test_leading_crlfs_before_a_message_are_ignored() -> None:
    # RFC 3261 7.5.
    message = parse_message(b"\r\n\r\n" + golden("bye.sip"))
    assert isinstance(message, SipRequest) and message.method == "BYE"


def test_body_longer_than_content_length_is_cut_and_missing_length_takes_the_rest() -> None:
    cut = parse_message(base_request(body=b"0123456789", length=4))
    assert cut.body == b"0123"
    rest = parse_message(base_request(body=b"").replace(b"Content-Length: 0\r\n", b"")
                         + b"whole rest")
    assert rest.body == b"whole rest"
    assert "Content-Length" not in rest.headers


def test_parse_error_carries_the_partial_request_for_the_400() -> None:
    with pytest.raises(SipParseError) as info:
        parse_message(base_request(drop="Call-ID"))
    partial = info.value.request
    assert partial is not None and partial.method == "INVITE"
    response = response_to(partial, info.value.status)
    assert response.status == 400 and response.reason == "Bad Request"
    assert response.headers.rows("Via") == partial.headers.rows("Via")
    assert "Call-ID" not in response.headers
    parse_message(response.serialize().replace(b"Content-Length", b"Call-ID: x\r\nl"))

    with pytest.raises(SipParseError) as info:
        parse_message(base_request(version="SIP/3.0"))
    assert info.value.status == 505 and info.value.request is not None


def test_a_request_rejected_before_its_headers_were_read_still_carries_the_readable_ones(
) -> None:
    # A broken line (no colon, not UTF-8, a control character) stops the parser before any
    # header field is read; what can be read still routes the 400 (RFC 3261 8.2.6.1).
    for bad in ("NoColonHere", "Subject: a\x01b"):
        with pytest.raises(SipParseError) as info:
            parse_message(base_request(extra=bad + "\r\n continued"))
        assert info.value.status == 400
        partial = info.value.request
        assert partial is not None and partial.method == "INVITE" and partial.uri == ""
        assert partial.headers.rows("Via") == [
            "SIP/2.0/UDP 192.0.2.10:5060;branch=z9hG4bK776asdhds;rport"]
        assert partial.call_id == "a84b4c76e66710@pc33.example.com"
        # The bad line and its continuation are left out, nothing else.
        assert [name for name, _ in partial.headers] == [
            "Via", "Max-Forwards", "To", "From", "Call-ID", "CSeq", "Content-Length"]
    latin1 = base_request(extra="Subject: caf\u00e9").replace("caf\u00e9".encode(), b"caf\xe9")
    with pytest.raises(SipParseError) as info:
        parse_message(latin1)
    assert info.value.request is not None and "Call-ID" in info.value.request.headers
    long_uri = base_request().replace(b"sip:ivr@gw.example.com SIP",
                                      b"sip:" + b"a" * 9000 + b" SIP")
    with pytest.raises(SipParseError) as info:
        parse_message(long_uri)
    assert info.value.status == 414 and info.value.request is not None
    assert info.value.request.top_via_branch == "z9hG4bK776asdhds"
    # Never for what gets no answer anyway.
    with pytest.raises(SipParseError) as info:
        parse_message(base_request(method="ACK", extra="NoColonHere"))
    assert info.value.status == 0 and info.value.request is None


def test_typed_parse_classmethods() -> None:
    assert SipRequest.parse(golden("bye.sip")).method == "BYE"
    assert SipResponse.parse(golden("response_200_ok.sip")).status == 200
    with pytest.raises(SipParseError):
        SipRequest.parse(golden("response_200_ok.sip"))
    with pytest.raises(SipParseError):
        SipResponse.parse(golden("bye.sip"))


# --- building ----------------------------------------------------------------------------------


def invite_with_two_via_rows() -> SipRequest:
    invite = parse_message(golden("invite_compact_folded.sip"))
    assert isinstance(invite, SipRequest)
    return invite


def test_response_to_copies_via_from_to_callid_cseq_and_adds_the_tag() -> None:
    invite = invite_with_two_via_rows()
    response = response_to(invite, 180, to_tag="4f2a9c1e")
    assert (response.status, response.reason) == (180, "Ringing")
    # RFC 3261 8.2.6.2: Via rows equal and in order (the comma-joined row stays joined).
    assert response.headers.rows("Via") == invite.headers.rows("Via")
    assert [v.branch for v in response.via] == [v.branch for v in invite.via]
    assert response.headers.get("From") == invite.headers.get("From")
    assert response.headers.get("To") == "IVR <sip:ivr@gw.example.com>;tag=4f2a9c1e"
    assert response.to_tag == "4f2a9c1e"
    assert response.call_id == invite.call_id and response.cseq == invite.cseq
    names = [n for n, _ in response.headers]
    assert names[:6] == ["Via", "Via", "From", "To", "Call-ID", "CSeq"]
    assert_round_trips(parse_message(response.serialize()))


def test_response_to_keeps_an_existing_to_tag_and_builds_bodies() -> None:
    bye = parse_message(golden("bye.sip"))
    assert isinstance(bye, SipRequest)
    ok = response_to(bye, 200, to_tag="ignored", headers=[("User-Agent", "gw")])
    assert ok.to_tag == "4f2a9c1e88b07d35"
    assert ok.headers.get("User-Agent") == "gw" and ok.reason == "OK"

    invite = parse_message(golden("invite_baresip.sip"))
    assert isinstance(invite, SipRequest)
    answer = response_to(invite, 200, to_tag="t1", body=b"v=0\r\n",
                         content_type="application/sdp")
    wire = answer.serialize()
    assert wire.endswith(b"Content-Type: application/sdp\r\nContent-Length: 5\r\n\r\nv=0\r\n")
    assert parse_message(wire).body == b"v=0\r\n"


def test_response_to_record_route_timestamp_and_reasons() -> None:
    invite = parse_message(base_request(
        extra="Record-Route: <sip:p1.example.com;lr>, <sip:p2.example.com;lr>\r\nTimestamp: 54"
    ))
    assert isinstance(invite, SipRequest)
    ok = response_to(invite, 200, to_tag="x")
    # RFC 3261 12.1.1: dialog-creating responses carry the Record-Route.
    assert ok.headers.get_all("Record-Route") == [
        "<sip:p1.example.com;lr>", "<sip:p2.example.com;lr>",
    ]
    assert "Record-Route" not in response_to(invite, 486, to_tag="x").headers
    trying = response_to(invite, 100)
    assert trying.headers.get("Timestamp") == "54" and trying.to_tag is None
    expected = {
        100: "Trying", 180: "Ringing", 200: "OK", 400: "Bad Request", 401: "Unauthorized",
        403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
        413: "Request Entity Too Large", 415: "Unsupported Media Type", 420: "Bad Extension",
        481: "Call/Transaction Does Not Exist", 486: "Busy Here", 487: "Request Terminated",
        488: "Not Acceptable Here", 491: "Request Pending", 500: "Server Internal Error",
        501: "Not Implemented", 503: "Service Unavailable", 505: "Version Not Supported",
    }
    for status, reason in expected.items():
        assert response_to(invite, status).reason == reason == reason_phrase(status)
    assert response_to(invite, 499).reason == "Client Error"
    assert response_to(invite, 503, "Service Unavailable (draining)").reason.endswith("draining)")
    with pytest.raises(ValueError):
        response_to(invite, 99)


def test_stamp_via_fills_rport_and_received_per_rfc3581() -> None:
    # rport without value: fill it AND add received, even for the same address (RFC 3581 4).
    invite = parse_message(golden("invite_baresip.sip"))
    assert isinstance(invite, SipRequest)
    stamp_via(invite, "127.0.0.1", 5062)
    top = invite.top_via
    assert top.rport == 5062 and top.received == "127.0.0.1"
    assert invite.headers.get("Via") == (
        "SIP/2.0/UDP 127.0.0.1:5062;branch=z9hG4bK8f6c1d2e7a4b3c59;rport=5062;received=127.0.0.1"
    )
    # NATed: the source port differs from sent-by; the response goes to the source.
    natted = parse_message(golden("invite_baresip.sip"))
    assert isinstance(natted, SipRequest)
    stamp_via(natted, "203.0.113.9", 40001)
    assert (natted.top_via.received, natted.top_via.rport) == ("203.0.113.9", 40001)


def test_stamp_via_received_only_when_the_host_differs() -> None:
    same = parse_message(base_request().replace(b";rport", b""))
    assert isinstance(same, SipRequest)
    before = same.headers.get("Via")
    stamp_via(same, "192.0.2.10", 5060)
    assert same.headers.get("Via") == before  # RFC 3261 18.2.1: same IP, nothing to add

    other = parse_message(base_request().replace(b";rport", b""))
    assert isinstance(other, SipRequest)
    stamp_via(other, "198.51.100.1", 5060)
    assert other.top_via.received == "198.51.100.1" and not other.top_via.has_rport

    # A domain name in sent-by always gets received=; only the top of a joined row changes.
    joined = invite_with_two_via_rows()
    joined.headers.remove("Via")
    joined.headers.add("Via", "SIP/2.0/UDP pc33.example.com;branch=z9hG4bKa, "
                       "SIP/2.0/UDP p1.example.com;branch=z9hG4bKb")
    stamp_via(joined, "192.0.2.33", 5060)
    assert joined.headers.rows("Via") == [
        "SIP/2.0/UDP pc33.example.com;branch=z9hG4bKa;received=192.0.2.33, "
        "SIP/2.0/UDP p1.example.com;branch=z9hG4bKb"
    ]

    v6 = parse_message(base_request().replace(b"192.0.2.10:5060", b"[2001:db8::1]:5060"))
    assert isinstance(v6, SipRequest)
    stamp_via(v6, "2001:db8::1", 5060)
    assert v6.top_via.received == "2001:db8::1" and v6.top_via.rport == 5060


def test_build_request_for_uas_originated_bye() -> None:
    bye = build_request(
        "BYE", "sip:tester-0x5581c3a0@127.0.0.1:5062", call_id="8d3b0e6f1c2a4b5d",
        from_="<sip:ivr@127.0.0.1:5080>;tag=4f2a", to="<sip:tester@127.0.0.1>;tag=5b1a",
        cseq=2, via_host="127.0.0.1", via_port=5080, contact="<sip:ivr@127.0.0.1:5080>",
        headers=[("User-Agent", "gw")],
    )
    again = parse_message(bye.serialize())
    assert isinstance(again, SipRequest)
    assert (again.method, again.cseq, again.call_id) == ("BYE", (2, "BYE"), "8d3b0e6f1c2a4b5d")
    assert (again.from_tag, again.to_tag) == ("4f2a", "5b1a")
    assert again.headers.get("Max-Forwards") == "70"
    via = again.top_via
    assert via.branch is not None and via.branch.startswith("z9hG4bK") and via.has_rport
    assert (via.host, via.port) == ("127.0.0.1", 5080)
    assert [n for n, _ in again.headers][:7] == [
        "Via", "Max-Forwards", "From", "To", "Call-ID", "CSeq", "Contact",
    ]
    refer = build_request(
        "REFER", "sip:a@b", call_id="c", from_="<sip:x@y>;tag=1", to="<sip:a@b>;tag=2", cseq=3,
        via_host="2001:db8::5", via_port=5080, branch="z9hG4bKfixed", body=b"hi",
        content_type="text/plain",
    )
    assert refer.top_via_branch == "z9hG4bKfixed" and refer.top_via.host == "[2001:db8::5]"
    assert parse_message(refer.serialize()).body == b"hi"
    with pytest.raises(ValueError):
        build_request("BYE", "sip:a@b", call_id="c", from_="<sip:x@y>\r\nEvil: 1", to="t",
                      cseq=1, via_host="h", via_port=1)


# --- helpers -----------------------------------------------------------------------------------


def test_headers_multimap_semantics() -> None:
    headers = Headers([("v", "SIP/2.0/UDP a;branch=z9hG4bK1, SIP/2.0/UDP b;branch=z9hG4bK2"),
                       ("call-id", "x@y"), ("X-Custom", "1")])
    assert [n for n, _ in headers] == ["Via", "Call-ID", "X-Custom"]
    assert "CALL-ID" in headers and "i" in headers and "x-custom" in headers
    assert "Contact" not in headers and 5 not in headers
    assert headers.get("VIA") == "SIP/2.0/UDP a;branch=z9hG4bK1"  # first list element
    assert headers.get_all("Via") == ["SIP/2.0/UDP a;branch=z9hG4bK1",
                                      "SIP/2.0/UDP b;branch=z9hG4bK2"]
    assert headers.get("Subject") is None and headers.get("Subject", "-") == "-"
    headers.add("X-Custom", "2")
    assert headers.get_all("x-custom") == ["1", "2"]
    copy = headers.copy()
    headers.set("X-CUSTOM", "3")
    assert headers.get_all("X-Custom") == ["3"] and copy.get_all("X-Custom") == ["1", "2"]
    assert [n for n, _ in headers] == ["Via", "Call-ID", "X-CUSTOM"]  # unknown: as spelled
    headers.remove("i")
    assert "Call-ID" not in headers and len(headers) == 2
    assert headers != copy and copy == copy.copy()
    with pytest.raises(ValueError):
        headers.add("Bad Name", "x")
    with pytest.raises(ValueError):
        headers.set("Subject", "a\r\nInjected: yes")
    # Commas inside quotes and <> are not separators.
    contacts = Headers([("Contact", '"A, B" <sip:a@b;x=1,2>, <sip:c@d>')])
    assert contacts.get_all("Contact") == ['"A, B" <sip:a@b;x=1,2>', "<sip:c@d>"]
    # Authorization is not a list: its commas separate parameters.
    auth = Headers([("Authorization", 'Digest username="a", realm="b"')])
    assert auth.get_all("Authorization") == ['Digest username="a", realm="b"']
    compact = {"i": "Call-ID", "m": "Contact", "e": "Content-Encoding", "l": "Content-Length",
               "c": "Content-Type", "f": "From", "s": "Subject", "k": "Supported", "t": "To",
               "v": "Via", "o": "Event", "r": "Refer-To", "b": "Referred-By",
               "u": "Allow-Events", "x": "Session-Expires"}
    for short, long in compact.items():
        assert Headers.canonical(short) == Headers.canonical(short.upper()) == long


def test_parse_name_addr_forms() -> None:
    full = parse_name_addr('"Display" <sip:a@b;transport=udp>;tag=abc')
    assert full == NameAddr("Display", "sip:a@b;transport=udp", {"tag": "abc"})
    assert parse_name_addr("<sip:a@b>") == NameAddr(None, "sip:a@b", {})
    # RFC 3261 20.10: after a bare URI, parameters are header parameters.
    bare = parse_name_addr("sip:a@b;tag=x;lr")
    assert bare == NameAddr(None, "sip:a@b", {"tag": "x", "lr": None})
    assert parse_name_addr("Alice Smith <tel:+15551234>").display == "Alice Smith"
    assert parse_name_addr('"" <sip:a@b>').display == ""
    assert parse_name_addr('<sip:a@b>;x="quoted;value"').params == {"x": "quoted;value"}
    for text in ['"unterminated <sip:a@b>', "<sip:a@b", "sip:a@b?x=y", "no-scheme@b",
                 "<sip:a@b> junk", "<sip:a@b>;", "<sip:a@b>;tag=1;tag=2", "<>", "",
                 "Bell, A <sip:a@b>", '"x" sip:a@b']:
        with pytest.raises(SipParseError) as info:
            parse_name_addr(text)
        assert info.value.status == 400, text
    round_trip = parse_name_addr('"A \\"q\\" \\\\" <sip:a@b>;tag=1;x="a b"')
    assert parse_name_addr(round_trip.serialize()) == round_trip


def test_parse_via_and_rport() -> None:
    via = parse_via("SIP/2.0/UDP 192.0.2.1:5060;branch=z9hG4bK74bf9;received=10.0.0.1;rport")
    assert via == Via("UDP", "192.0.2.1", 5060,
                      {"branch": "z9hG4bK74bf9", "received": "10.0.0.1", "rport": None})
    assert via.branch == "z9hG4bK74bf9" and via.received == "10.0.0.1"
    assert via.has_rport and via.rport is None
    assert parse_via("SIP/2.0/UDP h;rport=5070").rport == 5070
    assert parse_via("sip/2.0/tcp [2001:db8::9]:5061;branch=z9hG4bKx").sent_by == (
        "2001:db8::9", 5061)
    assert parse_via("SIP / 2.0 / UDP  host ; branch = z9hG4bKa").branch == "z9hG4bKa"
    assert Via.parse(str(via)) == via
    for text in ["SIP/2.0/UDP", "SIP/2.0 host", "SIP/3.0/UDP h", "SIP/2.0/UDP h:0",
                 "SIP/2.0/UDP h;branch", "SIP/2.0/UDP h;rport=x", "SIP/2.0/UDP h, x",
                 "SIP/2.0/UDP h;;"]:
        with pytest.raises(SipParseError):
            parse_via(text)


def test_parse_cseq_and_generators() -> None:
    assert parse_cseq("1 INVITE") == (1, "INVITE")
    assert parse_cseq("  0009\tINVITE ") == (9, "INVITE")
    assert parse_cseq("4294967295 BYE") == (4294967295, "BYE")
    for text in ["INVITE", "1", "-1 INVITE", "4294967296 BYE", "1 IN VITE", "x BYE"]:
        with pytest.raises(SipParseError):
            parse_cseq(text)
    tags = {new_tag() for _ in range(50)}
    assert len(tags) == 50 and all(len(t) >= 8 for t in tags)
    branch = new_branch()
    assert branch.startswith("z9hG4bK") and len(branch) > 7 + 16
    call_id = new_call_id("192.0.2.5")
    assert call_id.endswith("@192.0.2.5") and call_id != new_call_id("192.0.2.5")
    assert "@" not in new_call_id("")


# --- fuzzing -----------------------------------------------------------------------------------

GOLDEN_BYTES = [golden(name) for name in GOLDEN_FILES]
_INSERTS = [b"\r\n", b"\n", b" ", b"\t", b":", b";", b",", b'"', b"\\", b"<", b">", b"=", b"/",
            b"\x00", b"\xff", b"\xc3", b"SIP/2.0", b"\r\n ", b"\r\n\r\n", b"9999999999999"]


@st.composite
def mutated_goldens(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(GOLDEN_BYTES)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, len(data)))
        if op == "set" and data:
            data[min(pos, len(data) - 1)] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.sampled_from(_INSERTS) | st.binary(max_size=6))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 12))]
        else:
            del data[pos:]
    return bytes(data)


def check_any_input(data: bytes) -> None:
    try:
        message = parse_message(data)
    except SipParseError as exc:
        assert exc.status in (0, 400, 413, 414, 505)
        assert str(exc)
        return
    # Anything accepted must be fully usable: accessors, round trip, response, Via stamping.
    assert message.call_id and message.cseq[1]
    _ = (message.from_tag, message.to_tag, message.top_via_branch, message.via)
    assert_round_trips(message)
    if isinstance(message, SipRequest):
        stamp_via(message, "192.0.2.1", 5060)
        assert_round_trips(message)
        response = response_to(message, 200, to_tag="t")
        assert parse_message(response.serialize()).to_tag in ("t", message.to_tag)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=600), mutated_goldens()))
def test_any_bytes_parse_or_raise_sipparseerror(data: bytes) -> None:
    check_any_input(data)


_NAMES = {"Via": "v", "From": "f", "To": "t", "Call-ID": "i", "CSeq": None, "Contact": "m",
          "Max-Forwards": None, "Subject": "s", "Content-Type": "c", "Content-Length": "l"}
_HOSTS = st.sampled_from(["127.0.0.1", "example.com", "[2001:db8::7]", "10.0.0.7", "gw-1.test"])
_WORD = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9.\-_]{0,15}", fullmatch=True)


@st.composite
def spelled(draw: st.DrawFn, name: str) -> str:
    """A header name as a peer might write it: compact, or in random case."""
    compact = _NAMES.get(name)
    if compact is not None and draw(st.booleans()):
        return compact if draw(st.booleans()) else compact.upper()
    flips = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    return "".join(c.upper() if f else c.lower() for c, f in zip(name, flips, strict=True))


@st.composite
def validish_requests(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    method = draw(st.sampled_from(["INVITE", "BYE", "OPTIONS", "CANCEL", "ACK", "INFO", "X-Ext"]))
    uri = f"sip:{draw(_WORD)}@{draw(_HOSTS)}"
    call_id = f"{draw(_WORD)}@{draw(_HOSTS)}"
    cseq = draw(st.integers(0, 2**32 - 1))
    from_tag = draw(_WORD)
    to_tag = draw(st.none() | _WORD)
    branches = [f"z9hG4bK{draw(_WORD)}" for _ in range(draw(st.integers(1, 4)))]
    body = draw(st.binary(max_size=120))
    vias = [f"SIP/2.0/{draw(st.sampled_from(['UDP', 'TCP', 'tls']))} {draw(_HOSTS)}"
            f"{draw(st.sampled_from(['', ':5060', ':15062']))};branch={b}"
            f"{draw(st.sampled_from(['', ';rport', ';received=192.0.2.1']))}" for b in branches]
    # Vias: each either its own row or comma-joined to the previous one.
    via_rows: list[str] = []
    for via in vias:
        join = draw(st.booleans())
        if via_rows and join:
            via_rows[-1] += draw(st.sampled_from([",", ", ", " ,  "])) + via
        else:
            via_rows.append(via)
    display = draw(st.sampled_from(["", '"Alice, A." ', "Bob ", '"q\\"uote" ']))
    to_value = f"<{uri}>" + (f";tag={to_tag}" if to_tag else "")
    fields: list[tuple[str, str]] = [
        ("From", f"{display}<sip:{draw(_WORD)}@{draw(_HOSTS)}>;tag={from_tag}"),
        ("To", to_value if draw(st.booleans()) or not to_tag else f"{uri};tag={to_tag}"),
        ("Call-ID", call_id),
        ("CSeq", f"{cseq}{draw(st.sampled_from([' ', '  ', chr(9)]))}{method}"),
        ("Max-Forwards", str(draw(st.integers(0, 255)))),
        ("Subject", draw(st.sampled_from(["", "hello there", "a  b c"]))),
        ("X-Extra", draw(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x2FF,
                                               exclude_characters=":\x7f"), max_size=30))),
    ]
    fields += [("Via", row) for row in via_rows]
    if draw(st.booleans()):
        fields.append(("Content-Length", str(len(body))))
    if body:
        fields.append(("Content-Type", "application/octet-stream"))
    # Vias keep their relative order; everything else lands anywhere between them.
    others = draw(st.permutations([f for f in fields if f[0] != "Via"]))
    order: list[tuple[str, str]] = []
    via_iter = iter([f for f in fields if f[0] == "Via"])
    for item in others:
        if draw(st.booleans()):
            order.extend(via_iter)
        order.append(item)
    order.extend(via_iter)
    eol = draw(st.sampled_from(["\r\n", "\n"]))
    lines = [f"{method} {uri} SIP/2.0"]
    for name, value in order:
        before = draw(st.sampled_from(["", " ", "\t", "  "]))
        after = draw(st.sampled_from(["", " ", "  ", "\t"]))
        if " " in value and draw(st.booleans()):
            # Fold at a space (RFC 3261 7.3.1).
            value = value.replace(" ", eol + draw(st.sampled_from([" ", "\t", "   "])), 1)
        lines.append(f"{draw(spelled(name))}{before}:{after}{value}")
    data = (draw(st.sampled_from(["", "\r\n"])) + eol.join(lines) + eol + eol).encode() + body
    expected = dict(method=method, uri=uri, call_id=call_id, cseq=(cseq, method),
                    from_tag=from_tag, to_tag=to_tag, branches=branches, body=body)
    return data, expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(validish_requests())
def test_validish_messages_parse_and_round_trip(case: tuple[bytes, dict[str, Any]]) -> None:
    data, expected = case
    message = parse_message(data)
    assert isinstance(message, SipRequest)
    assert (message.method, message.uri) == (expected["method"], expected["uri"])
    assert message.call_id == expected["call_id"]
    assert message.cseq == expected["cseq"]
    assert message.from_tag == expected["from_tag"]
    assert message.to_tag == expected["to_tag"]
    assert [v.branch for v in message.via] == expected["branches"]
    assert message.body == expected["body"]
    assert_round_trips(message)
    response = response_to(message, 200, to_tag="gw1")
    again = parse_message(response.serialize())
    assert [v.branch for v in again.via] == expected["branches"]
    assert again.to_tag == (expected["to_tag"] or "gw1")
