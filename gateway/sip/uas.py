"""Sans-I/O SIP user agent server for an IVR endpoint (RFC 3261 over UDP).

:class:`UasCore` is fed datagrams (``receive``) and the passage of time (``tick``) and returns
effects: datagrams to send and call events for the I/O shell (:mod:`gateway.sip.endpoint`). It
never touches a socket or reads a clock; ``now`` is always passed in, so every timer is tested
in virtual time.

What it does, per RFC 3261 unless noted:

- INVITE -> 100 Trying -> (the shell answers) 200 OK with the SDP answer; the 200 is
  retransmitted from T1 = 500 ms doubling to T2 = 4 s until the ACK, and if no ACK comes within
  64*T1 the call is ended with a BYE (13.3.1.4). Retransmitted INVITEs get the last response
  again; responses to every request are cached per transaction for 64*T1 so retransmitted
  requests are absorbed (17.2).
- CANCEL before the final response -> 200 to the CANCEL and 487 to the INVITE (9.2).
- BYE -> 200 and the call ends (15.1.2); OPTIONS -> 200 (11.2, trunk keep-alives), 503 while
  draining or not ready;
  re-INVITE (hold with a=sendonly/inactive, resume) -> 200 with a mirrored answer (RFC 3264 8);
  unknown methods -> 501; at capacity -> 486 (or 503 with Retry-After while draining or not
  ready), as the injected admission question says (the replica's one admission: the core
  counts no calls of its own);
  no common codec -> 488.
- A request the parser rejects (no Call-ID, a broken header line, SIP/3.0...) gets the
  parser's 400/414/505 with the reason, statelessly, whenever its Via header fields say where
  the response goes (8.2.6.1, 16.3; RFC 4475 3.1.2.18): the peer stops retransmitting. ACKs,
  responses and requests without a usable Via get silence.
- Security: a source-address allow-list (CIDR) and optional digest authentication; anything
  else gets 403 (or a 401 challenge) and no call state, and nothing at all when malformed.
- Requests we originate in a dialog (BYE, REFER per RFC 3515) are retransmitted from T1 to T2
  until a final response or 64*T1 (17.1.2).
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.sip.digest import DigestAuthenticator
from gateway.sip.message import (
    SipKeepalive,
    SipParseError,
    SipRequest,
    SipResponse,
    build_request,
    new_branch,
    new_tag,
    parse_message,
    parse_name_addr,
    parse_via,
    reason_phrase,
    response_to,
    stamp_via,
)
from gateway.sip.sdp import Answer, SdpError, negotiate, parse_sdp

log = logging.getLogger(__name__)

T1 = 0.5
T2 = 4.0
TIMEOUT = 64 * T1
ALLOW = "INVITE, ACK, CANCEL, BYE, OPTIONS, REFER, NOTIFY"
USER_AGENT = "qwen3-tts-ivr-gateway"
#: Responses kept for absorbing retransmissions (17.2). Each lives 64*T1; a flood of requests
#: with fresh branches (from an allowed or spoofed address) would otherwise grow the cache
#: without bound, so past this many the oldest go first (a retransmission of an evicted one is
#: handled again, which every path here tolerates).
MAX_CACHED_RESPONSES = 4096

Addr = tuple[str, int]

#: What may not appear in a Reason-Phrase (RFC 3261 25.1: text, SP and HTAB; no CR, LF or other
#: controls).
_PHRASE_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


# --- effects ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendTo:
    """Send ``data`` to ``addr`` over the SIP socket."""

    data: bytes
    addr: Addr


@dataclass(frozen=True, slots=True)
class IncomingCall:
    """A new INVITE passed every check: allocate media and call :meth:`UasCore.answer`."""

    key: str
    source: Addr
    caller: str
    #: What was dialled: the Request-URI user, else the To user (the line it reaches).
    called: str
    offer_codecs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CallAnswered:
    """The 200 OK went out; media may flow. ``answer`` is the negotiated media."""

    key: str
    answer: Answer


@dataclass(frozen=True, slots=True)
class CallConfirmed:
    """The ACK arrived."""

    key: str


@dataclass(frozen=True, slots=True)
class MediaChanged:
    """A re-INVITE changed the media (hold, resume, new address)."""

    key: str
    answer: Answer


@dataclass(frozen=True, slots=True)
class CallEnded:
    """The call is over; ``reason`` says why (bye, cancel, no-ack, local, refer-failed...)."""

    key: str
    reason: str


@dataclass(frozen=True, slots=True)
class TransferDone:
    """A REFER we sent got its final answer (``accepted`` means 2xx)."""

    key: str
    accepted: bool
    status: int


@dataclass(frozen=True, slots=True)
class Dropped:
    """A datagram was dropped without a response (counted by the shell)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """An INVITE was turned away (486 at capacity, 503 draining or not ready): ``reason`` is the
    admission's (counted by the shell)."""

    reason: str


