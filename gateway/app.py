"""The composition root: :func:`create_app` builds every collaborator once and wires them.

Nothing else constructs shared objects, and nothing reaches back here: each component gets the
few narrow things it uses (STYLE.md rule 17). What is built, and who gets it:

- :class:`~gateway.clock.Clock` (injected; tests pass a virtual one): everything that waits.
- :class:`~gateway.readiness.Readiness`: loading / ready / failed / draining.
- :class:`~gateway.call.admission.Admission`: the replica's one call budget.
- :class:`~gateway.call.registry.CallRegistry`: the calls in progress.
- :class:`DialogSlot`: the :class:`~gateway.call.lifecycle.DialogFactory` (IVR script or
  greeter), installed once the engine is ready.
- :class:`~gateway.call.lifecycle.CallLifecycle` over those: what both transports ask.
- The transports: the Twilio routes (lifecycle, signature checker, outcome store, their
  config, metrics, and on a fleet the live-call updater that sends outcomes to Twilio's REST
  API) and the SIP endpoint (lifecycle, UAS config, metrics).
- The engine and :class:`~gateway.tts.service.SpeechService` (loaded in the background), the
  prompt cache, and for an IVR the lines (:mod:`gateway.ivr.lines`: ``GATEWAY_LINES``, or the one
  script of ``GATEWAY_SCRIPT``) made ready as the first
  :class:`~gateway.ivr.switchboard.Version`: the :class:`~gateway.ivr.switchboard.Switchboard`
  routes each call to its line, and the :class:`~gateway.ivr.switchboard.Reloader` installs
  the next version when the files change (or on SIGHUP, :meth:`Gateway.request_reload`).
- The speech recogniser's worker pool (:class:`~gateway.asr.pool.RecognizerPool`), when a
  script has speech gathers; started beside the engine, handed to each line's runner context.

``/healthz`` answers 200 as soon as the process serves HTTP (liveness); ``/readyz`` answers 200
only once the model is loaded and warmed (graph capture plus one generation), so a load
balancer never sends a caller to a gateway that would answer with silence.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from gateway import heap
from gateway.aio import cancel_and_wait
from gateway.asr.pool import RecognizerPool
from gateway.audio.condition import Conditioning
from gateway.bot.agent import BotConfig
from gateway.call.admission import Admission
from gateway.call.events import Codec
from gateway.call.inbound import InboundCap
from gateway.call.lifecycle import CallLifecycle, DetectorFactory, DialogFactory
from gateway.call.playout import start_buffer_setting
from gateway.call.registry import CallRegistry
from gateway.call.session import Call, Dialog, SpeechDetector
from gateway.clock import Clock, SystemClock
from gateway.config import Settings
from gateway.errors import ConfigError, GatewayError
from gateway.greeter import GreeterDialogs
from gateway.http_limits import RequestLimits
from gateway.ivr.cache import PromptCache
from gateway.ivr.lines import FileStamp, LinePlan, load_lines, single_script
from gateway.ivr.prompts import resolve_voice
from gateway.ivr.script import Script
from gateway.ivr.switchboard import Reloader, Switchboard, VersionBuilder, script_voice
from gateway.ivr.voices import VoiceRegistry
from gateway.metrics import Metrics
from gateway.readiness import Readiness
from gateway.sip.endpoint import RTP_PLAYOUT, SipEndpoint
from gateway.speech import Speaker, SpeechVoice
from gateway.text import Reader, Reading
from gateway.tts.engine import Engine, VoicePrompt
from gateway.tts.service import SpeechService
from gateway.twilio.rest import CallUpdater
from gateway.twilio.routes import build_router
from gateway.twilio.signature import SignatureChecker
from gateway.twilio.stream import Outcomes, TwilioConfig

log = logging.getLogger(__name__)

EngineFactory = Callable[[Settings], Sequence[Engine]]


def default_engine_factory(settings: Settings) -> list[Engine]:
    """The real engine: Qwen3-TTS loaded once with ``from_pretrained`` of ``settings.model``,
    and one batched engine for the device; or, with ``engine=simulated``, a simulated device
    (chosen only explicitly)."""
    if settings.engine == "simulated":
        from gateway.tts.simulated import SimulatedEngine, load_profile

        return [SimulatedEngine(load_profile(settings.device_profile),
                                max_rows=settings.batch_rows,
                                chunk_schedule=settings.chunk_schedule,
                                adaptive_chunks=settings.adaptive_chunks,
                                prefill_chunk=settings.prefill_chunk)]
    from gateway.tts.batched import BatchedQwenEngine
    from gateway.tts.qwen import QwenModel

    shared = QwenModel(settings.model, device=settings.device, dtype=settings.dtype)
    return [
        BatchedQwenEngine(
            shared,
            max_rows=settings.batch_rows,
            max_seq_len=settings.max_seq_len,
            chunk_schedule=settings.chunk_schedule,
            codec_decode=settings.codec_decode,
            trim_leading_silence=False,  # the phone path trims (gateway.audio.condition)
            adaptive_chunks=settings.adaptive_chunks,
            prefill_chunk=settings.prefill_chunk,
            cuda_graphs={"auto": None, "on": True, "off": False}[settings.cuda_graphs],
        )
    ]


class DialogSlot:
    """The dialog factory calls start with, installed once the engine is ready.

    Admission refuses calls until then, so no call ever meets an empty slot. Swapping the
    installed factory (a reloaded script, a line router) changes what *new* calls run.
    """

    def __init__(self) -> None:
        self._factory: DialogFactory | None = None

    def install(self, factory: DialogFactory) -> None:
        self._factory = factory

    @property
    def installed(self) -> DialogFactory | None:
        return self._factory

    def for_call(self, call: Call) -> Dialog:
        if self._factory is None:
            raise RuntimeError("no dialog installed: the gateway is not ready")
        return self._factory.for_call(call)


class FixedDialog:
    """Every call runs the same dialog (``create_app(dialog=...)``)."""

    def __init__(self, dialog: Dialog) -> None:
        self.dialog = dialog

    def for_call(self, call: Call) -> Dialog:
        return self.dialog


@dataclass
class Gateway:
    """What :func:`create_app` built, for the process around it (server, CLI) and for tests.

    Components never receive this: each gets its own collaborators from :func:`create_app`.
    """

    settings: Settings
    clock: Clock
    metrics: Metrics
    readiness: Readiness
    admission: Admission
    registry: CallRegistry
    dialogs: DialogSlot
    lifecycle: CallLifecycle
    outcomes: Outcomes
    signatures: SignatureChecker
    twilio: TwilioConfig
    #: The lines and scripts as loaded at start-up (None: the greeter answers every call).
    plan: LinePlan | None = None
    #: The voice each script speaks with, warmed up with the engine.
    voices: list[SpeechVoice] | None = None
    cache: PromptCache | None = None
    speech: SpeechService | None = None
    #: Routes calls to lines, in the version installed (once ready, for an IVR).
    switchboard: Switchboard | None = None
    #: Installs new versions of the lines and scripts (once ready, for an IVR).
    reloader: Reloader | None = None
    sip: SipEndpoint | None = None
    #: Live-call updates through Twilio's REST API (GATEWAY_TWILIO_ACCOUNT_SID), or None.
    updater: CallUpdater | None = None
    _reload_task: asyncio.Task[None] | None = None
    #: Whether this gateway holds the start-up heap frozen (:mod:`gateway.heap`), once ready.
    _heap_held: bool = False
    #: Where speech gathers' turns are recognised (None: no speech gathers, or speech is off).
    recognizer: RecognizerPool | None = None
    #: The HTTP client every call's webhooks share (an IVR's, from start-up to shutdown).
    webhooks: httpx.AsyncClient | None = None

    @property
    def speech_service(self) -> SpeechService:
        if self.speech is None:
            raise RuntimeError("speech service not started")
        return self.speech

    @property
    def script(self) -> Script | None:
        """The script of the default line in the version new calls run (None: the greeter)."""
        if self.switchboard is not None:
            version = self.switchboard.version
            return version.plan.lines[version.plan.default].script
        if self.plan is not None:
            return self.plan.lines[self.plan.default].script
        return None

    def request_reload(self, reason: str = "SIGHUP") -> None:
        """Reload the lines and scripts now (``gateway serve`` calls this on SIGHUP; safe from
        a signal handler). Before the gateway is ready it is ignored: start-up reads the files
        as they are then."""
        if self.reloader is None:
            log.warning("%s: no reload (%s)", reason,
                        "no IVR script" if self.plan is None else "not ready yet")
            return
        self.reloader.request(reason)

    async def drain(self) -> None:
        """SIGTERM: stop taking calls, let the active ones finish within the grace period."""
        await self.lifecycle.drain(self.settings.drain_grace_s)


def conditioning(settings: Settings) -> Conditioning:
    """The phone path's conditioning, from settings (live speech and rendered prompts alike)."""
    return Conditioning(trim_leading_silence=settings.trim_leading_silence,
                        normalize_level=settings.normalize_level,
                        target_dbfs=settings.level_target_dbfs)


