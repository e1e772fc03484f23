"""Twilio HTTP and WebSocket entry points.

- ``POST /twilio/voice``: the number's voice webhook. Reserves a seat in the replica's call
  budget and returns ``<Connect><Stream>`` TwiML that opens the bidirectional Media Stream to
  ``wss://<public host>/twilio/media``; at capacity, draining or warming up, a short apology and
  ``<Hangup/>`` instead.
- ``POST /twilio/after-stream``: the ``<Connect action>``; Twilio requests it once the stream
  ends. Returns what the call does next: ``<Dial>`` for a transfer decided during the stream,
  else ``<Hangup/>``.
- ``WS /twilio/media``: the Media Stream itself (:class:`~gateway.twilio.session.TwilioSession`).

Every entry validates X-Twilio-Signature; a bad or missing one gets 403 and nothing else.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response
from twilio.twiml.voice_response import Connect, Dial, VoiceResponse

from gateway.call.events import TransferTo
from gateway.call.lifecycle import CallLifecycle
from gateway.metrics import Metrics
from gateway.twilio.session import Outcomes, TwilioConfig, TwilioSession
from gateway.twilio.signature import SignatureChecker

log = logging.getLogger(__name__)

#: Call fields forwarded to the stream as <Parameter>s (they arrive in ``start.customParameters``).
FORWARDED_PARAMS = ("CallSid", "From", "To", "Direction")


def _twiml(response: VoiceResponse) -> Response:
    return Response(content=str(response), media_type="application/xml")


def _forbidden() -> Response:
    return Response(status_code=403, content="invalid or missing X-Twilio-Signature\n",
                    media_type="text/plain")


def build_router(
    lifecycle: CallLifecycle,
    checker: SignatureChecker,
    outcomes: Outcomes,
    config: TwilioConfig,
    metrics: Metrics,
) -> APIRouter:
    """The Twilio routes, given the collaborators they use and nothing else."""
    router = APIRouter(prefix="/twilio")

    @router.post("/voice")
    async def voice(request: Request) -> Response:
        form = await request.form()
        if not checker.check(request, form, websocket=False):
            metrics.signature_rejections.labels("voice").inc()
            log.warning("POST /twilio/voice refused: bad X-Twilio-Signature from %s",
                        request.client.host if request.client else "?")
            return _forbidden()
        call_sid = form.get("CallSid")
        if isinstance(call_sid, str) and call_sid:
            refused = lifecycle.reserve(call_sid, "twilio", config.reservation_s)
        else:
            refused = lifecycle.refusal()
            if refused is not None:
                metrics.calls_refused.labels("twilio", refused).inc()
        if refused is not None:
            # Full, draining or warming up: a short apology beats ringing into silence; Twilio
            # then hangs up. The caller's next try lands on another replica.
            log.warning("call %s refused: %s", call_sid, refused.replace("_", " "))
            busy = VoiceResponse()
            busy.say(config.busy_message)
            busy.hangup()
            return _twiml(busy)
        base = checker.base_url(request)
        ws_base = "wss" + base[5:] if base.startswith("https") else "ws" + base[4:]
        response = VoiceResponse()
        connect = Connect(action=f"{base}/twilio/after-stream")
        stream = connect.stream(url=f"{ws_base}/twilio/media")
        for name in FORWARDED_PARAMS:
            value = form.get(name)
            if isinstance(value, str) and value:
                stream.parameter(name=name, value=value)
        response.append(connect)
        return _twiml(response)

    @router.post("/after-stream")
    async def after_stream(request: Request) -> Response:
        form = await request.form()
        if not checker.check(request, form, websocket=False):
            metrics.signature_rejections.labels("after-stream").inc()
            return _forbidden()
        call_sid = form.get("CallSid")
        outcome = outcomes.take(call_sid) if isinstance(call_sid, str) else None
        response = VoiceResponse()
        if isinstance(outcome, TransferTo):
            if outcome.target.startswith(("sip:", "sips:")):
                dial = Dial()
                dial.sip(outcome.target)
                response.append(dial)
            else:
                response.dial(outcome.target)
            log.info("call %s: transferring to %s", call_sid, outcome.target)
        else:
            response.hangup()
        return _twiml(response)

    @router.websocket("/media")
    async def media(websocket: WebSocket) -> None:
        if not checker.check(websocket, {}, websocket=True):
            metrics.signature_rejections.labels("media").inc()
            log.warning("WS /twilio/media refused: bad X-Twilio-Signature from %s",
                        websocket.client.host if websocket.client else "?")
            # Closing before accept makes the server answer the upgrade with HTTP 403.
            await websocket.close(code=1008)
            return
        if not lifecycle.readiness.ready:
            # Not warmed up yet: refuse rather than keep a caller in silence.
            metrics.calls_refused.labels("twilio", "not_ready").inc()
            await websocket.close(code=1013)
            return
        await websocket.accept()
        await TwilioSession(websocket, lifecycle, config, outcomes, metrics).run()

    return router