Effect = SendTo | IncomingCall | CallAnswered | CallConfirmed | MediaChanged | CallEnded | \
    TransferDone | Dropped | Refused


# --- configuration ----------------------------------------------------------------------------


@dataclass
class UasConfig:
    """What the endpoint is and whom it serves."""

    local_ip: str
    local_port: int
    allow: Sequence[str] = ("127.0.0.0/8",)
    authenticator: DigestAuthenticator | None = None
    codecs: Sequence[str] = ("PCMU", "PCMA")
    user: str = "ivr"
    #: RFC 3261's T1 (RTT estimate): 500 ms on the internet; a private trunk may use less.
    t1: float = T1

    def __post_init__(self) -> None:
        self.networks = [ipaddress.ip_network(cidr, strict=False) for cidr in self.allow]

    def allowed(self, ip: str) -> bool:
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return any(address in network for network in self.networks)


# --- state ------------------------------------------------------------------------------------


@dataclass
class _Retransmit:
    data: bytes
    addr: Addr
    interval: float
    next_at: float
    give_up_at: float


@dataclass
class Dialog:
    """One call's SIP dialog (RFC 3261 12) and its pending transactions."""

    key: str
    call_id: str
    local_tag: str
    remote_tag: str
    remote_uri: str
    local_uri: str
    remote_target: str
    source: Addr
    invite: SipRequest
    state: Literal["proceeding", "answered", "confirmed", "terminated"] = "proceeding"
    local_cseq: int = field(default_factory=lambda: 1)
    remote_cseq: int = 0
    rtp_ip: str = ""
    rtp_port: int = 0
    session_id: int = 0
    session_version: int = 1
    answer: Answer | None = None
    #: The 2xx to the (re-)INVITE being retransmitted until its ACK.
    ok: _Retransmit | None = None
    ok_cseq: int = 0
    #: Our in-dialog requests awaiting a final response: branch -> (method, retransmit).
    client: dict[str, tuple[str, _Retransmit]] = field(default_factory=dict)
    #: The route set (RFC 3261 12.1.1): the INVITE's Record-Route values, in order. A SIP proxy
    #: (Kamailio in front of several gateways) puts itself here so our BYE and REFER reach it.
    route_set: list[str] = field(default_factory=list)


def _route(dialog: Dialog) -> tuple[str, list[str]]:
    """Request-URI and Route values of a request in ``dialog`` (RFC 3261 12.2.1.1)."""
    routes = dialog.route_set
    if not routes:
        return dialog.remote_target, []
    try:
        first = parse_name_addr(routes[0])
    except SipParseError:
        return dialog.remote_target, list(routes)
    uri_params = {p.split("=", 1)[0].strip().lower() for p in first.uri.split(";")[1:]}
    if "lr" in uri_params:
        # Loose routing (what every current proxy does): the target stays in the Request-URI.
        return dialog.remote_target, list(routes)
    # A strict router wants itself as the Request-URI and the target as the last Route.
    return first.uri, [*routes[1:], f"<{dialog.remote_target}>"]


#: Why a new call would be refused now, or None: welcome (``draining``/``not_ready`` -> 503,
#: ``at_capacity`` -> 486). The gateway passes its one admission's question
#: (:meth:`gateway.call.admission.Admission.refusal`, shared by every transport).
AdmissionQuestion = Callable[[], str | None]


