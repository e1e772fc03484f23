"""FastAPI app factory: load the engine, warm it, then report ready.

``/healthz`` answers 200 as soon as the process serves HTTP (liveness); ``/readyz`` answers 200
only once the model is loaded and warmed (graph capture plus one generation), so a load
balancer never sends a caller to a gateway that would answer with silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from gateway.audio.vad import SpeechStartDetector
from gateway.call import Call, CallOutcome, CallTransport, Dialog, HangUp, Voice
from gateway.config import Settings
from gateway.demo import greeter
from gateway.errors import GatewayError
from gateway.http_limits import RequestLimits
from gateway.ivr.cache import PromptCache
from gateway.ivr.prompts import ResolvedVoice, render_missing, resolve_voice
from gateway.ivr.runner import IvrRunner, RunnerContext, load_sound
from gateway.ivr.script import Script, load_script
from gateway.ivr.voices import VoiceRegistry
from gateway.metrics import Metrics
from gateway.tts.engine import Engine, VoicePrompt
from gateway.tts.service import SpeechService
from gateway.twilio.routes import build_router
from gateway.twilio.signature import SignatureChecker

log = logging.getLogger(__name__)

EngineFactory = Callable[[Settings], Sequence[Engine]]

#: How long the voice webhook holds a place for a call whose Media Stream has not connected yet
#: (Twilio connects within a second or two; a call that never streams gives its place back).
RESERVATION_S = 30.0


def default_engine_factory(settings: Settings) -> list[Engine]:
    """The real engines: Qwen3-TTS loaded once with ``from_pretrained`` of ``settings.model``,
    then one batched engine for the device (or, with ``engine=slots``, ``settings.slots``
    slots over the shared weights)."""
    from gateway.tts.batched import BatchedQwenEngine
    from gateway.tts.qwen import QwenEngine, QwenModel

    shared = QwenModel(settings.model, device=settings.device, dtype=settings.dtype)
    if settings.engine == "batched":
        return [
            BatchedQwenEngine(
                shared,
                max_rows=settings.batch_rows,
                max_seq_len=settings.max_seq_len,
                chunk_schedule=settings.chunk_schedule,
                codec_decode=settings.codec_decode,
                trim_leading_silence=settings.trim_leading_silence,
                adaptive_chunks=settings.adaptive_chunks,
                prefill_chunk=settings.prefill_chunk,
            )
        ]
    return [
        QwenEngine(
            shared,
            chunk_schedule=settings.chunk_schedule,
            max_seq_len=settings.max_seq_len,
            codec_decode=settings.codec_decode,
            trim_leading_silence=settings.trim_leading_silence,
            adaptive_chunks=settings.adaptive_chunks,
        )
        for _ in range(settings.slots)
    ]


@dataclass
class GatewayState:
    """Everything one gateway process shares between calls."""

    settings: Settings
    metrics: Metrics
    signatures: SignatureChecker
    speech: SpeechService | None = None
    ready: bool = False
    load_error: str | None = None
    calls: dict[str, Call] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    #: The IVR script every call runs (None: the first-call greeter).
    script: Script | None = None
    voice: ResolvedVoice | None = None
    cache: PromptCache | None = None
    ivr: RunnerContext | None = None
    #: How each finished stream's call continues: read by the <Connect action> webhook.
    outcomes: dict[str, CallOutcome] = field(default_factory=dict)
    #: The dialog every call runs (set by create_app).
    dialog: Dialog | None = None
    #: True while draining: new calls are refused (SIP 503), active calls finish.
    draining: bool = False
    #: Twilio calls admitted by the voice webhook whose stream has not started yet:
    #: CallSid -> when the reservation lapses. They count against ``max_calls``.
    reservations: dict[str, float] = field(default_factory=dict)
    sip: Any = None
    #: Called with a message when start-up fails (the CLI stops the server and exits 1).
    on_fatal: Callable[[str], None] | None = None

    def call_voice(self) -> Voice:
        """The voice calls speak with: the script's, else the configured speaker."""
        if self.script is not None:
            voice = self.script.voice
            return Voice(speaker=(voice.speaker or "ryan").lower(), language=voice.language,
                         instruct=voice.style, seed=None,
                         prompt=self.voice.prompt if self.voice is not None else None)
        settings = self.settings
        return Voice(speaker=settings.speaker, language=settings.language,
                     instruct=settings.instruct, seed=settings.seed)

    # --- admission ----------------------------------------------------------------------------

    def active_calls(self, transport: str | None = None) -> int:
        """Calls in progress (on one transport, or all)."""
        if transport is None:
            return len(self.calls)
        return sum(1 for call in self.calls.values() if call.transport_name == transport)

    def _reserved(self) -> int:
        now = time.monotonic()
        for sid in [sid for sid, until in self.reservations.items() if until <= now]:
            del self.reservations[sid]
        return len(self.reservations)

    def refusal(self) -> str | None:
        """Why a new call would be turned away now (``None``: it is welcome)."""
        if self.draining:
            return "draining"
        if not self.ready:
            return "not_ready"
        if len(self.calls) + self._reserved() >= self.settings.max_calls:
            return "at_capacity"
        return None

    def admit_twilio(self, call_sid: str | None) -> str | None:
        """The voice webhook's admission: hold a place for the stream, or say why not."""
        reason = self.refusal()
        if reason is None and call_sid:
            self.reservations[call_sid] = time.monotonic() + RESERVATION_S
        return reason

    def admit_stream(self, call_sid: str | None) -> str | None:
        """A Media Stream starting: its webhook's reservation, or a fresh admission (TwiML
        served by someone else points straight at the stream URL)."""
        if call_sid and self.reservations.pop(call_sid, None) is not None:
            return None
        return self.refusal()

    def sip_capacity(self) -> int:
        """How many SIP calls may be up at once now: what the other transports leave."""
        others = len(self.calls) - self.active_calls("sip") + self._reserved()
        return max(0, self.settings.max_calls - others)

    # --- drain --------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Stop taking calls (/readyz 503, Twilio busy message, SIP 503); calls continue."""
        if self.draining:
            return
        self.draining = True
        self.metrics.draining.set(1)
        log.warning("draining: no new calls; %d active call(s) may continue for up to %g s",
                    len(self.calls), self.settings.drain_grace_s)

    async def drain(self, poll_s: float = 0.1) -> None:
        """Drain: wait for the active calls to end, up to the grace period; hang up the rest."""
        self.begin_drain()
        deadline = time.monotonic() + self.settings.drain_grace_s
        while (self.calls or self._reserved()) and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        left = list(self.calls.values())
        if left:
            log.warning("drain grace over: hanging up %d call(s)", len(left))
            for call in left:
                with contextlib.suppress(Exception):
                    await call.end(HangUp())
        log.info("drained")

    # --- calls --------------------------------------------------------------------------------

    def open_call(self, call_id: str, transport: CallTransport, transport_name: str,
                  parameters: dict[str, str]) -> Call:
        """A new call on any transport, registered and counted."""
        call = Call(call_id, transport, self.speech_service, self.call_voice(),
                    metrics=self.metrics, transport_name=transport_name,
                    max_frames_per_send=self.settings.frames_per_message)
        call.parameters.update(parameters)
        self.calls[call_id] = call
        self.metrics.calls_total.labels(transport_name).inc()
        self.metrics.calls_active.labels(transport_name).inc()
        return call

    def close_call(self, call: Call, transport_name: str) -> None:
        """Forget a finished call."""
        if self.calls.pop(call.call_id, None) is not None:
            self.metrics.calls_active.labels(transport_name).dec()

    def new_speech_detector(self) -> SpeechStartDetector | None:
        """A caller-speech detector for one call (None when speech barge-in is off)."""
        settings = self.settings
        if not settings.barge_in_on_speech:
            return None
        return SpeechStartDetector(min_speech_ms=settings.vad_min_speech_ms,
                                   threshold=settings.vad_threshold)

    async def run_dialog(self, call: Call, dialog: Dialog) -> None:
        """Drive ``call`` with ``dialog``; a dialog bug ends this call, not the gateway."""
        try:
            await dialog(call)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("call %s: dialog failed; hanging up", call.call_id)
            await call.close()
            await call.transport.end(HangUp())

    @property
    def speech_service(self) -> SpeechService:
        if self.speech is None:
            raise RuntimeError("speech service not started")
        return self.speech


