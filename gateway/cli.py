"""The ``gateway`` command: a thin wrapper over settings, the app and the engine.

Tests call :func:`main` with an argv list instead of spawning a process.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gateway.config import Settings
from gateway.errors import GatewayError
from gateway.loadsim.cli import loadsim_app
from gateway.tts.model_source import require_model_source

if TYPE_CHECKING:
    from gateway.text import FreeTextMode

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Qwen3-TTS telephony IVR media gateway.",
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(no_args_is_help=True, help="Model utilities.")
prompts_app = typer.Typer(no_args_is_help=True,
                          help="IVR scripts: validate, pre-render, draw, test.")
app.add_typer(prompts_app, name="prompts")
app.add_typer(loadsim_app, name="loadsim")
app.add_typer(model_app, name="model")
voices_app = typer.Typer(
    no_args_is_help=True, help="Registered cloned voices (Qwen3-TTS voice-clone prompts)."
)
app.add_typer(voices_app, name="voices")



def _setup_logging(level: str, fmt: str = "text") -> None:
    from gateway.logs import setup_logging

    setup_logging(level, "json" if fmt == "json" else "text")


def _settings(**overrides: object) -> Settings:
    values = {k: v for k, v in overrides.items() if v is not None}
    from pydantic import ValidationError

    from gateway.config import settings_error

    try:
        return Settings(**values)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise GatewayError(f"invalid settings: {settings_error(exc)}") from None


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address [GATEWAY_HOST].")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port [GATEWAY_PORT].")] = None,
    model: Annotated[
        str | None, typer.Option(help="Model id or local directory [GATEWAY_MODEL].")
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto|cpu|cuda [GATEWAY_DEVICE].")] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Run without Twilio signature validation.")
    ] = False,
    public_url: Annotated[
        str | None, typer.Option(help="Public https:// URL [GATEWAY_PUBLIC_URL].")
    ] = None,
    script: Annotated[
        Path | None, typer.Option(help="IVR script to run for every call [GATEWAY_SCRIPT].")
    ] = None,
    lines: Annotated[
        Path | None,
        typer.Option(help="Lines file: a script per dialled number [GATEWAY_LINES]."),
    ] = None,
    sip: Annotated[
        str | None, typer.Option(help="SIP endpoint host:port, e.g. 0.0.0.0:5060 [GATEWAY_SIP].")
    ] = None,
) -> None:
    """Run the gateway (HTTP webhooks + Twilio Media Streams WebSocket, SIP with --sip).

    The lines file and scripts are reloaded when they change on disk and on SIGHUP: a valid
    edit is rendered, then takes new calls; an invalid one is logged and refused."""
    import uvicorn

    from gateway.app import create_app

    settings = _settings(
        host=host, port=port, model=model, device=device, public_url=public_url,
        insecure=True if insecure else None, script=script, lines=lines, sip=sip,
    )
    _setup_logging(settings.log_level, settings.log_format)
    settings.require_security()
    if settings.insecure:
        logging.getLogger("gateway").warning(
            "--insecure: Twilio signatures are NOT validated; never expose this to the internet"
        )
    from gateway.ivr.script import ScriptError
    from gateway.net import bind

    # First: every listening socket. A port in use is one line (ConfigError) naming its
    # setting, before the script, the cache or the model is touched, and nothing is left
    # loading behind it (uvicorn binds HTTP only after the app's lifespan has started the load).
    http_socket = bind(settings.host, settings.port, kind="tcp", what="HTTP server",
                       variable="GATEWAY_HOST/GATEWAY_PORT")
    sip_socket = None
    try:
        if settings.sip_bind is not None:
            from gateway.sip.endpoint import bind_udp

            sip_socket = bind_udp(*settings.sip_bind)
        fastapi_app = create_app(settings, sip_socket=sip_socket)
        # Before the model loads (the app's lifespan): a hub model the hub cannot provide is
        # one line in seconds, not a minute of huggingface_hub retries. After the script, whose
        # errors say more about what the operator just did. A simulated device loads no model.
        if settings.engine != "simulated":
            require_model_source(settings.model)
    except BaseException as exc:
        http_socket.close()
        if sip_socket is not None:
            sip_socket.close()
        if not isinstance(exc, ScriptError):
            raise
        for diagnostic in exc.diagnostics:
            typer.echo(f"{diagnostic.file}:{diagnostic.line}:{diagnostic.column}: error: "
                       f"{diagnostic.message}", err=True)
        raise GatewayError(f"refusing to start: {settings.lines or settings.script} has errors"
                           ) from None
    from gateway.http_limits import server_limits
    from gateway.logs import uvicorn_log_config
    from gateway.server import DrainingServer

    config = uvicorn.Config(
        fastapi_app,
        host=settings.host,
        port=settings.port,
        ws_max_size=settings.ws_max_size,
        log_level=settings.log_level,
        log_config=uvicorn_log_config(),
        # Slow or idle clients must not hold sockets forever (header deadline and size cap,
        # keep-alive timeout); request bodies are capped by the app's RequestLimits.
        **server_limits(settings),
        # After the drain, whatever is still connected gets this long to close.
        timeout_graceful_shutdown=5,
        proxy_headers=True,
    )
    gateway = fastapi_app.state.gateway
    server = DrainingServer(config, gateway.drain)
    failure: list[str] = []

    def on_fatal(message: str) -> None:
        failure.append(message)
        server.should_exit = True

    gateway.readiness.on_fatal = on_fatal
    # SIGHUP: reload the lines and scripts now (the convention of daemons since inetd). The
    # handler only hands the request to the event loop.
    previous = signal.signal(signal.SIGHUP,
                             lambda signum, frame: gateway.request_reload("SIGHUP"))
    try:
        server.run(sockets=[http_socket])
    finally:
        signal.signal(signal.SIGHUP, previous)
    if failure:
        raise GatewayError(failure[0])
    # Calls are drained and the app has shut down: leave now. The interpreter's own teardown
    # (a final garbage collection over the model's objects) takes seconds on a busy host, and
    # an orchestrator counts those against its stop timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@app.command()
def say(
    text: Annotated[str, typer.Argument(help="What to say.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="8 kHz WAV to write.")],
    speaker: Annotated[str | None, typer.Option(help="CustomVoice speaker.")] = None,
    language: Annotated[str | None, typer.Option(help="Language.")] = None,
    model: Annotated[str | None, typer.Option(help="Model id or local directory.")] = None,
    device: Annotated[str | None, typer.Option(help="auto|cpu|cuda.")] = None,
    encoding: Annotated[
        str, typer.Option("--encoding", help="pcm (16-bit) or ulaw (G.711 mu-law) WAV.")
    ] = "pcm",
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    free_text: Annotated[
        str | None,
        typer.Option("--free-text", help="What is read aloud: off, numbers or full "
                                         "[GATEWAY_FREE_TEXT].")] = None,
    text_only: Annotated[
        bool, typer.Option("--text-only", help="Print the words it would say; no model.")
    ] = False,
) -> None:
    """Render TEXT through the phone-audio path into an 8 kHz WAV an author can listen to.

    TEXT is read as a caller would hear it (numbers, amounts, dates, times and phone numbers
    in words, --free-text), and may mark a value with a say-as type as scripts do:
    'Your balance is {"456.10":currency}.' The words spoken are printed first."""
    settings = _settings(model=model, device=device, speaker=speaker, language=language,
                         free_text=free_text)
    spoken = _spoken(text, settings.language, settings.free_text)
    typer.echo(f"says: {spoken}")
    if text_only:
        return
    import numpy as np
    import soundfile as sf

    from gateway.app import conditioning
    from gateway.audio.framer import PhonePipeline
    from gateway.audio.g711 import ulaw_decode
    from gateway.tts.batched import BatchedQwenEngine
    from gateway.tts.engine import SpeechRequest

    if encoding not in ("pcm", "ulaw"):
        raise GatewayError("--encoding must be pcm or ulaw")
    _setup_logging("warning")
    require_model_source(settings.model)
    # The gateway's own engine, one row: the audio a caller would hear for this text.
    engine = BatchedQwenEngine(
        model=settings.model, device=settings.device, dtype=settings.dtype, max_rows=1,
        chunk_schedule=settings.chunk_schedule, max_seq_len=settings.max_seq_len,
        codec_decode=settings.codec_decode, trim_leading_silence=False,
        adaptive_chunks=settings.adaptive_chunks, cuda_graphs=False,
    )
    request = SpeechRequest(text=spoken, speaker=settings.speaker, language=settings.language,
                            instruct=settings.instruct, seed=seed)
    # The callers' own phone path: trim and level (gateway.audio.condition), 8 kHz, G.711.
    pipeline = PhonePipeline(codec="pcmu", conditioner=conditioning(settings).new())
    frames: list[bytes] = []
    t0 = time.perf_counter()
    first: float | None = None
    for chunk in engine.stream(request):
        if first is None:
            first = time.perf_counter() - t0
        frames.extend(pipeline.push(chunk))
    frames.extend(pipeline.flush())
    total = time.perf_counter() - t0
    pcm = ulaw_decode(b"".join(frames)).astype(np.int16)
    subtype = "PCM_16" if encoding == "pcm" else "ULAW"
    output.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(output), pcm, 8000, subtype=subtype, format="WAV")
    seconds = len(pcm) / 8000
    typer.echo(
        f"wrote {output}: {seconds:.2f} s of 8 kHz {encoding} audio ({len(frames)} frames); "
        f"first chunk after {1000 * (first or 0):.0f} ms, total {total:.2f} s on {engine.device}"
    )


DEMO_SCRIPT = Path(__file__).resolve().parent.parent / "prompts" / "demo.yaml"


@app.command()
def demo(
    port: Annotated[int, typer.Option(help="HTTP port of the gateway.")] = 8080,
    host: Annotated[str, typer.Option(help="Bind address (loopback: the demo is insecure).")
                    ] = "127.0.0.1",
    model: Annotated[str, typer.Option(help="Model id or local directory.")] = "tiny",
    backend_port: Annotated[int, typer.Option(
        help="Port of the demo's account backend stub (not started when ACME_BACKEND_URL "
             "is set).")] = 8081,
    sip: Annotated[str | None, typer.Option(
        help="Also answer SIP here, e.g. 127.0.0.1:5060.")] = None,
) -> None:
    """Run the demo IVR (prompts/demo.yaml, --insecure) with its account backend stub: call it
    with `gateway call http://127.0.0.1:8080` and press 1."""
    from gateway.demo_backend import bind as bind_backend

    if not DEMO_SCRIPT.exists():
        raise GatewayError(f"the demo script is not at {DEMO_SCRIPT} (run from a checkout)")
    _setup_logging("info")
    require_model_source(model)
    backend = None
    if not os.environ.get("ACME_BACKEND_URL"):
        from gateway.demo_backend import BackendThread

        # Bound first: a port in use is one line naming the option, before any model loads.
        backend = BackendThread(bind_backend("127.0.0.1", backend_port)).start()
        os.environ["ACME_BACKEND_URL"] = backend.url
        logging.getLogger("gateway").info(
            "demo backend stub at %s: any six-digit account (417029: Dana, 29.10 dollars; "
            "9xxxxx: overdue)", backend.url)
    try:
        serve(host=host, port=port, model=model, device=None, insecure=True, public_url=None,
              script=DEMO_SCRIPT, lines=None, sip=sip)
    finally:
        if backend is not None:
            backend.stop()


@app.command("demo-backend")
def demo_backend(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8081,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
) -> None:
    """Run only the demo's account backend stub (what ACME_BACKEND_URL points the demo at)."""
    import uvicorn

    from gateway.demo_backend import bind as bind_backend
    from gateway.demo_backend import create_app
    from gateway.logs import uvicorn_log_config

    _setup_logging("info")
    sock = bind_backend(host, port)
    typer.echo(f"demo backend on http://{host}:{port}/accounts/lookup "
               f"(point ACME_BACKEND_URL at http://{host}:{port})")
    uvicorn.Server(uvicorn.Config(create_app(), log_level="info",
                                  log_config=uvicorn_log_config())).run(sockets=[sock])


