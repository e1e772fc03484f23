"""The sans-I/O SIP UAS in virtual time: RFC 3261 timers, CANCEL, BYE, re-INVITE, security."""

from __future__ import annotations

import hashlib

import pytest

from gateway.sip.digest import DigestAuthenticator
from gateway.sip.message import SipRequest, SipResponse, parse_message
from gateway.sip.uas import (
    T1,
    T2,
    CallAnswered,
    CallConfirmed,
    CallEnded,
    Dropped,
    IncomingCall,
    MediaChanged,
    Refused,
    SendTo,
    TransferDone,
    UasConfig,
    UasCore,
)

PEER = ("127.0.0.1", 5062)
OFFER = (
    "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    "m=audio 16000 RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:101 telephone-event/8000\r\n"
    "a=fmtp:101 0-15\r\na=ptime:20\r\na={direction}\r\n"
)


def invite(
    call_id: str = "call-1",
    branch: str = "z9hG4bK-1",
    cseq: int = 1,
    *,
    to_tag: str | None = None,
    direction: str = "sendrecv",
    codecs: str = "0 101",
    extra: str = "",
    body: str | None = None,
    uri: str = "sip:ivr@127.0.0.1:5080",
    to_uri: str = "sip:ivr@127.0.0.1:5080",
) -> bytes:
    sdp = (
        body
        if body is not None
        else OFFER.format(direction=direction).replace("RTP/AVP 0 101", f"RTP/AVP {codecs}")
    )
    to = f"<{to_uri}>" + (f";tag={to_tag}" if to_tag else "")
    return (
        f"INVITE {uri} SIP/2.0\r\n"
        f"Via: SIP/2.0/UDP 127.0.0.1:5062;branch={branch};rport\r\n"
        f"Max-Forwards: 70\r\nFrom: <sip:tester@127.0.0.1>;tag=caller-tag\r\nTo: {to}\r\n"
        f"Call-ID: {call_id}\r\nCSeq: {cseq} INVITE\r\n"
        f"Contact: <sip:tester@127.0.0.1:5062>\r\n{extra}"
        f"Content-Type: application/sdp\r\nContent-Length: {len(sdp)}\r\n\r\n{sdp}"
    ).encode()