def create_app(
    settings: Settings,
    engine_factory: EngineFactory = default_engine_factory,
    dialog: Dialog | None = None,
) -> FastAPI:
    """Build the gateway app. The engine loads in the background once the server starts."""
    token = settings.twilio_auth_token.get_secret_value() if settings.twilio_auth_token else None
    metrics = Metrics()
    state = GatewayState(
        settings=settings,
        metrics=metrics,
        signatures=SignatureChecker(None if settings.insecure else token, settings.public_url),
    )
    if settings.script is not None:
        # Refuse to start with an invalid script (ScriptError lists every problem), or with a
        # cloned voice that is not registered.
        registry = VoiceRegistry(settings.voices_dir)
        state.script = load_script(settings.script,
                                   voice_exists=lambda name: registry.exists(name))
        state.voice = resolve_voice(state.script, settings.voices_dir)
        state.cache = PromptCache(
            settings.cache_dir, max_memory_bytes=settings.cache_memory_mb * 1024 * 1024,
            metrics=metrics,
        )
    if dialog is None:
        if state.script is not None:
            dialog = partial(_ivr_dialog, state=state)
        else:
            dialog = partial(_greeter_dialog, greeting=settings.greeting)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state, engine_factory))
        if settings.sip:
            # Bound at once: until the engine is ready, INVITEs get 503 (a SIP proxy probing
            # with OPTIONS still sees the endpoint alive).
            state.sip = await _start_sip(state)
        try:
            yield
        finally:
            if state.sip is not None:
                await state.sip.stop()
            loader.cancel()
            for call in list(state.calls.values()):
                await call.close()
            if state.speech is not None:
                await asyncio.to_thread(state.speech.stop)

    app = FastAPI(title="Qwen3-TTS IVR gateway", lifespan=lifespan)
    app.state.gateway = state
    # Webhook bodies are read whole before their signature can be checked: cap size and time.
    app.add_middleware(RequestLimits, max_body_bytes=settings.max_request_bytes,
                       timeout_s=settings.http_request_timeout_s)

    @app.get("/healthz")
    async def healthz() -> dict[str, object]:
        return {"status": "alive", "uptime_s": round(time.monotonic() - state.started_at, 1)}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if state.draining:
            # A load balancer stops sending new calls here; the active ones carry on.
            return JSONResponse({"status": "draining", "calls": len(state.calls)},
                                status_code=503)
        if state.ready and state.speech is not None:
            return JSONResponse({"status": "ready", "engine": state.speech.engine.name,
                                 "calls": len(state.calls)})
        body = {"status": "failed" if state.load_error else "loading", "error": state.load_error}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    state.dialog = dialog
    app.include_router(build_router(state, dialog))
    return app


