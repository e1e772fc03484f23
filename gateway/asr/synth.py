"""Synthetic caller speech for tests, the ASR benchmark and the load simulator.

Real callers cannot be recorded here, so test speech comes from two offline synthesisers with
different voices and prosody: ``flite`` (CMU Flite; voices ``kal``, ``awb``, ``rms``, ``slt``)
and ``espeak-ng`` (formant synthesis; language voices such as ``en-us`` and ``en-gb-scotland``
with ``+f3``-style variants). Both are Debian packages (.ci/run installs them).

Everything that reaches a recogniser goes through the phone line the gateway really sees:
resampled to 8 kHz, levelled, optionally mixed with line noise (white noise plus mains hum, from
a seeded generator, so every run hears the same noise), then G.711 mu-law encoded and decoded with
:mod:`gateway.audio.g711`. :func:`phone_line` returns the mu-law bytes a call would receive.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import numpy as np
import numpy.typing as npt
from scipy import signal

from gateway.audio.g711 import float_to_int16, ulaw_encode

__all__ = [
    "RATE",
    "SynthVoice",
    "SynthesisError",
    "line_noise",
    "phone_line",
    "synthesize",
]

RATE: Final[int] = 8000
"""Telephone sample rate (G.711)."""

Audio = npt.NDArray[np.float64]


class SynthesisError(RuntimeError):
    """A synthesiser is missing or failed; the message says how to install it."""


@dataclass(frozen=True)
class SynthVoice:
    """One synthetic speaker: which engine, which voice, how fast (1.0 = the engine's default)."""

    engine: Literal["flite", "espeak-ng"]
    voice: str
    speed: float = 1.0
    pitch: int | None = None  # espeak-ng only: 0-99, default 50

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``flite/slt`` or ``espeak-ng/en-gb+f3@1.2``."""
        speed = "" if self.speed == 1.0 else f"@{self.speed:g}"
        return f"{self.engine}/{self.voice}{speed}"


def _executable(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise SynthesisError(f"{name} is not installed; apt-get install -y {name} (.ci/run does)")
    return exe


def _command(text: str, voice: SynthVoice, path: Path) -> list[str]:
    if voice.engine == "flite":
        # duration_stretch > 1 is slower speech (flite's own knob, see flite's README).
        return [_executable("flite"), "-voice", voice.voice,
                "--setf", f"duration_stretch={1.0 / voice.speed:.3f}",
                "-t", text, "-o", str(path)]
    cmd = [_executable("espeak-ng"), "-v", voice.voice, "-s", str(round(165 * voice.speed)),
           "-w", str(path)]
    if voice.pitch is not None:
        cmd += ["-p", str(voice.pitch)]
    return [*cmd, text]


@functools.lru_cache(maxsize=1024)
def _synthesize_cached(text: str, voice: SynthVoice) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "say.wav"
        try:
            subprocess.run(_command(text, voice, path), check=True, capture_output=True,
                           timeout=60)
        except subprocess.CalledProcessError as exc:
            raise SynthesisError(f"{voice.label} failed on {text!r}: "
                                 f"{exc.stderr.decode(errors='replace').strip()}") from exc
        with wave.open(str(path)) as w:
            native = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    g = int(np.gcd(RATE, native))
    x = signal.resample_poly(pcm / 32768.0, RATE // g, native // g)
    return np.asarray(x, dtype=np.float64).tobytes()


def synthesize(text: str, voice: SynthVoice) -> Audio:
    """``text`` spoken by ``voice`` at 8 kHz, float64 in [-1, 1], trimmed to its audible part.

    Cached per (text, voice): the benchmark hears each sentence in several line conditions.
    """
    x = np.frombuffer(_synthesize_cached(text, voice), dtype=np.float64)
    loud = np.flatnonzero(np.abs(x) > 10 ** (-40 / 20))
    if loud.size == 0:
        raise SynthesisError(f"{voice.label} produced silence for {text!r}")
    return x[loud[0] : loud[-1] + 1].copy()


def _level(x: Audio, dbfs: float) -> Audio:
    rms = float(np.sqrt(np.mean(x**2)))
    return x * (10 ** (dbfs / 20) / rms) if rms > 0 else x


def line_noise(samples: int, dbfs: float, seed: int, mains_hz: float = 60.0) -> Audio:
    """White noise plus mains hum (odd harmonics, as a ground loop adds), ``dbfs`` RMS in all."""
    rng = np.random.default_rng(seed)
    white = _level(rng.standard_normal(samples), 0.0)
    t = np.arange(samples) / RATE
    hum = sum(a * np.sin(2 * np.pi * k * mains_hz * t + rng.uniform(0, 2 * np.pi))
              for k, a in ((1, 1.0), (3, 0.5), (5, 0.3)))
    # Hum 6 dB under the hiss, as in tests/test_audio_vad.py's line noise.
    return _level(white + _level(np.asarray(hum), -6.0), dbfs)


def phone_line(
    speech: Audio,
    *,
    level_dbfs: float = -20.0,
    snr_db: float | None = None,
    seed: int = 0,
    lead_s: float = 0.3,
    tail_s: float = 0.5,
) -> bytes:
    """``speech`` as a caller's mu-law audio: levelled, padded, optionally noisy, G.711-coded.

    ``lead_s``/``tail_s`` of line silence (or noise) surround the speech, as a VAD-bounded
    utterance would. ``snr_db`` None means a clean line (G.711 quantisation only).
    """
    x = np.concatenate([np.zeros(round(lead_s * RATE)), _level(speech, level_dbfs),
                        np.zeros(round(tail_s * RATE))])
    if snr_db is not None:
        x = x + line_noise(x.shape[0], level_dbfs - snr_db, seed)
    return ulaw_encode(float_to_int16(x.astype(np.float32)))
