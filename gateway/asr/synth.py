"""Synthetic caller speech for tests, the ASR benchmark and the load simulator.

Real callers cannot be recorded here, so test speech comes from two offline synthesisers with
different voices and prosody: ``flite`` (CMU Flite; voices ``kal``, ``awb``, ``rms``, ``slt``)
and ``espeak-ng`` (formant synthesis; language voices such as ``en-us`` and ``en-gb-scotland``
with ``+f3``-style variants). Both are Debian packages (.ci/run installs them).

Everything that reaches a recogniser goes through the phone line the gateway really sees:
resampled to 8 kHz, levelled, optionally mixed with line noise (white noise plus mains hum, from
a seeded generator, so every run hears the same noise), then G.711 mu-law encoded and decoded with
:mod:`gateway.audio.g711`. :func:`phone_line` returns the mu-law bytes a call would receive.

:class:`LineEffects` are what a real line and a real speaker add beyond that (tempo and pitch
shifts, a handset's band-pass, a room's reverberation), applied with ``sox`` before the line;
:func:`random_effects` draws a seeded chain of them. :func:`noise_only` is a turn with no
speech in it (hiss, hum, a burst of crackle, breathing-like noise) for measuring what a
recogniser invents on noise.
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
    "NOISES",
    "RATE",
    "LineEffects",
    "SynthVoice",
    "SynthesisError",
    "apply_effects",
    "line_noise",
    "noise_only",
    "phone_line",
    "random_effects",
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


@dataclass(frozen=True)
class LineEffects:
    """What a speaker and their line add to clean speech (applied by :func:`apply_effects`)."""

    #: Speaking rate (sox ``tempo``: 1.1 is 10 % faster, pitch unchanged).
    tempo: float = 1.0
    #: Pitch shift in cents (sox ``pitch``; 100 cents = a semitone), duration unchanged.
    pitch_cents: int = 0
    #: A handset's pass band in Hz (sox ``sinc``), e.g. (300, 3400); None: the full 0-4 kHz.
    band: tuple[int, int] | None = None
    #: Reverberance 0-100 (sox ``reverb``, a small room's wet/dry mix); 0: none.
    reverb: int = 0
    #: Line noise this far under the speech (dB); None: a clean line.
    snr_db: float | None = None

    @property
    def label(self) -> str:
        """Short description for error listings, e.g. ``tempo 1.1, pitch -200, reverb 40``."""
        parts = []
        if self.tempo != 1.0:
            parts.append(f"tempo {self.tempo:.2f}")
        if self.pitch_cents:
            parts.append(f"pitch {self.pitch_cents:+d}")
        if self.band is not None:
            parts.append(f"band {self.band[0]}-{self.band[1]}")
        if self.reverb:
            parts.append(f"reverb {self.reverb}")
        if self.snr_db is not None:
            parts.append(f"{self.snr_db:.0f} dB noise")
        return ", ".join(parts) or "none"

    def sox_chain(self) -> list[str]:
        """The sox effects (voice, then room); the handset's band is :func:`apply_effects`'s
        (sox's ``pitch`` resamples internally, and its ``sinc`` then refuses 3.4 kHz)."""
        chain: list[str] = []
        if self.tempo != 1.0:
            chain += ["tempo", "-s", f"{self.tempo:.3f}"]
        if self.pitch_cents:
            chain += ["pitch", str(self.pitch_cents)]
        if self.reverb:
            # reverberance, HF damping, room scale: a small room, not a hall.
            chain += ["reverb", str(self.reverb), "50", "30"]
        return chain


def random_effects(seed: int) -> LineEffects:
    """A seeded chain: tempo 0.85-1.15, pitch +-300 cents, a 300-3400 Hz band half the time,
    reverb a third of the time, 15-20 dB line noise half the time."""
    rng = np.random.default_rng([seed, 0xEFFEC7])
    return LineEffects(
        tempo=round(float(rng.uniform(0.85, 1.15)), 2),
        pitch_cents=int(rng.integers(-300, 301)),
        band=(300, 3400) if rng.random() < 0.5 else None,
        reverb=int(rng.integers(20, 61)) if rng.random() < 1 / 3 else 0,
        snr_db=round(float(rng.uniform(15.0, 20.0)), 1) if rng.random() < 0.5 else None,
    )


def apply_effects(speech: Audio, effects: LineEffects) -> Audio:
    """``speech`` (8 kHz float) through ``effects``' sox chain (noise is :func:`phone_line`'s)."""
    chain = effects.sox_chain()
    out = speech
    if chain:
        fmt = ["-t", "raw", "-r", str(RATE), "-e", "floating-point", "-b", "32", "-c", "1"]
        try:
            raw = subprocess.run([_executable("sox"), *fmt, "-", *fmt, "-", *chain],
                                 input=speech.astype(np.float32).tobytes(), capture_output=True,
                                 check=True, timeout=60).stdout
        except subprocess.CalledProcessError as exc:
            raise SynthesisError(f"sox failed on {effects.label}: "
                                 f"{exc.stderr.decode(errors='replace').strip()}") from exc
        out = np.frombuffer(raw, dtype=np.float32).astype(np.float64)
    if effects.band is not None:
        sos = signal.butter(4, effects.band, btype="bandpass", fs=RATE, output="sos")
        out = signal.sosfilt(sos, out)
    return np.asarray(out, dtype=np.float64)


NOISES: Final[tuple[str, ...]] = ("hiss", "hum", "crackle", "breath")
"""The kinds of :func:`noise_only` turns."""


def noise_only(kind: str, seconds: float, seed: int) -> Audio:
    """A turn of ``kind`` noise with no speech in it, at a speech-like level (-20 dBFS RMS in
    its loud part), to pass through :func:`phone_line` as a caller's audio would.

    ``hiss``: white noise; ``hum``: mains hum with its odd harmonics; ``crackle``: sparse
    clicks and pops, as a bad connection makes; ``breath``: band-limited noise swelling and
    fading twice a second, as breathing into the handset sounds."""
    rng = np.random.default_rng([seed, 0x401CE])
    n = round(seconds * RATE)
    t = np.arange(n) / RATE
    if kind == "hiss":
        x = rng.standard_normal(n)
    elif kind == "hum":
        x = np.zeros(n)
        for k, a in ((1, 1.0), (3, 0.6), (5, 0.4), (7, 0.2)):
            x += a * np.sin(2 * np.pi * k * 50.0 * t + rng.uniform(0, 2 * np.pi))
    elif kind == "crackle":
        x = np.zeros(n)
        clicks = rng.integers(0, n, size=max(1, round(seconds * 25)))
        x[clicks] = rng.choice([-1.0, 1.0], size=clicks.size) * rng.uniform(0.3, 1.0, clicks.size)
        x = signal.lfilter([1.0], [1.0, -0.9], x) + 0.05 * rng.standard_normal(n)
    elif kind == "breath":
        b, a = signal.butter(2, [400 / (RATE / 2), 2000 / (RATE / 2)], btype="band")
        envelope = np.clip(np.sin(2 * np.pi * 2.0 * t + rng.uniform(0, 2 * np.pi)), 0, None) ** 2
        x = signal.lfilter(b, a, rng.standard_normal(n)) * envelope
    else:
        raise ValueError(f"unknown noise {kind!r}; one of {', '.join(NOISES)}")
    return _level(np.asarray(x, dtype=np.float64), -20.0)