async def _greeter_dialog(call: Call, greeting: str) -> None:
    await greeter(call, greeting)


async def _ivr_dialog(call: Call, state: GatewayState) -> None:
    assert state.ivr is not None, "the IVR context is built before the gateway is ready"
    await IvrRunner(call, state.ivr, dict(call.parameters)).run()


async def _load(state: GatewayState, engine_factory: EngineFactory) -> None:
    """Load and warm the engine off the event loop, then mark the gateway ready."""
    t0 = time.monotonic()
    settings = state.settings
    try:
        if settings.barge_in_on_speech:
            # The VAD model (one ONNX session shared by every call) loads before the first call.
            from gateway.audio.vad import load_session

            await asyncio.to_thread(load_session)
        engines = list(await asyncio.to_thread(engine_factory, settings))
        # Every slot warms up (graph capture is per slot), each with every configured voice.
        for engine in engines:
            await asyncio.to_thread(engine.warmup, _warmup_voices(state))
    except asyncio.CancelledError:
        raise
    except GatewayError as exc:
        _fail(state, str(exc))
        return
    except Exception as exc:
        log.exception("engine start-up failed")
        _fail(state, f"engine start-up failed: {exc}")
        return
    speech = SpeechService(
        engines,
        metrics=state.metrics,
        first_audio_budget_s=settings.first_audio_budget_ms / 1000,
        ahead_high_s=settings.ahead_high_ms / 1000,
        ahead_low_s=settings.ahead_low_ms / 1000,
        step_timeout_s=settings.engine_step_timeout_ms / 1000 or None,
        warmup_voices=_warmup_voices(state),
    )
    speech.start()
    state.speech = speech
    if state.script is not None and state.cache is not None:
        try:
            await _prepare_ivr(state, engines[0])
        except Exception as exc:
            log.exception("preparing the IVR script failed")
            _fail(state, f"preparing the IVR script failed: {exc}")
            return
    state.ready = True
    log.info("ready: %s, %d turn(s) at once (load + warm-up %.1f s)", engines[0].name,
             speech.capacity, time.monotonic() - t0)