def in_dialog(
    method: str,
    local_tag: str,
    call_id: str = "call-1",
    cseq: int = 2,
    branch: str = "z9hG4bK-2",
    body: str = "",
    content_type: str = "",
) -> bytes:
    ctype = f"Content-Type: {content_type}\r\n" if content_type else ""
    return (
        f"{method} sip:ivr@127.0.0.1:5080 SIP/2.0\r\n"
        f"Via: SIP/2.0/UDP 127.0.0.1:5062;branch={branch}\r\n"
        f"From: <sip:tester@127.0.0.1>;tag=caller-tag\r\n"
        f"To: <sip:ivr@127.0.0.1:5080>;tag={local_tag}\r\n"
        f"Call-ID: {call_id}\r\nCSeq: {cseq} {method}\r\n{ctype}"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


class Budget:
    """The replica's admission as the core asks it (the gateway passes its one Admission's
    ``refusal``): ``max_calls`` calls, counted here on the core's dialogs; ``draining``."""

    def __init__(self, max_calls: int = 4) -> None:
        self.max_calls = max_calls
        self.draining = False
        self.core: UasCore | None = None

    def refusal(self) -> str | None:
        if self.draining:
            return "draining"
        if self.core is not None and self.core.active_calls >= self.max_calls:
            return "at_capacity"
        return None


def core(max_calls: int = 4, budget: Budget | None = None, **overrides: object) -> UasCore:
    values: dict[str, object] = dict(local_ip="127.0.0.1", local_port=5080)
    values.update(overrides)
    budget = budget if budget is not None else Budget(max_calls)
    uas = UasCore(UasConfig(**values), admission=budget.refusal)  # type: ignore[arg-type]
    budget.core = uas
    return uas


def sent(effects: list[object]) -> list[SipRequest | SipResponse]:
    return [parse_message(e.data) for e in effects if isinstance(e, SendTo)]


def statuses(effects: list[object]) -> list[int]:
    return [m.status for m in sent(effects) if isinstance(m, SipResponse)]


def answered(uas: UasCore, now: float = 0.0, **kwargs: object) -> tuple[str, str, list[object]]:
    effects = uas.receive(invite(**kwargs), PEER, now)  # type: ignore[arg-type]
    incoming = next(e for e in effects if isinstance(e, IncomingCall))
    effects = uas.answer(incoming.key, "127.0.0.1", 20000, now)
    ok = sent(effects)[0]
    assert isinstance(ok, SipResponse) and ok.status == 200
    return incoming.key, ok.to_tag or "", effects


@pytest.mark.parametrize(("uri", "to_uri", "called"), [
    # A proxy retargeted the call: the Request-URI says whom it is for now (RFC 3261 16.5).
    ("sip:2000@127.0.0.1:5080", "sip:+15550002222@carrier.example", "2000"),
    ("sip:+15550003333@127.0.0.1:5080;user=phone", "sip:ivr@127.0.0.1", "+15550003333"),
    # No user in the Request-URI (an INVITE to the host alone): the To user.
    ("sip:127.0.0.1:5080", "sip:+15550002222@127.0.0.1", "+15550002222"),
])
def test_the_called_user_is_the_request_uris_else_the_tos(uri: str, to_uri: str,
                                                           called: str) -> None:
    effects = core().receive(invite(uri=uri, to_uri=to_uri), PEER, 0.0)  # type: ignore[arg-type]
    incoming = next(e for e in effects if isinstance(e, IncomingCall))
    assert incoming.called == called


def test_invite_trying_then_ok_with_an_sdp_answer_then_ack() -> None:
    uas = core()
    effects = uas.receive(invite(), PEER, 0.0)
    assert statuses(effects) == [100]
    incoming = next(e for e in effects if isinstance(e, IncomingCall))
    assert incoming.caller == "tester" and incoming.called == "ivr"
    effects = uas.answer(incoming.key, "127.0.0.1", 20000, 0.0)
    ok = sent(effects)[0]
    assert isinstance(ok, SipResponse) and ok.status == 200 and ok.to_tag
    assert b"m=audio 20000 RTP/AVP 0 101" in ok.body and b"a=fmtp:101 0-15" in ok.body
    assert ok.headers.get("Contact") == "<sip:ivr@127.0.0.1:5080>"
    answer = next(e for e in effects if isinstance(e, CallAnswered)).answer
    assert answer.codec == "PCMU" and answer.telephone_event_pt == 101
    assert answer.remote_rtp == ("127.0.0.1", 16000)
    ack = in_dialog("ACK", ok.to_tag, cseq=1)
    assert uas.receive(ack, PEER, 0.1) == [CallConfirmed(incoming.key)]
    assert uas.tick(10.0) == []  # no retransmissions after the ACK


def test_ok_is_retransmitted_t1_doubling_to_t2_then_bye_without_ack() -> None:
    uas = core()
    key, _, _ = answered(uas)
    times = []
    now = 0.0
    while now < 40:
        now = round(now + 0.05, 2)
        effects = uas.tick(now)
        if any(isinstance(e, SendTo) and e.data.startswith(b"SIP/2.0 200") for e in effects):
            times.append(now)
        if any(isinstance(e, CallEnded) for e in effects):
            requests = [m for m in sent(effects) if isinstance(m, SipRequest)]
            assert [r.method for r in requests] == ["BYE"]
            assert CallEnded(key, "no-ack") in effects
            break
    gaps = [round(b - a, 2) for a, b in zip([0.0, *times], times, strict=False)]
    assert gaps[:4] == [T1, 2 * T1, 4 * T1, T2] and set(gaps[4:]) == {T2}
    assert now == pytest.approx(64 * T1, abs=0.06)


def test_retransmitted_invite_gets_the_same_response_and_no_new_call() -> None:
    uas = core()
    first = uas.receive(invite(), PEER, 0.0)
    again = uas.receive(invite(), PEER, 0.2)
    assert [e.data for e in again if isinstance(e, SendTo)] == [
        e.data for e in first if isinstance(e, SendTo)
    ]
    assert not any(isinstance(e, IncomingCall) for e in again)
    key = next(e for e in first if isinstance(e, IncomingCall)).key
    ok = uas.answer(key, "127.0.0.1", 20000, 0.3)
    later = uas.receive(invite(), PEER, 0.4)
    assert [e.data for e in later if isinstance(e, SendTo)] == [
        e.data for e in ok if isinstance(e, SendTo)
    ]
    assert uas.active_calls == 1


def test_cancel_before_answer_gets_200_and_the_invite_487() -> None:
    uas = core()
    effects = uas.receive(invite(), PEER, 0.0)
    key = next(e for e in effects if isinstance(e, IncomingCall)).key
    cancel = invite().replace(b"INVITE sip", b"CANCEL sip").replace(b"1 INVITE", b"1 CANCEL")
    effects = uas.receive(cancel, PEER, 0.5)
    responses = [m for m in sent(effects) if isinstance(m, SipResponse)]
    assert [(r.status, r.cseq[1]) for r in responses] == [(200, "CANCEL"), (487, "INVITE")]
    assert CallEnded(key, "cancel") in effects
    assert uas.answer(key, "127.0.0.1", 20000, 0.6) == []  # too late to answer
    other = cancel.replace(b"branch=z9hG4bK-1", b"branch=z9hG4bK-unknown")
    assert statuses(uas.receive(other, PEER, 0.7)) == [481]


def test_bye_ends_the_call_and_unknown_dialogs_get_481() -> None:
    uas = core()
    key, tag, _ = answered(uas)
    uas.receive(in_dialog("ACK", tag, cseq=1), PEER, 0.1)
    effects = uas.receive(in_dialog("BYE", tag), PEER, 1.0)
    assert statuses(effects) == [200] and CallEnded(key, "bye") in effects
    assert statuses(uas.receive(in_dialog("BYE", "nope", branch="z9hG4bK-9"), PEER, 1.1)) == [481]
    uas.tick(2.0)
    assert uas.active_calls == 0


def test_options_unknown_methods_and_keepalives() -> None:
    uas = core()
    options = (
        b"OPTIONS sip:ivr@127.0.0.1:5080 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:5062;"
        b"branch=z9hG4bK-o\r\nFrom: <sip:probe@127.0.0.1>;tag=p\r\nTo: <sip:ivr@127.0.0.1>\r\n"
        b"Call-ID: ping\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n"
    )
    effects = uas.receive(options, PEER, 0.0)
    reply = sent(effects)[0]
    assert isinstance(reply, SipResponse) and reply.status == 200
    assert "INVITE" in (reply.headers.get("Allow") or "")
    subscribe = options.replace(b"OPTIONS", b"SUBSCRIBE").replace(b"o\r\n", b"s\r\n")
    assert statuses(uas.receive(subscribe, PEER, 0.1)) == [501]
    assert uas.receive(b"\r\n\r\n", PEER, 0.2) == []


def test_reinvite_hold_and_resume() -> None:
    uas = core()
    key, tag, _ = answered(uas)
    uas.receive(in_dialog("ACK", tag, cseq=1), PEER, 0.1)
    hold = invite(cseq=2, branch="z9hG4bK-h", to_tag=tag, direction="sendonly")
    effects = uas.receive(hold, PEER, 5.0)
    ok = sent(effects)[0]
    assert isinstance(ok, SipResponse) and ok.status == 200 and b"a=recvonly" in ok.body
    change = next(e for e in effects if isinstance(e, MediaChanged))
    assert change.answer.on_hold
    assert uas.receive(in_dialog("ACK", tag, cseq=2, branch="z9hG4bK-ha"), PEER, 5.1) == []
    resume = invite(cseq=3, branch="z9hG4bK-r", to_tag=tag, direction="sendrecv")
    effects = uas.receive(resume, PEER, 9.0)
    ok = sent(effects)[0]
    assert isinstance(ok, SipResponse) and b"a=sendrecv" in ok.body
    assert not next(e for e in effects if isinstance(e, MediaChanged)).answer.on_hold
    assert uas.dialogs[key].state == "confirmed"


def test_no_common_codec_is_488() -> None:
    uas = core()
    effects = uas.receive(invite(codecs="18"), PEER, 0.0)
    key = next(e for e in effects if isinstance(e, IncomingCall)).key
    effects = uas.answer(key, "127.0.0.1", 20000, 0.0)
    assert statuses(effects) == [488]
    assert any(isinstance(e, CallEnded) for e in effects) and uas.active_calls == 0


def test_over_capacity_is_486_and_draining_is_503() -> None:
    budget = Budget(max_calls=1)
    uas = core(budget=budget)
    answered(uas)
    effects = uas.receive(invite(call_id="c2", branch="z9hG4bK-c2"), PEER, 1.0)
    assert statuses(effects) == [486]
    assert sent(effects)[0].headers.get("Retry-After") == "5"
    assert [e.reason for e in effects if isinstance(e, Refused)] == ["at_capacity"]
    budget.draining = True
    effects = uas.receive(invite(call_id="c3", branch="z9hG4bK-c3"), PEER, 1.0)
    assert statuses(effects) == [503]
    assert sent(effects)[0].headers.get("Retry-After") == "30"
    assert [e.reason for e in effects if isinstance(e, Refused)] == ["draining"]


def test_the_core_refuses_only_on_the_admissions_word() -> None:
    """One gate: the core counts no calls of its own (it once also refused at a
    ``UasConfig.max_calls`` the replica's admission did not know about)."""
    uas = UasCore(UasConfig(local_ip="127.0.0.1", local_port=5080))  # nobody to ask: welcome
    for n in range(12):
        answered(uas, call_id=f"c{n}", branch=f"z9hG4bK-c{n}")
    assert uas.active_calls == 12
    budget = Budget(max_calls=20)
    roomy = core(budget=budget)
    for n in range(12):
        answered(roomy, call_id=f"c{n}", branch=f"z9hG4bK-c{n}")
    budget.max_calls = 12  # the operator lowered the budget: the next INVITE is refused
    effects = roomy.receive(invite(call_id="c12", branch="z9hG4bK-c12"), PEER, 1.0)
    assert statuses(effects) == [486]


def test_disallowed_source_gets_403_and_no_state() -> None:
    uas = core(allow=["10.0.0.0/8"])
    effects = uas.receive(invite(), ("192.0.2.7", 5060), 0.0)
    assert statuses(effects) == [403]
    assert not uas.dialogs and uas.next_deadline() is None
    assert uas.stats["rejected_source"] == 1


def test_malformed_datagrams_are_dropped_with_no_response() -> None:
    uas = core()
    for junk in (b"\x00\xff garbage", b"INVITE\r\n\r\n", b"SIP/2.0 200\r\n"):
        effects = uas.receive(junk, PEER, 0.0)
        assert all(isinstance(e, Dropped) for e in effects) and effects
    assert uas.stats["dropped"] == 3


def test_digest_authentication_challenges_then_accepts() -> None:
    auth = DigestAuthenticator("ivr", {"trunk": "s3cret"}, secret=b"k" * 32)
    uas = core(authenticator=auth)
    effects = uas.receive(invite(), PEER, 0.0)
    challenge = sent(effects)[0]
    assert isinstance(challenge, SipResponse) and challenge.status == 401
    header = challenge.headers.get("WWW-Authenticate") or ""
    nonce = header.split('nonce="')[1].split('"')[0]
    ha1 = hashlib.md5(b"trunk:ivr:s3cret").hexdigest()
    ha2 = hashlib.md5(b"INVITE:sip:ivr@127.0.0.1:5080").hexdigest()
    response = hashlib.md5(f"{ha1}:{nonce}:{ha2}".encode()).hexdigest()
    authorization = (
        f'Authorization: Digest username="trunk", realm="ivr", nonce="{nonce}", '
        f'uri="sip:ivr@127.0.0.1:5080", response="{response}"\r\n'
    )
    effects = uas.receive(invite(branch="z9hG4bK-a2", cseq=2, extra=authorization), PEER, 0.1)
    assert statuses(effects) == [100]
    wrong = authorization.replace(response, "0" * 32)
    effects = uas.receive(invite(call_id="c9", branch="z9hG4bK-a3", extra=wrong), PEER, 0.2)
    assert statuses(effects) == [401]


def test_local_hangup_sends_bye_and_retransmits_until_answered() -> None:
    uas = core()
    key, tag, _ = answered(uas)
    uas.receive(in_dialog("ACK", tag, cseq=1), PEER, 0.1)
    effects = uas.hangup(key, 1.0)
    bye = sent(effects)[0]
    assert (
        isinstance(bye, SipRequest) and bye.method == "BYE" and CallEnded(key, "local") in effects
    )
    assert bye.headers.get("To", "").endswith("tag=caller-tag")
    assert [m.method for m in sent(uas.tick(1.5)) if isinstance(m, SipRequest)] == ["BYE"]
    ok = (
        f"SIP/2.0 200 OK\r\nVia: {bye.headers.get('Via')}\r\nFrom: {bye.headers.get('From')}\r\n"
        f"To: {bye.headers.get('To')}\r\nCall-ID: {bye.call_id}\r\nCSeq: {bye.cseq[0]} BYE\r\n"
        f"Content-Length: 0\r\n\r\n"
    ).encode()
    assert uas.receive(ok, PEER, 1.6) == []
    assert uas.tick(5.0) == [] and not uas.dialogs


def test_refer_then_notify_reports_the_transfer() -> None:
    uas = core()
    key, tag, _ = answered(uas)
    uas.receive(in_dialog("ACK", tag, cseq=1), PEER, 0.1)
    effects = uas.refer(key, "+15555550100", 1.0)
    refer = sent(effects)[0]
    assert isinstance(refer, SipRequest) and refer.method == "REFER"
    assert refer.headers.get("Refer-To") == "<sip:+15555550100@127.0.0.1:5062;user=phone>"
    accepted = (
        f"SIP/2.0 202 Accepted\r\nVia: {refer.headers.get('Via')}\r\n"
        f"From: {refer.headers.get('From')}\r\nTo: {refer.headers.get('To')}\r\n"
        f"Call-ID: {refer.call_id}\r\nCSeq: {refer.cseq[0]} REFER\r\n"
        f"Content-Length: 0\r\n\r\n"
    ).encode()
    assert uas.receive(accepted, PEER, 1.1) == []
    notify = in_dialog(
        "NOTIFY",
        tag,
        cseq=3,
        branch="z9hG4bK-n",
        body="SIP/2.0 200 OK\r\n",
        content_type="message/sipfrag",
    )
    effects = uas.receive(notify, PEER, 2.0)
    assert statuses(effects) == [200] and TransferDone(key, True, 200) in effects


@pytest.mark.parametrize(
    ("record_route", "uri", "routes"),
    [
        # No proxy: straight to the caller's Contact.
        ("", "sip:tester@127.0.0.1:5062", []),
        # Loose routers (Kamailio, every current proxy): Route set in order, target unchanged.
        ("Record-Route: <sip:10.0.0.1;lr;ftag=x>, <sip:10.0.0.2:5070;lr>\r\n",
         "sip:tester@127.0.0.1:5062", ["<sip:10.0.0.1;lr;ftag=x>", "<sip:10.0.0.2:5070;lr>"]),
        # Two Record-Route rows read the same as one comma-joined row.
        ("Record-Route: <sip:10.0.0.1;lr>\r\nRecord-Route: <sip:10.0.0.2;lr>\r\n",
         "sip:tester@127.0.0.1:5062", ["<sip:10.0.0.1;lr>", "<sip:10.0.0.2;lr>"]),
        # A strict router (RFC 2543): it becomes the Request-URI, the target the last Route.
        ("Record-Route: <sip:10.0.0.1>\r\n",
         "sip:10.0.0.1", ["<sip:tester@127.0.0.1:5062>"]),
    ],
)
def test_in_dialog_requests_follow_the_record_route(
    record_route: str, uri: str, routes: list[str]
) -> None:
    """RFC 3261 12.1.1/12.2.1.1: a call that came through a proxy is hung up through it."""
    uas = core()
    key, tag, effects = answered(uas, extra=record_route)
    ok = sent(effects)[0]
    assert isinstance(ok, SipResponse)
    assert ok.headers.get_all("Record-Route") == routes if "lr" in record_route else True
    uas.receive(in_dialog("ACK", tag, cseq=1), PEER, 0.1)
    bye = sent(uas.hangup(key, 1.0))[0]
    assert isinstance(bye, SipRequest) and bye.method == "BYE"
    assert bye.uri == uri
    assert bye.headers.get_all("Route") == routes


def test_the_ack_of_a_486_ends_its_transaction_and_is_not_counted_as_dropped() -> None:
    """Every refusal at capacity used to count its ACK in gateway_sip_dropped_total as "ACK for
    no dialog": the caller's ACK of a non-2xx final is part of the INVITE transaction."""
    uas = core(max_calls=1)
    answered(uas)
    effects = uas.receive(invite(call_id="c2", branch="z9hG4bK-c2"), PEER, 1.0)
    (busy,) = sent(effects)
    assert isinstance(busy, SipResponse) and busy.status == 486
    # RFC 3261 17.1.1.3: the ACK has the INVITE's branch and the response's To tag.
    ack = in_dialog("ACK", busy.to_tag or "", call_id="c2", cseq=1, branch="z9hG4bK-c2")
    assert uas.receive(ack, PEER, 1.1) == []
    # An ACK that matches nothing still is a stray.
    stray = in_dialog("ACK", "nobody", call_id="c9", cseq=1, branch="z9hG4bK-c9")
    assert [type(e).__name__ for e in uas.receive(stray, PEER, 1.2)] == ["Dropped"]


def test_the_ack_of_a_reject_is_absorbed_too() -> None:
    uas = core()
    effects = uas.receive(invite(call_id="c3", branch="z9hG4bK-c3"), PEER, 0.0)
    incoming = next(e for e in effects if isinstance(e, IncomingCall))
    (busy,) = sent(uas.reject(incoming.key, 486, 0.1))
    assert isinstance(busy, SipResponse) and busy.status == 486
    ack = in_dialog("ACK", busy.to_tag or "", call_id="c3", cseq=1, branch="z9hG4bK-c3")
    assert uas.receive(ack, PEER, 0.2) == []
