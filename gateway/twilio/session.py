"""The Media Streams WebSocket shell: pumps messages between the socket, the protocol and a Call.

It reads, feeds :class:`~gateway.twilio.protocol.MediaStreamProtocol`, dispatches the typed
events to the :class:`~gateway.call.Call`, and writes what the call sends. A message the
protocol rejects closes *this* socket with the error's close code and a logged reason; nothing
here is shared with other calls except the speech service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from gateway.audio.vad import SpeechStartDetector
from gateway.call import (
    Call,
    CallOutcome,
    Codec,
    Dialog,
    Dtmf,
    HangUp,
    Hangup,
    PlaybackDone,
    SpeechStarted,
)
from gateway.errors import CallProtocolError, ProtocolViolation
from gateway.logs import call_id_var
from gateway.twilio.protocol import (
    Connected,
    Mark,
    Media,
    MediaStreamProtocol,
    OutboundClear,
    OutboundMark,
    Start,
    Stop,
)
from gateway.twilio.protocol import (
    Dtmf as DtmfMessage,
)

if TYPE_CHECKING:
    from gateway.app import GatewayState

log = logging.getLogger(__name__)



#: Inbound messages handled back to back before the receive loop yields to other calls
#: (a burst of 16 media messages is well under a millisecond of work).
YIELD_EVERY = 16

#: Finished calls' outcomes kept for their <Connect action> request.
MAX_OUTCOMES = 10_000


class TwilioTransport:
    """:class:`~gateway.call.CallTransport` over one Media Streams socket."""

    codec: Codec = "pcmu"

    def __init__(
        self,
        websocket: WebSocket,
        protocol: MediaStreamProtocol,
        outcomes: dict[str, CallOutcome] | None = None,
        max_lead_s: float = 1.0,
    ) -> None:
        self._ws = websocket
        self._protocol = protocol
        # Audio is sent at most this far ahead of the caller's playback: Twilio would buffer
        # a whole 20 s prompt, but a caller who barges in after 1 s would then have cost 20 s
        # of bandwidth and server work, and a few hundred calls bursting whole prompts at once
        # starve everything else.
        self._max_lead_s = max_lead_s
        self._lead_origin = 0.0
        self._sent_s = 0.0
        # Where each outstanding mark sits in the sent audio: its echo says Twilio has played
        # that far, which corrects the lead estimate when playback runs ahead of our clock.
        self._mark_at_s: dict[str, float] = {}
        self._outcomes = outcomes if outcomes is not None else {}
        self.call_sid: str | None = None
        # Frames, marks and clear come from the utterance task and the receive loop; one lock
        # keeps each message whole and in order on the socket.
        self._lock = asyncio.Lock()
        self.messages_sent = 0

    async def _write(self, text: str) -> None:
        async with self._lock:
            if self._ws.application_state is WebSocketState.CONNECTED:
                try:
                    await self._ws.send_text(text)
                except (WebSocketDisconnect, RuntimeError):
                    # The server closed the socket under the call (uvicorn answers invalid
                    # UTF-8 or an oversize frame itself; Starlette still says CONNECTED) or the
                    # peer vanished. The receive loop ends the call; a late frame is dropped
                    # rather than killing the utterance task with an unretrieved exception.
                    return
                self.messages_sent += 1

    def lead_s(self) -> float:
        """Seconds of sent audio Twilio has not played yet, as far as this side can tell."""
        return max(0.0, self._sent_s - (time.monotonic() - self._lead_origin))

    async def send_frames(self, frames: list[bytes]) -> None:
        # Several 20 ms frames may share one message: its payload is still a whole number of
        # 160-byte frames, and Twilio plays them back to back.
        now = time.monotonic()
        ahead = self._sent_s - (now - self._lead_origin)
        if ahead <= 0:
            # Nothing left to play at Twilio: playback restarts with this frame.
            self._lead_origin, self._sent_s, ahead = now, 0.0, 0.0
            self._mark_at_s.clear()  # positions were on the old origin, all played by now
        if ahead > self._max_lead_s:
            await asyncio.sleep(ahead - self._max_lead_s)
        await self._write(self._protocol.media_text(b"".join(frames)))
        self._sent_s += len(frames) * 0.02

    async def send_mark(self, name: str) -> None:
        self._mark_at_s[name] = self._sent_s
        await self._write(self._protocol.send(OutboundMark(name)))

    def mark_played(self, name: str) -> None:
        """Twilio echoed mark ``name``: everything sent before it has been played."""
        position = self._mark_at_s.pop(name, None)
        if position is None:
            return
        # Only ever move the estimate forward: a mark says playback is at least this far along
        # (it may have arrived late), so the lead can shrink on it but never grow.
        self._lead_origin = min(self._lead_origin, time.monotonic() - position)

    async def clear(self) -> None:
        await self._write(self._protocol.send(OutboundClear()))
        self._sent_s = 0.0  # Twilio's buffer is empty now
        self._mark_at_s.clear()  # cleared marks come back at once; they say nothing now

    async def hangup(self) -> None:
        await self.end(HangUp())

    async def end(self, outcome: CallOutcome) -> None:
        # Closing the stream makes Twilio request the <Connect action> URL, which answers with
        # <Dial> or <Hangup/> from the outcome recorded here.
        if self.call_sid is not None:
            outcomes = self._outcomes
            outcomes[self.call_sid] = outcome
            # Read (and removed) by /twilio/after-stream, normally within a second. If that
            # request lands on another replica it never comes here: keep the newest only.
            while len(outcomes) > MAX_OUTCOMES:
                del outcomes[next(iter(outcomes))]
        async with self._lock:
            if self._ws.application_state is WebSocketState.CONNECTED:
                # Already closed under us (see _write): nothing left to close.
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                    await self._ws.close(code=1000)


class TwilioSession:
    """One Media Streams connection, from ``connected`` to ``stop`` or close."""

    def __init__(self, websocket: WebSocket, state: GatewayState, dialog: Dialog) -> None:
        self.ws = websocket
        self.state = state
        self.dialog = dialog
        self.protocol = MediaStreamProtocol(max_message_bytes=state.settings.max_message_bytes)
        self.transport = TwilioTransport(websocket, self.protocol, state.outcomes,
                                         max_lead_s=state.settings.twilio_max_lead_ms / 1000)
        self.call: Call | None = None
        self._dialog_task: asyncio.Task[None] | None = None
        self.inbound_frames = 0
        self._last_rx = 0.0  # loop time of the last message received
        self.vad: SpeechStartDetector | None = None

    @property
    def label(self) -> str:
        return self.protocol.call_sid or self.protocol.stream_sid or f"ws-{id(self):x}"

    async def run(self) -> None:
        """Pump until the stream stops, the socket closes or a message is rejected."""
        metrics = self.state.metrics
        # Twilio sends caller audio every 20 ms for the whole stream. Silence this long means
        # the peer vanished without closing (half-open TCP, a crashed proxy): nothing else would
        # ever end this call or free what it holds. Ending it here cancels its generation.
        idle_s = self.state.settings.twilio_idle_timeout_s
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._last_rx = loop.time()
        idle_expired = False
        receiving = False
        watchdog: asyncio.TimerHandle | None = None

        # One timer per call, re-armed only when it comes due (about once per idle_s), rather
        # than a timeout armed and cancelled around each of the 50 messages a second (asyncio
        # .timeout() cost 3.7 us a message in a micro-benchmark; the receive itself 0.2 us).
        def check_idle() -> None:
            nonlocal watchdog, idle_expired
            due = self._last_rx + idle_s
            now = loop.time()
            if now < due:
                watchdog = loop.call_later(due - now, check_idle)
                return
            if not receiving:
                # Cancel only while the task waits for the socket, so the CancelledError lands
                # there, never inside a dispatch or the call's clean-up.
                watchdog = loop.call_later(min(1.0, idle_s), check_idle)
                return
            idle_expired = True
            task.cancel()

        watchdog = loop.call_later(idle_s, check_idle) if idle_s > 0 else None
        received = 0
        try:
            while True:
                receiving = True
                message = await self.ws.receive()
                receiving = False
                self._last_rx = loop.time()
                if message["type"] == "websocket.disconnect":
                    log.info("call %s: socket closed by peer (code %s)", self.label,
                             message.get("code"))
                    return
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                event = self.protocol.receive(data)
                if not await self._dispatch(event):
                    return
                # ws.receive() does not suspend while frames are queued: without a yield a client
                # bursting thousands of messages would hold the event loop (and every other
                # call's audio) until its whole burst was processed. In steady state (one
                # message per 20 ms) receive() suspends anyway, so yield only every few
                # messages rather than pay an extra loop turn per frame on every call.
                received += 1
                if received % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        except CallProtocolError as exc:
            metrics.calls_closed_by_error.labels("twilio", type(exc).__name__).inc()
            log.warning("call %s: closing stream: %s (close code %d)", self.label, exc.reason,
                        exc.close_code)
            await self._close(exc.close_code, exc.reason)
        except WebSocketDisconnect as exc:
            log.info("call %s: socket gone (code %s)", self.label, exc.code)
        except asyncio.CancelledError:
            # Ours (the idle watchdog) unless someone else cancelled too (server shutdown).
            if not idle_expired or task.uncancel() > 0:
                raise
            metrics.calls_inbound_timeouts.labels("twilio").inc()
            log.warning("call %s: nothing received for %g s; the stream is dead, ending the "
                        "call", self.label, idle_s)
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._end()

    async def _dispatch(self, event: object) -> bool:
        """Act on one inbound event; False when the stream is over."""
        if isinstance(event, Media):
            # Inbound caller audio, 20 ms of mu-law: only the speech detector reads it.
            self.inbound_frames += 1
            detector = self.vad
            if detector is not None and self.call is not None and detector.push(event.audio):
                self.call.deliver(SpeechStarted())
            return True
        call = self.call
        if isinstance(event, DtmfMessage):
            if call is not None:
                call.deliver(Dtmf(event.dtmf.digit, at=time.monotonic()))
            return True
        if isinstance(event, Mark):
            self.transport.mark_played(event.mark.name)
            if call is not None:
                call.deliver(PlaybackDone(event.mark.name))
            return True
        if isinstance(event, Start):
            if event.start.callSid in self.state.calls:
                # A second stream for a live call (a replayed or forged start): taking it would
                # replace the first call in the call table and could steer its outcome.
                raise ProtocolViolation(f"call {event.start.callSid} already has a stream")
            refused = self.state.admit_stream(event.start.callSid)
            if refused is not None:
                # No webhook reservation and no room (or draining): this stream is not taken.
                self.state.metrics.calls_refused.labels("twilio", refused).inc()
                log.warning("call %s: stream refused: %s", event.start.callSid,
                            refused.replace("_", " "))
                await self._close(1013, f"try again later ({refused.replace('_', ' ')})")
                return False
            self._start(event)
            return True
        if isinstance(event, Stop):
            log.info("call %s: stream stopped by Twilio", self.label)
            return False
        assert isinstance(event, Connected)
        return True

    def _start(self, event: Start) -> None:
        meta = event.start
        params = meta.customParameters
        self.transport.call_sid = meta.callSid
        # From here on this task's records, and those of the tasks it starts, carry the call.
        call_id_var.set(meta.callSid)
        self.call = self.state.open_call(
            meta.callSid, self.transport, "twilio",
            {"caller": params.get("From", ""), "called": params.get("To", "")},
        )
        self.vad = self.state.new_speech_detector()
        log.info("call %s: stream %s started (params %s)", meta.callSid, meta.streamSid,
                 sorted(meta.customParameters))
        self._dialog_task = asyncio.create_task(self.state.run_dialog(self.call, self.dialog))

    async def _close(self, code: int, reason: str) -> None:
        if self.ws.application_state is WebSocketState.CONNECTED:
            try:
                # Close reasons are limited to 123 bytes (RFC 6455 section 5.5).
                await self.ws.close(code=code, reason=reason.encode()[:120].decode(errors="ignore"))
            except Exception:
                pass

    async def _end(self) -> None:
        call = self.call
        if call is not None:
            call.deliver(Hangup("stream ended"))
            await call.close()
            self.state.close_call(call, "twilio")
        task = self._dialog_task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        await self._close(1000, "stream ended")
