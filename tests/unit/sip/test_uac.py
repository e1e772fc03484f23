"""The sans-I/O SIP user agent client (gateway.sip.uac) on a virtual clock, no sockets.

First against a scripted peer (responses built from what the phone sent), for the exact RFC 3261
timers and messages; then against the gateway's own :class:`~gateway.sip.uas.UasCore`, the two
sans-I/O cores exchanging datagrams in memory with a network that can delay and lose them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from gateway.sip.digest import DigestAuthenticator
from gateway.sip.message import (
    SipRequest,
    SipResponse,
    build_request,
    parse_message,
    response_to,
)
from gateway.sip.sdp import parse_sdp
from gateway.sip.uac import (
    T2,
    Action,
    Anomaly,
    Answered,
    AnswerUnusable,
    AuthAnswered,
    ByeSent,
    Cancelled,
    CancelTimer,
    HungUp,
    MediaChanged,
    MediaPlan,
    Provisional,
    ReinviteDone,
    Rejected,
    RemoteHangup,
    SendTo,
    SetTimer,
    SetupTimedOut,
    Timers,
    TransferRequested,
    UacConfig,
    UacCore,
    UacError,
)
from gateway.sip.uas import (
    AdmissionQuestion,
    CallAnswered,
    CallConfirmed,
    CallEnded,
    IncomingCall,
    TransferDone,
    UasConfig,
    UasCore,
)
from gateway.sip.uas import MediaChanged as UasMediaChanged
from gateway.sip.uas import SendTo as UasSendTo
from tests.support.clocks import VirtualClock

E = TypeVar("E")
PHONE = ("127.0.0.1", 5070)
PEER = ("127.0.0.1", 5080)
T1 = 0.5


def sdp(port: int = 16000, direction: str = "sendrecv", formats: str = "0 101") -> bytes:
    return (
        "v=0\r\no=peer 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
        f"m=audio {port} RTP/AVP {formats}\r\na=rtpmap:0 PCMU/8000\r\n"
        "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-15\r\na=ptime:20\r\n"
        f"a={direction}\r\n"
    ).encode()


class Phone:
    """A :class:`UacCore` with an in-memory shell: its timers on the virtual clock, what it sends
    and what it reports collected, datagrams optionally handed to a peer (``network``)."""

    def __init__(self, clock: VirtualClock, **config: Any) -> None:
        self.clock = clock
        options: dict[str, Any] = {"local_ip": "127.0.0.1", "sip_port": PHONE[1],
                                   "rtp_port": 40000, "caller_id": "tester"}
        self.core = UacCore(UacConfig(**{**options, **config}), clock)
        self.timers = Timers(clock, lambda timer: self.apply(self.core.timer_fired(timer)))
        #: (time, message, address) of every datagram sent, in order.
        self.sent: list[tuple[float, SipRequest | SipResponse, tuple[str, int]]] = []
        self.raw: list[bytes] = []
        self.events: list[Action] = []
        self.network: Callable[[bytes, tuple[str, int]], None] | None = None
        self._read = 0

    def apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendTo):
                self.sent.append((self.clock.now(), parse_message(action.data), action.addr))
                self.raw.append(action.data)
                if self.network is not None:
                    self.network(action.data, action.addr)
            elif isinstance(action, SetTimer | CancelTimer):
                self.timers.apply(action)
            else:
                self.events.append(action)

    def receive(self, message: SipRequest | SipResponse | bytes, source: tuple[str, int] = PEER
                ) -> None:
        data = message if isinstance(message, bytes) else message.serialize()
        self.apply(self.core.receive(data, source))

    def new(self) -> list[SipRequest | SipResponse]:
        """Messages sent since the last call."""
        out = [m for _, m, _ in self.sent[self._read:]]
        self._read = len(self.sent)
        return out

    def request(self, method: str) -> SipRequest:
        """The latest request of ``method`` sent."""
        for _, message, _ in reversed(self.sent):
            if isinstance(message, SipRequest) and message.method == method:
                return message
        raise AssertionError(f"no {method} sent; sent {[str(m)[:40] for _, m, _ in self.sent]}")

    def event(self, kind: type[E]) -> E:
        found = [e for e in self.events if isinstance(e, kind)]
        assert len(found) == 1, f"{kind.__name__}: {self.events}"
        return found[0]

    def anomalies(self) -> list[str]:
        return [e.reason for e in self.events if isinstance(e, Anomaly)]


def reply(request: SipRequest, status: int, *, tag: str | None = "peer",
          body: bytes = b"", headers: list[tuple[str, str]] | None = None) -> SipResponse:
    """The scripted peer's response (RFC 3261 8.2.6), with its Contact on a 2xx."""
    extra = list(headers or [])
    if 200 <= status < 300 and request.method == "INVITE":
        extra.append(("Contact", f"<sip:ivr@{PEER[0]}:{PEER[1]}>"))
    return response_to(request, status, to_tag=tag if status > 100 else None, headers=extra,
                       body=body, content_type="application/sdp" if body else None)