@app.command()
def call(
    target: Annotated[str, typer.Argument(
        help="http://host:port (Twilio: the voice webhook and the stream) or "
             "sip:host:port / host:port (SIP).")] = "http://127.0.0.1:8080",
    to: Annotated[str, typer.Option("--to", help="The number dialled (picks the line).")
                  ] = "+15550002222",
    caller: Annotated[str, typer.Option("--from", help="The caller's number.")
                      ] = "+15550000000",
    output: Annotated[Path, typer.Option("-o", "--output", help="WAV of what you heard.")
                      ] = Path("call.wav"),
    say: Annotated[list[str] | None, typer.Option(
        "--say", help="A phrase (spoken by espeak-ng or flite) or FILE.wav to say when you "
                      "press s; repeatable.")] = None,
    speakers: Annotated[bool, typer.Option(
        "--speakers/--no-speakers", help="Play to the speakers when there are any.")] = True,
    auth_token: Annotated[str | None, typer.Option(
        help="Sign as Twilio does [GATEWAY_TWILIO_AUTH_TOKEN].")] = None,
    max_duration: Annotated[float, typer.Option(help="Hang up after this many seconds.")
                            ] = 600.0,
) -> None:
    """Call a gateway from the terminal: hear it (speakers and a WAV), press keys (0-9 * #),
    say things (s, or `say: PHRASE` lines on a pipe), q hangs up; the call's events print as
    they happen."""
    from gateway.softphone import CallOptions, place_call

    _setup_logging("warning")
    token = auth_token if auth_token is not None else os.environ.get("GATEWAY_TWILIO_AUTH_TOKEN")
    options = CallOptions(target=target, to=to, caller=caller, output=output,
                          auth_token=token or None, speakers=speakers, say=list(say or []),
                          max_duration_s=max_duration)
    if asyncio.run(place_call(options)) != 0:
        raise GatewayError("the call did not connect")


