"""Serving lines, and changing them while calls are up.

- :class:`Version`: one loaded :class:`~gateway.ivr.lines.LinePlan` made ready to take calls:
  a :class:`~gateway.ivr.runner.RunnerContext` per line (its script, voice, clones, sounds and
  the prompt keys they make), every fixed sentence in the prompt cache.
- :class:`VersionBuilder`: plan -> version, through the gateway's own speech service (the same
  steps as start-up: the model's languages, cloned voices, sounds, missing prompts rendered).
- :class:`Switchboard`: the :class:`~gateway.call.lifecycle.DialogFactory` of an IVR gateway.
  Each call is routed by what it dialled and runs on the version installed when it started,
  to its end: a call never changes scripts halfway.
- :class:`Reloader`: the background task of ``gateway serve`` that builds the next version when
  the files change on disk (or on SIGHUP) and installs it only once it is complete. An edit
  that does not validate, or a version that cannot be prepared, is refused: its errors are
  logged as ``file:line:column: error: message``, ``gateway_script_reload_errors_total``
  counts it, and the installed version keeps serving.

Why polling and not inotify: the lines and scripts are often a mounted volume (a Kubernetes
ConfigMap is swapped by a symlink rename, EFS/NFS report no events to the client). A stat of a
few files every couple of seconds costs nothing, works on every one of them and runs on the
injected clock, so tests drive it in virtual time. A changed file must look the same on two
checks in a row before it is read, so a file still being written is not taken for an edit.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np

from gateway.asr.pool import RecognizerPool
from gateway.audio.condition import Conditioning
from gateway.bot.agent import BotConfig
from gateway.call.session import Call, Dialog
from gateway.clock import Clock
from gateway.errors import GatewayError
from gateway.ivr.cache import PromptCache
from gateway.ivr.lines import FileStamp, LinePlan, Route, script_sounds, stamp
from gateway.ivr.prompts import (
    ResolvedVoice,
    audio_identity,
    render_missing,
    resolve_clones,
    resolve_voice,
)
from gateway.ivr.runner import IvrRunner, RunnerContext, load_sound
from gateway.ivr.script import Script, ScriptError
from gateway.metrics import Metrics
from gateway.speech import Speaker, SpeechVoice
from gateway.tts.engine import Engine
from gateway.tts.service import SpeechService

log = logging.getLogger(__name__)

__all__ = ["Reloader", "Switchboard", "Version", "VersionBuilder", "script_voice"]


def script_voice(script: Script, voice: ResolvedVoice | None) -> SpeechVoice:
    """The voice a script's calls speak with live (its speaker, or its cloned voice)."""
    spec = script.voice
    return SpeechVoice(speaker=(spec.speaker or "ryan").lower(), language=spec.language,
                       instruct=spec.style, seed=None,
                       prompt=voice.prompt if voice is not None else None)


@dataclass(frozen=True)
class Version:
    """A plan ready to take calls: a runner context per line."""

    number: int
    plan: LinePlan
    contexts: Mapping[str, RunnerContext]