async def dial(clock: VirtualClock, timeout_s: float = 8.0, **config: Any
               ) -> tuple[Phone, SipRequest]:
    """A phone that has sent its INVITE (Timer B after ``timeout_s``); the INVITE."""
    phone = Phone(clock, **config)
    phone.apply(phone.core.invite(PEER, "ivr", timeout_s=timeout_s))
    return phone, phone.request("INVITE")


async def answered(clock: VirtualClock) -> tuple[Phone, SipRequest]:
    """A phone whose call is up (200 ACKed); its INVITE."""
    phone, invite = await dial(clock)
    phone.receive(reply(invite, 200, body=sdp()))
    assert phone.core.state == "confirmed"
    phone.new()
    return phone, invite


def in_dialog(phone: Phone, method: str, cseq: int, *, branch: str, body: bytes = b"",
              headers: list[tuple[str, str]] | None = None,
              content_type: str | None = None) -> SipRequest:
    """A request the peer sends in the phone's dialog."""
    invite = phone.request("INVITE")
    return build_request(
        method, f"sip:tester@127.0.0.1:{PHONE[1]}", call_id=invite.call_id,
        from_=f"<sip:ivr@{PEER[0]}:{PEER[1]}>;tag=peer",
        to=invite.headers.get("From") or "", cseq=cseq, via_host=PEER[0], via_port=PEER[1],
        branch=branch, contact=f"<sip:ivr@{PEER[0]}:{PEER[1]}>", headers=headers or [],
        body=body, content_type=content_type or ("application/sdp" if body else None))


# --- a scripted peer ------------------------------------------------------------------------------


async def test_full_call_flow_invite_ringing_answer_ack_and_bye() -> None:
    clock = VirtualClock()
    phone, invite = await dial(clock)
    assert invite.uri == f"sip:ivr@{PEER[0]}:{PEER[1]}"
    assert invite.cseq == (1, "INVITE") and invite.from_tag == phone.core.local_tag
    assert (invite.top_via_branch or "").startswith("z9hG4bK") and invite.to_tag is None
    assert invite.headers.get("Contact") == f"<sip:tester@127.0.0.1:{PHONE[1]}>"
    offer = parse_sdp(invite.body).media[0]
    assert offer.port == 40000 and offer.formats == [0, 101] and offer.ptime == 20
    assert offer.direction == "sendrecv" and offer.fmtp[101] == "0-15"

    await clock.advance(0.1)
    phone.receive(reply(invite, 100))
    phone.receive(reply(invite, 180))
    assert [(e.status, e.at) for e in phone.events if isinstance(e, Provisional)] == \
        [(100, 0.1), (180, 0.1)]
    assert phone.core.state == "proceeding"
    await clock.advance(5.0)  # Timer A stopped with the first provisional (17.1.1.2)
    assert phone.core.invite_retransmits == 0 and len(phone.new()) == 1

    # A 2xx through a proxy: the route set is its Record-Route, reversed (12.1.2).
    ok = reply(invite, 200, body=sdp(16002), headers=[
        ("Record-Route", "<sip:p2.example;lr>"), ("Record-Route", "<sip:127.0.0.1:5999;lr>")])
    phone.receive(ok)
    answer = phone.event(Answered)
    assert answer.at == pytest.approx(5.1) and answer.answer.event_pt == 101
    assert answer.media == MediaPlan(("127.0.0.1", 16002), 0, 101, True)
    [ack] = phone.new()
    assert isinstance(ack, SipRequest) and ack.method == "ACK"
    assert ack.uri == f"sip:ivr@{PEER[0]}:{PEER[1]}" and ack.cseq == (1, "ACK")
    assert ack.to_tag == "peer" and ack.top_via_branch != invite.top_via_branch
    assert ack.headers.get_all("Route") == ["<sip:127.0.0.1:5999;lr>", "<sip:p2.example;lr>"]
    assert phone.sent[-1][2] == ("127.0.0.1", 5999)  # the next hop: the first route
    assert phone.core.status == 200 and phone.core.provisional == [100, 180]

    phone.apply(phone.core.hangup())
    bye = phone.request("BYE")
    assert bye.cseq == (2, "BYE") and bye.to_tag == "peer" and bye.call_id == invite.call_id
    assert bye.headers.get_all("Route") == ack.headers.get_all("Route")
    assert phone.event(ByeSent).at == pytest.approx(5.1) and phone.core.state == "terminating"
    await clock.advance(0.05)
    phone.receive(reply(bye, 200))
    assert phone.event(HungUp) == HungUp(200, "OK", pytest.approx(5.15))
    assert phone.core.state == "terminated" and phone.anomalies() == []
    assert len(phone.timers) == 0  # every timer off once nothing is pending