def _spoken(text: str, language: str, free_text: FreeTextMode) -> str:
    """What ``say`` speaks: TEXT's say-as slots read by type, the rest by the free-text
    normaliser (TEXT with braces that are no slots is free text throughout)."""
    from gateway.text import Reader, Reading

    reader = Reader(language, Reading(free_text=free_text))
    try:
        rendering = reader.sentence(text, {}, language)
    except ValueError:
        return reader.free(text, language)
    for fallback in rendering.fallbacks:
        typer.echo(f"warning: {fallback}", err=True)
    return rendering.spoken


@model_app.command("tiny")
def model_tiny(
    directory: Annotated[Path, typer.Argument(help="Where to write the checkpoint.")],
    kind: Annotated[str, typer.Option(help="custom_voice or base.")] = "custom_voice",
    seed: Annotated[int, typer.Option(help="Random-weight seed.")] = 0,
) -> None:
    """Build a tiny random-weight Qwen3-TTS checkpoint of the real architecture (tests, smoke)."""
    from gateway.tts.tiny import build_tiny_checkpoint

    if kind not in ("custom_voice", "base"):
        raise GatewayError("--kind must be custom_voice or base")
    path = build_tiny_checkpoint(directory, kind=kind, seed=seed)  # type: ignore[arg-type]
    typer.echo(f"tiny {kind} checkpoint written to {path} (random weights: it speaks noise)")


