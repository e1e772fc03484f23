"""The asyncio shell of the SIP endpoint: UDP sockets, timers, and the bridge to :class:`Call`.

It only pumps: datagrams into :class:`~gateway.sip.uas.UasCore` and
:class:`~gateway.sip.rtp` objects, their effects out to sockets and to the call. Per call, a
:class:`SipMedia` owns one RTP socket and implements the call's transport: 20 ms frames paced on
a monotonic deadline (STYLE rule 5), marks reported when the frame before them has been sent,
barge-in that simply stops the stream (nothing is buffered at the far end to clear), RFC 4733
digits and caller speech delivered as the same events the Twilio transport delivers.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.audio.g711 import alaw_decode, codec_silence, ulaw_encode
from gateway.audio.pacer import Pacer
from gateway.call import (
    Call,
    CallOutcome,
    Codec,
    Dtmf,
    HangUp,
    Hangup,
    PlaybackDone,
    SpeechStarted,
    TransferTo,
)
from gateway.logs import call_context
from gateway.sip.rtp import DtmfReceiver, RtpError, RtpPacket, RtpReceiverStats, RtpSender
from gateway.sip.sdp import Answer
from gateway.sip.uas import (
    CallAnswered,
    CallConfirmed,
    CallEnded,
    Dropped,
    Effect,
    IncomingCall,
    MediaChanged,
    SendTo,
    TransferDone,
    UasConfig,
    UasCore,
)

if TYPE_CHECKING:
    from gateway.app import GatewayState
    from gateway.audio.vad import SpeechStartDetector

log = logging.getLogger(__name__)

_MARK = object()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Any) -> None:
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
    digits: list[str] = field(default_factory=list)


class SipMedia:
    """One call's RTP session and the :class:`~gateway.call.CallTransport` behind the call."""

    def __init__(self, endpoint: SipEndpoint, key: str, answer: Answer,
                 sock: asyncio.DatagramTransport, protocol: _Udp) -> None:
        self.endpoint = endpoint
        self.key = key
        self.codec: Codec = "pcmu" if answer.codec.upper() == "PCMU" else "pcma"
        self._silence = bytes([codec_silence(self.codec)]) * 160
        self.answer = answer
        self.sock = sock
        protocol.on_datagram = self._on_rtp
        self.sender = RtpSender(answer.payload_type)
        self.dtmf = DtmfReceiver()
        self.rx = RtpReceiverStats()
        self.stats = MediaStats()
        self.call: Call | None = None
        self.vad: SpeechStartDetector | None = None
        # Symmetric RTP (RFC 4961): send where the caller's RTP comes from once it arrives;
        # until then, to the address in its SDP.
        self.remote = answer.remote_rtp
        self._latched = False
        self._queue: collections.deque[object] = collections.deque()
        self._pacer_task: asyncio.Task[None] | None = None
        self._on_hold = answer.on_hold
        # When the caller's RTP last arrived (or the call began, or came off hold): a caller
        # whose media stops for endpoint.rtp_timeout_s is gone, whether or not a BYE says so.
        self.last_rx = time.monotonic()
        self.timed_out = False

    @property
    def on_hold(self) -> bool:
        """Held (a=sendonly/inactive from the caller): we send nothing, expect nothing."""
        return self._on_hold

    @on_hold.setter
    def on_hold(self, value: bool) -> None:
        if self._on_hold and not value:
            self.last_rx = time.monotonic()  # the silence of the hold does not count
        self._on_hold = value

    # --- CallTransport ------------------------------------------------------------------------

    async def send_frames(self, frames: list[bytes]) -> None:
        self._queue.extend(frames)

    async def send_mark(self, name: str) -> None:
        self._queue.append((_MARK, name))

    async def clear(self) -> None:
        # Barge-in: nothing is buffered at the far end, so dropping our queue stops the audio
        # within one frame; the next utterance starts a new talkspurt (marker bit).
        self._queue.clear()
        self.sender.start_talkspurt()

    async def hangup(self) -> None:
        await self.end(HangUp())

    async def end(self, outcome: CallOutcome) -> None:
        if isinstance(outcome, TransferTo):
            await self.endpoint.transfer(self.key, outcome.target)
        else:
            self.endpoint.hangup(self.key)

    # --- sending ------------------------------------------------------------------------------

    def start(self) -> None:
        self._pacer_task = asyncio.create_task(self._pace(), name=f"rtp-{self.key[:16]}")

    async def _pace(self) -> None:
        """One packet every 20 ms against a monotonic deadline; silence when idle.

        Continuous RTP keeps NAT bindings and the far end's media timers alive; a gap in our
        stream would also be heard as a click.
        """
        pacer = Pacer()
        pacer.start(time.monotonic())
        while True:
            deadline = pacer.next_deadline()
            delay = deadline - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            frame = self._next_frame()
            if self.on_hold:
                continue
            self._check_inactivity(deadline)
            packet = self.sender.packet(frame if frame is not None else self._silence)
            self.sock.sendto(packet, self.remote)
            self.stats.sent += 1

    def _check_inactivity(self, now: float) -> None:
        """Checked on the pacer's 20 ms beat: no timer per packet, and none at all when held."""
        limit = self.endpoint.rtp_timeout_s
        if limit <= 0 or self.timed_out or now - self.last_rx < limit:
            return
        self.timed_out = True
        log.warning("sip call %s: no RTP from the caller for %.1f s; hanging up", self.key[:24],
                    now - self.last_rx)
        self.endpoint.state.metrics.calls_inbound_timeouts.labels("sip").inc()
        self.endpoint.hangup(self.key, "rtp timeout")

    def _next_frame(self) -> bytes | None:
        queue = self._queue
        while queue:
            item = queue.popleft()
            if isinstance(item, tuple):
                # Everything before the mark has gone out: report it as played.
                if self.call is not None:
                    self.call.deliver(PlaybackDone(item[1]))
                continue
            assert isinstance(item, bytes)
            return item
        return None

    # --- receiving ----------------------------------------------------------------------------

    def _on_rtp(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._latched:
            if addr != self.remote:
                self.stats.ignored_source += 1
                return
        elif not (addr[0] == self.answer.remote_rtp[0] or self.endpoint.accept_any_rtp_source):
            self.stats.ignored_source += 1
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
        # One clock read per packet, shared by the inactivity timer, jitter and DTMF.
        now = self.last_rx = time.monotonic()
        call = self.call
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
                if call is not None:
                    call.deliver(Dtmf(digit, at=now))
            return
        if packet.payload_type != self.answer.payload_type:
            return
        self.rx.update(packet, now)
        if self.vad is not None and call is not None:
            payload = packet.payload if self.codec == "pcmu" else ulaw_encode(
                alaw_decode(packet.payload))
            if self.vad.push(payload):
                call.deliver(SpeechStarted())

    async def close(self) -> None:
        if self._pacer_task is not None:
            self._pacer_task.cancel()
            try:
                await self._pacer_task
            except asyncio.CancelledError:
                pass
        self.sock.close()


class SipEndpoint:
    """SIP over UDP for the gateway: one signalling socket, one RTP socket per call."""

    def __init__(
        self,
        state: GatewayState,
        config: UasConfig,
        *,
        rtp_ports: range = range(20000, 21000),
        answer_delay_s: float = 0.0,
        accept_any_rtp_source: bool = False,
        rtp_timeout_s: float = 60.0,
    ) -> None:
        self.state = state
        self.core = UasCore(config)
        self.config = config
        self.rtp_ports = rtp_ports
        self.answer_delay_s = answer_delay_s
        self.accept_any_rtp_source = accept_any_rtp_source
        self.rtp_timeout_s = rtp_timeout_s
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

    async def start(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self.loop = loop
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Udp(self._on_sip), local_addr=(host, port))
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
            self._apply(self.core.hangup(key, time.monotonic()))
        await asyncio.sleep(0)
        if self._timer is not None:
            self._timer.cancel()
        for key in list(self.media):
            await self._finish(key, "shutdown")
        if self._sock is not None:
            self._sock.close()

    @property
    def draining(self) -> bool:
        return self.core.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.core.draining = value

    # --- signalling ---------------------------------------------------------------------------

    def _on_sip(self, data: bytes, addr: tuple[str, int]) -> None:
        # Not ready (loading, warming up) or draining: new INVITEs and OPTIONS get 503.
        self.core.draining = self.state.draining or not self.state.ready
        # One call budget per replica: SIP gets what Twilio calls leave of GATEWAY_MAX_CALLS.
        self.core.config.max_calls = self.state.sip_capacity() if self.state.ready else 0
        self._apply(self.core.receive(data, addr, time.monotonic()))

    async def _timers(self) -> None:
        while True:
            deadline = self.core.next_deadline()
            timeout = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
            self._apply(self.core.tick(time.monotonic()))

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, SendTo):
                if self._sock is not None:
                    self._sock.sendto(effect.data, effect.addr)
            elif isinstance(effect, IncomingCall):
                self._spawn(self._incoming(effect))
            elif isinstance(effect, CallAnswered):
                pass  # handled inline by _incoming, which called answer()
            elif isinstance(effect, CallConfirmed):
                log.info("sip call %s confirmed (ACK)", effect.key[:24])
            elif isinstance(effect, MediaChanged):
                media = self.media.get(effect.key)
                if media is not None:
                    media.answer = effect.answer
                    media.on_hold = effect.answer.on_hold or effect.answer.direction in (
                        "recvonly", "inactive")
                    log.info("sip call %s media %s", effect.key[:24],
                             "on hold" if media.on_hold else "resumed")
            elif isinstance(effect, CallEnded):
                self._spawn(self._finish(effect.key, effect.reason))
            elif isinstance(effect, TransferDone):
                future = self._transfers.pop(effect.key, None)
                if future is not None and not future.done():
                    future.set_result(effect.accepted)
            elif isinstance(effect, Dropped):
                self.dropped += 1
                self.state.metrics.sip_dropped.inc()
                log.debug("sip: %s", effect.reason)
        self._wake.set()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _incoming(self, event: IncomingCall) -> None:
        if self.answer_delay_s:
            await asyncio.sleep(self.answer_delay_s)
        dialog = self.core.dialogs.get(event.key)
        if dialog is None or dialog.state != "proceeding":
            return  # cancelled while ringing
        try:
            sock, protocol, port = await self._bind_rtp()
        except OSError:
            log.error("sip: no free RTP port in %s", self.rtp_ports)
            self._apply(self.core.reject(event.key, 503, time.monotonic()))
            return
        effects = self.core.answer(event.key, self.config.local_ip, port, time.monotonic())
        answered = next((e for e in effects if isinstance(e, CallAnswered)), None)
        if answered is None:
            sock.close()
            self._apply(effects)
            return
        media = SipMedia(self, event.key, answered.answer, sock, protocol)
        self.media[event.key] = media
        call_id = f"sip-{dialog.call_id}"
        call = self.state.open_call(call_id, media, "sip",
                                    {"caller": event.caller, "called": event.called})
        media.call = call
        media.vad = self.state.new_speech_detector()
        self.calls[event.key] = call
        media.start()
        self._apply(effects)
        log.info("sip call %s from %s answered with %s", call_id, event.caller,
                 answered.answer.codec)
        assert self.state.dialog is not None
        # The call's tasks (and the tasks they start) log with its id.
        with call_context(call_id):
            self._spawn(self.state.run_dialog(call, self.state.dialog))

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
            call.deliver(Hangup(reason))
            await call.close()
            self.state.close_call(call, "sip")
        if media is not None:
            await media.close()
            log.info("sip call %s ended (%s): %d RTP sent, %d received, jitter %.1f ms",
                     key[:24], reason, media.stats.sent, media.stats.received,
                     media.rx.jitter_ms)

    # --- commands from calls ------------------------------------------------------------------

    def hangup(self, key: str, reason: str = "local") -> None:
        self._apply(self.core.hangup(key, time.monotonic(), reason))

    async def transfer(self, key: str, target: str) -> None:
        """REFER the caller to ``target``; hang up once it is accepted (or refused)."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._transfers[key] = future
        effects = self.core.refer(key, target, time.monotonic())
        if not effects:
            self._transfers.pop(key, None)
            self.hangup(key)
            return
        self._apply(effects)
        try:
            accepted = await asyncio.wait_for(future, 32)
        except TimeoutError:
            accepted = False
        if not accepted:
            # Documented limitation: a peer that refuses REFER cannot be transferred by this
            # endpoint (no B2BUA bridging); the caller is hung up with a log line.
            log.warning("sip call %s: transfer to %s refused by the peer; hanging up",
                        key[:24], target)
        self.hangup(key)