class VersionBuilder:
    """Makes a :class:`LinePlan` ready to take calls, as start-up does."""

    def __init__(
        self,
        *,
        cache: PromptCache,
        speech: SpeechService,
        engine: Engine,
        conditioning: Conditioning | None,
        clock: Clock,
        voices_dir: Path,
        render_lazily: bool = False,
        recognizer: RecognizerPool | None = None,
        metrics: Metrics | None = None,
        http: httpx.AsyncClient | None = None,
        bots: BotConfig | None = None,
    ) -> None:
        """``recognizer``: where speech gathers' turns are recognised (None: keys only).
        ``http``: the client the calls' webhooks share (None: one per webhook). ``bots``: how
        bot nodes reach their bots."""
        self.cache = cache
        self.speech = speech
        self.engine = engine
        self.conditioning = conditioning
        self.clock = clock
        self.voices_dir = voices_dir
        self.render_lazily = render_lazily
        self.recognizer = recognizer
        self.metrics = metrics
        self.http = http
        self.bots = bots

    async def build(self, plan: LinePlan, number: int, *, background: bool = False) -> Version:
        """Check every script against the model, resolve voices and sounds, render the
        missing prompts (unless lazy; ``background``: behind callers' turns).

        Raises :class:`~gateway.errors.GatewayError` saying what stops the plan from serving.
        """
        engine = self.engine
        known = {language.lower() for language in (*engine.languages, "Auto")}
        for path, script in plan.scripts().items():
            # Scripts are validated against the published languages; this model may speak fewer.
            unsupported = [lang for lang in script.languages_spoken() if lang.lower() not in known]
            if unsupported:
                raise GatewayError(f"the script speaks {', '.join(unsupported)}, which "
                                   f"{engine.name} does not (it speaks "
                                   f"{', '.join(engine.languages)}): {path}")
        prepared = await asyncio.to_thread(self._prepare, plan)
        await self.prepare_speech(plan)
        audio = audio_identity(engine, self.conditioning)
        contexts = {}
        for name, line in plan.lines.items():
            parts = prepared[line.path]
            reader = line.reader()
            # CLDR and phonenumbers data loaded now, not on a first caller's turn.
            reader.warm(line.script.languages_spoken())
            contexts[name] = RunnerContext(
                script=line.script,
                cache=self.cache,
                model_fingerprint=engine.fingerprint,
                voice_identity=parts.voice.identity,
                speaker=Speaker(self.speech, script_voice(line.script, parts.voice)),
                audio=audio,
                clock=self.clock,
                sounds=parts.sounds,
                clones=parts.clones,
                http=self.http,
                bots=self.bots,
                recognizer=self.recognizer,
                metrics=self.metrics,
                line=name,
                version=number,
                reader=reader,
            )
        if not self.render_lazily:
            t0 = self.clock.now()
            hits = rendered = 0
            # Per script and the way its lines read it (a line's lexicon changes its words,
            # and so its prompts' keys); two lines reading one script alike render it once.
            readings = {(line.path, line.reader()): line.script for line in plan.lines.values()}
            for (path, reader), script in readings.items():
                parts = prepared[path]
                h, r = await render_missing(script, self.cache, self.speech, engine.fingerprint,
                                            parts.voice, self.conditioning, parts.clones,
                                            background=background, reader=reader)
                hits, rendered = hits + h, rendered + r
            log.info("prompts ready: %d cached, %d rendered in %.1f s", hits, rendered,
                     self.clock.now() - t0)
        return Version(number, plan, contexts)

    async def prepare_speech(self, plan: LinePlan) -> None:
        """Start the recogniser's workers if this plan is the first with a speech gather, and
        compile its grammars. A recogniser that cannot start leaves speech gathers on keys
        (logged; each turn falls back and says so): it never stops a version from serving."""
        pool = self.recognizer
        if pool is None:
            return
        grammars = [(path, name, grammar) for path, script in plan.scripts().items()
                    for name in script.speech_gathers()
                    if (grammar := script.speech_grammar(name)) is not None]
        bots = [name for script in plan.scripts().values() for name in script.bot_nodes()]
        if not grammars and not bots:
            return
        t0 = self.clock.now()
        try:
            await pool.start()  # at once when running
            for _, _, grammar in grammars:
                await pool.prepare(grammar)
        except GatewayError as exc:
            log.error("speech recognition is unavailable (%s): speech gathers take keys only",
                      exc)
            return
        log.info("speech recogniser ready: %s, %d worker(s), %d grammar(s) (%.1f s)", pool.name,
                 pool.workers, len(grammars), self.clock.now() - t0)

    def _prepare(self, plan: LinePlan) -> dict[Path, _Parts]:
        """Voices, clones and sounds of each script (file reads: off the event loop)."""
        return {
            path: _Parts(
                resolve_voice(script, self.voices_dir),
                resolve_clones(script, self.voices_dir),
                {name: load_sound(path.parent / name) for name in script_sounds(script)},
            )
            for path, script in plan.scripts().items()
        }


class _Parts(NamedTuple):
    """What a script needs from disk besides itself."""

    voice: ResolvedVoice
    clones: dict[str, ResolvedVoice]
    sounds: dict[str, np.ndarray]


class Switchboard:
    """Routes each call to its line's script, in the version installed when it starts."""

    def __init__(self, version: Version, metrics: Metrics | None = None) -> None:
        self._version = version
        self._metrics = metrics
        #: Calls running per version number (an old version is dropped with its last call).
        self.active: dict[int, int] = {}
        if metrics is not None:
            metrics.script_version.set(version.number)

    @property
    def version(self) -> Version:
        """What new calls run."""
        return self._version

    def install(self, version: Version) -> None:
        """New calls run ``version`` from now on; calls in progress keep theirs."""
        self._version = version
        if self._metrics is not None:
            self._metrics.script_version.set(version.number)

    def route(self, dialled: str) -> Route:
        return self._version.plan.route(dialled)

    def for_call(self, call: Call) -> Dialog:
        version = self._version
        plan = version.plan
        route = plan.route(call.parameters.get("called", ""))
        call.line = route.label
        if not route.matched and not plan.single:
            log.warning("call %s: %s is on no line of %s; the default line %r answers",
                        call.call_id, repr(route.dialled) if route.dialled else "no number",
                        plan.source, route.line.name)
        else:
            log.info("call %s: line %r (dialled %s), version %d", call.call_id,
                     route.line.name, route.dialled or "nothing", version.number)
        context = version.contexts[route.line.name]

        async def run(call: Call) -> None:
            self.active[version.number] = self.active.get(version.number, 0) + 1
            try:
                await IvrRunner(call, context, dict(call.parameters)).run()
            finally:
                left = self.active[version.number] - 1
                if left:
                    self.active[version.number] = left
                else:
                    del self.active[version.number]

        return run