VoicesDir = Annotated[
    Path | None,
    typer.Option("--dir", help="Voices directory [GATEWAY_VOICES_DIR, else ./voices]."),
]


@voices_app.command("add")
def voices_add(
    name: Annotated[str, typer.Argument(help="Voice name: a-z, 0-9, '_', '-' (max 64).")],
    ref: Annotated[Path, typer.Argument(help="Reference clip, 1-30 s (any rate/channels).")],
    text: Annotated[str, typer.Option("--text", help="What the reference clip says.")],
    directory: VoicesDir = None,
    base_model: Annotated[
        str | None, typer.Option("--base-model", help="Qwen3-TTS Base model id or directory.")
    ] = None,
    device: Annotated[str, typer.Option(help="auto|cpu|cuda.")] = "cpu",
) -> None:
    """Compute NAME's voice-clone prompt from REF once and store it (replaces an existing NAME)."""
    from gateway.ivr.voices import DEFAULT_BASE_MODEL, VoiceRegistry, default_voices_dir

    _setup_logging("warning")
    require_model_source(base_model or DEFAULT_BASE_MODEL, what="Qwen3-TTS Base model",
                         option="--base-model")
    registry = VoiceRegistry(directory or default_voices_dir())
    record = registry.add(name, ref, text, base_model=base_model or DEFAULT_BASE_MODEL,
                          device=device)
    typer.echo(
        f"registered voice {record.name!r}: {record.ref_duration_s:.2f} s reference, "
        f"identity {record.identity[:12]}, in {registry.directory}"
    )