def _detectors(settings: Settings) -> DetectorFactory | None:
    """Caller-speech detectors per codec (None when speech barge-in is off)."""
    if not settings.barge_in_on_speech:
        return None
    from gateway.audio.vad import SpeechStartDetector

    def detector(codec: Codec) -> SpeechDetector:
        return SpeechStartDetector(min_speech_ms=settings.vad_min_speech_ms,
                                   threshold=settings.vad_threshold, codec=codec)

    return detector


def _speech_gathers(plan: LinePlan) -> list[str]:
    """``script: node`` of every speech gather in the plan's scripts."""
    return [f"{path.name}: {name}" for path, script in plan.scripts().items()
            for name in (*script.speech_gathers(), *script.bot_nodes())]


def _recognizer(settings: Settings, plan: LinePlan) -> RecognizerPool | None:
    """The recogniser pool for the scripts' speech gathers (None, and why logged, if off).

    Made whenever recognition is on, even when no script listens yet: a reload can add a speech
    gather, and the pool's workers start only once a version has one
    (:meth:`~gateway.ivr.switchboard.VersionBuilder.build`)."""
    gathers = _speech_gathers(plan)
    if settings.asr == "off":
        if gathers:
            log.warning("GATEWAY_ASR=off: the speech gathers (%s) take keys only",
                        ", ".join(gathers))
        return None
    if not settings.barge_in_on_speech:
        if gathers:
            log.warning("speech gathers need the caller-speech detector to find the caller's "
                        "turn; GATEWAY_BARGE_IN_ON_SPEECH is off, so they take keys only")
        return None
    from gateway.asr.factory import recognizer_factory

    factory = recognizer_factory(settings)
    if factory is None:
        return None
    return RecognizerPool(factory, workers=settings.asr_workers,
                          timeout_s=settings.asr_timeout_s)


