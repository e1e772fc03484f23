"""Recorded caller speech for the load simulator: a turn that says something instead of keys.

A turn of ``--digits`` written ``say:PATH.wav`` plays that recording as the caller's audio (in
place of the silence a simulated caller otherwise sends) and measures the gateway's answer from
the end of the speech, as the gateway measures a spoken turn. Any WAV soundfile reads will do
(any rate, any channels): it is mixed to mono, resampled to 8 kHz, its silent head and tail
trimmed (40 dB under its peak: the turn ends where the speech does, not the file), and G.711
mu-law coded once per process, before a level's clock starts. Synthetic callers are fine::

    flite -voice slt -t "agent" -o agent.wav
    espeak-ng -v en-us -w balance.wav "check my balance"
    gateway loadsim http://127.0.0.1:8080 --digits say:agent.wav
"""

from __future__ import annotations

import functools
from math import gcd

import numpy as np

from gateway.errors import GatewayError

__all__ = ["SAY", "is_speech", "speech_frames"]

SAY = "say:"
"""The prefix of a turn that is recorded speech."""

_FRAME = 160  # 20 ms at 8 kHz, one byte per sample in G.711
_TRIM = 10 ** (-40 / 20)  # head and tail quieter than this, relative to the peak, are cut


def is_speech(turn: str) -> bool:
    """True for a ``say:PATH`` turn."""
    return turn.startswith(SAY)


@functools.cache
def speech_frames(turn: str) -> tuple[bytes, ...]:
    """The 20 ms mu-law frames of a ``say:PATH`` turn (the last one padded with silence).

    Raises :class:`GatewayError` naming the file when it cannot be read.
    """
    import soundfile as sf
    from scipy.signal import resample_poly

    from gateway.audio.g711 import ULAW_SILENCE, float_to_int16, ulaw_encode

    path = turn[len(SAY):]
    try:
        audio, rate = sf.read(path, dtype="float32", always_2d=True)
    except (OSError, RuntimeError, sf.LibsndfileError) as exc:
        raise GatewayError(f"cannot read the speech for turn {turn!r}: {exc}") from None
    mono = audio.mean(axis=1)
    if rate != 8000:
        g = gcd(int(rate), 8000)
        mono = resample_poly(mono, 8000 // g, int(rate) // g)
    peak = float(np.max(np.abs(mono))) if len(mono) else 0.0
    loud = np.flatnonzero(np.abs(mono) > peak * _TRIM) if peak > 0 else np.zeros(0, int)
    if not len(loud):
        raise GatewayError(f"the speech for turn {turn!r} is silent")
    mono = mono[loud[0]:loud[-1] + 1]
    coded = ulaw_encode(float_to_int16(np.asarray(mono, dtype=np.float32)))
    coded += bytes([ULAW_SILENCE]) * (-len(coded) % _FRAME)
    return tuple(coded[i:i + _FRAME] for i in range(0, len(coded), _FRAME))