async def test_timer_a_doubles_until_timer_b_and_no_cancel_without_a_provisional() -> None:
    clock = VirtualClock()
    phone, invite = await dial(clock)  # Timer B: 8 s
    await clock.advance(10)
    sent = [(t, m) for t, m, _ in phone.sent]
    assert [t for t, _ in sent] == [0, 0.5, 1.5, 3.5, 7.5]  # T1, 2T1, 4T1, 8T1 (17.1.1.2)
    assert {m.serialize() for _, m in sent} == {invite.serialize()}
    assert phone.core.invite_retransmits == 4
    assert phone.event(SetupTimedOut) == SetupTimedOut(None)  # at Timer B, no CANCEL (9.1)
    assert phone.core.state == "terminated" and len(phone.timers) == 0
    # A 200 that turns up after all is ACKed and hung up: nobody is left holding a call.
    phone.new()
    phone.receive(reply(invite, 200, body=sdp()))
    ack, bye = phone.new()
    assert isinstance(ack, SipRequest) and ack.method == "ACK"
    assert isinstance(bye, SipRequest) and bye.method == "BYE"
    assert "after the call was given up" in phone.anomalies()[0]


async def test_setup_timeout_after_ringing_cancels_and_acks_the_487() -> None:
    clock = VirtualClock()
    phone, invite = await dial(clock, timeout_s=1.0)
    phone.receive(reply(invite, 180, tag="ring"))
    await clock.advance(1.0)
    cancel = phone.request("CANCEL")
    # 9.1: the INVITE's Request-URI, Call-ID, From, To (no tag), CSeq number and top Via.
    assert cancel.uri == invite.uri and cancel.cseq == (1, "CANCEL")
    assert cancel.headers.get_all("Via") == invite.headers.get_all("Via")
    assert cancel.to_tag is None and cancel.from_tag == invite.from_tag
    assert not any(isinstance(e, SetupTimedOut) for e in phone.events)  # waiting for the 487
    phone.receive(reply(cancel, 200, tag="ring"))
    phone.receive(reply(invite, 487, tag="ring"))
    ack = phone.request("ACK")
    # 17.1.1.3: same branch as the INVITE, the response's To tag.
    assert ack.headers.get_all("Via") == invite.headers.get_all("Via")
    assert ack.cseq == (1, "ACK") and ack.to_tag == "ring"
    assert phone.event(SetupTimedOut) == SetupTimedOut(487)
    assert phone.core.status == 487 and phone.core.provisional == [180]
    assert phone.anomalies() == [] and len(phone.timers) == 0


async def test_cancel_waits_for_a_provisional_then_a_crossed_200_is_acked_and_hung_up() -> None:
    clock = VirtualClock()
    phone, invite = await dial(clock)
    phone.new()
    phone.apply(phone.core.cancel())
    assert phone.new() == []  # 9.1: not before a provisional response
    await clock.advance(0.2)
    phone.receive(reply(invite, 180))
    cancel = phone.request("CANCEL")
    assert cancel.headers.get_all("Via") == invite.headers.get_all("Via")
    phone.receive(reply(cancel, 200))
    phone.receive(reply(invite, 200, body=sdp()))  # the callee answered as we cancelled
    assert [getattr(m, "method", None) for m in phone.new()] == ["CANCEL", "ACK", "BYE"]
    assert phone.event(Cancelled) == Cancelled(200)
    assert not any(isinstance(e, Answered) for e in phone.events)
    phone.receive(reply(phone.request("BYE"), 200))
    assert phone.event(HungUp).status == 200 and phone.core.state == "terminated"


async def test_cancel_while_ringing_ends_with_487() -> None:
    clock = VirtualClock()
    phone, invite = await dial(clock)
    phone.receive(reply(invite, 180))
    phone.new()
    phone.apply(phone.core.cancel())
    cancel = phone.request("CANCEL")
    await clock.advance(T1)
    assert [m.method for m in phone.new() if isinstance(m, SipRequest)] == ["CANCEL", "CANCEL"]
    phone.receive(reply(invite, 487))
    assert phone.event(Cancelled) == Cancelled(487)
    phone.receive(reply(cancel, 200))
    assert phone.anomalies() == [] and len(phone.timers) == 0


@pytest.mark.parametrize(("status", "reason"), [(486, "Busy Here"),
                                                (503, "Service Unavailable")])
async def test_refusals_are_final_acked_and_reacked_when_retransmitted(status: int,
                                                                       reason: str) -> None:
    clock = VirtualClock()
    phone, invite = await dial(clock)
    refusal = reply(invite, status, headers=[("Retry-After", "5")])
    phone.receive(refusal)
    assert phone.event(Rejected) == Rejected(status, reason)
    assert (phone.core.status, phone.core.reason, phone.core.state) == (status, reason,
                                                                        "terminated")
    ack = phone.request("ACK")
    assert ack.headers.get_all("Via") == invite.headers.get_all("Via")
    phone.new()
    phone.receive(refusal)  # our ACK was lost: the refusal comes again, the ACK goes again
    [again] = phone.new()
    assert again.serialize() == ack.serialize() and phone.core.final_retransmits == 1
    await clock.advance(64 * T1)
    assert phone.new() == [] and phone.anomalies() == []


