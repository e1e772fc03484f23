"""Rendering prompts into the cache: at server start, from the CLI, or lazily per call."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.audio.condition import Conditioning
from gateway.audio.g711 import float_to_int16
from gateway.audio.resample import Decimator24kTo8k
from gateway.ivr.cache import PromptCache, PromptKey
from gateway.ivr.script import Script
from gateway.ivr.script import Voice as ScriptVoice
from gateway.text import Reader
from gateway.tts.engine import Engine, SpeechRequest, VoicePrompt
from gateway.tts.service import SpeechService

log = logging.getLogger(__name__)

#: How far behind callers' turns a background render queues (see :func:`render_missing`).
BACKGROUND_DEFER_S = 5.0


@dataclass(frozen=True)
class ResolvedVoice:
    """A script's voice made concrete: its cache identity and, for a clone, its prompt."""

    identity: str
    prompt: VoicePrompt | None = None


def resolve_voice(script: Script, voices_dir: Path | None = None) -> ResolvedVoice:
    """The voice part of prompt keys: a speaker name, or a cloned voice's name and the hash of
    its stored prompt (re-registering the voice changes it, which invalidates its prompts)."""
    voice = script.voice
    if voice.speaker is not None:
        return ResolvedVoice(speaker_identity(voice))
    assert voice.clone is not None
    from gateway.ivr.voices import VoiceRegistry, default_voices_dir

    registry = VoiceRegistry(voices_dir if voices_dir is not None else default_voices_dir())
    record, prompt = registry.load(voice.clone)
    return ResolvedVoice(
        f"clone:{voice.clone}:{record.identity}",
        VoicePrompt(name=voice.clone, identity=record.identity, prompt=prompt,
                    ref_text=record.ref_text),
    )


def audio_identity(engine: Engine, conditioning: Conditioning | None) -> str:
    """The render settings of a prompt's audio: the engine's (dtype, codec decoding) and the
    phone path's conditioning (``raw`` when none is applied)."""
    phone = conditioning.identity if conditioning is not None else "raw"
    return f"{engine.render_settings};{phone}"


def resolve_clones(script: Script, voices_dir: Path | None = None) -> dict[str, ResolvedVoice]:
    """Every cloned voice a node's ``voice:`` switches to (the script's own is resolved by
    :func:`resolve_voice`)."""
    names = {change.clone for node in script.nodes.values()
             if (change := node.voice) is not None and change.clone is not None}
    names.discard(script.voice.clone)
    if not names:
        return {}
    from gateway.ivr.voices import VoiceRegistry, default_voices_dir

    registry = VoiceRegistry(voices_dir if voices_dir is not None else default_voices_dir())
    resolved = {}
    for name in sorted(names):
        record, prompt = registry.load(name)
        resolved[name] = ResolvedVoice(
            f"clone:{name}:{record.identity}",
            VoicePrompt(name=name, identity=record.identity, prompt=prompt,
                        ref_text=record.ref_text),
        )
    return resolved


def speaker_identity(voice: ScriptVoice) -> str:
    """The voice part of a built-in speaker's cache keys."""
    return f"speaker:{(voice.speaker or '').lower()}"


def prompt_key_for(voice: ScriptVoice, fingerprint: str, identity: str, text: str,
                   audio: str) -> PromptKey:
    """The cache key of ``text`` spoken with ``voice`` (language, style and seed included) and
    rendered with the settings ``audio`` names (:func:`audio_identity`)."""
    return PromptKey(model=fingerprint, voice=identity, language=voice.language,
                     style=voice.style, text=text, seed=voice.seed, audio=audio)


def prompt_key(script: Script, fingerprint: str, identity: str, text: str,
               audio: str) -> PromptKey:
    """The cache key of ``text`` in the script's own voice (its seed is the script's)."""
    return prompt_key_for(script.voice, fingerprint, identity, text, audio)


def request_for(spec: Script | ScriptVoice, text: str,
                voice: ResolvedVoice | None = None) -> SpeechRequest:
    """The request rendering ``text`` for the cache in a script's voice (or another)."""
    if isinstance(spec, Script):
        spec = spec.voice
    return SpeechRequest(text=text, speaker=(spec.speaker or "ryan").lower(),
                         language=spec.language, instruct=spec.style, seed=spec.seed,
                         voice_prompt=voice.prompt if voice is not None else None)


