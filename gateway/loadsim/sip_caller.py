"""A simulated phone for load tests: the I/O shell around the gateway's own sans-I/O SIP client.

One SIP stack: the call's signalling is :class:`gateway.sip.uac.UacCore` (transactions, dialog,
RFC 3261 timers, digest, CANCEL, in-dialog requests; checked against the gateway's own
:class:`~gateway.sip.uas.UasCore` in memory and against real peers: baresip, SIPp, Kamailio),
what it sends on RTP is :class:`gateway.loadsim.rtp_out.OutboundStream` paced by the
gateway's one :class:`~gateway.audio.pacer.Pacer` on the injected clock, and what it hears is
logged and measured by :class:`gateway.loadsim.rtp_log.RtpReceiveLog` (whose docstring defines
every measurement the simulator reports). This module only pumps: it binds the UDP sockets
(SIP, and an even RTP port with RTCP on the next), feeds them to those objects, writes what
they say to write, runs their timers and its pacer on the injected clock, and turns their
events into the measurements and awaitables below.

What a :class:`SipCaller` does, like a desk phone calling an IVR: INVITE with an SDP offer
(PCMU/8000 on PT 0 and telephone-event/8000 on PT 101, ``fmtp 0-15``, ``ptime 20``,
``sendrecv``), ACK, CANCEL when the setup times out after a provisional response, BYE;
:meth:`SipCaller.hold` and :meth:`SipCaller.resume` re-INVITE with ``a=sendonly`` /
``a=sendrecv``. It answers the gateway's BYE (its media stops), OPTIONS, re-INVITE and REFER: a
load simulator cannot follow a transfer, so it accepts the REFER (the gateway's transaction
succeeds as it would with a real phone) and then reports the transfer failed with a NOTIFY
whose ``message/sipfrag`` says ``SIP/2.0 503 Service Unavailable`` (RFC 3515 2.4.4, 2.4.5); the
target is kept in ``transferred_to``. RTP goes out one 20 ms packet per deadline (silence unless
frames are supplied; RFC 4733 events in place of audio while a key is pressed); every datagram on
the RTP socket is timestamped on arrival and logged.

Every measurement and every SIP timer uses the injected :class:`gateway.clock.Clock`
(:class:`~gateway.clock.SystemClock` by default, whose ``now`` is the event loop's clock too).

Exceptions: :class:`LoadSimError` (a :class:`~gateway.errors.GatewayError`) for misuse (a second
``call()``, DTMF without a call), with :class:`CallFailed` (a final response >= 300 to the
INVITE: ``.status``, ``.reason``) and :class:`CallTimeout` (no final response in time) below it.
What the network sends is never raised out of a datagram handler: what the SIP core could not
use (:class:`~gateway.sip.uac.Anomaly`) and an unparseable RTP packet
(:class:`~gateway.sip.rtp.RtpError`) are recorded in ``errors`` and dropped; an unusable SDP
answer (:class:`~gateway.sip.sdp.SdpError`) gets the 2xx ACKed, the call hung up with BYE
(RFC 3261 13.2.2.4) and is raised by :meth:`SipCaller.call`; in a re-INVITE it gets a 488.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable
from typing import Final

from gateway.audio.pacer import Pacer
from gateway.clock import Clock, SystemClock
from gateway.errors import GatewayError
from gateway.loadsim.rtp_log import (
    CLOCK_RATE,
    FRAME_S,
    FRAME_SAMPLES,
    JITTER_BUFFER_S,
    PT_PCMU,
    PT_TELEPHONE_EVENT,
    SILENCE_THRESHOLD,
    STOP_HOLD_S,
    PlayoutStats,
    RtpReceiveLog,
    StreamStats,
    is_silent,
)
from gateway.loadsim.rtp_out import DtmfKey, OutboundStream, PacingStats
from gateway.sip.rtp import RtpError, RtpPacket
from gateway.sip.sdp import MediaAnswer, read_answer
from gateway.sip.uac import (
    T1,
    T2,
    Action,
    Anomaly,
    Answered,
    AnswerUnusable,
    ByeSent,
    Cancelled,
    CancelTimer,
    HungUp,
    MediaChanged,
    MediaPlan,
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
)

__all__ = [
    "CLOCK_RATE",
    "FRAME_S",
    "FRAME_SAMPLES",
    "JITTER_BUFFER_S",
    "PT_PCMU",
    "PT_TELEPHONE_EVENT",
    "REFUSAL_STATUSES",
    "SILENCE_THRESHOLD",
    "STOP_HOLD_S",
    "T1",
    "T2",
    "CallFailed",
    "CallTimeout",
    "LoadSimError",
    "MediaAnswer",
    "PacingStats",
    "PlayoutStats",
    "RtpReceiveLog",
    "SipCaller",
    "StreamStats",
    "is_silent",
    "read_answer",
]

REFUSAL_STATUSES: Final = frozenset({486, 503, 600})
"""Final responses that mean "not now" (busy here, unavailable or draining, busy everywhere):
the load simulator counts them as refused calls, not failures (RFC 3261 21.4.24, 21.5.4,
21.6.1)."""

_MAX_ERRORS: Final[int] = 1000
_USER_AGENT: Final[str] = "gateway-loadsim/0.2"
_Setup = Answered | Rejected | AnswerUnusable | SetupTimedOut | Cancelled


class LoadSimError(GatewayError):
    """Root of the simulated phone's own errors; raised directly for misuse."""