async def test_a_lost_200_retransmitted_by_the_server_gets_the_same_ack_again() -> None:
    clock = VirtualClock()
    phone, invite = await dial(clock)
    ok = reply(invite, 200, body=sdp())
    phone.receive(ok)
    first = phone.request("ACK").serialize()
    for _ in range(2):
        phone.receive(ok)
    acks = [m.serialize() for m in phone.new() if getattr(m, "method", "") == "ACK"]
    assert acks == [first] * 3 and phone.core.final_retransmits == 2
    assert len([e for e in phone.events if isinstance(e, Answered)]) == 1
    # A 2xx from another fork of the call is not our dialog.
    phone.receive(reply(invite, 200, tag="other", body=sdp()))
    assert "another dialog" in phone.anomalies()[0] and phone.new() == []


@pytest.mark.parametrize(("status", "challenge", "credentials"), [
    (401, "WWW-Authenticate", "Authorization"),
    (407, "Proxy-Authenticate", "Proxy-Authorization"),
])
async def test_a_digest_challenge_is_answered_once(status: int, challenge: str,
                                                   credentials: str) -> None:
    clock = VirtualClock()
    auth = DigestAuthenticator("trunk.example", {"alice": "s3cret"}, b"k" * 32)
    phone, invite = await dial(clock, username="alice", password="s3cret")
    phone.receive(reply(invite, status, headers=[(challenge, auth.challenge_header())]))
    ack, again = phone.new()[1:]
    assert isinstance(ack, SipRequest) and ack.method == "ACK" and ack.cseq == (1, "ACK")
    assert ack.top_via_branch == invite.top_via_branch
    # 22.2: the same request with credentials, the next CSeq, a new branch.
    assert isinstance(again, SipRequest) and again.method == "INVITE"
    assert again.cseq == (2, "INVITE") and again.top_via_branch != invite.top_via_branch
    assert again.call_id == invite.call_id and again.from_tag == invite.from_tag
    assert again.body == invite.body
    assert auth.verify(again, credentials) == "alice"
    assert phone.event(AuthAnswered) == AuthAnswered("INVITE", status, ("trunk.example",))
    await clock.advance(T1)
    assert phone.new()[0].serialize() == again.serialize()  # Timer A runs for the new one
    phone.receive(reply(again, 200, body=sdp()))
    assert phone.core.state == "confirmed" and phone.request("ACK").cseq == (2, "ACK")
    phone.apply(phone.core.hangup())
    assert phone.request("BYE").cseq == (3, "BYE")


async def test_refused_credentials_are_final_but_a_stale_nonce_is_retried() -> None:
    clock = VirtualClock()
    # Nonces are stamped on the authenticator's own (wall) clock; the stale one is asked for.
    auth = DigestAuthenticator("gw", {"alice": "s3cret"}, b"k" * 32)
    wrong, invite = await dial(clock, username="alice", password="guess")
    wrong.receive(reply(invite, 401, headers=[("WWW-Authenticate", auth.challenge_header())]))
    retry = wrong.request("INVITE")
    assert auth.check(retry).reason.startswith("wrong response")
    wrong.receive(reply(retry, 401, headers=[("WWW-Authenticate", auth.challenge_header())]))
    assert wrong.event(Rejected) == Rejected(401, "Unauthorized")  # asking again won't help
    assert len([m for m in wrong.new() if getattr(m, "method", "") == "INVITE"]) == 2

    stale, invite = await dial(clock, username="alice", password="s3cret")
    stale.receive(reply(invite, 401, headers=[("WWW-Authenticate", auth.challenge_header())]))
    retry = stale.request("INVITE")
    stale.receive(reply(retry, 401, headers=[("WWW-Authenticate",
                                              auth.challenge_header(stale=True))]))
    third = stale.request("INVITE")
    assert third.cseq == (3, "INVITE") and auth.verify(third) == "alice"

    anonymous, invite = await dial(clock)
    anonymous.receive(reply(invite, 401, headers=[("WWW-Authenticate",
                                                   auth.challenge_header())]))
    assert anonymous.event(Rejected).status == 401  # no credentials: the final answer


async def test_non_invite_timer_e_caps_at_t2_and_timer_f_gives_up() -> None:
    clock = VirtualClock()
    phone, _ = await answered(clock)
    start = clock.now()
    phone.apply(phone.core.hangup(timeout_s=12.0))
    await clock.advance(13)
    times = [round(t - start, 3) for t, m, _ in phone.sent if getattr(m, "method", "") == "BYE"]
    # 17.1.2.2: T1, 2T1, 4T1, then every T2 (4 s) until Timer F.
    assert times == [0, 0.5, 1.5, 3.5, 7.5, 11.5]
    assert phone.event(HungUp) == HungUp(None, "", pytest.approx(start + 12))
    assert phone.anomalies() == ["BYE: no final response within 12 s"]
    assert phone.core.state == "terminated" and len(phone.timers) == 0


