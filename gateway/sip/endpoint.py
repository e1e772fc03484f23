"""The SIP/RTP adapter: UDP sockets and timers around the sans-I/O core, bound to calls.

It only pumps and translates: datagrams into :class:`~gateway.sip.uas.UasCore` and
:mod:`gateway.sip.rtp` objects, their effects out to sockets and to the call lifecycle
(:mod:`gateway.call`). An INVITE is admitted by the replica's one admission (the core asks it;
the seat is taken as the INVITE arrives, so a ringing call counts); an answered call is started
by the lifecycle; BYE, CANCEL, a lost ACK or the lifecycle's inactivity watch end it.

Per call, a :class:`SipMedia` owns one RTP socket and is the call's transport: it declares how
RTP plays (:data:`RTP_PLAYOUT`: one packet per 20 ms, silence when idle, a mark played once the
frame before it is sent, barge-in faded and marked as a new talkspurt) and puts each frame the
call's playout releases into an RTP packet. Inbound, it latches symmetric RTP, caps the packet
rate (:mod:`gateway.call.inbound`), and hands caller audio (in the call's codec, decoded once by
the speech detector) and RFC 4733 digits to the call.

Hold (a re-INVITE with a=sendonly or a=inactive): nothing is sent and nothing is played; what
the call was saying waits in its playout and is heard from where it stopped once the caller
resumes. The RTP timestamp is the sampling clock and keeps running meanwhile (RFC 3550 section
5.1: it advances with time, not with packets), so the first packet after the hold carries the
hold's duration in its timestamp, the next sequence number (the sequence counts packets sent)
and the marker bit of a new talkspurt (RFC 3551 section 4.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from gateway.aio import cancel_and_wait
from gateway.call.events import CallOutcome, Codec, TransferTo
from gateway.call.inbound import InboundRate
from gateway.call.lifecycle import CallLifecycle
from gateway.call.playout import PlayoutPolicy
from gateway.call.session import Call
from gateway.metrics import Metrics
from gateway.net import bind
from gateway.sip.rtp import (
    DtmfReceiver,
    DtmfSender,
    RtpError,
    RtpPacket,
    RtpReceiverStats,
    RtpSender,
)
from gateway.sip.sdp import Answer
from gateway.sip.uas import (
    CallAnswered,
    CallConfirmed,
    CallEnded,
    Dropped,
    Effect,
    IncomingCall,
    MediaChanged,
    Refused,
    SendTo,
    TransferDone,
    UasConfig,
    UasCore,
)

log = logging.getLogger(__name__)

__all__ = ["MAX_DIGITS", "RTP_PLAYOUT", "MediaStats", "SipEndpoint", "SipMedia"]

#: How RTP plays: the gateway owns the stream (lead 0), so pacing is one packet per 20 ms beat,
#: silence keeps the stream continuous (NAT bindings, the far end's media timers; a gap would be
#: heard as a click), a stream more than 5 frames (100 ms, the deep end of jitter buffers) behind
#: re-anchors instead of bursting, and a barge-in fades the next frame out. A live utterance
#: starts behind the start buffer (:mod:`gateway.call.playout`): a beat with nothing to send
#: mid-utterance goes out as silence, which the caller hears as a dropout whatever their phone's
#: jitter buffer holds (``GATEWAY_SIP_START_BUFFER_MS`` sets it).
RTP_PLAYOUT = PlayoutPolicy(
    lead_s=0.0,
    max_frames_per_send=1,
    min_frames_per_send=1,
    keepalive=True,
    max_lag_frames=5,
    far_end_marks=False,
    fade_on_interrupt=True,
    # A second of audio queued ahead of the wire, as Twilio's lead (GATEWAY_TWILIO_MAX_LEAD_MS):
    # a cached prompt is fed in as it plays, not queued whole.
    buffer_frames=50,
    start_buffer_s=0.02,
)

#: Digits a call keeps in :attr:`MediaStats.digits` (the latest; ``digits_received`` counts all).
MAX_DIGITS = 64

#: One 20 ms frame, in seconds.
_FRAME_S = 0.02

#: How long a REFER may wait for its final NOTIFY before the caller is hung up (64*T1).
TRANSFER_TIMEOUT_S = 32.0


def bind_udp(host: str, port: int, variable: str = "GATEWAY_SIP") -> socket.socket:
    """A UDP socket bound to ``host:port``, or a :class:`~gateway.errors.ConfigError` that
    says which setting to change (the port is taken, the address is not this host's)."""
    return bind(host, port, kind="udp", what="SIP endpoint", variable=variable)


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, tuple[str, int]], None]) -> None:
        self.on_datagram = on_datagram
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDP transport is not a subclass of asyncio.DatagramTransport; duck-type it.
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable and friends
        log.debug("udp error: %s", exc)