class Reloader:
    """Builds and installs the next version when the files change, or when asked (SIGHUP).

    ``load`` reads the lines (or the one script) afresh, filling the dict it is given with the
    files it read and their stamps, also when it fails: those are watched for the next edit.
    """

    def __init__(
        self,
        *,
        load: Callable[[dict[Path, FileStamp]], LinePlan],
        builder: VersionBuilder,
        switchboard: Switchboard,
        clock: Clock,
        interval_s: float,
        metrics: Metrics | None = None,
    ) -> None:
        self._load = load
        self._builder = builder
        self._switchboard = switchboard
        self._clock = clock
        self._interval_s = interval_s
        self._metrics = metrics
        #: The files of the installed version, or of the last attempt, as they were read.
        self._watch: dict[Path, FileStamp] = dict(switchboard.version.plan.stamps)
        self._pending: dict[Path, FileStamp] | None = None
        self._wake = asyncio.Event()
        self._requests: list[str] = []
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._progress = asyncio.Condition()
        #: Looks at the files finished, and reload attempts finished (installed or refused).
        self.checks = 0
        self.attempts = 0
        #: The reasons of the latest attempts and whether each installed a version.
        self.history: deque[tuple[str, bool]] = deque(maxlen=100)

    async def wait(self, *, attempts: int = 0, checks: int = 0) -> None:
        """Return once ``attempts`` reloads and ``checks`` looks at the files have finished
        (counted from the start): what tests, and whoever asked for a reload, wait on."""
        async with self._progress:
            await self._progress.wait_for(
                lambda: self.attempts >= attempts and self.checks >= checks)

    async def _advanced(self, *, attempt: bool) -> None:
        async with self._progress:
            if attempt:
                self.attempts += 1
            else:
                self.checks += 1
            self._progress.notify_all()

    def request(self, reason: str = "SIGHUP") -> None:
        """Reload now, whatever the files' stamps say. Safe from a signal handler or another
        thread; before :meth:`run` has started it is remembered for then."""
        self._requests.append(reason)
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake.set)

    async def run(self) -> None:
        """Watch until cancelled: every ``interval_s`` (0: only on :meth:`request`)."""
        self._loop = asyncio.get_running_loop()
        if self._requests:
            self._wake.set()
        while True:
            try:
                await self._clock.wait_for(self._wake.wait(), self._interval_s or None)
            except TimeoutError:
                pass
            if self._wake.is_set():
                self._wake.clear()
                reasons, self._requests = self._requests, []
                if reasons:
                    self._pending = None
                    await self.reload(" and ".join(dict.fromkeys(reasons)))
                    continue
            await self._check()

    async def _check(self) -> None:
        try:
            await self._look()
        finally:
            await self._advanced(attempt=False)

    async def _look(self) -> None:
        now = await asyncio.to_thread(lambda: {path: stamp(path) for path in self._watch})
        if now == self._watch:
            self._pending = None
            return
        if now != self._pending:
            # Changed since the last look: maybe still being written. Read it once it holds
            # still for a whole interval.
            self._pending = now
            return
        self._pending = None
        changed = sorted(str(path) for path in now if now[path] != self._watch[path])
        await self.reload(f"changed on disk: {', '.join(changed)}")

    async def reload(self, reason: str) -> bool:
        """Load, validate and prepare the next version and install it; False when refused
        (the installed version keeps serving)."""
        async with self._lock:
            installed = self._switchboard.version
            number = installed.number + 1
            stamps: dict[Path, FileStamp] = {}
            log.info("reloading %s (%s)", installed.plan.source, reason)
            t0 = self._clock.now()
            ok = False
            try:
                plan = await asyncio.to_thread(self._load, stamps)
                version = await self._builder.build(plan, number, background=True)
            except ScriptError as exc:
                for d in exc.diagnostics:
                    log.error("%s:%d:%d: error: %s", d.file, d.line, d.column, d.message)
                log.error("reload refused: %d error(s); version %d keeps serving",
                          len(exc.diagnostics), installed.number)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not isinstance(exc, GatewayError):
                    log.exception("reload failed")
                log.error("reload refused: %s; version %d keeps serving", exc, installed.number)
            else:
                self._switchboard.install(version)
                ok = True
                earlier = sum(n for v, n in self._switchboard.active.items() if v < number)
                log.info("reloaded %s in %.1f s: version %d takes new calls; %d call(s) in "
                         "progress finish on the version they started with", plan.describe(),
                         self._clock.now() - t0, number, earlier)
            finally:
                # Watch what this attempt read: a refused edit is not retried until the files
                # change again (or a SIGHUP asks).
                self._watch = stamps or self._watch
                if self._metrics is not None:
                    (self._metrics.script_reloads if ok
                     else self._metrics.script_reload_errors).inc()
                self.history.append((reason, ok))
                await self._advanced(attempt=True)
            return ok