@voices_app.command("list")
def voices_list(
    directory: VoicesDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Full records as JSON.")] = False,
) -> None:
    """List the registered voices."""
    import json

    from gateway.ivr.voices import VoiceRegistry, default_voices_dir

    _setup_logging("warning")
    registry = VoiceRegistry(directory or default_voices_dir())
    records = registry.list()
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in records], indent=2, ensure_ascii=False))
        return
    if not records:
        typer.echo(f"no voices in {registry.directory}")
        return
    rows = [("NAME", "DURATION", "CREATED", "BASE MODEL", "IDENTITY", "TEXT")]
    for r in records:
        text = r.ref_text if len(r.ref_text) <= 48 else r.ref_text[:47] + "…"
        created = r.created.astimezone().strftime("%Y-%m-%d %H:%M:%S")
        rows.append((r.name, f"{r.ref_duration_s:.2f} s", created, r.base_model,
                     r.identity[:12], text))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        padded = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        typer.echo("  ".join([*padded, row[-1]]))


@voices_app.command("remove")
def voices_remove(
    name: Annotated[str, typer.Argument(help="Voice to unregister.")],
    directory: VoicesDir = None,
) -> None:
    """Unregister voice NAME."""
    from gateway.ivr.voices import VoiceRegistry, default_voices_dir

    registry = VoiceRegistry(directory or default_voices_dir())
    registry.remove(name)
    typer.echo(f"removed voice {name!r} from {registry.directory}")


@prompts_app.command("validate")
def prompts_validate(
    files: Annotated[list[Path], typer.Argument(help="IVR scripts or lines files (YAML).")],
) -> None:
    """Check scripts, or a lines file and every script it names: schema and logic errors as
    file:line:column: message."""
    from gateway.ivr.lines import load_plan
    from gateway.ivr.script import ScriptError
    from gateway.ivr.voices import VoiceRegistry

    registry = VoiceRegistry(_settings().voices_dir)
    failed = 0
    for path in files:
        try:
            plan = load_plan(path, voice_exists=registry.exists)
        except ScriptError as exc:
            failed += 1
            for diagnostic in exc.diagnostics:
                typer.echo(f"{diagnostic.file}:{diagnostic.line}:{diagnostic.column}: error: "
                           f"{diagnostic.message}", err=True)
            continue
        if not plan.single:
            typer.echo(f"{path}: ok ({len(plan.lines)} lines, {len(plan.numbers)} numbers, "
                       f"default {plan.default!r})")
        for script_path, script in plan.scripts().items():
            typer.echo(f"{script_path}: ok ({len(script.nodes)} nodes, "
                       f"{len(script.static_sentences())} cached sentences)")
    if failed:
        raise GatewayError(f"{failed} of {len(files)} file(s) have errors")