def renders(script: Script, identity: ResolvedVoice,
            clones: dict[str, ResolvedVoice] | None = None, reader: Reader | None = None,
            ) -> list[tuple[str, ScriptVoice, ResolvedVoice]]:
    """Every static sentence, as the engine receives it (read by ``reader``, the line's;
    default the script's own), with the voice it is spoken in and that voice's identity."""
    reader = reader if reader is not None else script.reader()
    out: dict[tuple[str, ScriptVoice], ResolvedVoice] = {}
    for template, voice in script.static_renders():
        if voice.clone is None:
            resolved = ResolvedVoice(speaker_identity(voice))
        elif voice.clone == script.voice.clone:
            resolved = identity
        else:
            resolved = (clones or {})[voice.clone]
        # Two templates may read the same ("{'1':ordinal}" and "first"): one render.
        text = reader.sentence(template, {}, voice.language).spoken
        out.setdefault((text, voice), resolved)
    return [(text, voice, resolved) for (text, voice), resolved in out.items()]


def pcm_from_chunks(chunks: Iterable[np.ndarray],
                    conditioning: Conditioning | None = None) -> np.ndarray:
    """24 kHz float chunks -> the 8 kHz int16 the cache stores, through the call's own phone
    path (the same conditioning and decimator), so a cached prompt sounds like a live one."""
    conditioner = conditioning.new() if conditioning is not None else None
    decimator = Decimator24kTo8k()
    parts = []
    for chunk in chunks:
        parts.append(decimator.push(conditioner.push(chunk) if conditioner else chunk))
    if conditioner is not None:
        parts.append(decimator.push(conditioner.flush()))
    parts.append(decimator.flush())
    return float_to_int16(np.concatenate(parts) if parts else np.zeros(0, np.float32))


async def render_missing(
    script: Script,
    cache: PromptCache,
    speech: SpeechService,
    fingerprint: str,
    voice: ResolvedVoice,
    conditioning: Conditioning | None = None,
    clones: dict[str, ResolvedVoice] | None = None,
    *,
    background: bool = False,
    reader: Reader | None = None,
) -> tuple[int, int]:
    """Load every static prompt into memory (in every voice and language the script speaks
    it in), rendering the missing ones through the scheduler.

    Returns ``(hits, rendered)``. Renders run concurrently, one per free slot; ``background``
    (a script reloaded while calls are up): on a quarter of the slots, queued behind every
    caller's turn of the next few seconds, so callers keep their first-audio budget.
    ``reader``: how the line reads its sentences (default: the script's own); the cache keys
    on the words the engine receives.

    Whatever touches the disk or costs milliseconds runs in a worker thread, never on the event
    loop: it runs while the gateway already answers (a SIP endpoint is up before the engine
    loads, and /healthz), and reading, hashing and decoding every cached prompt, or an fsynced
    write per render, would stall all of it for as long.
    """
    rendered = 0
    audio = audio_identity(speech.engines[0], conditioning)
    wanted = [(prompt_key_for(spec, fingerprint, resolved.identity, text, audio),
               request_for(spec, text, resolved))
              for text, spec, resolved in renders(script, voice, clones, reader)]
    # Disk I/O off the event loop (a prompt not in memory is read and verified from its file):
    # a reload runs while calls are up, and their frames are paced on this loop.
    found = await asyncio.to_thread(lambda: [cache.get(key) is not None for key, _ in wanted])
    hits = sum(found)
    todo = [item for item, hit in zip(wanted, found, strict=True) if not hit]

    async def render_one(key: PromptKey, request: SpeechRequest) -> None:
        nonlocal rendered
        t0 = time.monotonic()
        # The scheduler serves the earliest deadline first: a background render's deadline
        # is BACKGROUND_DEFER_S later than that of a caller's turn submitted at the same time.
        stream = (speech.stream(request, turn_started_at=speech.clock.now() + BACKGROUND_DEFER_S)
                  if background else speech.stream(request))
        chunks = [chunk async for chunk in stream]
        render_s = time.monotonic() - t0

        def store() -> None:
            # The phone path over the whole prompt, then the atomic, fsynced write.
            cache.put(key, pcm_from_chunks(chunks, conditioning), render_s=render_s)

        await asyncio.to_thread(store)
        rendered += 1

    # Deadline order in the scheduler is submission order here; bound the burst by what the
    # device generates at once (every batch row, or every slot), so a batched engine renders
    # the whole script in a few batched passes instead of one prompt at a time.
    limit = asyncio.Semaphore(max(1, speech.capacity // 4 if background else speech.capacity))

    async def bounded(key: PromptKey, request: SpeechRequest) -> None:
        async with limit:
            await render_one(key, request)

    await asyncio.gather(*(bounded(key, request) for key, request in todo))
    log.info("prompt cache for %r: %d hit(s), %d rendered", script.name, hits, rendered)
    return hits, rendered