async def test_a_provisional_to_a_bye_slows_its_retransmissions_to_t2() -> None:
    clock = VirtualClock()
    phone, _ = await answered(clock)
    phone.apply(phone.core.hangup())
    bye = phone.request("BYE")
    phone.receive(reply(bye, 100))
    await clock.advance(4.5)
    assert [round(t, 1) for t, m, _ in phone.sent if getattr(m, "method", "") == "BYE"] == \
        [0, 4]


async def test_remote_bye_is_answered_and_its_retransmission_gets_the_same_200() -> None:
    clock = VirtualClock()
    phone, _ = await answered(clock)
    await clock.advance(2)
    bye = in_dialog(phone, "BYE", 1, branch="z9hG4bK-bye")
    phone.receive(bye)
    [ok] = phone.new()
    assert isinstance(ok, SipResponse) and ok.status == 200
    assert ok.to_tag == phone.core.local_tag and ok.cseq == (1, "BYE")
    assert phone.event(RemoteHangup) == RemoteHangup(2.0)
    phone.receive(bye)
    [again] = phone.new()
    assert again.serialize() == ok.serialize()
    assert phone.core.requests_received == {"BYE": 2} and phone.core.state == "terminated"
    assert phone.core.hangup() == []  # nothing left to end


async def test_refer_is_accepted_and_the_outcome_notified() -> None:
    clock = VirtualClock()
    phone, _ = await answered(clock)
    refer = in_dialog(phone, "REFER", 1, branch="z9hG4bK-refer",
                      headers=[("Refer-To", "<sip:agent@127.0.0.1:5099>")])
    phone.receive(refer)
    [accepted] = phone.new()
    assert isinstance(accepted, SipResponse) and accepted.status == 202
    assert phone.event(TransferRequested) == TransferRequested("sip:agent@127.0.0.1:5099")
    assert phone.core.transferred_to == "sip:agent@127.0.0.1:5099"
    phone.apply(phone.core.report_transfer(503, "Service Unavailable"))
    notify = phone.request("NOTIFY")
    assert notify.body == b"SIP/2.0 503 Service Unavailable\r\n"
    assert notify.headers.get("Content-Type") == "message/sipfrag;version=2.0"
    assert notify.headers.get("Event") == "refer"
    assert notify.headers.get("Subscription-State") == "terminated;reason=noresource"
    phone.receive(reply(notify, 200))
    for bad, reason in ((None, "Missing Refer-To"), ("<not a uri", "Bad Refer-To")):
        headers = [("Refer-To", bad)] if bad else []
        phone.receive(in_dialog(phone, "REFER", 5, branch=f"z9hG4bK-{reason[:3]}",
                                headers=headers))
        response = phone.new()[-1]
        assert isinstance(response, SipResponse) and (response.status, response.reason) == (
            400, reason)
    assert len(phone.anomalies()) == 2


async def test_a_re_invite_to_hold_is_answered_and_the_200_retransmitted_until_acked() -> None:
    clock = VirtualClock()
    phone, _ = await answered(clock)
    hold = in_dialog(phone, "INVITE", 2, branch="z9hG4bK-hold",
                     body=sdp(16004, direction="sendonly"))
    phone.receive(hold)
    assert phone.event(MediaChanged).media == MediaPlan(("127.0.0.1", 16004), 0, 101, False)
    [ok] = phone.new()
    assert isinstance(ok, SipResponse) and ok.status == 200
    answer = parse_sdp(ok.body)
    assert answer.media[0].direction == "recvonly" and answer.origin.version == 2
    await clock.advance(1.6)  # 13.3.1.4: again at T1 and 3 T1 without the ACK
    assert [m.serialize() for m in phone.new()] == [ok.serialize()] * 2
    phone.receive(in_dialog(phone, "ACK", 2, branch="z9hG4bK-hold-ack"))
    await clock.advance(64 * T1)
    assert phone.new() == [] and phone.anomalies() == []