@prompts_app.command("graph")
def prompts_graph(
    file: Annotated[Path, typer.Argument(help="IVR script (YAML).")],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="flow.svg, flow.png, flow.pdf or flow.dot.")
    ],
) -> None:
    """Draw the call flow (nodes, what each says, keys and conditions on the edges)."""
    from gateway.ivr.graph import render
    from gateway.ivr.script import ScriptError, load_script

    try:
        script = load_script(file)
    except ScriptError as exc:
        raise GatewayError(f"invalid script:\n{exc}") from None
    render(script, output)
    typer.echo(f"wrote {output}: {len(script.nodes)} nodes")


@prompts_app.command("test")
def prompts_test(
    file: Annotated[Path, typer.Argument(help="IVR script (YAML).")],
    cases: Annotated[Path, typer.Argument(help="Case file (YAML): callers and what they hear.")],
    line: Annotated[
        str | None,
        typer.Option(help="FILE is a lines file: test this line's script, read with its "
                          "reading and lexicon (default: the default line)."),
    ] = None,
) -> None:
    """Run scripted callers through the IVR (no model): check path, sentences and outcome."""
    import asyncio

    from gateway.ivr.cases import load_cases, report, run_cases
    from gateway.ivr.lines import is_lines_file, load_lines
    from gateway.ivr.script import ScriptError, load_script

    # The runner logs failed webhooks as warnings; here they are what a case is about.
    _setup_logging("error")
    reader = None
    try:
        if line is not None or is_lines_file(file):
            plan = load_lines(file)
            chosen = plan.lines.get(line or plan.default)
            if chosen is None:
                raise GatewayError(f"{file} has no line {line!r} (lines: "
                                   f"{', '.join(plan.lines)})")
            script, reader = chosen.script, chosen.reader()
        else:
            script = load_script(file)
        case_file = load_cases(cases, script)
    except ScriptError as exc:
        for diagnostic in exc.diagnostics:
            typer.echo(f"{diagnostic}", err=True)
        raise GatewayError(f"cannot run {cases}: fix the errors above") from None
    results = asyncio.run(run_cases(script, case_file, reader))
    failed = report(results, str(cases), typer.echo)
    typer.echo(f"{len(results) - failed} passed, {failed} failed")
    if failed:
        raise GatewayError(f"{failed} of {len(results)} case(s) failed")