def bot_config(settings: Settings) -> BotConfig:
    """How bot nodes reach their bots: the handshake's signing token and the trust store for
    ``wss://`` (loaded once, here, off the event loop: ~36 ms of CPU per load)."""
    import ssl

    token = settings.bot_auth_token or settings.twilio_auth_token
    context = ssl.create_default_context()
    if settings.bot_ca_file is not None:
        try:
            context.load_verify_locations(cafile=str(settings.bot_ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"GATEWAY_BOT_CA_FILE {settings.bot_ca_file}: {exc}") from None
    return BotConfig(auth_token=token.get_secret_value() if token else None,
                     account_sid=settings.twilio_account_sid or "", ssl_context=context)


def webhook_client() -> httpx.AsyncClient:
    """The one HTTP client the calls' webhooks share.

    A client per webhook paid its TLS set-up (loading the CA bundle: 36 ms of CPU measured,
    even for an http:// backend) on the event loop, where it stalled every call's audio, and
    opened a new connection each time. This one is built once, off the loop, and keeps its
    connections to the backend alive between calls. Each webhook's own deadline bounds its
    request (:class:`~gateway.ivr.script.Webhook` ``timeout``)."""
    return httpx.AsyncClient()


async def _start_recognizer(gateway: Gateway) -> None:
    """Start the recogniser's workers (~2 s each) while the engine loads, when a script at
    start-up listens. A recogniser that cannot start is the version builder's to report: it
    tries again when it prepares the first version, and logs why speech gathers take keys."""
    pool, plan = gateway.recognizer, gateway.plan
    if pool is None or plan is None or not _speech_gathers(plan):
        return
    try:
        await pool.start()
    except GatewayError:
        pass
    except Exception:
        log.exception("starting the speech recogniser failed: speech gathers take keys only")


def greeter_voice(settings: Settings) -> SpeechVoice:
    """The voice of the greeter (no script): the configured speaker."""
    return SpeechVoice(speaker=settings.speaker, language=settings.language,
                       instruct=settings.instruct, seed=settings.seed)


def load_lines_setting(settings: Settings, stamps: dict[Path, FileStamp] | None = None
                       ) -> LinePlan | None:
    """``GATEWAY_LINES`` (or the one script of ``GATEWAY_SCRIPT``) loaded and validated: raises
    :class:`~gateway.ivr.script.ScriptError` listing every problem; None when neither is set.
    ``stamps`` is filled with the files read (:func:`gateway.ivr.lines.load_lines`)."""
    voices = VoiceRegistry(settings.voices_dir)
    if settings.lines is not None:
        # GATEWAY_LINES supersedes GATEWAY_SCRIPT (Settings.superseded_script).
        return load_lines(settings.lines, voice_exists=voices.exists, stamps=stamps)
    if settings.script is not None:
        return single_script(settings.script, voice_exists=voices.exists, stamps=stamps)
    return None


def create_app(
    settings: Settings,
    engine_factory: EngineFactory = default_engine_factory,
    dialog: Dialog | None = None,
    *,
    clock: Clock | None = None,
    sip_socket: socket.socket | None = None,
) -> FastAPI:
    """Build the gateway app. The engine loads in the background once the server starts.

    ``dialog`` runs every call instead of the script or greeter; ``clock`` replaces real time
    (tests drive a virtual clock through it); ``sip_socket``: the UDP socket ``GATEWAY_SIP``
    names, bound by the caller (``gateway serve`` binds it before anything else, so a port in
    use stops it with one line before the model is touched).
    """
    clock = clock if clock is not None else SystemClock()
    token = settings.twilio_auth_token.get_secret_value() if settings.twilio_auth_token else None
    metrics = Metrics()
    readiness = Readiness(metrics, clock)
    admission = Admission(settings.max_calls, readiness, clock, metrics)
    registry = CallRegistry(metrics)
    dialogs = DialogSlot()
    if dialog is not None:
        dialogs.install(FixedDialog(dialog))
    lifecycle = CallLifecycle(
        admission=admission, registry=registry, readiness=readiness, dialogs=dialogs,
        clock=clock, metrics=metrics, conditioning=conditioning(settings),
        detectors=_detectors(settings),
        inbound=InboundCap(settings.inbound_media_rate, settings.inbound_media_burst),
    )
    gateway = Gateway(
        settings=settings, clock=clock, metrics=metrics, readiness=readiness,
        admission=admission, registry=registry, dialogs=dialogs, lifecycle=lifecycle,
        outcomes=Outcomes(),
        signatures=SignatureChecker(None if settings.insecure else token, settings.public_url),
        twilio=TwilioConfig.from_settings(settings),
        updater=CallUpdater.from_settings(settings, clock, metrics),
    )
    # Refuse to start with an invalid lines file or script (ScriptError lists every problem),
    # or with a cloned voice that is not registered, before the model is loaded.
    if settings.superseded_script is not None:
        log.warning("GATEWAY_LINES (%s) supersedes GATEWAY_SCRIPT (%s): calls run the lines' "
                    "scripts", settings.lines, settings.superseded_script)
    gateway.plan = load_lines_setting(settings)
    if gateway.plan is not None:
        gateway.voices = [script_voice(script, resolve_voice(script, settings.voices_dir))
                          for script in gateway.plan.scripts().values()]
        gateway.cache = PromptCache(
            settings.cache_dir, max_memory_bytes=settings.cache_memory_mb * 1024 * 1024,
            metrics=metrics,
        )
        gateway.recognizer = _recognizer(settings, gateway.plan)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.sip:
            # Bound at once: until the engine is ready, INVITEs get 503 (a SIP proxy probing
            # with OPTIONS still sees the endpoint alive). Before the engine starts loading: a
            # bind that fails stops start-up with no load thread left running behind it.
            gateway.sip = await _start_sip(gateway, sip_socket)
        if gateway.updater is not None:
            await gateway.updater.start()
        if gateway.plan is not None:
            gateway.webhooks = await asyncio.to_thread(webhook_client)
        loader = asyncio.create_task(_load(gateway, engine_factory))
        lag = asyncio.create_task(_watch_loop_lag(metrics), name="loop-lag")
        try:
            yield
        finally:
            try:
                lag.cancel()
                if gateway.sip is not None:
                    await gateway.sip.stop()
                loader.cancel()
                await cancel_and_wait(gateway._reload_task, log=log,
                                      what="the script reloader")
                await lifecycle.close_all()
                if gateway.webhooks is not None:
                    await gateway.webhooks.aclose()
                if gateway.updater is not None:
                    await gateway.updater.close()
                if gateway.recognizer is not None:
                    await gateway.recognizer.close()
                if gateway.speech is not None:
                    await asyncio.to_thread(gateway.speech.stop)
            finally:
                if gateway._heap_held:
                    gateway._heap_held = False
                    heap.release()

    app = FastAPI(title="Qwen3-TTS IVR gateway", lifespan=lifespan)
    app.state.gateway = gateway
    # Webhook bodies are read whole before their signature can be checked: cap size and time.
    app.add_middleware(RequestLimits, max_body_bytes=settings.max_request_bytes,
                       timeout_s=settings.http_request_timeout_s, metrics=metrics)

    @app.get("/healthz")
    async def healthz() -> dict[str, object]:
        return {"status": "alive", "uptime_s": round(readiness.uptime_s, 1)}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        # ``max_calls`` is this replica's call budget (GATEWAY_MAX_CALLS): the load simulator
        # warns when it offers more concurrent callers than that, rather than report refusals
        # as the engine's limit.
        if readiness.draining:
            # A load balancer stops sending new calls here; the active ones carry on.
            return JSONResponse({"status": "draining", "calls": len(registry),
                                 "max_calls": admission.max_calls}, status_code=503)
        if readiness.ready and readiness.engine_name is not None:
            return JSONResponse({"status": "ready", "engine": readiness.engine_name,
                                 "calls": len(registry), "max_calls": admission.max_calls})
        body = {"status": "failed" if readiness.load_error else "loading",
                "error": readiness.load_error, "max_calls": admission.max_calls}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    app.include_router(build_router(lifecycle, gateway.signatures, gateway.outcomes,
                                    gateway.twilio, metrics, gateway.updater))
    return app


#: How often the event loop's lag is sampled.
LOOP_LAG_PERIOD_S = 0.05


async def _watch_loop_lag(metrics: Metrics, period_s: float = LOOP_LAG_PERIOD_S) -> None:
    """Sample how late the event loop runs a callback due now: every call's media (pacing,
    marks, RTP) waits that long behind whatever held the loop or the GIL (the engine core's
    thread shares it). ``gateway_event_loop_lag_seconds``."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        metrics.event_loop_lag.observe(max(0.0, loop.time() - due))


async def _load(gateway: Gateway, engine_factory: EngineFactory) -> None:
    """Load and warm the engine off the event loop, make the lines ready (or the greeter),
    install the dialogs, then report ready."""
    clock = gateway.clock
    t0 = clock.now()
    settings = gateway.settings
    voices = gateway.voices or [greeter_voice(settings)]
    warmup = _warmup_voices(voices)
    # The recogniser's workers start while the engine loads.
    recognizer = asyncio.create_task(_start_recognizer(gateway))
    try:
        if settings.barge_in_on_speech:
            # The VAD model (one ONNX session shared by every call) loads before the first call.
            from gateway.audio.vad import load_session

            await asyncio.to_thread(load_session)
        engines = list(await asyncio.to_thread(engine_factory, settings))
        # Every engine warms up (graph capture is per engine), with every configured voice.
        for engine in engines:
            await asyncio.to_thread(engine.warmup, warmup)
        speech = SpeechService(
            engines,
            metrics=gateway.metrics,
            first_audio_budget_s=settings.first_audio_budget_ms / 1000,
            ahead_high_s=settings.ahead_high_ms / 1000,
            ahead_low_s=settings.ahead_low_ms / 1000,
            step_timeout_s=settings.engine_step_timeout_ms / 1000 or None,
        )
    except asyncio.CancelledError:
        recognizer.cancel()
        raise
    except GatewayError as exc:
        gateway.readiness.fail(str(exc))
        return
    except Exception as exc:
        log.exception("engine start-up failed")
        gateway.readiness.fail(f"engine start-up failed: {exc}")
        return
    await recognizer
    speech.start()
    gateway.speech = speech
    if gateway.plan is not None and gateway.cache is not None:
        try:
            await _prepare_ivr(gateway, engines[0])
        except Exception as exc:
            log.exception("preparing the IVR script failed")
            gateway.readiness.fail(f"preparing the IVR script failed: {exc}")
            return
    # Everything start-up built lives as long as the process: out of the collector's full
    # collections, which would otherwise stop every call's media for ~0.3 s (gateway/heap.py).
    heap.hold()
    gateway._heap_held = True
    if gateway.dialogs.installed is None:
        if gateway.switchboard is not None:
            gateway.dialogs.install(gateway.switchboard)
        else:
            reader = Reader(voices[0].language, Reading(free_text=settings.free_text))
            reader.warm([voices[0].language])
            gateway.dialogs.install(GreeterDialogs(Speaker(speech, voices[0]), settings.greeting,
                                                   reader))
    gateway.readiness.mark_ready(engines[0].name)
    log.info("ready: %s, %d turn(s) at once (load + warm-up %.1f s)", engines[0].name,
             speech.capacity, clock.now() - t0)
    if gateway.reloader is not None:
        gateway._reload_task = asyncio.create_task(gateway.reloader.run(), name="reloader")


async def _start_sip(gateway: Gateway, sock: socket.socket | None) -> SipEndpoint:
    from gateway.sip.digest import DigestAuthenticator
    from gateway.sip.uas import UasConfig

    settings = gateway.settings
    bind = settings.sip_bind
    assert bind is not None
    host, port = bind
    public_ip = settings.sip_public_ip or ("127.0.0.1" if host == "0.0.0.0" else host)
    authenticator = None
    users = settings.sip_user_table
    if users is not None:
        authenticator = DigestAuthenticator(settings.sip_realm, users, secret=os.urandom(32),
                                            clock=gateway.clock)
    config = UasConfig(local_ip=public_ip, local_port=port,
                       allow=settings.sip_allow_networks,
                       authenticator=authenticator,
                       t1=settings.sip_t1_ms / 1000)
    endpoint = SipEndpoint(gateway.lifecycle, config, metrics=gateway.metrics,
                           rtp_ports=settings.rtp_port_range,
                           answer_delay_s=settings.sip_answer_delay_ms / 1000,
                           rtp_timeout_s=settings.sip_rtp_timeout_s,
                           playout=replace(RTP_PLAYOUT, start_buffer_s=start_buffer_setting(
                               settings.sip_start_buffer_ms),
                               start_buffer_adapts=settings.start_buffer_adaptive))
    await endpoint.start(host, port, sock=sock)
    return endpoint


async def _prepare_ivr(gateway: Gateway, engine: Engine) -> None:
    """Make the start-up plan the first version (every static prompt loaded, and unless lazy
    rendered) and build its switchboard and reloader."""
    plan, cache, settings = gateway.plan, gateway.cache, gateway.settings
    assert plan is not None and cache is not None and gateway.speech is not None
    builder = VersionBuilder(
        cache=cache, speech=gateway.speech, engine=engine, conditioning=conditioning(settings),
        clock=gateway.clock, voices_dir=settings.voices_dir,
        render_lazily=settings.render_lazily, recognizer=gateway.recognizer,
        metrics=gateway.metrics, http=gateway.webhooks,
        bots=await asyncio.to_thread(bot_config, settings),
    )
    version = await builder.build(plan, 1)
    gateway.switchboard = Switchboard(version, gateway.metrics)
    log.info("serving %s", plan.describe())
    gateway.reloader = Reloader(
        load=lambda stamps: _reload_plan(settings, stamps), builder=builder,
        switchboard=gateway.switchboard, clock=gateway.clock,
        interval_s=settings.reload_interval_s, metrics=gateway.metrics,
    )


def _reload_plan(settings: Settings, stamps: dict[Path, FileStamp]) -> LinePlan:
    plan = load_lines_setting(settings, stamps)
    assert plan is not None  # a gateway serving an IVR has GATEWAY_LINES or GATEWAY_SCRIPT
    return plan


def _warmup_voices(voices: Sequence[SpeechVoice]) -> list[tuple[str, str] | VoicePrompt]:
    """Every voice calls will speak with (speakers or clones), each once."""
    out: list[tuple[str, str] | VoicePrompt] = []
    for voice in voices:
        entry = voice.prompt if voice.prompt is not None else (voice.speaker, voice.language)
        if entry not in out:
            out.append(entry)
    return out