async def test_hold_by_re_invite_and_glare_gets_491() -> None:
    clock = VirtualClock()
    phone, _ = await answered(clock)
    phone.apply(phone.core.reinvite("sendonly"))
    offer = phone.request("INVITE")
    assert offer.cseq == (2, "INVITE") and offer.to_tag == "peer"
    assert parse_sdp(offer.body).media[0].direction == "sendonly"
    assert parse_sdp(offer.body).origin.version == 2
    with pytest.raises(UacError, match="pending"):
        phone.core.reinvite("sendrecv")
    theirs = in_dialog(phone, "INVITE", 2, branch="z9hG4bK-glare", body=sdp())
    phone.receive(theirs)
    glare = phone.new()[-1]
    assert isinstance(glare, SipResponse) and glare.status == 491  # 14.2
    phone.receive(reply(offer, 200, body=sdp(16006, direction="recvonly")))
    ack = phone.request("ACK")
    assert ack.cseq == (2, "ACK")
    assert phone.event(MediaChanged).media == MediaPlan(("127.0.0.1", 16006), 0, 101, True)
    assert phone.event(ReinviteDone) == ReinviteDone("sendonly", 200)
    # A refused re-INVITE is ACKed in its transaction and leaves the call up.
    phone.apply(phone.core.reinvite("sendrecv"))
    resume = phone.request("INVITE")
    phone.receive(reply(resume, 488))
    assert phone.request("ACK").top_via_branch == resume.top_via_branch
    assert phone.core.state == "confirmed"
    assert "re-INVITE (sendrecv) answered 488" in phone.anomalies()[-1]


async def test_malformed_and_stray_responses_are_dropped_with_a_reason_and_the_call_goes_on(
) -> None:
    clock = VirtualClock()
    phone, invite = await dial(clock)
    good = reply(invite, 200, body=sdp())
    no_tag = reply(invite, 200, tag=None, body=sdp())
    wrong_cseq = good.serialize().replace(b"CSeq: 1 INVITE", b"CSeq: 7 INVITE")
    broken_cseq = good.serialize().replace(b"CSeq: 1 INVITE", b"CSeq: one INVITE")
    stranger = good.serialize().replace(invite.call_id.encode(), b"someone-else")
    for junk in (b"\x00\xff garbage", no_tag.serialize(), wrong_cseq, broken_cseq, stranger,
                 b"\r\n\r\n"):
        phone.receive(junk)
    reasons = phone.anomalies()
    assert len(reasons) == 5, reasons
    assert "unparseable datagram" in reasons[0]
    assert "without a To tag" in reasons[1]
    assert "CSeq 7, not 1" in reasons[2]
    assert "unparseable datagram" in reasons[3] and "malformed CSeq" in reasons[3]
    assert "unknown Call-ID" in reasons[4]
    assert phone.core.state == "calling" and phone.new() == [invite]  # nothing answered
    phone.receive(good)
    assert phone.core.state == "confirmed"
    # In the dialog: a response to nothing of ours, and one without a Via, change nothing.
    bye_like = good.serialize().replace(b"CSeq: 1 INVITE", b"CSeq: 9 BYE")
    no_via = b"\r\n".join(line for line in good.serialize().split(b"\r\n")
                          if not line.startswith(b"Via"))
    phone.receive(bye_like)
    phone.receive(no_via)
    assert len(phone.anomalies()) == 7 and phone.core.state == "confirmed"
    assert "unexpected response 200 to BYE" in phone.anomalies()[5]
    assert "missing mandatory header field(s): Via" in phone.anomalies()[6]
    phone.apply(phone.core.hangup())
    phone.receive(reply(phone.request("BYE"), 200))
    assert phone.event(HungUp).status == 200


async def test_an_unusable_answer_is_acked_and_hung_up() -> None:
    clock = VirtualClock()
    phone, invite = await dial(clock)
    phone.receive(reply(invite, 200, body=sdp(formats="8", direction="sendrecv")
                        .replace(b"a=rtpmap:0 PCMU/8000", b"a=rtpmap:8 PCMA/8000")))
    assert "no PCMU" in str(phone.event(AnswerUnusable).error)
    assert [getattr(m, "method", None) for m in phone.new()] == ["INVITE", "ACK", "BYE"]
    assert not any(isinstance(e, Answered) for e in phone.events)


async def test_requests_outside_the_dialog_get_481_and_options_200() -> None:
    clock = VirtualClock()
    phone, _ = await answered(clock)
    options = in_dialog(phone, "OPTIONS", 3, branch="z9hG4bK-o")
    phone.receive(options)
    stranger = build_request("BYE", "sip:tester@127.0.0.1", call_id="nobody",
                             from_="<sip:x@y>;tag=1", to="<sip:tester@127.0.0.1>;tag=2", cseq=1,
                             via_host="10.0.0.9", via_port=5060)
    phone.receive(stranger, ("10.0.0.9", 5060))
    info = in_dialog(phone, "INFO", 4, branch="z9hG4bK-i")
    phone.receive(info)
    statuses = [m.status for m in phone.new() if isinstance(m, SipResponse)]
    assert statuses == [200, 481, 405]
    assert phone.core.state == "confirmed" and len(phone.anomalies()) == 2


async def test_misuse_raises() -> None:
    clock = VirtualClock()
    phone, _ = await dial(clock)
    with pytest.raises(UacError, match="one call"):
        phone.core.invite(PEER, "ivr")
    with pytest.raises(UacError, match="no call"):
        phone.core.reinvite("sendonly")
    assert phone.core.hangup() == [] and phone.core.report_transfer(503, "x") == []
    phone.apply(phone.core.close())
    assert len(phone.timers) == 0 and phone.core.state == "terminated"