class UasCore:
    """The SIP state machine of one endpoint (any number of dialogs)."""

    def __init__(self, config: UasConfig, admission: AdmissionQuestion | None = None) -> None:
        """``admission`` is asked while handling each INVITE and OPTIONS (a pure question: the
        core stays free of I/O); None welcomes every call."""
        self.config = config
        self.admission = admission
        self.dialogs: dict[str, Dialog] = {}
        # Server transactions' last responses, for absorbing retransmitted requests (17.2):
        # (branch, method) -> (expires_at, response bytes, addr).
        self._responses: dict[tuple[str, str], tuple[float, bytes, Addr]] = {}
        self._session_ids = itertools.count(1)
        self.t1 = config.t1
        self.timeout = 64 * config.t1
        self.stats = {"received": 0, "dropped": 0, "rejected_source": 0, "challenged": 0}

    # --- introspection ------------------------------------------------------------------------

    def _refusal(self) -> str | None:
        admission = self.admission
        return admission() if admission is not None else None

    @property
    def active_calls(self) -> int:
        return sum(1 for d in self.dialogs.values() if d.state != "terminated")

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has work (None: nothing scheduled)."""
        # The cache is in expiry order (see _cache): its first entry expires first.
        times = [next(iter(self._responses.values()))[0]] if self._responses else []
        for dialog in self.dialogs.values():
            if dialog.ok is not None:
                times.append(dialog.ok.next_at)
            times.extend(t.next_at for _, t in dialog.client.values())
        return min(times) if times else None

    # --- input --------------------------------------------------------------------------------

    def receive(self, data: bytes, source: Addr, now: float) -> list[Effect]:
        """Handle one datagram from ``source``."""
        self.stats["received"] += 1
        try:
            message = parse_message(data)
        except SipKeepalive:
            return []
        except SipParseError as exc:
            self.stats["dropped"] += 1
            return self._answer_malformed(exc, exc.request, source,
                                          f"malformed SIP from {source[0]}: {exc}")
        if isinstance(message, SipResponse):
            return self._on_response(message, now)
        if not self.config.allowed(source[0]):
            # No state for strangers: one stateless 403 (or silence for ACKs, which get none).
            self.stats["rejected_source"] += 1
            if message.method == "ACK":
                return [Dropped(f"ACK from disallowed {source[0]}")]
            return [self._reply(message, source, 403, now=now, cache=False)]
        try:
            stamp_via(message, source[0], source[1])
            cached = self._responses.get((_branch(message), message.method))
            if cached is not None and message.method != "ACK":
                return [SendTo(cached[1], source)]
            return self._on_request(message, source, now)
        except SipParseError as exc:
            self.stats["dropped"] += 1
            return self._answer_malformed(exc, message, source,
                                          f"bad {message.method} from {source[0]}: {exc}")

    def _answer_malformed(self, exc: SipParseError, request: SipRequest | None, source: Addr,
                          why: str) -> list[Effect]:
        """A request we cannot accept: answer ``exc.status`` with the reason when the response
        can be routed (RFC 3261 8.2.6.1, 16.3: a 400 naming the problem), else drop it.

        Never for an ACK or a response (17.1.1.1), never to a stranger (the allow-list's
        sources alone get answers), and only when every Via parses: the response travels back
        along them (18.2.2) and the caller's transaction matches it by the top one's branch
        (17.1.3). Stateless: nothing is cached, no dialog is made.
        """
        dropped = Dropped(why)
        if not exc.status or request is None or request.method == "ACK":
            return [dropped]
        if not self.config.allowed(source[0]):
            self.stats["rejected_source"] += 1
            return [dropped]
        try:
            vias = request.headers.get_all("Via")
            for value in vias:
                parse_via(value)
            if not vias:
                return [dropped]
            stamp_via(request, source[0], source[1])
        except SipParseError:
            return [dropped]
        # The reason names the problem (what Kamailio's sanity module does too); it is this
        # peer's own text coming back, cut short and without control characters.
        detail = _PHRASE_UNSAFE.sub("?", exc.message)
        if len(detail) > 120:
            detail = detail[:117] + "..."
        response = response_to(request, exc.status, f"{reason_phrase(exc.status)} ({detail})",
                               to_tag=new_tag(), headers=[("User-Agent", USER_AGENT)])
        return [SendTo(response.serialize(), source), dropped]

    def tick(self, now: float) -> list[Effect]:
        """Fire every timer due at ``now``."""
        effects: list[Effect] = []
        responses = self._responses
        while responses:
            oldest = next(iter(responses))
            if responses[oldest][0] > now:
                break
            del responses[oldest]
        for dialog in list(self.dialogs.values()):
            ok = dialog.ok
            if ok is not None:
                if now >= ok.give_up_at:
                    # No ACK within 64*T1 (13.3.1.4): the dialog is confirmed only to be torn
                    # down with a BYE.
                    dialog.ok = None
                    log.warning("sip %s: no ACK for the 200 OK; sending BYE", dialog.call_id)
                    effects.extend(self._send_bye(dialog, now))
                    effects.append(self._end(dialog, "no-ack"))
                    continue
                if now >= ok.next_at:
                    effects.append(SendTo(ok.data, ok.addr))
                    ok.interval = min(ok.interval * 2, T2)
                    ok.next_at = now + ok.interval
            for branch, (method, retransmit) in list(dialog.client.items()):
                if now >= retransmit.give_up_at:
                    del dialog.client[branch]
                    if method == "REFER":
                        effects.append(TransferDone(dialog.key, False, 408))
                    continue
                if now >= retransmit.next_at:
                    effects.append(SendTo(retransmit.data, retransmit.addr))
                    retransmit.interval = min(retransmit.interval * 2, T2)
                    retransmit.next_at = now + retransmit.interval
            if dialog.state == "terminated" and not dialog.client:
                del self.dialogs[dialog.key]
        return effects

    # --- commands from the shell --------------------------------------------------------------

    def answer(self, key: str, rtp_ip: str, rtp_port: int, now: float) -> list[Effect]:
        """Answer a pending INVITE with media at ``rtp_ip:rtp_port``."""
        dialog = self.dialogs.get(key)
        if dialog is None or dialog.state != "proceeding":
            return []
        dialog.rtp_ip, dialog.rtp_port = rtp_ip, rtp_port
        dialog.session_id = next(self._session_ids) + int(now * 1000) % 1_000_000
        try:
            answer = self._negotiate(dialog, dialog.invite)
        except SdpError as exc:
            effects: list[Effect] = [self._reply(dialog.invite, dialog.source, exc.status,
                                                 now=now, to_tag=dialog.local_tag)]
            effects.append(self._end(dialog, f"sdp-{exc.status}"))
            return effects
        dialog.answer = answer
        dialog.state = "answered"
        return [self._send_ok(dialog, dialog.invite, answer, now), CallAnswered(key, answer)]

    def reject(self, key: str, status: int, now: float, reason: str | None = None) -> list[Effect]:
        """Refuse a pending INVITE (e.g. 503 when media cannot be allocated)."""
        dialog = self.dialogs.get(key)
        if dialog is None or dialog.state != "proceeding":
            return []
        reply = self._reply(dialog.invite, dialog.source, status, reason, now=now,
                            to_tag=dialog.local_tag)
        return [reply, self._end(dialog, f"rejected-{status}")]

    def hangup(self, key: str, now: float, reason: str = "local") -> list[Effect]:
        """End a call from our side (BYE once answered; 487-style refusal before)."""
        dialog = self.dialogs.get(key)
        if dialog is None or dialog.state == "terminated":
            return []
        if dialog.state == "proceeding":
            return self.reject(key, 480, now, "Temporarily Unavailable")
        dialog.ok = None
        return [*self._send_bye(dialog, now), self._end(dialog, reason)]

    def refer(self, key: str, target: str, now: float) -> list[Effect]:
        """Ask the caller's side to call ``target`` (RFC 3515); :class:`TransferDone` follows."""
        dialog = self.dialogs.get(key)
        if dialog is None or dialog.state not in ("answered", "confirmed"):
            return []
        refer_to = target if target.startswith(("sip:", "sips:")) else \
            f"sip:{target}@{_host_of(dialog.remote_target)};user=phone"
        return [self._send_in_dialog(dialog, "REFER", now,
                                     headers=[("Refer-To", f"<{refer_to}>"),
                                              ("Referred-By", f"<{dialog.local_uri}>")])]

    # --- requests -----------------------------------------------------------------------------

    def _on_request(self, request: SipRequest, source: Addr, now: float) -> list[Effect]:
        method = request.method
        if method == "ACK":
            return self._on_ack(request)
        if method == "CANCEL":
            return self._on_cancel(request, source, now)
        dialog = self.dialogs.get(_key(request)) if request.to_tag else None
        if dialog is not None and dialog.local_tag != request.to_tag:
            dialog = None  # a dialog is identified by both tags (12)
        if request.to_tag and dialog is None and method != "OPTIONS":
            return [self._reply(request, source, 481, now=now)]
        if method == "INVITE":
            if dialog is not None:
                return self._on_reinvite(dialog, request, source, now)
            return self._on_invite(request, source, now)
        if method == "BYE":
            if dialog is None:
                # A BYE without a To tag matches no dialog (15.1.2: 481); sipvicious-style
                # scanners send exactly this.
                return [self._reply(request, source, 481, now=now)]
            effects: list[Effect] = [self._reply(request, source, 200, now=now)]
            if dialog.state != "terminated":
                dialog.ok = None
                effects.append(self._end(dialog, "bye"))
            return effects
        if method == "OPTIONS":
            if self._refusal() in ("draining", "not_ready"):
                # A SIP proxy probing with OPTIONS (Kamailio's dispatcher) takes this replica
                # out of rotation; calls already up are unaffected.
                return [self._reply(request, source, 503, "Service Unavailable (draining)",
                                    now=now, headers=[("Retry-After", "30")])]
            return [self._reply(request, source, 200, now=now, headers=[
                ("Allow", ALLOW), ("Accept", "application/sdp")])]
        if method == "NOTIFY" and dialog is not None:
            return self._on_notify(dialog, request, source, now)
        if method in ("REFER", "NOTIFY", "INFO", "UPDATE", "PRACK"):
            return [self._reply(request, source, 405, now=now, headers=[("Allow", ALLOW)])]
        return [self._reply(request, source, 501, now=now, headers=[("Allow", ALLOW)])]

    def _on_invite(self, request: SipRequest, source: Addr, now: float) -> list[Effect]:
        auth = self.config.authenticator
        if auth is not None:
            result = auth.check(request, "Authorization")
            if result.username is None:
                # An expired nonce is re-challenged with stale=true so the peer retries
                # without asking for credentials again (RFC 2617 3.2.1).
                self.stats["challenged"] += 1
                challenge = auth.challenge_header(stale=result.stale)
                return [self._reply(request, source, 401, now=now, cache=False,
                                    headers=[("WWW-Authenticate", challenge)])]
        for dialog in self.dialogs.values():
            if dialog.call_id != request.call_id:
                continue
            if _branch(dialog.invite) == _branch(request):
                # A retransmission whose cached response was evicted: answer it again (17.2.1),
                # never open a second call.
                if dialog.ok is not None:
                    return [SendTo(dialog.ok.data, source)]
                if dialog.state == "proceeding":
                    return [self._reply(request, source, 100, now=now)]
                return [Dropped(f"retransmitted INVITE of ended call {request.call_id[:40]}")]
            # Same Call-ID, a new transaction, no To tag: a merged or forged request (8.2.2.2).
            # A second dialog under this key would orphan the first call's media and state.
            return [self._reply(request, source, 482, now=now, to_tag=new_tag())]
        refusal = self._refusal()
        if refusal in ("draining", "not_ready"):
            return [self._reply(request, source, 503, f"Service Unavailable ({refusal})",
                                now=now, headers=[("Retry-After", "30")]), Refused(refusal)]
        if refusal == "at_capacity":
            return [self._reply(request, source, 486, now=now, headers=[("Retry-After", "5")]),
                    Refused("at_capacity")]
        body_type = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if not request.body or body_type != "application/sdp":
            # An INVITE without an offer (RFC 3264 delayed offer) is not supported here.
            return [self._reply(request, source, 488, "Not Acceptable Here (no SDP offer)",
                                now=now)]
        try:
            offer = parse_sdp(request.body)
        except SdpError as exc:
            return [self._reply(request, source, exc.status, now=now)]
        local_tag = new_tag()
        from_ = parse_name_addr(request.headers.get("From") or "")
        to = parse_name_addr(request.headers.get("To") or "")
        contact_header = request.headers.get("Contact")
        target = parse_name_addr(contact_header).uri if contact_header else from_.uri
        dialog = Dialog(
            key=_key(request),
            call_id=request.call_id,
            local_tag=local_tag,
            remote_tag=request.from_tag or "",
            remote_uri=request.headers.get("From") or "",
            local_uri=to.uri,
            remote_target=target,
            source=source,
            invite=request,
            remote_cseq=request.cseq[0],
            route_set=request.headers.get_all("Record-Route"),
        )
        self.dialogs[dialog.key] = dialog
        codecs = tuple(
            m.rtpmap[pt].name.upper() if pt in m.rtpmap else str(pt)
            for m in offer.media if m.kind == "audio" for pt in m.formats
        )
        return [
            self._reply(request, source, 100, now=now),
            IncomingCall(dialog.key, source, _user(from_.uri), _dialled(request.uri, to.uri),
                         codecs),
        ]

    def _on_reinvite(self, dialog: Dialog, request: SipRequest, source: Addr,
                     now: float) -> list[Effect]:
        if dialog.state == "proceeding" or dialog.ok is not None:
            # An offer while ours is outstanding (RFC 3261 14.2: 491).
            return [self._reply(request, source, 491, now=now)]
        dialog.remote_cseq = request.cseq[0]
        try:
            answer = self._negotiate(dialog, request)
        except SdpError as exc:
            return [self._reply(request, source, exc.status, now=now)]
        dialog.answer = answer
        dialog.session_version += 1
        return [self._send_ok(dialog, request, answer, now), MediaChanged(dialog.key, answer)]

    def _on_ack(self, request: SipRequest) -> list[Effect]:
        dialog = self.dialogs.get(_key(request))
        if dialog is None or request.to_tag != dialog.local_tag:
            if (_branch(request), "INVITE") in self._responses:
                # The ACK of a final response we sent that INVITE (486 at capacity, 488, 503...):
                # it ends that INVITE server transaction (RFC 3261 17.2.1), nothing is wrong.
                return []
            return [Dropped("ACK for no dialog")]
        if dialog.ok is not None and request.cseq[0] == dialog.ok_cseq:
            dialog.ok = None
            if dialog.state == "answered":
                dialog.state = "confirmed"
                return [CallConfirmed(dialog.key)]
        return []

    def _on_cancel(self, request: SipRequest, source: Addr, now: float) -> list[Effect]:
        # CANCEL matches the INVITE transaction by its branch (9.2).
        dialog = next((d for d in self.dialogs.values()
                       if _branch(d.invite) == _branch(request)
                       and d.call_id == request.call_id), None)
        if dialog is None:
            return [self._reply(request, source, 481, now=now)]
        effects: list[Effect] = [self._reply(request, source, 200, now=now)]
        if dialog.state == "proceeding":
            effects.append(self._reply(dialog.invite, dialog.source, 487, now=now,
                                       to_tag=dialog.local_tag))
            effects.append(self._end(dialog, "cancel"))
        return effects

    def _on_notify(self, dialog: Dialog, request: SipRequest, source: Addr,
                   now: float) -> list[Effect]:
        # Progress of our REFER (RFC 3515 2.4.5): a message/sipfrag status line.
        effects: list[Effect] = [self._reply(request, source, 200, now=now)]
        frag = request.body.decode("utf-8", "replace")
        match = re.match(r"SIP/2\.0\s+(\d{3})", frag)
        if match and int(match.group(1)) >= 200:
            status = int(match.group(1))
            effects.append(TransferDone(dialog.key, 200 <= status < 300, status))
        return effects

    # --- responses to our requests ------------------------------------------------------------

    def _on_response(self, response: SipResponse, now: float) -> list[Effect]:
        try:
            branch = _branch(response)
            _, method = response.cseq
        except SipParseError:
            self.stats["dropped"] += 1
            return [Dropped("response without a usable Via/CSeq")]
        for dialog in self.dialogs.values():
            pending = dialog.client.get(branch)
            if pending is None:
                continue
            if response.status < 200:
                # Provisional: stop retransmitting, keep waiting (17.1.2.2).
                pending[1].next_at = pending[1].give_up_at
                return []
            del dialog.client[branch]
            if method == "REFER":
                if response.status >= 300:
                    return [TransferDone(dialog.key, False, response.status)]
                # 202: the NOTIFY with the outcome follows.
            return []
        return [Dropped(f"response {response.status} to no transaction of ours")]

    # --- helpers ------------------------------------------------------------------------------

    def _negotiate(self, dialog: Dialog, request: SipRequest) -> Answer:
        offer = parse_sdp(request.body)
        return negotiate(offer, local_ip=dialog.rtp_ip, local_port=dialog.rtp_port,
                         session_id=dialog.session_id, version=dialog.session_version,
                         codecs=self.config.codecs)

    def _contact(self) -> str:
        return f"<sip:{self.config.user}@{self.config.local_ip}:{self.config.local_port}>"

    def _send_ok(self, dialog: Dialog, request: SipRequest, answer: Answer,
                 now: float) -> SendTo:
        response = response_to(request, 200, to_tag=dialog.local_tag, body=answer.sdp,
                               content_type="application/sdp", headers=[
                                   ("Contact", self._contact()), ("Allow", ALLOW),
                                   ("Supported", "replaces"), ("User-Agent", USER_AGENT)])
        data = response.serialize()
        dialog.ok = _Retransmit(data, dialog.source, self.t1, now + self.t1, now + self.timeout)
        dialog.ok_cseq = request.cseq[0]
        self._cache((_branch(request), "INVITE"), data, dialog.source, now)
        return SendTo(data, dialog.source)

    def _reply(self, request: SipRequest, source: Addr, status: int, reason: str | None = None,
               *, now: float, to_tag: str | None = None, cache: bool = True,
               headers: Iterable[tuple[str, str]] = ()) -> SendTo:
        if to_tag is None and status > 100 and not request.to_tag:
            dialog = self.dialogs.get(_key(request))
            to_tag = dialog.local_tag if dialog is not None else new_tag()
        response = response_to(request, status, reason, to_tag=to_tag if status > 100 else None,
                               headers=[*headers, ("User-Agent", USER_AGENT)])
        data = response.serialize()
        if cache and (status >= 200 or request.method == "INVITE"):
            self._cache((_branch(request), request.method), data, source, now)
        return SendTo(data, source)

    def _cache(self, key: tuple[str, str], data: bytes, addr: Addr, now: float) -> None:
        # Re-inserting moves an entry to the end, so the dict stays in expiry order (every entry
        # lives self.timeout): expiry and eviction both take from the front.
        responses = self._responses
        responses.pop(key, None)
        responses[key] = (now + self.timeout, data, addr)
        while len(responses) > MAX_CACHED_RESPONSES:
            del responses[next(iter(responses))]

    def _send_in_dialog(self, dialog: Dialog, method: str, now: float,
                        headers: Sequence[tuple[str, str]] = ()) -> SendTo:
        dialog.local_cseq += 1
        branch = new_branch()
        from_header = f"<{dialog.local_uri}>;tag={dialog.local_tag}"
        uri, routes = _route(dialog)
        request = build_request(
            method, uri, call_id=dialog.call_id, from_=from_header,
            to=dialog.remote_uri, cseq=dialog.local_cseq, via_host=self.config.local_ip,
            via_port=self.config.local_port, branch=branch, contact=self._contact(),
            headers=[*(("Route", r) for r in routes), *headers, ("User-Agent", USER_AGENT)],
        )
        data = request.serialize()
        # Sent back to where the caller's signalling comes from (symmetric, NAT-safe).
        retransmit = _Retransmit(data, dialog.source, self.t1, now + self.t1, now + self.timeout)
        dialog.client[branch] = (method, retransmit)
        return SendTo(data, dialog.source)

    def _send_bye(self, dialog: Dialog, now: float) -> list[Effect]:
        if dialog.state in ("answered", "confirmed"):
            return [self._send_in_dialog(dialog, "BYE", now)]
        return []

    def _end(self, dialog: Dialog, reason: str) -> CallEnded:
        dialog.state = "terminated"
        return CallEnded(dialog.key, reason)


def _branch(message: SipRequest | SipResponse) -> str:
    """The transaction id: the top Via's branch, or for RFC 2543 peers without one the
    Call-ID, CSeq number and From tag (RFC 3261 17.2.3)."""
    branch = message.top_via_branch
    if branch is not None:
        return branch
    return f"2543;{message.call_id};{message.cseq[0]};{message.from_tag or ''}"


def _key(request: SipRequest) -> str:
    """A dialog's key from the caller's side: Call-ID and the caller's tag."""
    return f"{request.call_id};{request.from_tag or ''}"


def _user(uri: str) -> str:
    match = re.match(r"^sips?:([^@;>]+)@", uri)
    return match.group(1) if match else uri


def _dialled(request_uri: str, to_uri: str) -> str:
    """Who the INVITE is for: the Request-URI's user (the target after any retargeting by a
    proxy, RFC 3261 8.1.1.1 and 16.5), else the To user (an INVITE to ``sip:host`` alone)."""
    match = re.match(r"^sips?:([^@;>]+)@", request_uri)
    return match.group(1) if match else _user(to_uri)


def _host_of(uri: str) -> str:
    match = re.match(r"^sips?:(?:[^@]+@)?([^;>?]+)", uri)
    return match.group(1) if match else uri
