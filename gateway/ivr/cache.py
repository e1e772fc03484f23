"""The prompt cache: static sentences rendered once, played without touching the GPU.

Key: a SHA-256 over everything that changes the audio (model id and revision, voice identity,
language, style, normalised text, the seed the render used (``None``: none, never claimed as 0),
the engine's render settings (dtype, codec decoding) and the phone path's conditioning (leading-
silence trim, level normalisation), sampling settings, audio-pipeline version). Value: 8 kHz
16-bit PCM, so mu-law and A-law frames are both exact encodes of it, stored as a standard WAV an
author can play, plus a JSON record (text, duration, created, checksum).

On disk, per key ``<dir>/<k[:2]>/<k>.json`` names the WAV ``<k>.<sha12>.wav`` it commits to. A
WAV is written under a temporary name and renamed into place before the JSON that references it,
and the JSON is renamed into place last: a reader sees the old entry, or the new one, never half
of one. Concurrent renders of one key each write their own content-addressed WAV, and whichever
JSON lands last wins, consistently. The checksum is verified on every load from disk; a corrupt
or truncated entry is deleted, counted, and re-rendered, never played.

If the directory becomes read-only or full, calls carry on from memory (and live rendering) and
the ``gateway_prompt_cache_write_errors_total`` alarm rises.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import soundfile as sf

log = logging.getLogger(__name__)

#: Bump when anything between the model and the 8 kHz PCM changes (decimator, trim, decode):
#: every cached prompt is then re-rendered.
PIPELINE_VERSION = "1"
SAMPLE_RATE = 8000
#: Sampling settings of the engine (faster-qwen3-tts defaults); part of the key.
SAMPLING = "t0.9-k50-p1.0-rp1.05"


def normalise_text(text: str) -> str:
    """Whitespace-insensitive form of a sentence (YAML folding must not re-render prompts)."""
    return re.sub(r"\s+", " ", text).strip()


@dataclass(frozen=True)
class PromptKey:
    """Everything that changes a prompt's audio."""

    model: str
    voice: str
    language: str
    style: str | None
    text: str
    #: The seed of the request that renders (rendered) the audio; None: unseeded.
    seed: int | None
    #: Engine render settings and phone-path conditioning (:func:`gateway.ivr.prompts.
    #: audio_identity`): a prompt rendered in bfloat16, or without the trim, is other audio.
    audio: str
    sampling: str = SAMPLING
    pipeline: str = PIPELINE_VERSION

    def digest(self) -> str:
        """Stable name of the prompt on disk and in memory (SHA-256 of the canonical key)."""
        return _digest(self)


# Memoised: a cache hit is on the caller's critical path, and hashing is the slowest step of it
# (a fresh SHA-256 costs 3 ms the first times a thread asks OpenSSL for one, measured in the
# 220-turn cache test). Keys are small; start-up computes every static prompt's digest, so
# callers' turns find them here.
@functools.lru_cache(maxsize=65536)
def _digest(key: PromptKey) -> str:
    record = asdict(key) | {"text": normalise_text(key.text)}
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    write_errors: int = 0
    renders: int = 0
    render_s: float = 0.0