@prompts_app.command("render")
def prompts_render(
    files: Annotated[list[Path], typer.Argument(help="IVR scripts or lines files (YAML).")],
    model: Annotated[str | None, typer.Option(help="Model id or local directory.")] = None,
    device: Annotated[str | None, typer.Option(help="auto|cpu|cuda.")] = None,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Prompt cache directory [GATEWAY_CACHE_DIR].")
    ] = None,
) -> None:
    """Pre-render every static prompt of the scripts (of a lines file: of every script it
    names) into the cache (resumable: present ones are skipped)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from gateway.ivr.cache import PromptCache, PromptKey
    from gateway.ivr.lines import load_plan
    from gateway.ivr.prompts import (
        audio_identity,
        pcm_from_chunks,
        prompt_key_for,
        renders,
        request_for,
        resolve_clones,
        resolve_voice,
    )
    from gateway.ivr.script import ScriptError
    from gateway.tts.engine import SpeechRequest
    from gateway.tts.service import SpeechService

    settings = _settings(model=model, device=device, cache_dir=cache_dir)
    _setup_logging("warning")
    if settings.cache_dir is None:
        raise GatewayError("rendering needs a cache directory (--cache-dir)")
    try:
        # Each script once per way its lines read it, however many lines or files name it.
        scripts = {(line.path, line.reader()): line.script for path in files
                   for line in load_plan(path).lines.values()}
    except ScriptError as exc:
        raise GatewayError(f"invalid script:\n{exc}") from None
    if settings.engine != "simulated":
        require_model_source(settings.model)
    from gateway.app import conditioning, default_engine_factory

    # The gateway's own engines (batched by default) behind the speech scheduler: prompts render
    # concurrently, one per batch row, as the gateway renders missing prompts at start-up.
    engines = default_engine_factory(settings)
    fingerprint = engines[0].fingerprint
    phone = conditioning(settings)
    audio = audio_identity(engines[0], phone)
    cache = PromptCache(settings.cache_dir, max_memory_bytes=1)
    todo = []
    hits = 0
    seen: set[PromptKey] = set()
    for (_, reader), script in scripts.items():
        voice = resolve_voice(script, settings.voices_dir)
        clones = resolve_clones(script, settings.voices_dir)
        for text, spec, resolved in renders(script, voice, clones, reader):
            key = prompt_key_for(spec, fingerprint, resolved.identity, text, audio)
            if key in seen:
                continue
            seen.add(key)
            if cache.on_disk(key):
                hits += 1
            else:
                todo.append((request_for(spec, text, resolved), key))
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TimeElapsedColumn())
    speech = SpeechService(engines)
    speech.start()
    t0 = time.perf_counter()
    try:
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task("rendering prompts", total=len(todo))

            async def render_all() -> None:
                limit = asyncio.Semaphore(max(1, speech.capacity))

                async def render_one(request: SpeechRequest, key: PromptKey) -> None:
                    async with limit:
                        started = time.perf_counter()
                        chunks = [chunk async for chunk in speech.stream(request)]
                        # Written as each finishes: an interrupted run resumes from here.
                        cache.put(key, pcm_from_chunks(chunks, phone),
                                  render_s=time.perf_counter() - started)
                        progress.advance(task)

                await asyncio.gather(*(render_one(*item) for item in todo))

            asyncio.run(render_all())
    finally:
        speech.stop()
    typer.echo(f"{hits} already cached, {len(todo)} rendered into {settings.cache_dir} "
               f"in {time.perf_counter() - t0:.1f} s on {engines[0].name} "
               f"({speech.capacity} at once)")


def _unwrap_summaries(command: Any) -> None:
    """Join the first paragraph of every command's help into one line.

    Typer's rich help keeps the docstring's line breaks in the command list (``gateway
    --help``), so summaries broke mid-sentence wherever the source did; the terminal wraps
    them instead. Later paragraphs keep their breaks."""
    if command.help:
        first, sep, rest = inspect.cleandoc(command.help).partition("\n\n")
        command.help = " ".join(first.split()) + sep + rest
    for sub in getattr(command, "commands", {}).values():
        _unwrap_summaries(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code instead of exiting (for tests)."""
    command = typer.main.get_command(app)
    _unwrap_summaries(command)
    try:
        command.main(args=argv, prog_name="gateway", standalone_mode=False)
    except GatewayError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 1
    except SystemExit as exc:  # click's --help and usage errors
        return int(exc.code or 0)
    except Exception as exc:  # usage errors: typer vendors click, so match both classes
        import click

        show = getattr(exc, "show", None)
        code = getattr(exc, "exit_code", None)
        if isinstance(exc, click.ClickException) or (callable(show) and isinstance(code, int)):
            show()  # type: ignore[misc]
            return int(code)  # type: ignore[arg-type]
        raise
    return 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