# --- against the gateway's own UAS, in memory -----------------------------------------------------


@dataclass
class Network:
    """Datagrams between the two cores, 5 ms each way, some of them lost on purpose."""

    clock: VirtualClock
    phone: Phone
    gateway: Gateway
    latency: float = 0.005
    #: Datagrams for which this returns True are lost (once each, by index in ``log``).
    lose: Callable[[bytes], bool] = lambda data: False
    log: list[tuple[str, bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.phone.network = lambda data, addr: self.carry("phone", data, addr)
        self.gateway.network = lambda data, addr: self.carry("gateway", data, addr)

    def carry(self, sender: str, data: bytes, addr: tuple[str, int]) -> None:
        self.log.append((sender, data))
        if self.lose(data):
            return
        if sender == "phone":
            assert addr == PEER, addr
            self.clock.call_later(self.latency, lambda: self.gateway.receive(data, PHONE))
        else:
            assert addr == PHONE, addr
            self.clock.call_later(self.latency, lambda: self.phone.receive(data, PEER))

    def lines(self, sender: str) -> list[str]:
        return [data.split(b"\r\n", 1)[0].decode() for who, data in self.log if who == sender]


class Gateway:
    """:class:`UasCore` with its shell's duties done in memory: timers from ``next_deadline``
    on the same virtual clock, every INVITE answered at once (media on port 30000)."""

    def __init__(self, clock: VirtualClock, admission: AdmissionQuestion | None = None,
                 **config: Any) -> None:
        self.clock = clock
        self.core = UasCore(UasConfig(local_ip=PEER[0], local_port=PEER[1], t1=T1, **config),
                            admission=admission)
        self.events: list[Any] = []
        self.network: Callable[[bytes, tuple[str, int]], None] | None = None
        self._tick: Any = None

    def receive(self, data: bytes, source: tuple[str, int]) -> None:
        self.apply(self.core.receive(data, source, self.clock.now()))

    def apply(self, effects: list[Any]) -> None:
        for effect in effects:
            if isinstance(effect, UasSendTo):
                assert self.network is not None
                self.network(effect.data, effect.addr)
            else:
                self.events.append(effect)
                if isinstance(effect, IncomingCall):
                    self.apply(self.core.answer(effect.key, "127.0.0.1", 30000,
                                                self.clock.now()))
        self._schedule()

    def _schedule(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
        deadline = self.core.next_deadline()
        if deadline is not None:
            self._tick = self.clock.call_later(
                deadline - self.clock.now(),
                lambda: self.apply(self.core.tick(self.clock.now())))

    def key(self) -> str:
        return next(e.key for e in self.events if isinstance(e, IncomingCall))


def pair(clock: VirtualClock, phone_config: dict[str, Any] | None = None,
         **gateway_config: Any) -> tuple[Phone, Gateway, Network]:
    phone = Phone(clock, **(phone_config or {}))
    gateway = Gateway(clock, **gateway_config)
    return phone, gateway, Network(clock, phone, gateway)


async def test_against_the_uas_a_whole_call_hold_resume_transfer_and_bye() -> None:
    clock = VirtualClock()
    phone, gateway, network = pair(clock)
    phone.apply(phone.core.invite(PEER, "ivr"))
    await clock.advance(0.1)
    answered_ = phone.event(Answered)
    assert answered_.media == MediaPlan(("127.0.0.1", 30000), 0, 101, True)
    assert answered_.at == pytest.approx(0.01)  # one round trip
    assert [type(e) for e in gateway.events] == [IncomingCall, CallAnswered, CallConfirmed]
    assert phone.core.provisional == [100]
    key = gateway.key()

    phone.apply(phone.core.reinvite("sendonly"))
    await clock.advance(0.1)
    assert phone.event(ReinviteDone) == ReinviteDone("sendonly", 200)
    held = [e for e in gateway.events if isinstance(e, UasMediaChanged)]
    assert held[-1].answer.on_hold and held[-1].answer.direction == "recvonly"
    assert phone.event(MediaChanged).media.send  # we keep sending; the gateway stops
    await clock.advance(2 * T2)
    assert gateway.core.dialogs[key].ok is None  # the re-INVITE's 200 was ACKed

    gateway.apply(gateway.core.refer(key, "+15555550100", clock.now()))
    await clock.advance(0.1)
    target = phone.event(TransferRequested).target
    assert "+15555550100" in target
    phone.apply(phone.core.report_transfer(503, "Service Unavailable"))
    await clock.advance(0.1)
    assert [e for e in gateway.events if isinstance(e, TransferDone)] == [
        TransferDone(key, False, 503)]

    phone.apply(phone.core.hangup())
    await clock.advance(0.1)
    assert phone.event(HungUp).status == 200
    assert gateway.events[-1] == CallEnded(key, "bye")
    await clock.advance(64 * T1)
    assert phone.anomalies() == [] and len(phone.timers) == 0
    assert not gateway.core.dialogs and gateway.core.next_deadline() is None
    assert network.lines("phone") == [
        f"INVITE sip:ivr@{PEER[0]}:{PEER[1]} SIP/2.0", f"ACK sip:ivr@{PEER[0]}:{PEER[1]} SIP/2.0",
        f"INVITE sip:ivr@{PEER[0]}:{PEER[1]} SIP/2.0", f"ACK sip:ivr@{PEER[0]}:{PEER[1]} SIP/2.0",
        "SIP/2.0 202 Accepted", f"NOTIFY sip:ivr@{PEER[0]}:{PEER[1]} SIP/2.0",
        f"BYE sip:ivr@{PEER[0]}:{PEER[1]} SIP/2.0"]


async def test_against_the_uas_its_bye_its_lost_200_and_its_digest_challenge() -> None:
    clock = VirtualClock()
    auth = DigestAuthenticator("ivr", {"trunk": "s3cret"}, b"k" * 32)
    phone, gateway, network = pair(clock, {"username": "trunk", "password": "s3cret"},
                                   authenticator=auth)
    lost: list[bytes] = []

    def lose_first_200(data: bytes) -> bool:
        if data.startswith(b"SIP/2.0 200") and b"INVITE" in data and not lost:
            lost.append(data)
            return True
        return False

    network.lose = lose_first_200
    phone.apply(phone.core.invite(PEER, "ivr"))
    await clock.advance(0.1)
    assert phone.event(AuthAnswered).realms == ("ivr",)
    assert gateway.core.stats["challenged"] == 1
    assert lost and not any(isinstance(e, Answered) for e in phone.events)
    await clock.advance(T1)  # the gateway retransmits its 200 (13.3.1.4); the phone ACKs it
    assert phone.event(Answered).at == pytest.approx(T1 + 0.02, abs=0.01)
    assert CallConfirmed(gateway.key()) in gateway.events

    gateway.apply(gateway.core.hangup(gateway.key(), clock.now()))
    await clock.advance(0.1)
    assert phone.event(RemoteHangup) and phone.core.state == "terminated"
    await clock.advance(64 * T1)
    assert not gateway.core.dialogs and phone.anomalies() == []
    assert network.lines("phone")[:3] == [f"INVITE sip:ivr@{PEER[0]}:{PEER[1]} SIP/2.0",
                                          f"ACK sip:ivr@{PEER[0]}:{PEER[1]} SIP/2.0",
                                          f"INVITE sip:ivr@{PEER[0]}:{PEER[1]} SIP/2.0"]


async def test_against_the_uas_at_capacity_486_and_a_cancel_before_the_answer() -> None:
    clock = VirtualClock()
    phone, gateway, _ = pair(clock, admission=lambda: "at_capacity")
    phone.apply(phone.core.invite(PEER, "ivr"))
    await clock.advance(0.1)
    assert phone.event(Rejected) == Rejected(486, "Busy Here")
    await clock.advance(64 * T1)
    assert phone.core.final_retransmits == 0 and phone.anomalies() == []

    # A gateway that rings and never answers: the phone's CANCEL gets the 487.
    clock2 = VirtualClock()
    phone, gateway, _ = pair(clock2)
    gateway.apply = _ringing_only(gateway)  # type: ignore[method-assign]
    phone.apply(phone.core.invite(PEER, "ivr", timeout_s=2.0))
    await clock2.advance(3.0)
    assert phone.event(SetupTimedOut) == SetupTimedOut(487)
    assert [type(e) for e in gateway.events][-1] is CallEnded
    assert gateway.events[-1].reason == "cancel" and phone.anomalies() == []


def _ringing_only(gateway: Gateway) -> Callable[[list[Any]], None]:
    """The gateway's shell that never answers (a call left ringing)."""
    original = Gateway.apply

    def apply(effects: list[Any]) -> None:
        kept = [e for e in effects if not isinstance(e, IncomingCall)]
        gateway.events += [e for e in effects if isinstance(e, IncomingCall)]
        original(gateway, kept)

    return apply


@pytest.mark.parametrize("name", ["gateway.sip.uac", "gateway.loadsim.rtp_out",
                                  "gateway.loadsim.rtp_log"])
def test_the_core_does_no_io_of_its_own(name: str) -> None:
    """Sans-I/O (STYLE.md 1, 8): no socket, no event loop, no clock but the injected one; for
    the SIP client core and the simulated phone's RTP units that its shell drives."""
    import ast
    import importlib
    from pathlib import Path

    module = importlib.import_module(name)
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert not imported & {"asyncio", "socket", "selectors", "threading", "time"}, imported
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not {c for c in calls if c.startswith(("time.", "asyncio.", "loop."))}