async def _start_sip(state: GatewayState) -> Any:
    from gateway.sip.digest import DigestAuthenticator
    from gateway.sip.endpoint import SipEndpoint
    from gateway.sip.uas import UasConfig

    settings = state.settings
    assert settings.sip is not None
    host, _, port_text = settings.sip.rpartition(":")
    host = host or "0.0.0.0"
    public_ip = settings.sip_public_ip or ("127.0.0.1" if host == "0.0.0.0" else host)
    authenticator = None
    if settings.sip_users is not None:
        users = dict(entry.split(":", 1) for entry in
                     settings.sip_users.get_secret_value().split(",") if ":" in entry)
        authenticator = DigestAuthenticator(settings.sip_realm, users, secret=os.urandom(32))
    low, _, high = settings.rtp_ports.partition("-")
    config = UasConfig(local_ip=public_ip, local_port=int(port_text),
                       allow=[c.strip() for c in settings.sip_allow.split(",") if c.strip()],
                       max_calls=settings.max_calls, authenticator=authenticator,
                       t1=settings.sip_t1_ms / 1000)
    endpoint = SipEndpoint(state, config, rtp_ports=range(int(low), int(high or low) + 1),
                           answer_delay_s=settings.sip_answer_delay_ms / 1000,
                           rtp_timeout_s=settings.sip_rtp_timeout_s)
    await endpoint.start(host, int(port_text))
    return endpoint


async def _prepare_ivr(state: GatewayState, engine: Engine) -> None:
    """Build the runner context; load (and unless lazy, render) the script's static prompts."""
    script, cache, settings = state.script, state.cache, state.settings
    assert script is not None and cache is not None and state.speech is not None
    assert state.voice is not None
    state.ivr = RunnerContext(
        script=script,
        cache=cache,
        model_fingerprint=engine.fingerprint,
        voice_identity=state.voice.identity,
        sounds={name: load_sound(script_dir(script) / name) for name in script_sounds(script)},
    )
    if settings.render_lazily:
        return
    t0 = time.monotonic()
    hits, rendered = await render_missing(script, cache, state.speech, engine.fingerprint,
                                          state.voice)
    log.info("prompts ready: %d cached, %d rendered in %.1f s", hits, rendered,
             time.monotonic() - t0)


def _warmup_voices(state: GatewayState) -> list[tuple[str, str] | VoicePrompt]:
    """Every voice calls will speak with: the script's (speaker or clone), else the setting."""
    voice = state.call_voice()
    if voice.prompt is not None:
        return [voice.prompt]
    return [(voice.speaker, voice.language)]


def script_dir(script: Script) -> Path:
    return script.path.parent if script.path is not None else Path.cwd()


def script_sounds(script: Script) -> list[str]:
    return sorted({node.play for node in script.nodes.values() if node.play is not None})


def _fail(state: GatewayState, message: str) -> None:
    state.load_error = message
    log.error("%s", message)
    if state.on_fatal is not None:
        state.on_fatal(message)
