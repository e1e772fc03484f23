"""Sans-I/O SIP user agent client: one outgoing call, as a phone places it (RFC 3261 over UDP).

:class:`UacCore` is the mirror of :class:`gateway.sip.uas.UasCore`. It is fed datagrams
(:meth:`~UacCore.receive`) and timer expiries (:meth:`~UacCore.timer_fired`) and is told what
the phone's user does (:meth:`~UacCore.invite`, :meth:`~UacCore.cancel`,
:meth:`~UacCore.hangup`, :meth:`~UacCore.reinvite`, :meth:`~UacCore.report_transfer`); each
returns a list of actions: :class:`~gateway.sip.uas.SendTo` (a datagram for an address),
:class:`SetTimer` / :class:`CancelTimer`, and events for the application. It never touches a
socket and reads time only from the injected :class:`gateway.clock.Clock`, so every timer is
tested on a virtual clock and the core can talk to a :class:`~gateway.sip.uas.UasCore` in memory.
Messages are parsed and built by :mod:`gateway.sip.message`, SDP by :mod:`gateway.sip.sdp`,
digest credentials by :func:`gateway.sip.digest.authorization`.

What it does, per RFC 3261 unless noted:

- **INVITE** with an SDP offer (PCMU + telephone-event 0-15, ptime 20, sendrecv; RFC 3264,
  RFC 4733). Timer A retransmits from T1 doubling until any response (17.1.1.2); Timer B is the
  caller's setup timeout. A 2xx is ACKed in the dialog (13.2.2.4) and the ACK re-sent for
  every retransmitted 2xx; a final >= 300 is ACKed in the transaction (17.1.1.3, same branch)
  and re-ACKed when retransmitted. The 2xx fixes the dialog: the remote tag, the remote target
  (its Contact), the route set (its Record-Route, reversed: 12.1.2) and the next hop.
- **Digest** (22.2, 22.3): a 401/407 to any request but CANCEL is answered once with
  ``Authorization``/``Proxy-Authorization`` (again only for ``stale=true``), the request sent
  anew with a new branch and the next CSeq; without credentials it is the final answer.
- **CANCEL** (9.1): :meth:`UacCore.cancel`, or Timer B after a provisional response; never
  before a provisional (it waits for one). The 487 that follows is ACKed; a 2xx that crossed
  the CANCEL is ACKed and the call hung up with BYE (15).
- **Requests we send in the dialog** (12.2.1.1): BYE (:meth:`UacCore.hangup`), re-INVITE for
  hold and resume (RFC 3264 8.4), NOTIFY reporting a transfer's outcome (RFC 3515 2.4.5); Timer
  E retransmits non-INVITE requests from T1 doubling to T2 (T2 once a provisional came,
  17.1.2.2) until a final or Timer F.
- **Requests we receive**: BYE (200, :class:`RemoteHangup`), OPTIONS (200), REFER (202,
  :class:`TransferRequested`; the application reports the outcome), re-INVITE (200 with our
  answer, :class:`MediaChanged`; the 200 retransmitted until the ACK, 13.3.1.4; 491 while our
  own re-INVITE is pending, 14.2), anything else in the dialog 405, outside it 481.
  Retransmitted requests get the cached response (17.2).

What the network sends never raises: an unparseable datagram, a response with a broken
Via/CSeq/To, or one that matches no transaction of ours is reported as an :class:`Anomaly` and
dropped, and the call carries on. Misuse (a second :meth:`UacCore.invite`) raises
:class:`UacError`, a :class:`~gateway.errors.GatewayError`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from gateway.clock import Cancellable, Clock
from gateway.errors import GatewayError
from gateway.sip.digest import authorization, challenge_is_stale, parse_credentials
from gateway.sip.message import (
    SipKeepalive,
    SipParseError,
    SipRequest,
    SipResponse,
    build_request,
    dialog_route,
    new_branch,
    new_call_id,
    new_tag,
    parse_message,
    parse_name_addr,
    response_to,
    stamp_via,
    uri_hostport,
)
from gateway.sip.sdp import MediaAnswer, SdpError, negotiate, offer, parse_sdp, read_answer
from gateway.sip.uas import Addr, SendTo

__all__ = [
    "ALLOW",
    "BYE_TIMEOUT_S",
    "T1",
    "T2",
    "USER_AGENT",
    "Action",
    "Anomaly",
    "AnswerUnusable",
    "Answered",
    "AuthAnswered",
    "ByeSent",
    "CancelTimer",
    "Cancelled",
    "HungUp",
    "MediaChanged",
    "MediaPlan",
    "Provisional",
    "ReinviteDone",
    "Rejected",
    "RemoteHangup",
    "SendTo",
    "SetTimer",
    "SetupTimedOut",
    "TimerId",
    "Timers",
    "TransferRequested",
    "UacConfig",
    "UacCore",
    "UacError",
]

T1 = 0.5
"""RFC 3261 T1, the RTT estimate: the first retransmission interval."""
T2 = 4.0
"""RFC 3261 T2: the cap on non-INVITE (and 2xx) retransmission intervals."""
BYE_TIMEOUT_S = 5.0
"""How long a BYE the core sends by itself (a crossed 2xx, an unusable answer) may take."""
ALLOW = "INVITE, ACK, BYE, CANCEL, OPTIONS, REFER"
USER_AGENT = "gateway-uac"
PT_PCMU = 0

#: Client transactions and responses remembered for absorbing retransmissions (17.1, 17.2).
_REMEMBERED = 64
#: How many times one request is sent with credentials: once, and once more for a stale nonce.
_AUTH_ATTEMPTS = 2
_AUTH_HEADERS = {401: ("WWW-Authenticate", "Authorization"),
                 407: ("Proxy-Authenticate", "Proxy-Authorization")}


class UacError(GatewayError):
    """The core was asked for something its state does not allow (a programming error)."""


# --- actions ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TimerId:
    """Which timer: RFC 3261's letter (A, B, E, F; G and H for our 2xx to a re-INVITE) or
    ``cancel`` (the wait for the INVITE's final after a CANCEL), and the transaction's branch."""

    name: str
    branch: str


@dataclass(frozen=True, slots=True)
class SetTimer:
    """Call :meth:`UacCore.timer_fired` with ``timer`` at ``at`` (the injected clock's time),
    replacing any earlier setting of the same timer."""

    timer: TimerId
    at: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    """The timer is no longer wanted."""

    timer: TimerId


@dataclass(frozen=True, slots=True)
class MediaPlan:
    """Where and how to send RTP: to ``remote``, audio on ``audio_pt``, RFC 4733 events on
    ``event_pt`` (None: the far end takes none), or nothing while ``send`` is False (hold)."""

    remote: Addr
    audio_pt: int
    event_pt: int | None
    send: bool


@dataclass(frozen=True, slots=True)
class Provisional:
    """A 1xx to the INVITE (180 Ringing, 183 Session Progress...)."""

    status: int
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class Answered:
    """The call is up: the 2xx was ACKed; ``answer`` is its SDP, ``media`` what to send."""

    answer: MediaAnswer
    media: MediaPlan
    at: float


@dataclass(frozen=True, slots=True)
class Rejected:
    """The INVITE got a final response >= 300 (486 busy, 503 unavailable, 404...), ACKed."""

    status: int
    reason: str


@dataclass(frozen=True, slots=True)
class AnswerUnusable:
    """A 2xx whose SDP answer cannot be used: ACKed, and hung up with BYE (13.2.2.4)."""

    error: SdpError


@dataclass(frozen=True, slots=True)
class SetupTimedOut:
    """No final response before Timer B. After a provisional a CANCEL was sent; ``status`` is
    the final that then ended the INVITE (487, or a crossed 2xx, hung up), None if none came."""

    status: int | None


@dataclass(frozen=True, slots=True)
class Cancelled:
    """:meth:`UacCore.cancel` took effect; ``status`` as in :class:`SetupTimedOut`."""

    status: int | None


@dataclass(frozen=True, slots=True)
class AuthAnswered:
    """A 401/407 to ``method`` was answered with credentials for ``realms``; the request went
    out again."""

    method: str
    status: int
    realms: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ByeSent:
    """Our BYE went out (first transmission)."""

    at: float


@dataclass(frozen=True, slots=True)
class HungUp:
    """Our BYE's transaction ended: its final status, None without one before Timer F."""

    status: int | None
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class RemoteHangup:
    """The far end sent BYE (answered 200); media should stop."""

    at: float


@dataclass(frozen=True, slots=True)
class MediaChanged:
    """A re-INVITE (theirs or ours) changed where or whether RTP is sent."""

    media: MediaPlan


@dataclass(frozen=True, slots=True)
class ReinviteDone:
    """Our re-INVITE (hold ``sendonly`` / resume ``sendrecv``) ended: its final status, None
    without one in time."""

    direction: str
    status: int | None


@dataclass(frozen=True, slots=True)
class TransferRequested:
    """A REFER was accepted (202): the far end asks us to call ``target`` (RFC 3515). Report
    the outcome with :meth:`UacCore.report_transfer`."""

    target: str


@dataclass(frozen=True, slots=True)
class Anomaly:
    """Something the network sent or failed to send that a phone would log: dropped, or
    handled as well as it could be; the call carries on (unless a final event says not)."""

    reason: str


Action = SendTo | SetTimer | CancelTimer | Provisional | Answered | Rejected | AnswerUnusable | \
    SetupTimedOut | Cancelled | AuthAnswered | ByeSent | HungUp | RemoteHangup | MediaChanged | \
    ReinviteDone | TransferRequested | Anomaly


# --- configuration and state ------------------------------------------------------------------


@dataclass(frozen=True)
class UacConfig:
    """Who the phone is and where its sockets are (the shell binds them first)."""

    local_ip: str
    sip_port: int
    rtp_port: int
    #: The user of our From and Contact URIs.
    caller_id: str = "uac"
    #: RFC 3261's T1; a test or a private trunk may use less than 500 ms.
    t1: float = T1
    user_agent: str = USER_AGENT
    #: Digest credentials (RFC 3261 22); None: challenges are final answers.
    username: str | None = None
    password: str = ""
    #: SDP ``o=`` user and ``s=`` name of our offers.
    sdp_name: str = "-"


@dataclass
class _Client:
    """One client transaction (17.1): the request, its retransmission and what it is for."""

    purpose: str  # invite, reinvite, bye, cancel, notify
    request: SipRequest
    data: bytes
    dest: Addr
    branch: str
    deadline: float
    interval: float
    started: float = 0.0
    provisional: bool = False
    auth_attempts: int = 0
    #: For the INVITE: None while wanted, else why it is being ended (timeout, cancel) or
    #: "abandoned" once given up (a late final is still ACKed).
    ending: str | None = None
    direction: str = ""  # a re-INVITE's offered direction

    @property
    def method(self) -> str:
        return self.request.method

    @property
    def key(self) -> tuple[str, str]:
        # A CANCEL shares its INVITE's branch (9.1): the method tells them apart (17.1.3).
        return self.branch, self.request.method

    @property
    def timeout_s(self) -> float:
        return self.deadline - self.started


@dataclass(frozen=True)
class _Finished:
    """An ended INVITE transaction: the ACK to re-send when its final comes again."""

    ack: bytes
    dest: Addr
    to_tag: str | None
    success: bool


@dataclass
class _Ok:
    """Our 2xx to a re-INVITE, retransmitted until its ACK (13.3.1.4)."""

    data: bytes
    dest: Addr
    interval: float


class UacCore:
    """The SIP state machine of one outgoing call (see the module docstring).

    Read-only facts for the application: ``state`` (idle, calling, proceeding, confirmed,
    terminating, terminated), ``call_id``, ``status``/``reason`` (the INVITE's final),
    ``provisional`` (1xx codes in order), ``invite_retransmits`` (Timer A),
    ``final_retransmits`` (retransmitted finals re-ACKed), ``requests_received`` (method ->
    count), ``transferred_to`` (the latest REFER's target) and ``answer``.
    """

    def __init__(self, config: UacConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.t1 = config.t1
        self.state = "idle"
        self.call_id = ""
        self.local_tag = new_tag()
        self.status: int | None = None
        self.reason = ""
        self.provisional: list[int] = []
        self.invite_retransmits = 0
        self.final_retransmits = 0
        self.requests_received: dict[str, int] = {}
        self.transferred_to: str | None = None
        self.answer: MediaAnswer | None = None

        self._target: Addr = ("", 0)
        self._request_uri = ""
        self._from = ""
        self._to = ""
        self._contact = f"<sip:{config.caller_id}@{config.local_ip}:{config.sip_port}>"
        self._cseq = 0
        self._remote_tag: str | None = None
        self._remote_to = ""
        self._remote_target = ""
        self._route_set: list[str] = []
        self._dest: Addr = ("", 0)
        self._sdp_session = secrets.randbelow(1 << 31)
        self._sdp_version = 1
        self._invite: _Client | None = None  # the INVITE transaction that sets the call up
        self._cancel_pending = False
        self._clients: dict[tuple[str, str], _Client] = {}
        self._finished: dict[tuple[str, str], _Finished | None] = {}
        self._replies: dict[tuple[str, int, str, str], bytes] = {}
        self._ok: _Ok | None = None
        self._ok_branch = ""
        self._remote_bye = False
        self._armed: dict[TimerId, float] = {}

    # --- commands -----------------------------------------------------------------------------

    def invite(self, target: Addr, user: str, timeout_s: float | None = None) -> list[Action]:
        """Call ``sip:{user}@{host}:{port}`` at ``target``; Timer B fires after ``timeout_s``
        (default 64*T1). Raises :class:`UacError` when the core has placed its call already."""
        if self.state != "idle":
            raise UacError("a UacCore places one call; create another")
        now = self.clock.now()
        config = self.config
        self.state = "calling"
        self._target = target
        host, port = target
        self._request_uri = f"sip:{user}@{host}:{port}"
        self.call_id = new_call_id(config.local_ip)
        self._from = f"<sip:{config.caller_id}@{config.local_ip}>;tag={self.local_tag}"
        self._to = f"<{self._request_uri}>"
        self._cseq = 1
        branch = new_branch()
        request = self._request(
            "INVITE", self._request_uri, self._to, self._cseq, branch, contact=True,
            body=self._offer("sendrecv"),
            headers=[("Allow", ALLOW), ("User-Agent", config.user_agent)],
        )
        deadline = now + (64 * self.t1 if timeout_s is None else timeout_s)
        txn = _Client("invite", request, request.serialize(), target, branch, deadline, self.t1,
                      now)
        self._invite = txn
        return self._start(txn, now)

    def cancel(self) -> list[Action]:
        """Give up the call being set up (9.1): CANCEL now if a provisional came, else as soon
        as one does. :class:`Cancelled` follows. Nothing to do once the call is answered."""
        txn = self._invite
        if txn is None or txn.ending is not None or self.state not in ("calling", "proceeding"):
            return []
        txn.ending = "cancel"
        if not txn.provisional:
            self._cancel_pending = True
            return []
        return self._send_cancel(txn)

    def hangup(self, timeout_s: float = BYE_TIMEOUT_S) -> list[Action]:
        """End the answered call with BYE (Timer F after ``timeout_s``); :class:`ByeSent`, then
        :class:`HungUp`. Nothing (an empty list) unless the call is up."""
        if self.state != "confirmed":
            return []
        return self._bye(timeout_s)

    def reinvite(self, direction: str, timeout_s: float = 5.0) -> list[Action]:
        """Offer ``direction`` anew in the dialog (``sendonly`` holds the far end, ``sendrecv``
        resumes: RFC 3264 8.4); :class:`ReinviteDone` follows, and :class:`MediaChanged` when
        the answer is usable. Raises :class:`UacError` without a call or with a re-INVITE
        pending (RFC 3261 14.1)."""
        if self.state != "confirmed":
            raise UacError("no call in progress")
        if any(c.purpose == "reinvite" for c in self._clients.values()):
            raise UacError("a re-INVITE is already pending (RFC 3261 14.1)")
        self._sdp_version += 1
        now = self.clock.now()
        txn = self._in_dialog("reinvite", "INVITE", now + timeout_s,
                              body=self._offer(direction), extra=[("Allow", ALLOW)])
        txn.direction = direction
        return self._start(txn, now)

    def report_transfer(self, status: int, reason: str) -> list[Action]:
        """Tell the far end how the transfer it asked for ended (RFC 3515 2.4.5): a NOTIFY
        whose ``message/sipfrag`` body is the status line, ending the implicit subscription."""
        if self.state != "confirmed":
            return []
        now = self.clock.now()
        frag = f"SIP/2.0 {status} {reason}\r\n".encode()
        state = "terminated;reason=noresource" if status >= 200 else "active"
        txn = self._in_dialog(
            "notify", "NOTIFY", now + 64 * self.t1, body=frag,
            content_type="message/sipfrag;version=2.0",
            extra=[("Event", "refer"), ("Subscription-State", state)],
        )
        return self._start(txn, now)

    def close(self) -> list[Action]:
        """Forget the call without signalling (the shell is going away): every timer off."""
        self.state = "terminated"
        self._clients.clear()
        self._ok = None
        actions: list[Action] = [CancelTimer(timer) for timer in self._armed]
        self._armed.clear()
        return actions

    # --- input --------------------------------------------------------------------------------

    def receive(self, data: bytes, source: Addr) -> list[Action]:
        """Handle one datagram from ``source``."""
        try:
            message = parse_message(data)
        except SipKeepalive:
            return []  # CRLF keep-alive (RFC 5626 4.4.1)
        except SipParseError as exc:
            return [Anomaly(f"sip: unparseable datagram from {source}: {exc}")]
        try:
            if isinstance(message, SipRequest):
                return self._on_request(message, source)
            return self._on_response(message)
        except SipParseError as exc:
            what = message.method if isinstance(message, SipRequest) else \
                f"response {message.status}"
            return [Anomaly(f"sip: malformed {what} from {source} dropped: {exc}")]

    def timer_fired(self, timer: TimerId) -> list[Action]:
        """A timer set by :class:`SetTimer` is due."""
        if self._armed.pop(timer, None) is None:
            return []  # cancelled or replaced meanwhile
        now = self.clock.now()
        name = timer.name
        if name in ("G", "H"):
            return self._ok_timer(name, timer.branch, now)
        if name in ("A", "B", "cancel"):
            txn = self._clients.get((timer.branch, "INVITE"))
        else:
            txn = next((c for (branch, method), c in self._clients.items()
                        if branch == timer.branch and method != "INVITE"), None)
        if txn is None:
            return []
        if name == "A":
            if txn.provisional or txn.ending is not None or now >= txn.deadline:
                return []
            if txn is self._invite:
                self.invite_retransmits += 1
            txn.interval *= 2  # INVITE: doubling without a cap (17.1.1.2)
            return [SendTo(txn.data, txn.dest), self._set("A", txn.branch, now + txn.interval)]
        if name == "E":
            txn.interval = T2 if txn.provisional else min(2 * txn.interval, T2)
            return [SendTo(txn.data, txn.dest), self._set("E", txn.branch, now + txn.interval)]
        if name == "B":
            return self._invite_timeout(txn, now)
        if name == "F":
            return [*self._forget(txn), *self._client_done(txn, None, now)]
        if name == "cancel":
            return self._abandon(txn)
        return []

    # --- responses to our requests ------------------------------------------------------------

    def _on_response(self, response: SipResponse) -> list[Action]:
        status = response.status
        number, method = response.cseq
        branch = response.top_via_branch or ""
        to_tag = response.to_tag
        if response.call_id != self.call_id:
            return [Anomaly(f"sip: response {status} for an unknown Call-ID")]
        txn = self._clients.get((branch, method))
        if txn is None:
            return self._on_stray_response(response, branch, method, to_tag)
        if number != txn.request.cseq[0]:
            return [Anomaly(f"sip: response {status} to {method} with CSeq {number}, not "
                            f"{txn.request.cseq[0]}: dropped")]
        if method == "INVITE":
            if 200 <= status < 300 and not to_tag:
                return [Anomaly(f"sip: {status} to INVITE without a To tag (RFC 3261 12.1.1):"
                                " dropped")]
            return self._on_invite_response(txn, response)
        if status < 200:
            if not txn.provisional:
                # Proceeding: retransmit at T2 from now on (17.1.2.2).
                txn.provisional = True
                txn.interval = T2
                return [self._set("E", branch, self.clock.now() + T2)]
            return []
        now = self.clock.now()
        ended = self._forget(txn)
        if status in _AUTH_HEADERS and method != "CANCEL":
            retry = self._authenticate(txn, response, now)
            if retry is not None:
                return ended + retry
        return ended + self._client_done(txn, response, now)

    def _on_stray_response(self, response: SipResponse, branch: str, method: str,
                           to_tag: str | None) -> list[Action]:
        """A response to no live transaction: a retransmitted final, or a stranger."""
        key = (branch, method)
        if key not in self._finished:
            return [Anomaly(f"sip: unexpected response {response.status} to {method}")]
        finished = self._finished[key]
        if finished is None or response.status < 200:
            return []  # a non-INVITE final again, or a late provisional: harmless
        if finished.success and response.status < 300 and to_tag != finished.to_tag:
            return [Anomaly(f"sip: a second 2xx from another dialog (to-tag {to_tag}); "
                            "ignored")]
        # Our ACK was lost or is still in flight: send it again (13.2.2.4, 17.1.1.3).
        self.final_retransmits += 1
        return [SendTo(finished.ack, finished.dest)]

    def _on_invite_response(self, txn: _Client, response: SipResponse) -> list[Action]:
        status = response.status
        now = self.clock.now()
        if status < 200:
            actions: list[Action] = []
            if not txn.provisional:
                txn.provisional = True
                actions.append(self._unset("A", txn.branch))  # 17.1.1.2: Proceeding
            if txn is self._invite and txn.ending != "abandoned":
                self.provisional.append(status)
                if self.state == "calling":
                    self.state = "proceeding"
                actions.append(Provisional(status, response.reason, now))
                if self._cancel_pending:
                    self._cancel_pending = False
                    actions += self._send_cancel(txn)
            return actions
        actions = [*self._forget(txn), self._unset("cancel", txn.branch)]
        if status < 300:
            actions += self._confirm(txn, response)
        else:
            # 17.1.1.3: the transaction's own ACK: the INVITE's Request-URI, top Via (same
            # branch), From, Call-ID and CSeq number, and To from the response.
            to = response.headers.get("To") or txn.request.headers.get("To") or self._to
            ack = self._request("ACK", txn.request.uri, to, txn.request.cseq[0], txn.branch,
                                routes=txn.request.headers.get_all("Route"))
            data = ack.serialize()
            self._remember((txn.branch, "INVITE"), _Finished(data, txn.dest, None, False))
            actions.append(SendTo(data, txn.dest))
        if txn.purpose == "reinvite":
            return actions + self._reinvite_done(txn, response)
        if txn.ending == "abandoned":
            if status < 300:
                # Whoever answered late holds a call open for us: end it (15).
                actions += self._bye(BYE_TIMEOUT_S)
            late = "ACKed and hung up" if status < 300 else "ACKed"
            return [*actions, Anomaly(f"sip: INVITE answered {status} after the call was given "
                                      f"up: {late}")]
        self.status, self.reason = status, response.reason
        if status >= 300 and txn.ending is None and status in _AUTH_HEADERS:
            retry = self._authenticate(txn, response, now)
            if retry is not None:
                return actions + retry
        if status >= 300:
            self.state = "terminated"
            return [*actions, self._setup_outcome(txn, status, response.reason)]
        if txn.ending is not None:
            return [*actions, *self._bye(BYE_TIMEOUT_S), self._setup_outcome(txn, status, "")]
        try:
            answer = read_answer(response.body)
            audio_pt = answer.audio_pt
            if audio_pt is None:
                raise SdpError(488, f"the answer has no PCMU payload type "
                                    f"({answer.payload_types})")
        except SdpError as exc:
            return [*actions, AnswerUnusable(exc), *self._bye(BYE_TIMEOUT_S)]
        self.answer = answer
        # We send unless the answer says it will not receive (RFC 3264 6.1).
        media = MediaPlan((answer.address, answer.port), audio_pt, answer.event_pt,
                          answer.direction in ("sendrecv", "recvonly"))
        return [*actions, Answered(answer, media, now)]

    def _confirm(self, txn: _Client, response: SipResponse) -> list[Action]:
        """A 2xx to an INVITE: fix the dialog (first time) and ACK it (13.2.2.4)."""
        actions: list[Action] = []
        if self._remote_tag is None:
            self.state = "confirmed"
            self._remote_to = response.headers.get("To") or self._to
            self._remote_tag = response.to_tag
            contacts = response.headers.get_all("Contact")
            self._remote_target = self._request_uri
            if contacts:
                try:
                    self._remote_target = parse_name_addr(contacts[0]).uri
                except SipParseError as exc:
                    actions.append(Anomaly(f"sip: unreadable Contact in the 2xx: {exc}"))
            # 12.1.2: the route set is the Record-Route list, reversed, for a UAC.
            self._route_set = list(reversed(response.headers.get_all("Record-Route")))
            try:
                next_hop = parse_name_addr(self._route_set[0]).uri if self._route_set else \
                    self._remote_target
                self._dest = uri_hostport(next_hop)
            except SipParseError as exc:
                actions.append(Anomaly(f"sip: {exc}; sending in-dialog requests to "
                                       f"{self._target}"))
                self._dest = self._target
        ack, _ = self._dialog_request("ACK", cseq=txn.request.cseq[0])
        data = ack.serialize()
        self._remember((txn.branch, "INVITE"), _Finished(data, self._dest, response.to_tag,
                                                          True))
        actions.append(SendTo(data, self._dest))
        return actions

    def _setup_outcome(self, txn: _Client, status: int | None, reason: str) -> Action:
        if txn.ending == "timeout":
            return SetupTimedOut(status)
        if txn.ending == "cancel":
            return Cancelled(status)
        assert status is not None
        return Rejected(status, reason)

    def _reinvite_done(self, txn: _Client, response: SipResponse | None) -> list[Action]:
        direction = txn.direction
        if response is None:
            return [Anomaly(f"re-INVITE ({direction}): no final response within "
                            f"{txn.timeout_s:g} s"), ReinviteDone(direction, None)]
        done = ReinviteDone(direction, response.status)
        if response.status >= 300:
            return [Anomaly(f"re-INVITE ({direction}) answered {response.status} "
                            f"{response.reason}"), done]
        try:
            answer = read_answer(response.body)
        except SdpError as exc:
            return [Anomaly(f"re-INVITE ({direction}): unusable SDP answer: {exc}"), done]
        audio_pt = answer.audio_pt if answer.audio_pt is not None else PT_PCMU
        media = MediaPlan((answer.address, answer.port), audio_pt, answer.event_pt,
                          direction in ("sendrecv", "sendonly"))
        return [MediaChanged(media), done]

    def _client_done(self, txn: _Client, response: SipResponse | None,
                     now: float) -> list[Action]:
        """A non-INVITE transaction ended (a final response, or Timer F: ``response`` None)."""
        status = response.status if response is not None else None
        reason = response.reason if response is not None else ""
        if txn.purpose == "bye":
            self.state = "terminated"
            actions: list[Action] = []
            if response is None:
                actions.append(Anomaly(f"BYE: no final response within {txn.timeout_s:g} s"))
            elif response.status != 200:
                actions.append(Anomaly(f"BYE answered {response.status} {response.reason}"))
            return [*actions, HungUp(status, reason, now)]
        if txn.purpose == "cancel":
            actions = [Anomaly("CANCEL: no response")] if response is None else []
            invite = self._invite
            if invite is not None and invite.ending != "abandoned" and \
                    invite.key in self._clients:
                # Wait for the INVITE's final (487) as long again as the CANCEL could take.
                actions.append(self._set("cancel", invite.branch, now + 8 * self.t1))
            return actions
        if response is None:
            return [Anomaly(f"{txn.method}: no response")]
        if response.status >= 300:
            return [Anomaly(f"{txn.method} answered {response.status} {response.reason}")]
        return []

    def _invite_timeout(self, txn: _Client, now: float) -> list[Action]:
        """Timer B: the INVITE had no final response in time."""
        if txn.purpose == "reinvite":
            return [*self._forget(txn), *self._reinvite_done(txn, None)]
        if txn.ending == "abandoned":
            return []
        if txn.ending is not None:
            return self._abandon(txn)  # cancelled already: stop waiting for its outcome
        txn.ending = "timeout"
        actions: list[Action] = [self._unset("A", txn.branch)]
        if txn.provisional:
            return actions + self._send_cancel(txn)
        return actions + self._abandon(txn)

    def _abandon(self, txn: _Client) -> list[Action]:
        """Stop waiting for the INVITE's final; one that comes later is still ACKed."""
        if txn.ending == "abandoned" or txn.key not in self._clients:
            return []
        outcome = self._setup_outcome(txn, None, "")
        txn.ending = "abandoned"
        self._cancel_pending = False
        self.state = "terminated"
        return [self._unset("A", txn.branch), self._unset("B", txn.branch),
                self._unset("cancel", txn.branch), outcome]

    def _send_cancel(self, invite: _Client) -> list[Action]:
        # 9.1: Request-URI, Call-ID, To, From, CSeq number and the top Via (its branch) of the
        # request being cancelled; a CANCEL is never challenged, never retried with credentials.
        now = self.clock.now()
        request = self._request("CANCEL", invite.request.uri,
                                invite.request.headers.get("To") or self._to,
                                invite.request.cseq[0], invite.branch,
                                routes=invite.request.headers.get_all("Route"))
        txn = _Client("cancel", request, request.serialize(), invite.dest, invite.branch,
                      now + 8 * self.t1, self.t1, now)
        return self._start(txn, now)

    def _authenticate(self, txn: _Client, response: SipResponse,
                      now: float) -> list[Action] | None:
        """Send ``txn``'s request again with credentials for the challenge in ``response``
        (22.2): a new branch, the next CSeq. None when there is nothing to answer with."""
        config = self.config
        if config.username is None or txn.auth_attempts >= _AUTH_ATTEMPTS:
            return None
        challenge_header, credentials_header = _AUTH_HEADERS[response.status]
        challenges = response.headers.get_all(challenge_header)
        if txn.auth_attempts and not any(challenge_is_stale(c) for c in challenges):
            return None  # the credentials were refused: asking again would not help
        request = txn.request
        values = [value for value in (
            authorization(c, method=request.method, uri=request.uri, username=config.username,
                          password=config.password) for c in challenges) if value is not None]
        if not values:
            return None
        headers = request.headers.copy()
        headers.remove("Authorization")
        headers.remove("Proxy-Authorization")
        for value in values:
            headers.add(credentials_header, value)
        self._cseq += 1
        branch = new_branch()
        via = request.top_via
        via.params["branch"] = branch
        headers.set("Via", via.serialize())
        headers.set("CSeq", f"{self._cseq} {request.method}")
        retry = SipRequest(request.method, request.uri, headers, request.body)
        again = _Client(txn.purpose, retry, retry.serialize(), txn.dest, branch, txn.deadline,
                        self.t1, txn.started, auth_attempts=txn.auth_attempts + 1,
                        direction=txn.direction)
        if txn is self._invite:
            self._invite = again
        realms = tuple(_realm(c) for c in challenges)
        return [AuthAnswered(request.method, response.status, realms),
                *self._start(again, now)]

    # --- requests to us -----------------------------------------------------------------------

    def _on_request(self, request: SipRequest, source: Addr) -> list[Action]:
        method = request.method
        number, _ = request.cseq
        call_id = request.call_id
        branch = request.top_via_branch or ""
        from_tag = request.from_tag
        self.requests_received[method] = self.requests_received.get(method, 0) + 1
        cached = self._replies.get((call_id, number, method, branch))
        if cached is not None:
            return [SendTo(cached, source)]  # a retransmitted request gets the same answer
        if method == "ACK":
            if self._ok is not None and call_id == self.call_id:
                self._ok = None
                return [self._unset("G", self._ok_branch), self._unset("H", self._ok_branch)]
            return []  # ACKs get no response; stray ones are harmless
        if method == "OPTIONS":
            return [self._reply(request, source, 200,
                                headers=[("Allow", ALLOW), ("Accept", "application/sdp")])]
        in_dialog = (call_id == self.call_id and self._remote_tag is not None
                     and from_tag == self._remote_tag)
        if not in_dialog:
            return [Anomaly(f"sip: {method} outside our dialog from {source}"),
                    self._reply(request, source, 481)]
        now = self.clock.now()
        if method == "BYE":
            actions: list[Action] = [self._reply(request, source, 200)]
            if self.state == "confirmed":
                self.state = "terminated"
            if not self._remote_bye:
                self._remote_bye = True
                actions.append(RemoteHangup(now))
            if self._ok is not None:
                self._ok = None
                actions += [self._unset("G", self._ok_branch), self._unset("H", self._ok_branch)]
            return actions
        if method == "REFER":
            refer_to = request.headers.get("Refer-To")
            if not refer_to:
                return [Anomaly("sip: REFER without Refer-To"),
                        self._reply(request, source, 400, "Missing Refer-To")]
            try:
                target = parse_name_addr(refer_to).uri
            except SipParseError as exc:
                return [Anomaly(f"sip: REFER with an unreadable Refer-To: {exc}"),
                        self._reply(request, source, 400, "Bad Refer-To")]
            self.transferred_to = target
            return [self._reply(request, source, 202), TransferRequested(target)]
        if method == "INVITE":
            return self._on_reinvite(request, source, now)
        return [Anomaly(f"sip: unexpected {method} in the dialog"),
                self._reply(request, source, 405, headers=[("Allow", ALLOW)])]

    def _on_reinvite(self, request: SipRequest, source: Addr, now: float) -> list[Action]:
        """Answer a re-INVITE like a phone: same codec, hold honoured (RFC 3264 8.4)."""
        if any(c.purpose == "reinvite" for c in self._clients.values()) or self._ok is not None:
            return [self._reply(request, source, 491)]  # glare (14.2)
        try:
            answer = negotiate(
                parse_sdp(request.body), local_ip=self.config.local_ip,
                local_port=self.config.rtp_port, session_id=self._sdp_session,
                version=self._sdp_version + 1, codecs=("PCMU",),
            )
        except SdpError as exc:
            return [Anomaly(f"sip: re-INVITE: {exc}"), self._reply(request, source, 488)]
        self._sdp_version += 1
        # We send unless our answer says we will not (RFC 3264 6.1).
        media = MediaPlan(answer.remote_rtp, answer.payload_type, answer.telephone_event_pt,
                          answer.direction in ("sendrecv", "sendonly"))
        reply = self._reply(request, source, 200, headers=[("Contact", self._contact)],
                            body=answer.sdp)
        self._ok = _Ok(reply.data, source, self.t1)
        self._ok_branch = request.top_via_branch or ""
        return [MediaChanged(media), reply,
                self._set("G", self._ok_branch, now + self.t1),
                self._set("H", self._ok_branch, now + 64 * self.t1)]

    def _ok_timer(self, name: str, branch: str, now: float) -> list[Action]:
        ok = self._ok
        if ok is None or branch != self._ok_branch:
            return []
        if name == "H":
            self._ok = None
            return [self._unset("G", branch),
                    Anomaly("sip: no ACK for our 200 to the re-INVITE")]
        # 13.3.1.4: resend the 2xx at T1, 2*T1... capped at T2, until the ACK or Timer H.
        ok.interval = min(2 * ok.interval, T2)
        return [SendTo(ok.data, ok.dest), self._set("G", branch, now + ok.interval)]

    def _reply(self, request: SipRequest, source: Addr, status: int, reason: str | None = None,
               *, headers: list[tuple[str, str]] | None = None, body: bytes = b"") -> SendTo:
        """A response (8.2.6), cached for the request's retransmissions (17.2)."""
        # Our dialog's tag for requests in it; a fresh one for anything else (8.2.6.2).
        to_tag = self.local_tag if request.call_id == self.call_id else new_tag()
        # RFC 3581: the response goes back to the packet's source, recorded on the top Via.
        stamp_via(request, source[0], source[1])
        response = response_to(
            request, status, reason, to_tag=to_tag,
            headers=[("User-Agent", self.config.user_agent), *(headers or [])], body=body,
            content_type="application/sdp" if body else None,
        )
        data = response.serialize()
        number, method = request.cseq
        key = (request.call_id, number, method, request.top_via_branch or "")
        self._replies[key] = data
        if len(self._replies) > _REMEMBERED:
            self._replies.pop(next(iter(self._replies)))
        return SendTo(data, source)

    # --- building and sending -----------------------------------------------------------------

    def _offer(self, direction: str) -> bytes:
        config = self.config
        return offer(config.local_ip, config.rtp_port, session_id=self._sdp_session,
                     version=self._sdp_version, direction=direction,
                     username=config.sdp_name, name=config.sdp_name)

    def _request(self, method: str, uri: str, to: str, cseq: int, branch: str, *,
                 contact: bool = False, routes: list[str] | None = None,
                 headers: list[tuple[str, str]] | None = None, body: bytes = b"",
                 content_type: str | None = None) -> SipRequest:
        config = self.config
        return build_request(
            method, uri, call_id=self.call_id, from_=self._from, to=to, cseq=cseq,
            via_host=config.local_ip, via_port=config.sip_port, branch=branch,
            contact=self._contact if contact else None,
            headers=[*(("Route", route) for route in routes or ()), *(headers or ())],
            body=body, content_type=content_type or ("application/sdp" if body else None),
        )

    def _dialog_request(self, method: str, *, cseq: int | None = None, body: bytes = b"",
                        content_type: str | None = None,
                        extra: list[tuple[str, str]] | None = None) -> tuple[SipRequest, str]:
        """A request inside our dialog (12.2.1.1) and its Via branch."""
        if cseq is None:
            self._cseq += 1
            cseq = self._cseq
        branch = new_branch()
        uri, routes = dialog_route(self._remote_target, self._route_set)
        request = self._request(method, uri, self._remote_to, cseq, branch,
                                contact=method not in ("ACK", "BYE"), routes=routes,
                                headers=extra, body=body, content_type=content_type)
        return request, branch

    def _in_dialog(self, purpose: str, method: str, deadline: float, *, body: bytes = b"",
                   content_type: str | None = None,
                   extra: list[tuple[str, str]] | None = None) -> _Client:
        request, branch = self._dialog_request(method, body=body, content_type=content_type,
                                               extra=extra)
        return _Client(purpose, request, request.serialize(), self._dest, branch, deadline,
                       self.t1, self.clock.now())

    def _bye(self, timeout_s: float) -> list[Action]:
        now = self.clock.now()
        self.state = "terminating"
        actions: list[Action] = []
        if self._ok is not None:
            self._ok = None
            actions += [self._unset("G", self._ok_branch), self._unset("H", self._ok_branch)]
        txn = self._in_dialog("bye", "BYE", now + timeout_s)
        return [*actions, ByeSent(now), *self._start(txn, now)]

    def _start(self, txn: _Client, now: float) -> list[Action]:
        """Send a client transaction's request and arm its timers (A/B or E/F)."""
        self._clients[txn.key] = txn
        first, last = ("A", "B") if txn.method == "INVITE" else ("E", "F")
        return [SendTo(txn.data, txn.dest), self._set(first, txn.branch, now + txn.interval),
                self._set(last, txn.branch, txn.deadline)]

    def _forget(self, txn: _Client) -> list[Action]:
        """The transaction ended: off the live list, its timers off, and a non-INVITE one
        remembered so that its retransmitted final is recognised (the INVITE's own record,
        with its ACK, is made where the ACK is)."""
        self._clients.pop(txn.key, None)
        names = ("A", "B") if txn.method == "INVITE" else ("E", "F")
        if txn.method != "INVITE":
            self._remember(txn.key, None)
        return [self._unset(name, txn.branch) for name in names
                if TimerId(name, txn.branch) in self._armed]

    def _remember(self, key: tuple[str, str], finished: _Finished | None) -> None:
        self._finished[key] = finished
        if len(self._finished) > _REMEMBERED:
            self._finished.pop(next(iter(self._finished)))

    def _set(self, name: str, branch: str, at: float) -> SetTimer:
        timer = TimerId(name, branch)
        self._armed[timer] = at
        return SetTimer(timer, at)

    def _unset(self, name: str, branch: str) -> CancelTimer:
        timer = TimerId(name, branch)
        self._armed.pop(timer, None)
        return CancelTimer(timer)



class Timers:
    """The core's :class:`SetTimer`/:class:`CancelTimer` actions carried out on the injected
    clock's :meth:`~gateway.clock.Clock.call_later`: what every shell of :class:`UacCore` does
    with them (the load simulator's phone, the tests' in-memory peers). ``fire`` is called
    with the :class:`TimerId` when one is due; a timer set again replaces the earlier one."""

    def __init__(self, clock: Clock, fire: Callable[[TimerId], None]) -> None:
        self._clock = clock
        self._fire = fire
        self._handles: dict[TimerId, Cancellable] = {}

    def apply(self, action: SetTimer | CancelTimer) -> None:
        """Arm or disarm one timer."""
        old = self._handles.pop(action.timer, None)
        if old is not None:
            old.cancel()
        if isinstance(action, SetTimer):
            timer = action.timer
            self._handles[timer] = self._clock.call_later(
                action.at - self._clock.now(), lambda: self._due(timer))

    def _due(self, timer: TimerId) -> None:
        self._handles.pop(timer, None)
        self._fire(timer)

    def cancel_all(self) -> None:
        """Every timer off (the shell is closing)."""
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._handles)


def _realm(challenge: str) -> str:
    params = parse_credentials(challenge)
    return params.get("realm", "") if params else ""