class PromptCache:
    """Disk-backed, memory-fronted store of rendered prompts (thread-safe)."""

    def __init__(
        self,
        directory: str | Path | None,
        *,
        max_memory_bytes: int = 256 * 1024 * 1024,
        metrics: Any = None,
    ) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.max_memory_bytes = max_memory_bytes
        self.metrics = metrics
        self.stats = CacheStats()
        self._memory: OrderedDict[str, npt.NDArray[np.int16]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.error("prompt cache directory %s unusable (%s): memory only", directory, exc)
                self._write_failed()

    # --- lookups ------------------------------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        return self._bytes

    def get(self, key: PromptKey) -> npt.NDArray[np.int16] | None:
        """The prompt's PCM, from memory or verified from disk; ``None`` on a miss."""
        digest = key.digest()
        with self._lock:
            pcm = self._memory.get(digest)
            if pcm is not None:
                self._memory.move_to_end(digest)
        if pcm is None:
            pcm = self._load(digest)
            if pcm is not None:
                self._remember(digest, pcm)
        if pcm is None:
            self.stats.misses += 1
            if self.metrics is not None:
                self.metrics.prompt_cache_misses.inc()
        else:
            self.stats.hits += 1
            if self.metrics is not None:
                self.metrics.prompt_cache_hits.inc()
        return pcm

    def peek(self, key: PromptKey) -> npt.NDArray[np.int16] | None:
        """Memory-only lookup that does not count as a hit or miss (the per-turn fast path)."""
        digest = key.digest()
        with self._lock:
            pcm = self._memory.get(digest)
            if pcm is not None:
                self._memory.move_to_end(digest)
                self.stats.hits += 1
        if pcm is not None and self.metrics is not None:
            self.metrics.prompt_cache_hits.inc()
        return pcm

    def on_disk(self, key: PromptKey) -> bool:
        """True if a verified entry for ``key`` is on disk (loads and checks it)."""
        return self._load(key.digest()) is not None

    # --- stores -------------------------------------------------------------------------------

    def put(self, key: PromptKey, pcm: npt.NDArray[np.int16], *, render_s: float = 0.0,
            to_disk: bool = True) -> None:
        """Remember ``pcm`` for ``key`` in memory and, unless ``to_disk`` is False (the caller
        then runs :meth:`write` itself, off the event loop), atomically on disk."""
        pcm = np.ascontiguousarray(pcm, dtype=np.int16)
        self._remember(key.digest(), pcm)
        self.stats.renders += 1
        self.stats.render_s += render_s
        if self.metrics is not None and render_s:
            self.metrics.prompt_render_seconds.observe(render_s)
        if to_disk:
            self.write(key, pcm)

    def write(self, key: PromptKey, pcm: npt.NDArray[np.int16]) -> None:
        """Store ``pcm`` for ``key`` on disk only (blocking: a write and an fsync). A failure
        raises the write-error alarm; memory keeps serving the prompt."""
        if self.directory is None:
            return
        digest = key.digest()
        try:
            self._write(digest, key, np.ascontiguousarray(pcm, dtype=np.int16))
        except OSError as exc:
            log.error("prompt cache write failed for %s (%s); serving from memory", digest[:12],
                      exc)
            self._write_failed()

    def _remember(self, digest: str, pcm: npt.NDArray[np.int16]) -> None:
        with self._lock:
            old = self._memory.pop(digest, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._memory[digest] = pcm
            self._bytes += pcm.nbytes
            # Bounded by bytes, least recently used first; a single prompt larger than the
            # bound is still served (and evicted by the next insert).
            while self._bytes > self.max_memory_bytes and len(self._memory) > 1:
                _, evicted = self._memory.popitem(last=False)
                self._bytes -= evicted.nbytes
        if self.metrics is not None:
            self.metrics.prompt_cache_bytes.set(self._bytes)

    def _write_failed(self) -> None:
        self.stats.write_errors += 1
        if self.metrics is not None:
            self.metrics.prompt_cache_write_errors.inc()

    # --- disk ---------------------------------------------------------------------------------

    def _paths(self, digest: str) -> tuple[Path, Path]:
        assert self.directory is not None
        folder = self.directory / digest[:2]
        return folder, folder / f"{digest}.json"

    def _write(self, digest: str, key: PromptKey, pcm: npt.NDArray[np.int16]) -> None:
        folder, record_path = self._paths(digest)
        folder.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        sf.write(buffer, pcm, SAMPLE_RATE, subtype="PCM_16", format="WAV")
        wav = buffer.getvalue()
        checksum = hashlib.sha256(wav).hexdigest()
        wav_path = folder / f"{digest}.{checksum[:12]}.wav"
        if not wav_path.exists():
            _atomic_write(wav_path, wav)
        record = {
            "key": asdict(key),
            "text": normalise_text(key.text),
            "wav": wav_path.name,
            "sha256": checksum,
            "samples": int(pcm.shape[0]),
            "duration_s": round(pcm.shape[0] / SAMPLE_RATE, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _atomic_write(record_path, json.dumps(record, indent=2).encode("utf-8"))
        # Older WAVs of this key are orphans now (give concurrent readers a minute).
        for stale in folder.glob(f"{digest}.*.wav"):
            if stale != wav_path and time.time() - stale.stat().st_mtime > 60:
                stale.unlink(missing_ok=True)

    def _load(self, digest: str) -> npt.NDArray[np.int16] | None:
        if self.directory is None:
            return None
        folder, record_path = self._paths(digest)
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._discard(digest, record_path, None, f"unreadable record ({exc})")
            return None
        wav_path = folder / str(record.get("wav", ""))
        try:
            wav = wav_path.read_bytes()
        except OSError as exc:
            self._discard(digest, record_path, None, f"missing audio ({exc.strerror})")
            return None
        if hashlib.sha256(wav).hexdigest() != record.get("sha256"):
            self._discard(digest, record_path, wav_path, "checksum mismatch")
            return None
        try:
            pcm, rate = sf.read(io.BytesIO(wav), dtype="int16")
        except (RuntimeError, sf.LibsndfileError) as exc:
            self._discard(digest, record_path, wav_path, f"bad WAV ({exc})")
            return None
        if rate != SAMPLE_RATE or pcm.ndim != 1 or pcm.shape[0] != record.get("samples"):
            self._discard(digest, record_path, wav_path, "wrong format or length")
            return None
        return np.ascontiguousarray(pcm)

    def _discard(self, digest: str, record: Path, wav: Path | None, why: str) -> None:
        log.warning("prompt cache entry %s is corrupt (%s): discarded, will re-render",
                    digest[:12], why)
        self.stats.corrupt += 1
        if self.metrics is not None:
            self.metrics.prompt_cache_corrupt.inc()
        for path in (record, wav):
            if path is not None:
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    pass


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see all of it or none of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
