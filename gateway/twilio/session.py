"""The Media Streams adapter: one WebSocket's messages in, one call's frames out.

It only translates. :class:`TwilioSession` reads the socket, feeds
:class:`~gateway.twilio.protocol.MediaStreamProtocol`, and turns each typed event into what the
call lifecycle understands (``start`` -> admit and start the call; ``media`` -> caller audio;
``dtmf`` -> a key; ``mark`` -> playback done; ``stop`` or a closed socket -> finish).
:class:`TwilioTransport` is the call's way out: frames as ``media`` messages, ``mark``,
``clear``, and the end of the call: with a :class:`~gateway.twilio.rest.CallUpdater`, the
outcome goes to Twilio as a live-call update and Twilio ends the stream itself; otherwise (or
when the update fails) closing the stream makes Twilio request the ``<Connect action>`` URL,
which answers with what :class:`Outcomes` recorded. Pacing, backpressure,
inactivity and the speech detector are the lifecycle's (:mod:`gateway.call`); this adapter only
declares how Twilio plays audio (:meth:`TwilioConfig.playout`).

A message the protocol rejects closes *this* socket with the error's close code and a logged
reason; nothing here is shared with other calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from gateway.call.events import CallOutcome, Codec
from gateway.call.inactivity import InactivityWatch
from gateway.call.inbound import InboundRate
from gateway.call.lifecycle import CallLifecycle
from gateway.call.playout import PlayoutPolicy, start_buffer_setting
from gateway.call.session import Call
from gateway.clock import Cancellable, Clock, SystemClock
from gateway.config import Settings
from gateway.errors import CallProtocolError, ProtocolViolation
from gateway.logs import call_id_var
from gateway.metrics import Metrics
from gateway.twilio.protocol import (
    Connected,
    Dtmf,
    Mark,
    Media,
    MediaStreamProtocol,
    OutboundClear,
    OutboundMark,
    Start,
    Stop,
)
from gateway.twilio.rest import CallUpdater
from gateway.twilio.twiml import Busy, StreamOutcome, outcome_twiml

log = logging.getLogger(__name__)

__all__ = [
    "AFTER_STREAM_HOPS",
    "HANDOFF_S",
    "MAX_OUTCOMES",
    "Outcomes",
    "TwilioConfig",
    "TwilioSession",
    "TwilioTransport",
]

#: Inbound messages handled back to back before the receive loop yields to other calls
#: (a burst of 16 media messages is well under a millisecond of work).
YIELD_EVERY = 16

#: Finished calls' outcomes kept for their <Connect action> request.
MAX_OUTCOMES = 10_000

#: ``after-stream`` retries for a call this replica does not know, on a fleet (see
#: :attr:`TwilioConfig.after_stream_hops`): with round-robin over two replicas the first retry
#: reaches the other one; over N, three tries reach a given one with 1 - (1 - 1/N)^3.
AFTER_STREAM_HOPS = 2

#: After a live-call update Twilio ends the stream itself (the update interrupts
#: <Connect><Stream>); should it not within this long, the stream is closed from here and the
#: outcome recorded for after-stream still holds on this replica.
HANDOFF_S = 5.0

#: How a media message Twilio sends begins (compact JSON, ``event`` first).
_MEDIA_PREFIX = '{"event":"media"'


@dataclass(frozen=True)
class TwilioConfig:
    """The Twilio transport's settings (from :class:`~gateway.config.Settings`)."""

    max_message_bytes: int = 64 * 1024
    #: A stream with no inbound message this long is dead (Twilio sends media every 20 ms).
    idle_timeout_s: float = 10.0
    #: Audio is sent at most this far ahead of the caller's playback.
    max_lead_s: float = 1.0
    frames_per_message: int = 50
    #: The start buffer of a live utterance (:mod:`gateway.call.playout`); None: no hold.
    start_buffer_s: float | None = 0.02
    start_buffer_adapts: bool = True
    #: How long the voice webhook holds a seat for a stream that has not connected yet (Twilio
    #: connects within a second or two; a call that never streams gives its seat back). 0: none.
    reservation_s: float = 5.0
    busy_message: str = "Sorry, all our lines are busy right now."
    #: How many times ``after-stream`` answers a call it does not know with "wait, ask again"
    #: (``<Pause>`` + ``<Redirect>`` through the balancer) before ``<Hangup/>``. 0 without
    #: live-call updates: a gateway that cannot reach Twilio's API is taken to be the only
    #: replica, and a call it does not know has no outcome anywhere.
    after_stream_hops: int = 0
    after_stream_pause_s: int = 1

    @classmethod
    def from_settings(cls, settings: Settings) -> TwilioConfig:
        return cls(
            max_message_bytes=settings.max_message_bytes,
            idle_timeout_s=settings.twilio_idle_timeout_s,
            max_lead_s=settings.twilio_max_lead_ms / 1000,
            frames_per_message=settings.frames_per_message,
            start_buffer_s=start_buffer_setting(settings.twilio_start_buffer_ms),
            start_buffer_adapts=settings.start_buffer_adaptive,
            reservation_s=settings.twilio_reservation_s,
            busy_message=settings.busy_message,
            after_stream_hops=AFTER_STREAM_HOPS if settings.twilio_account_sid else 0,
        )

    def playout(self) -> PlayoutPolicy:
        """Twilio buffers what it is sent and echoes marks once they have played: send up to
        ``max_lead_s`` ahead, in messages of at least half that (two or more a second, not 50),
        and never fade on barge-in (``clear`` cuts Twilio's buffer at a playback position only
        Twilio knows). Twilio plays a message as soon as it arrives and plays silence once its
        buffer is empty, so a live utterance starts behind the start buffer."""
        lead_frames = max(1, round(self.max_lead_s / 0.02))
        most = max(1, min(self.frames_per_message, lead_frames))
        return PlayoutPolicy(
            lead_s=self.max_lead_s,
            max_frames_per_send=most,
            min_frames_per_send=max(1, min(most, lead_frames // 2)),
            keepalive=False,
            far_end_marks=True,
            fade_on_interrupt=False,
            start_buffer_s=self.start_buffer_s,
            start_buffer_adapts=self.start_buffer_adapts,
        )


class Outcomes:
    """How each finished stream's call continues, for its ``<Connect action>`` request.

    Recorded by the replica that ran the stream and read (once) by ``/twilio/after-stream``,
    normally within a second. On a fleet that request may land on another replica, which
    knows nothing of it: there the outcome reaches Twilio as a live-call update
    (:mod:`gateway.twilio.rest`), and this record is the fallback should the update fail. Only
    the newest :data:`MAX_OUTCOMES` are kept.
    """

    def __init__(self, limit: int = MAX_OUTCOMES) -> None:
        self._limit = limit
        self._outcomes: OrderedDict[str, StreamOutcome] = OrderedDict()

    def record(self, call_sid: str, outcome: StreamOutcome) -> None:
        self._outcomes[call_sid] = outcome
        self._outcomes.move_to_end(call_sid)
        while len(self._outcomes) > self._limit:
            self._outcomes.popitem(last=False)

    def take(self, call_sid: str) -> StreamOutcome | None:
        return self._outcomes.pop(call_sid, None)

    def get(self, call_sid: str) -> StreamOutcome | None:
        return self._outcomes.get(call_sid)

    def __contains__(self, call_sid: object) -> bool:
        return call_sid in self._outcomes

    def __len__(self) -> int:
        return len(self._outcomes)


class TwilioTransport:
    """:class:`~gateway.call.session.CallTransport` over one Media Streams socket."""

    codec: Codec = "pcmu"

    def __init__(
        self,
        websocket: WebSocket,
        protocol: MediaStreamProtocol,
        outcomes: Outcomes | None = None,
        playout: PlayoutPolicy | None = None,
        *,
        updater: CallUpdater | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._ws = websocket
        self._protocol = protocol
        self.playout = playout if playout is not None else TwilioConfig().playout()
        self._outcomes = outcomes if outcomes is not None else Outcomes()
        self._updater = updater
        self._clock = clock if clock is not None else SystemClock()
        self.call_sid: str | None = None
        #: Twilio took the outcome as a live-call update; it ends the stream itself.
        self.handed_off = False
        #: The session stopped reading: Twilio sent ``stop``, the socket closed or went silent.
        self.stream_over = False
        self._handoff: Cancellable | None = None
        self._closing: asyncio.Task[None] | None = None
        # Frames and marks come from the playout task, clear from the dialog, close from either:
        # one lock keeps each message whole and in order on the socket.
        self._lock = asyncio.Lock()
        self.messages_sent = 0
        #: Set by :meth:`abort`; the session's receive loop ends on it.
        self.aborted: str | None = None
        #: The session task reading the socket, and whether it is waiting on it right now.
        self.reader: asyncio.Task[None] | None = None
        self.receiving = False

    async def _write(self, text: str) -> None:
        async with self._lock:
            if self._ws.application_state is WebSocketState.CONNECTED:
                try:
                    await self._ws.send_text(text)
                except (WebSocketDisconnect, RuntimeError):
                    # The server closed the socket under the call (uvicorn answers invalid
                    # UTF-8 or an oversize frame itself; Starlette still says CONNECTED) or the
                    # peer vanished. The receive loop ends the call; a late frame is dropped
                    # rather than killing the playout with an unretrieved exception.
                    return
                self.messages_sent += 1

    async def send_frames(self, frames: list[bytes]) -> None:
        # Several 20 ms frames may share one message: its payload is still a whole number of
        # 160-byte frames, and Twilio plays them back to back.
        await self._write(self._protocol.media_text(b"".join(frames)))

    async def send_mark(self, name: str) -> None:
        await self._write(self._protocol.send(OutboundMark(name)))

    async def clear(self) -> None:
        await self._write(self._protocol.send(OutboundClear()))

    @property
    def connected(self) -> bool:
        """The stream is still up (Twilio has not ended it, nor have we)."""
        return not self.stream_over and self._ws.application_state is WebSocketState.CONNECTED

    async def end(self, outcome: CallOutcome) -> None:
        await self.hand_over(outcome)

    async def hand_over(self, outcome: StreamOutcome, *, close_code: int = 1000,
                        reason: str = "") -> bool:
        """Tell Twilio how the call continues; True when a live-call update delivered it.

        The outcome is recorded for ``after-stream`` first (this replica answers it whatever
        else happens). Then, with an updater, the call's TwiML is replaced through the REST
        API while the stream is still open, so no ``after-stream`` request (which any replica
        may get) can race the update; Twilio ends the stream when it runs the new TwiML, and
        the stream is closed from here only if it has not after :data:`HANDOFF_S`. Without an
        updater, or when the update failed, the stream is closed now and Twilio requests
        ``after-stream``, answered here with ``<Dial>``, the busy message or ``<Hangup/>``
        (``close_code`` and ``reason`` say why, RFC 6455 7.4.1: 1013 for a refused stream).
        """
        call_sid = self.call_sid
        if call_sid is not None:
            self._outcomes.record(call_sid, outcome)
            if self._updater is not None and self.connected:
                if await self._updater.update(call_sid, outcome_twiml(outcome),
                                              still_needed=lambda: self.connected):
                    self.handed_off = True
                    if self.connected and self._handoff is None:
                        self._handoff = self._clock.call_later(HANDOFF_S, self._handoff_over)
                    return True
        await self.close(close_code, reason)
        return False

    def _handoff_over(self) -> None:
        if self.connected:
            log.warning("call %s: Twilio took the update but kept the stream open for %g s; "
                        "closing it", self.call_sid, HANDOFF_S)
            self._closing = asyncio.create_task(self.close(1000))

    async def close(self, code: int, reason: str = "") -> None:
        """Close the stream (``reason`` at most 123 bytes, RFC 6455 5.5), once."""
        if self._handoff is not None:
            self._handoff.cancel()
        async with self._lock:
            if self._ws.application_state is WebSocketState.CONNECTED:
                # Already closed under us (see _write), or the peer vanished: nothing to close.
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await self._ws.close(
                        code=code, reason=reason.encode()[:120].decode(errors="ignore"))

    def abort(self, reason: str) -> None:
        """The stream went silent: stop reading (the session then closes the socket)."""
        if self.aborted is not None:
            return
        self.aborted = reason
        # Cancel only while the session waits on the socket, so the CancelledError lands there,
        # never inside a dispatch or the call's clean-up; otherwise the loop sees ``aborted``
        # after the message it is handling.
        if self.receiving and self.reader is not None:
            self.reader.cancel()


class TwilioSession:
    """One Media Streams connection, from ``connected`` to ``stop`` or close."""

    def __init__(
        self,
        websocket: WebSocket,
        lifecycle: CallLifecycle,
        config: TwilioConfig,
        outcomes: Outcomes,
        metrics: Metrics | None = None,
        updater: CallUpdater | None = None,
    ) -> None:
        self.ws = websocket
        self.lifecycle = lifecycle
        self.config = config
        self.metrics = metrics
        self.protocol = MediaStreamProtocol(max_message_bytes=config.max_message_bytes)
        self.transport = TwilioTransport(websocket, self.protocol, outcomes, config.playout(),
                                         updater=updater, clock=lifecycle.clock)
        self.call: Call | None = None
        self.inbound_frames = 0
        #: The cap on this stream's inbound message rate (:mod:`gateway.call.inbound`).
        self.rate: InboundRate = lifecycle.inbound_meter()
        self._dropped_metric = (metrics.inbound_media_dropped.labels("twilio")
                                if metrics is not None else None)
        self._watch: InactivityWatch | None = None

    @property
    def label(self) -> str:
        return self.protocol.call_sid or self.protocol.stream_sid or f"ws-{id(self):x}"

    async def run(self) -> None:
        """Pump until the stream stops, the socket closes, it goes silent or a message is
        rejected."""
        task = asyncio.current_task()
        assert task is not None
        transport = self.transport
        transport.reader = task
        clock = self.lifecycle.clock
        # Covers the socket before its ``start`` too; the call adopts it.
        watch = self.lifecycle.watch(self.config.idle_timeout_s, "twilio",
                                     lambda: transport.abort("inbound timeout"), self.label)
        self._watch = watch
        received = 0
        rate = self.rate
        protocol = self.protocol
        try:
            while transport.aborted is None:
                transport.receiving = True
                message = await self.ws.receive()
                transport.receiving = False
                now = clock.now()
                watch.touch(now)
                if message["type"] == "websocket.disconnect":
                    log.info("call %s: socket closed by peer (code %s)", self.label,
                             message.get("code"))
                    return
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                # ws.receive() does not suspend while frames are queued: without a yield a client
                # bursting thousands of messages would hold the event loop (and every other
                # call's audio) until its whole burst was read, dropped or not. In steady state
                # (one message per 20 ms) receive() suspends anyway, so yield only every few
                # messages rather than pay an extra loop turn per frame on every call.
                received += 1
                if received % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                if rate.allow(now):
                    event = protocol.receive(data)
                elif isinstance(data, str) and data.startswith(_MEDIA_PREFIX):
                    # Over the cap (a flood): media in the compact form Twilio sends is dropped
                    # unread; anything else is read, and dropped if it is media after all.
                    self._dropped()
                    continue
                else:
                    event = protocol.receive(data)
                    if isinstance(event, Media):
                        self._dropped()
                        continue
                if type(event) is Media:
                    # The per-frame case inline (no coroutine per message): caller audio, 20 ms
                    # of mu-law, for liveness and the speech detector.
                    self.inbound_frames += 1
                    call = self.call
                    if call is not None:
                        call.inbound_audio(event.audio, now)
                    continue
                if not await self._dispatch(event, now):
                    return
        except CallProtocolError as exc:
            if self.metrics is not None:
                self.metrics.calls_closed_by_error.labels("twilio", type(exc).__name__).inc()
            log.warning("call %s: closing stream: %s (close code %d)", self.label, exc.reason,
                        exc.close_code)
            await self._close(exc.close_code, exc.reason)
        except WebSocketDisconnect as exc:
            log.info("call %s: socket gone (code %s)", self.label, exc.code)
        except asyncio.CancelledError:
            # Ours (the inactivity watch) unless someone else cancelled too (server shutdown).
            if transport.aborted is None or task.uncancel() > 0:
                raise
        finally:
            transport.receiving = False
            transport.stream_over = True
            watch.cancel()
            await self._end()

    def _dropped(self) -> None:
        if self.rate.dropped == 1:
            log.warning("call %s: inbound media over %g messages/s; dropping the excess",
                        self.label, self.rate.rate)
        if self._dropped_metric is not None:
            self._dropped_metric.inc()

    async def _dispatch(self, event: object, now: float) -> bool:
        """Act on one inbound event other than media (run() handles those inline); False when
        the stream is over."""
        call = self.call
        if isinstance(event, Dtmf):
            if call is not None:
                call.dtmf(event.dtmf.digit)
            return True
        if isinstance(event, Mark):
            if call is not None:
                call.playback_done(event.mark.name)
            return True
        if isinstance(event, Start):
            return await self._start(event)
        if isinstance(event, Stop):
            log.info("call %s: stream stopped by Twilio", self.label)
            return False
        assert isinstance(event, Connected)
        return True

    async def _start(self, event: Start) -> bool:
        meta = event.start
        lifecycle = self.lifecycle
        if meta.callSid in lifecycle.registry:
            # A second stream for a live call (a replayed or forged start): taking it would
            # replace the first call in the call table and could steer its outcome.
            raise ProtocolViolation(f"call {meta.callSid} already has a stream")
        refused = lifecycle.admit(meta.callSid, "twilio")
        self.transport.call_sid = meta.callSid
        if refused is not None:
            # No reservation here and no room (or draining): this stream is not taken. On a
            # fleet that is how a replica keeps to its own budget whichever replica answered
            # the webhook; the caller still hears the busy message, by a live-call update or
            # from after-stream, as if the webhook had refused.
            log.warning("call %s: stream refused: %s", meta.callSid, refused.replace("_", " "))
            if await self.transport.hand_over(
                    Busy(self.config.busy_message), close_code=1013,
                    reason=f"try again later ({refused.replace('_', ' ')})"):
                return True  # Twilio ends the stream as it runs the busy TwiML
            return False
        params = meta.customParameters
        # From here on this task's records, and those of the tasks it starts, carry the call.
        call_id_var.set(meta.callSid)
        self.call = lifecycle.start(
            meta.callSid, self.transport,
            transport_name="twilio",
            call_id=meta.callSid,
            parameters={"caller": params.get("From", ""), "called": params.get("To", "")},
            inactivity_s=self.config.idle_timeout_s,
            watch=self._watch,
        )
        log.info("call %s: stream %s started (params %s)", meta.callSid, meta.streamSid,
                 sorted(meta.customParameters))
        return True

    async def _close(self, code: int, reason: str) -> None:
        await self.transport.close(code, reason)

    async def _end(self) -> None:
        call = self.call
        if call is not None:
            await self.lifecycle.finish(call, self.transport.aborted or "stream ended")
        await self._close(1000, "stream ended")

