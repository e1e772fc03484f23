"""Twilio HTTP and WebSocket entry points.

- ``POST /twilio/voice``: the number's voice webhook. Reserves a seat in the replica's call
  budget and returns ``<Connect><Stream>`` TwiML that opens the bidirectional Media Stream to
  ``wss://<public host>/twilio/media``; at capacity, draining or warming up, a short apology and
  ``<Hangup/>`` instead.
- ``POST /twilio/after-stream``: the ``<Connect action>``; Twilio requests it once the stream
  ends without a live-call update (:mod:`gateway.twilio.rest`) having replaced it. Returns what
  the call does next: ``<Dial>`` for a transfer decided during the stream, the busy message
  for a stream refused here, else ``<Hangup/>``. On a fleet the request may reach a replica
  that did not run the stream: with live-call updates configured that replica answers "wait a
  second and ask again" (``<Pause>`` + ``<Redirect>``, :data:`~gateway.twilio.stream.
  AFTER_STREAM_HOPS` times) rather than a ``<Hangup/>`` that would cut off a transfer being
  delivered by REST, or recorded on the replica that ran the stream.
- ``WS /twilio/media``: the Media Stream itself (:class:`~gateway.twilio.stream.TwilioStream`).

Every entry validates X-Twilio-Signature; a bad or missing one gets 403 and nothing else.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response
from twilio.twiml.voice_response import Connect, VoiceResponse

from gateway.call.events import TransferTo
from gateway.call.lifecycle import CallLifecycle
from gateway.metrics import Metrics
from gateway.twilio.rest import CallUpdater
from gateway.twilio.signature import SignatureChecker
from gateway.twilio.stream import Outcomes, TwilioConfig, TwilioStream
from gateway.twilio.twiml import after_stream_retry, busy, outcome_twiml

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
    updater: CallUpdater | None = None,
) -> APIRouter:
    """The Twilio routes, given the collaborators they use and nothing else (``updater``: the
    live-call updates of a fleet, None for a replica alone)."""
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
            return _twiml(busy(config.busy_message))
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
        if outcome is not None:
            metrics.twilio_after_stream.labels("outcome").inc()
            if isinstance(outcome, TransferTo):
                log.info("call %s: transferring to %s", call_sid, outcome.target)
            return _twiml(outcome_twiml(outcome))
        hop = _hop(request.query_params.get("hop"))
        if hop < config.after_stream_hops:
            # Not a call this replica knows. On a fleet the replica that ran its stream either
            # delivers the outcome by REST (the update replaces this <Pause> too) or recorded
            # it because the update failed; the next request through the balancer may reach
            # it. A <Hangup/> here would cut off that transfer.
            metrics.twilio_after_stream.labels("retry").inc()
            log.info("call %s: after-stream for a stream this replica did not run; asking "
                     "again in %d s (%d of %d)", call_sid, config.after_stream_pause_s, hop + 1,
                     config.after_stream_hops)
            url = f"{checker.base_url(request)}/twilio/after-stream?hop={hop + 1}"
            return _twiml(after_stream_retry(url, config.after_stream_pause_s))
        metrics.twilio_after_stream.labels("hangup").inc()
        response = VoiceResponse()
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
        await TwilioStream(websocket, lifecycle, config, outcomes, metrics, updater).run()

    return router


def _hop(value: str | None) -> int:
    """``?hop=N`` of an after-stream retry (0 for Twilio's first request, or junk)."""
    if value is None or not value.isdigit() or len(value) > 3:
        return 0
    return int(value)