@dataclass
class MediaStats:
    """What a call's RTP did (tests and logs read it)."""

    sent: int = 0
    received: int = 0
    ignored_source: int = 0
    malformed: int = 0
    #: Packets over the call's inbound rate cap, dropped unread.
    flooded: int = 0
    #: The latest :data:`MAX_DIGITS` digits received.
    digits: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_DIGITS))
    #: Digits received in all.
    digits_received: int = 0


class SipMedia:
    """One call's RTP session: the :class:`~gateway.call.session.CallTransport` of a SIP call."""

    def __init__(self, endpoint: SipEndpoint, key: str, answer: Answer,
                 sock: asyncio.DatagramTransport, protocol: _Udp) -> None:
        self.endpoint = endpoint
        self.playout: PlayoutPolicy = endpoint.playout
        self.key = key
        self.codec: Codec = "pcmu" if answer.codec.upper() == "PCMU" else "pcma"
        self.answer = answer
        self.sock = sock
        protocol.on_datagram = self._on_rtp
        self.sender = RtpSender(answer.payload_type)
        self.dtmf = DtmfReceiver()
        self.rx = RtpReceiverStats()
        self.stats = MediaStats()
        self.call: Call | None = None
        # Symmetric RTP (RFC 4961): send where the caller's RTP comes from once it arrives;
        # until then, to the address in its SDP.
        self.remote = answer.remote_rtp
        self._latched = False
        self._on_hold = answer.on_hold
        self._held_at: float | None = endpoint.clock.now() if answer.on_hold else None
        self.rate: InboundRate = endpoint.lifecycle.inbound_meter()
        # Keys being sent to the caller (send_digits), and where their event started.
        self._digits: DtmfSender | None = None
        self._digits_sent: asyncio.Future[None] | None = None
        self._event_ts = 0
        self._dropped_metric = (endpoint.metrics.inbound_media_dropped.labels("sip")
                                if endpoint.metrics is not None else None)

    @property
    def on_hold(self) -> bool:
        """Held (a=sendonly/inactive from the caller): we send nothing, expect nothing."""
        return self._on_hold

    @on_hold.setter
    def on_hold(self, value: bool) -> None:
        if value == self._on_hold:
            return
        self._on_hold = value
        now = self.endpoint.clock.now()
        if value:
            self._held_at = now
        elif self._held_at is not None:
            # The sampling clock ran on while nothing was sent (RFC 3550 5.1); the sequence
            # number did not (it counts packets). The audio resumes as a new talkspurt.
            self.sender.skip(max(0, round((now - self._held_at) / _FRAME_S)))
            self.sender.start_talkspurt()
            self._held_at = None
        if self.call is not None:
            self.call.hold(value)

    @property
    def timed_out(self) -> bool:
        """The call's inactivity watch gave up on the caller's RTP."""
        return self.call is not None and self.call.timed_out

    # --- CallTransport ------------------------------------------------------------------------

    async def send_frames(self, frames: list[bytes]) -> None:
        digits = self._digits
        for frame in frames:
            event = digits.next() if digits is not None else None
            if event is None:
                self.sock.sendto(self.sender.packet(frame), self.remote)
                continue
            # A key on the wire replaces this frame's audio (RFC 4733 section 2.5.1.2).
            payload, first = event
            if first:
                self._event_ts = self.sender.timestamp
            assert self.answer.telephone_event_pt is not None
            self.sock.sendto(self.sender.event_packet(payload, self.answer.telephone_event_pt,
                                                      self._event_ts, first),
                             self.remote)
        self.stats.sent += len(frames)
        if digits is not None and digits.done:
            self._digits = None
            if self._digits_sent is not None and not self._digits_sent.done():
                self._digits_sent.set_result(None)

    async def send_digits(self, digits: str) -> bool:
        """Send keys to the caller as RFC 4733 events in the outgoing RTP (False, sending
        nothing, when the caller's SDP did not offer telephone-event). Returns once sent."""
        if self.answer.telephone_event_pt is None:
            return False
        while self._digits is not None and self._digits_sent is not None:
            await asyncio.shield(self._digits_sent)
        sent = self._digits_sent = asyncio.get_running_loop().create_future()
        self._digits = DtmfSender(digits)
        await asyncio.shield(sent)
        return True

    async def send_mark(self, name: str) -> None:
        raise AssertionError("RTP has no far-end marks (RTP_PLAYOUT.far_end_marks is False)")

    async def clear(self) -> None:
        # Barge-in: nothing is buffered at the far end to clear; the next utterance starts a new
        # talkspurt (marker bit, RFC 3551 4.1).
        self.sender.start_talkspurt()

    async def end(self, outcome: CallOutcome) -> None:
        if isinstance(outcome, TransferTo):
            await self.endpoint.transfer(self.key, outcome.target)
        else:
            self.endpoint.hangup(self.key)

    def abort(self, reason: str) -> None:
        self.endpoint.hangup(self.key, reason)

    # --- receiving ----------------------------------------------------------------------------

    def _on_rtp(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._latched:
            if addr != self.remote:
                self.stats.ignored_source += 1
                return
        elif not (addr[0] == self.answer.remote_rtp[0] or self.endpoint.accept_any_rtp_source):
            self.stats.ignored_source += 1
            return
        # One clock read per packet, shared by the rate cap, the inactivity watch, jitter and
        # DTMF.
        now = self.endpoint.clock.now()
        if not self.rate.allow(now):
            # A flood from this source: dropped before it is even parsed.
            self.stats.flooded += 1
            if self.rate.dropped == 1:
                log.warning("sip call %s: inbound RTP over %g packets/s; dropping the excess",
                            _call_name(self.key), self.rate.rate)
            if self._dropped_metric is not None:
                self._dropped_metric.inc()
            return
        try:
            packet = RtpPacket.parse(data)
        except RtpError:
            self.stats.malformed += 1
            return
        if not self._latched:
            # Latch on the first *valid* RTP packet only: garbage from another port of the
            # caller's address must not steal the stream (and with it our outbound audio).
            self.remote = addr
            self._latched = True
        self.stats.received += 1
        call = self.call
        if call is not None:
            call.received(now)
        if packet.payload_type == self.answer.telephone_event_pt:
            # Events share the audio's sequence space (loss accounting) but repeat their start
            # timestamp, so they take no part in the jitter estimate (RFC 4733 2.3).
            self.rx.update(packet, now, update_jitter=False)
            try:
                digit = self.dtmf.feed(packet)
            except RtpError:
                self.stats.malformed += 1
                return
            if digit is not None:
                self.stats.digits.append(digit)
                self.stats.digits_received += 1
                if call is not None:
                    call.dtmf(digit, now)
            return
        if packet.payload_type != self.answer.payload_type:
            return
        self.rx.update(packet, now)
        if call is not None:
            call.inbound_audio(packet.payload, now)

    def close(self) -> None:
        self.sock.close()


class SipEndpoint:
    """SIP over UDP for the gateway: one signalling socket, one RTP socket per call."""

    def __init__(
        self,
        lifecycle: CallLifecycle,
        config: UasConfig,
        *,
        metrics: Metrics | None = None,
        rtp_ports: range = range(20000, 21000),
        answer_delay_s: float = 0.0,
        accept_any_rtp_source: bool = False,
        rtp_timeout_s: float = 60.0,
        playout: PlayoutPolicy = RTP_PLAYOUT,
    ) -> None:
        """Each call's cap on inbound RTP packets is the lifecycle's
        (:mod:`gateway.call.inbound`); ``playout`` is how its RTP plays (:data:`RTP_PLAYOUT`,
        its start buffer from settings)."""
        self.lifecycle = lifecycle
        self.clock = lifecycle.clock
        self.metrics = metrics
        # The core asks the replica's admission (a pure question) on each INVITE and OPTIONS.
        self.core = UasCore(config, admission=lifecycle.refusal)
        self.config = config
        self.rtp_ports = rtp_ports
        self.answer_delay_s = answer_delay_s
        self.accept_any_rtp_source = accept_any_rtp_source
        self.rtp_timeout_s = rtp_timeout_s
        self.playout = playout
        self.media: dict[str, SipMedia] = {}
        self.calls: dict[str, Call] = {}
        self.dropped = 0
        self._sock: asyncio.DatagramTransport | None = None
        self._wake = asyncio.Event()
        self._timer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._transfers: dict[str, asyncio.Future[bool]] = {}
        self._next_port = rtp_ports.start
        self.local_addr: tuple[str, int] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self, host: str, port: int, *,
                    sock: socket.socket | None = None) -> tuple[str, int]:
        """Serve SIP on ``sock`` (already bound, :func:`bind_udp`), else bind ``host:port``
        (:class:`~gateway.errors.ConfigError` when that fails)."""
        loop = asyncio.get_running_loop()
        self.loop = loop
        if sock is None:
            sock = bind_udp(host, port)
        transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self._on_sip),
                                                           sock=sock)
        self._sock = transport
        self.local_addr = transport.get_extra_info("sockname")[:2]
        if self.config.local_port == 0:
            self.config.local_port = self.local_addr[1]
        self._timer = asyncio.create_task(self._timers(), name="sip-timers")
        log.info("SIP endpoint on udp %s:%d (advertising %s)", *self.local_addr,
                 self.config.local_ip)
        return self.local_addr

    async def stop(self) -> None:
        for key in list(self.media):
            self._apply(self.core.hangup(key, self.clock.now()))
        await asyncio.sleep(0)
        await cancel_and_wait(self._timer, log=log, what="sip timers")
        self._timer = None
        for key in list(self.media):
            await self._finish(key, "shutdown")
        if self._sock is not None:
            self._sock.close()

    # --- signalling ---------------------------------------------------------------------------

    def _on_sip(self, data: bytes, addr: tuple[str, int]) -> None:
        self._apply(self.core.receive(data, addr, self.clock.now()))

    async def _timers(self) -> None:
        clock = self.clock
        while True:
            deadline = self.core.next_deadline()
            timeout = 1.0 if deadline is None else max(0.0, deadline - clock.now())
            self._wake.clear()
            try:
                await clock.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
            self._apply(self.core.tick(clock.now()))

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, SendTo):
                if self._sock is not None:
                    self._sock.sendto(effect.data, effect.addr)
            elif isinstance(effect, IncomingCall):
                # The INVITE passed the admission question: take its seat now, so a call that
                # is still ringing counts against the budget of every transport.
                refused = self.lifecycle.admit(effect.key, "sip")
                if refused is not None:
                    self._apply(self.core.reject(effect.key, 486 if refused == "at_capacity"
                                                 else 503, self.clock.now()))
                    continue
                self._spawn(self._incoming(effect))
            elif isinstance(effect, CallAnswered):
                pass  # handled inline by _incoming, which called answer()
            elif isinstance(effect, CallConfirmed):
                log.info("sip call %s confirmed (ACK)", _call_name(effect.key))
            elif isinstance(effect, MediaChanged):
                media = self.media.get(effect.key)
                if media is not None:
                    media.answer = effect.answer
                    media.on_hold = effect.answer.on_hold or effect.answer.direction in (
                        "recvonly", "inactive")
                    log.info("sip call %s media %s", _call_name(effect.key),
                             "on hold" if media.on_hold else "resumed")
            elif isinstance(effect, CallEnded):
                self._spawn(self._finish(effect.key, effect.reason))
            elif isinstance(effect, TransferDone):
                future = self._transfers.pop(effect.key, None)
                if future is not None and not future.done():
                    future.set_result(effect.accepted)
            elif isinstance(effect, Refused):
                if self.metrics is not None:
                    self.metrics.calls_refused.labels("sip", effect.reason).inc()
            elif isinstance(effect, Dropped):
                self.dropped += 1
                if self.metrics is not None:
                    self.metrics.sip_dropped.inc()
                log.debug("sip: %s", effect.reason)
        self._wake.set()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _incoming(self, event: IncomingCall) -> None:
        if self.answer_delay_s:
            await self.clock.sleep(self.answer_delay_s)
        dialog = self.core.dialogs.get(event.key)
        if dialog is None or dialog.state != "proceeding":
            return  # cancelled while ringing (its seat went with the CallEnded)
        try:
            sock, protocol, port = await self._bind_rtp()
        except OSError:
            log.error("sip: no free RTP port in %s", self.rtp_ports)
            self._apply(self.core.reject(event.key, 503, self.clock.now()))
            return
        effects = self.core.answer(event.key, self.config.local_ip, port, self.clock.now())
        answered = next((e for e in effects if isinstance(e, CallAnswered)), None)
        if answered is None:
            sock.close()
            self._apply(effects)
            return
        media = SipMedia(self, event.key, answered.answer, sock, protocol)
        self.media[event.key] = media
        call_id = _call_name(event.key)
        call = self.lifecycle.start(
            event.key, media,
            transport_name="sip",
            call_id=call_id,
            parameters={"caller": event.caller, "called": event.called},
            inactivity_s=self.rtp_timeout_s,
        )
        media.call = call
        if media.on_hold:
            call.hold(True)
        self.calls[event.key] = call
        self._apply(effects)
        log.info("sip call %s from %s answered with %s", call_id, event.caller,
                 answered.answer.codec)

    async def _bind_rtp(self) -> tuple[asyncio.DatagramTransport, _Udp, int]:
        loop = asyncio.get_running_loop()
        ports = self.rtp_ports
        for _ in range(len(ports)):
            port = self._next_port
            self._next_port = ports.start + (self._next_port - ports.start + 2) % len(ports)
            try:
                transport, protocol = await loop.create_datagram_endpoint(
                    lambda: _Udp(lambda data, addr: None),
                    local_addr=(self.local_addr[0] if self.local_addr else "0.0.0.0", port))
            except OSError:
                continue
            return transport, protocol, port
        raise OSError("no free RTP port")

    async def _finish(self, key: str, reason: str) -> None:
        media = self.media.pop(key, None)
        call = self.calls.pop(key, None)
        if call is not None:
            await self.lifecycle.finish(call, reason)
        else:
            # Never answered (cancelled while ringing, no RTP port): its seat is free.
            self.lifecycle.admission.release(key)
        if media is not None:
            media.close()
            log.info("sip call %s ended (%s): %d RTP sent, %d received, jitter %.1f ms",
                     _call_name(key), reason, media.stats.sent, media.stats.received,
                     media.rx.jitter_ms)

    # --- commands from calls ------------------------------------------------------------------

    def hangup(self, key: str, reason: str = "local") -> None:
        self._apply(self.core.hangup(key, self.clock.now(), reason))

    async def transfer(self, key: str, target: str) -> None:
        """REFER the caller to ``target``; hang up once it is accepted (or refused).

        One REFER at a time per call: the outcome (:class:`~gateway.sip.uas.TransferDone`)
        names the dialog, not the REFER, so a second one's NOTIFY could not be told from the
        first's. A second transfer while one is pending sends nothing and returns with the
        first one's outcome (it used to replace the first one's future, which then waited out
        the whole 32 s).
        """
        pending = self._transfers.get(key)
        if pending is not None:
            log.warning("sip call %s: transfer to %s while a transfer is pending; it waits for "
                        "that one", _call_name(key), target)
            with contextlib.suppress(TimeoutError):
                # Shielded: this waiter giving up must not cancel the first one's outcome.
                await self.clock.wait_for(asyncio.shield(pending), TRANSFER_TIMEOUT_S)
            return
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._transfers[key] = future
        try:
            effects = self.core.refer(key, target, self.clock.now())
            if not effects:
                self.hangup(key)
                return
            self._apply(effects)
            try:
                accepted = await self.clock.wait_for(asyncio.shield(future), TRANSFER_TIMEOUT_S)
            except TimeoutError:
                accepted = False
        finally:
            # Whatever ended this wait (an outcome, the timeout, our cancellation), the transfer
            # is over: forget it, and release anyone waiting on it with "not accepted".
            if self._transfers.get(key) is future:
                del self._transfers[key]
            if not future.done():
                future.set_result(False)
        if not accepted:
            # Documented limitation: a peer that refuses REFER cannot be transferred by this
            # endpoint (no B2BUA bridging); the caller is hung up with a log line.
            log.warning("sip call %s: transfer to %s refused by the peer; hanging up",
                        _call_name(key), target)
        self.hangup(key)


def _call_name(key: str) -> str:
    """A SIP call as every log line names it: ``sip-<Call-ID>``, the id its call, trace and
    utterances carry (a dialog's key is the Call-ID and the caller's tag)."""
    return f"sip-{key.split(';', 1)[0]}"