class CallFailed(LoadSimError):
    """The INVITE got a final response >= 300."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"call failed: {status} {reason}")
        self.status = status
        self.reason = reason

    @property
    def refused(self) -> bool:
        """Whether the response says "busy / not now" rather than "broken"."""
        return self.status in REFUSAL_STATUSES


class CallTimeout(LoadSimError):
    """The INVITE got no final response in time."""


class _Datagrams(asyncio.DatagramProtocol):
    """Hands datagrams to a callback; nothing raised there escapes into the event loop."""

    def __init__(
        self,
        on_datagram: Callable[[bytes, tuple[str, int]], None],
        on_error: Callable[[str], None],
        name: str,
    ) -> None:
        self._on_datagram = on_datagram
        self._on_error = on_error
        self._name = name

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            self._on_datagram(data, addr)
        except Exception as exc:  # never out of a datagram handler
            self._on_error(f"{self._name}: handling a datagram from {addr} failed: {exc!r}")

    def error_received(self, exc: Exception) -> None:
        self._on_error(f"{self._name}: socket error {exc!r}")


class SipCaller:
    """One simulated phone call (see the module docstring). Use once: ``call()``, then
    ``send_dtmf()`` / ``play()`` / the measurements, then ``hangup()`` and ``close()``.

    Measurements (all times from the injected ``clock``, monotonic seconds):

    - ``status``/``reason``: the INVITE's final response; ``provisional``: 1xx codes seen;
      ``invite_sent_at``; ``answered_at``: arrival of the 200; ``setup_ms``: INVITE -> 200;
      ``invite_retransmits`` (Timer A); ``final_retransmits``: retransmitted finals re-ACKed.
    - ``remote_hangup_at``: arrival of the gateway's BYE; ``hangup_status``/``hangup_ms``: our
      BYE's response and its round trip; ``transferred_to``: the Refer-To URI of a REFER.
    - ``rtp``: the :class:`RtpReceiveLog` (``jitter_ms``, ``loss_pct``, ``first_audio_after``,
      ``utterance_after``, ``stream_stopped_after``, ``playout``/``gaps`` delegate to it);
      ``pacing``: :class:`PacingStats` of our sends; ``packets_sent``; ``dtmf_sent``:
      ``(digit, first packet time)``.
    - ``requests_received``: method -> count; ``errors``: every unexpected message or failure.
    """

    def __init__(
        self,
        *,
        audio: Iterable[bytes] | None = None,
        caller_id: str = "loadsim",
        t1: float = T1,
        clock: Clock | None = None,
        silence_threshold: int = SILENCE_THRESHOLD,
        rng: random.Random | None = None,
        on_audio: Callable[[float, bytes, bool], None] | None = None,
        username: str | None = None,
        password: str = "",
    ) -> None:
        self.caller_id = caller_id
        #: Digest credentials for a gateway or trunk that challenges (401/407); None: a
        #: challenge fails the call.
        self.username = username
        self._password = password
        #: Told of every audio packet received, in arrival order: (arrival, mu-law payload,
        #: marker bit). The softphone plays from it; the load simulator leaves it unset.
        self.on_audio = on_audio
        self.t1 = t1
        self._clock: Clock = clock if clock is not None else SystemClock()
        #: Our RTP's send schedule, on the same clock as every measurement. It never
        #: re-anchors: a phone's sound card keeps producing samples while the process stalls,
        #: so deadlines that passed go out back-to-back and the timeline neither drifts nor
        #: jumps; a stall shows as lateness in ``pacing``, not as a shifted stream.
        self.pacer = Pacer(self._clock, FRAME_S, max_lag_frames=None)
        self._pacing = PacingStats()
        self.rtp = RtpReceiveLog(silence_threshold=silence_threshold)

        self.invite_sent_at: float | None = None
        self.answered_at: float | None = None
        self.setup_ms: float | None = None
        self.remote_hangup_at: float | None = None
        self.bye_sent_at: float | None = None
        self.hangup_status: int | None = None
        self.hangup_ms: float | None = None
        self.dtmf_sent: list[tuple[str, float]] = []
        self.errors: list[str] = []
        self.errors_dropped = 0
        self.answer: MediaAnswer | None = None
        self.remote_rtp: tuple[str, int] | None = None
        self.local_sip: tuple[str, int] | None = None
        self.local_rtp: tuple[str, int] | None = None

        self._core: UacCore | None = None
        self._timers: Timers | None = None
        self._out = OutboundStream(rng=rng, on_error=self._error)
        if audio is not None:
            self._out.play(audio)
        self._sip: asyncio.DatagramTransport | None = None
        self._rtp_transport: asyncio.DatagramTransport | None = None
        self._rtcp_transport: asyncio.DatagramTransport | None = None
        self._rtp_closed_at: float | None = None
        self._setup: asyncio.Future[_Setup] | None = None
        self._hung_up: asyncio.Future[int | None] | None = None
        self._reinvited: asyncio.Future[int | None] | None = None
        self._sender: asyncio.Task[None] | None = None

    # --- what the core knows ------------------------------------------------------------------

    @property
    def status(self) -> int | None:
        """The INVITE's final status (None before one)."""
        return self._core.status if self._core is not None else None

    @property
    def reason(self) -> str:
        return self._core.reason if self._core is not None else ""

    @property
    def provisional(self) -> list[int]:
        """The INVITE's 1xx codes, in order."""
        return self._core.provisional if self._core is not None else []

    @property
    def invite_retransmits(self) -> int:
        return self._core.invite_retransmits if self._core is not None else 0

    @property
    def final_retransmits(self) -> int:
        return self._core.final_retransmits if self._core is not None else 0

    @property
    def requests_received(self) -> dict[str, int]:
        return self._core.requests_received if self._core is not None else {}

    @property
    def transferred_to(self) -> str | None:
        return self._core.transferred_to if self._core is not None else None

    @property
    def call_id(self) -> str:
        """The SIP Call-ID of the call ("" before :meth:`call`)."""
        return self._core.call_id if self._core is not None else ""

    @property
    def pacing(self) -> PacingStats:
        """Scheduling lateness of every RTP packet sent (ms)."""
        return self._pacing

    @property
    def sending(self) -> bool:
        """Whether our RTP stream runs (from the answer until a BYE either way, or close)."""
        return self._sender is not None and not self._sender.done()

    @property
    def packets_sent(self) -> int:
        """RTP packets sent (audio and telephone events)."""
        return self._out.rtp.packets_sent

    async def __aenter__(self) -> SipCaller:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- what the caller does -----------------------------------------------------------------

    async def call(
        self,
        target: tuple[str, int],
        *,
        local_ip: str = "127.0.0.1",
        user: str = "loadsim",
        timeout_s: float = 10,
    ) -> None:
        """Call ``sip:{user}@{target}`` and return once the 200 is ACKed and RTP flows.

        ``user`` is the Request-URI (dialled) user; ours (From/Contact) is ``caller_id``.
        Raises :class:`CallFailed` (>= 300, ``status`` set), :class:`CallTimeout` (no final
        response within ``timeout_s``; a CANCEL follows a provisional) or
        :class:`~gateway.sip.sdp.SdpError`.
        """
        if self._setup is not None:
            raise LoadSimError("a SipCaller places one call; create another")
        loop = asyncio.get_running_loop()
        setup = self._setup = loop.create_future()
        sip, _ = await loop.create_datagram_endpoint(
            lambda: _Datagrams(self._on_sip, self._error, "sip"), local_addr=(local_ip, 0)
        )
        self._sip = sip
        self.local_sip = sip.get_extra_info("sockname")[:2]
        await self._bind_rtp(local_ip)
        assert self.local_sip is not None and self.local_rtp is not None
        core = self._core = UacCore(
            UacConfig(local_ip, self.local_sip[1], self.local_rtp[1], caller_id=self.caller_id,
                      t1=self.t1, user_agent=_USER_AGENT, username=self.username,
                      password=self._password, sdp_name="loadsim"),
            self._clock)
        self._timers = Timers(self._clock, lambda timer: self._pump(core.timer_fired(timer)))
        self.invite_sent_at = self._clock.now()
        self._pump(core.invite(target, user, timeout_s))
        outcome = await setup
        if isinstance(outcome, Answered):
            self.answer = outcome.answer
            self.answered_at = outcome.at
            self.setup_ms = 1000 * (outcome.at - self.invite_sent_at)
            self._apply_media(outcome.media)
            self._sender = loop.create_task(self._send_media(), name="loadsim-rtp")
            return
        if isinstance(outcome, Rejected):
            raise CallFailed(outcome.status, outcome.reason)
        if isinstance(outcome, AnswerUnusable):
            self._error(f"unusable SDP answer: {outcome.error}")
        if self._hung_up is not None:
            await self._hung_up  # a 2xx we could not use, or one that crossed our CANCEL
        if isinstance(outcome, AnswerUnusable):
            raise outcome.error
        raise CallTimeout(
            f"no final response to INVITE within {timeout_s:g} s "
            f"(provisional: {self.provisional or 'none'})"
        )

    async def hold(self, timeout_s: float = 5.0) -> int | None:
        """Put the call on hold as a phone does: a re-INVITE offering ``a=sendonly`` (RFC 3264
        section 8.4; we keep sending, the gateway stops). Returns the final status (a 2xx is
        ACKed), None without one within ``timeout_s``."""
        return await self._reinvite("sendonly", timeout_s)

    async def resume(self, timeout_s: float = 5.0) -> int | None:
        """Take the call off hold: a re-INVITE offering ``a=sendrecv``."""
        return await self._reinvite("sendrecv", timeout_s)

    def play(self, frames: Iterable[bytes]) -> None:
        """Send these 160-byte mu-law frames from the next 20 ms tick on, then silence."""
        self._out.play(frames)

    async def speak(self, frames: Iterable[bytes]) -> float:
        """:meth:`play` ``frames`` and return the time (the caller's clock) the last one was
        sent: the end of the caller's speech."""
        done: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        def spoken(at: float) -> None:
            if not done.done():
                done.set_result(at)

        self._out.play(frames, spoken)
        return await done

    async def send_dtmf(self, digit: str, duration_ms: int = 100) -> float:
        """Send one RFC 4733 event; returns the monotonic time its first packet was sent.

        Audio pauses while the event is on the wire. Returns after the last end packet, so
        consecutive calls press keys one after the other.
        """
        done: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        def on_done(first_at: float | None) -> None:
            if done.done():
                return
            if first_at is None:
                done.set_exception(
                    LoadSimError("the call's media stopped before the DTMF event was sent"))
            else:
                done.set_result(first_at)

        key = DtmfKey.press(digit, duration_ms, on_done)
        if self._sender is None or self._sender.done():
            raise LoadSimError("no call in progress")
        if self._out.event_pt is None:
            raise LoadSimError("the SDP answer did not accept telephone-event")
        queued = self._out.press(key)
        async with self._clock.timeout(queued * (key.packets + 1) * FRAME_S + 2.0):
            first_at = await asyncio.shield(done)
        self.dtmf_sent.append((digit, first_at))
        return first_at

    async def hangup(self, timeout_s: float = 5.0) -> int | None:
        """Send BYE (Timer E retransmissions) and wait for its final response.

        Returns the response's status (200 expected), or None when there is no call to end
        (never answered, or the gateway hung up first) or no response came in ``timeout_s``.
        """
        core = self._core
        if core is None or core.state != "confirmed":
            return None
        if self._sender is not None:
            self._sender.cancel()  # no packet goes out once the BYE has
        self._pump(core.hangup(timeout_s))
        await self._stop_media()
        assert self._hung_up is not None
        return await self._hung_up

    # --- measurements -------------------------------------------------------------------------

    def first_audio_after(self, t: float) -> float | None:
        """Arrival of the first non-silent audio packet after ``t`` (see :class:`RtpReceiveLog`)."""
        return self.rtp.first_audio_after(t)

    def utterance_after(self, t: float, until: float | None = None) -> float | None:
        """First audio of the utterance answering a turn at ``t`` (see
        :meth:`RtpReceiveLog.utterance_after`)."""
        return self.rtp.utterance_after(t, until, now=self._observed_now())

    def stream_stopped_after(self, t: float) -> float | None:
        """When received speech stopped after ``t``; None while it has not (yet)."""
        return self.rtp.stream_stopped_after(t, now=self._observed_now())

    def _observed_now(self) -> float:
        return self._rtp_closed_at if self._rtp_closed_at is not None else self._clock.now()

    def playout(self, start: float, end: float) -> PlayoutStats:
        """Playout gaps of the utterance received in [start, end) (see :class:`PlayoutStats`)."""
        return self.rtp.playout(start, end)

    def gaps(self, start: float, end: float) -> tuple[int, float]:
        """``(gaps, gap_ms)`` of the playout model over the utterance in [start, end)."""
        stats = self.rtp.playout(start, end)
        return stats.gaps, stats.gap_ms

    @property
    def jitter_ms(self) -> float:
        """RFC 3550 A.8 interarrival jitter of the received stream, ms."""
        return self.rtp.jitter_ms

    @property
    def loss_pct(self) -> float:
        """Received packets lost (RFC 3550 A.3, from sequence gaps), percent of those expected."""
        expected = sum(s.expected for s in self.rtp.streams())
        return 100 * self.rtp.lost / expected if expected else 0.0

    # --- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the sockets and cancel background work (idempotent; no BYE is sent)."""
        if self._sender is not None:
            self._sender.cancel()
        for future in (self._setup, self._hung_up, self._reinvited):
            if future is not None and not future.done():
                future.cancel()
        if self._timers is not None:
            self._timers.cancel_all()
        if self._core is not None:
            self._core.close()
        for transport in (self._sip, self._rtp_transport, self._rtcp_transport):
            if transport is not None:
                transport.close()
        if self._rtp_transport is not None and self._rtp_closed_at is None:
            self._rtp_closed_at = self._clock.now()

    async def aclose(self) -> None:
        """:meth:`close`, then wait until the sender has finished."""
        self.close()
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)

    # --- the pump -----------------------------------------------------------------------------

    def _error(self, text: str) -> None:
        if len(self.errors) < _MAX_ERRORS:
            self.errors.append(text)
        else:
            self.errors_dropped += 1

    def _on_sip(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._core is not None:
            self._pump(self._core.receive(data, addr))

    def _pump(self, actions: list[Action]) -> None:
        """Carry out what the SIP core says: datagrams, timers, and its events."""
        for action in actions:
            if isinstance(action, SendTo):
                if self._sip is not None and not self._sip.is_closing():
                    self._sip.sendto(action.data, action.addr)
            elif isinstance(action, SetTimer | CancelTimer):
                if self._timers is not None:
                    self._timers.apply(action)
            elif isinstance(action, Anomaly):
                self._error(action.reason)
            elif isinstance(action, _Setup):
                if self._setup is not None and not self._setup.done():
                    self._setup.set_result(action)
            else:
                self._on_event(action)

    def _on_event(self, event: Action) -> None:
        if isinstance(event, ByeSent):
            self.bye_sent_at = event.at
            self._hung_up = asyncio.get_running_loop().create_future()
        elif isinstance(event, HungUp):
            if event.status is not None:
                self.hangup_status = event.status
                self.hangup_ms = 1000 * (event.at - (self.bye_sent_at or event.at))
            if self._hung_up is not None and not self._hung_up.done():
                self._hung_up.set_result(event.status)
        elif isinstance(event, RemoteHangup):
            if self.remote_hangup_at is None:
                self.remote_hangup_at = event.at
            if self._sender is not None:
                self._sender.cancel()  # a phone stops its media when the far end hangs up
        elif isinstance(event, MediaChanged):
            self._apply_media(event.media)
        elif isinstance(event, ReinviteDone):
            if self._reinvited is not None and not self._reinvited.done():
                self._reinvited.set_result(event.status)
        elif isinstance(event, TransferRequested) and self._core is not None:
            # A load simulator cannot follow a transfer: it says so (RFC 3515 2.4.5).
            self._pump(self._core.report_transfer(503, "Service Unavailable"))

    async def _reinvite(self, direction: str, timeout_s: float) -> int | None:
        core = self._core
        if core is None or core.state != "confirmed":
            raise LoadSimError("no call in progress")
        self._reinvited = asyncio.get_running_loop().create_future()
        self._pump(core.reinvite(direction, timeout_s))
        return await self._reinvited

    # --- RTP ----------------------------------------------------------------------------------

    async def _bind_rtp(self, local_ip: str) -> None:
        """An even RTP port with RTCP on the next one (RFC 3550 11), so a peer's RTCP, sent to
        RTP + 1, lands on our socket and not on another caller's RTP port."""
        loop = asyncio.get_running_loop()
        for _ in range(32):
            rtp, _ = await loop.create_datagram_endpoint(
                lambda: _Datagrams(self._on_rtp, self._error, "rtp"), local_addr=(local_ip, 0)
            )
            port = rtp.get_extra_info("sockname")[1]
            if port % 2 == 0:
                try:
                    rtcp, _ = await loop.create_datagram_endpoint(
                        lambda: _Datagrams(self._on_rtcp, self._error, "rtcp"),
                        local_addr=(local_ip, port + 1),
                    )
                except OSError:
                    pass
                else:
                    self._rtp_transport, self._rtcp_transport = rtp, rtcp
                    self.local_rtp = (local_ip, port)
                    return
            rtp.close()
        raise LoadSimError("no even/odd UDP port pair free for RTP/RTCP")

    def _on_rtp(self, data: bytes, addr: tuple[str, int]) -> None:
        arrival = self._clock.now()
        try:
            self.rtp.record(data, addr, arrival)
        except RtpError as exc:
            self._error(f"rtp: malformed packet from {addr}: {exc}")
            return
        if self.on_audio is not None:
            packet = RtpPacket.parse(data)
            if packet.payload_type == self.rtp.audio_pt:
                self.on_audio(arrival, packet.payload, packet.marker)

    def _on_rtcp(self, data: bytes, addr: tuple[str, int]) -> None:
        self.rtp.rtcp += 1

    def _apply_media(self, media: MediaPlan) -> None:
        self.remote_rtp = media.remote
        self._out.apply(media)
        self.rtp.audio_pt = media.audio_pt
        self.rtp.event_pt = media.event_pt

    async def _send_media(self) -> None:
        """One packet per 20 ms deadline, as :class:`OutboundStream` says."""
        transport = self._rtp_transport
        assert transport is not None
        pacer, stream, clock, pacing = self.pacer, self._out, self._clock, self._pacing
        pacer.start()
        try:
            while True:
                due = await pacer.wait()
                now = clock.now()
                pacing.record(now - due)
                packet = stream.tick(now)
                if packet is not None and stream.remote is not None:
                    transport.sendto(packet, stream.remote)
        except Exception as exc:  # the sender dies loudly in errors, never silently
            self._error(f"rtp: the sender stopped: {exc!r}")
        finally:
            stream.stop()

    async def _stop_media(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.wait({self._sender})
