"""DTMF keys as in-band tones: the dual-frequency audio a keypad makes (ITU-T Q.23).

Where a transport has no way to send keys out of band (a Twilio Media Stream carries audio,
marks and ``clear`` only), keys can still reach the far end as audio: each key is two sine
tones, one from the low group (697-941 Hz) and one from the high group (1209-1633 Hz), which
G.711 carries well and DTMF receivers on the far side (an IVR, a voicemail system) detect.
Timing follows Q.24's limits with margin: 100 ms of tone, 100 ms of silence; ``w`` is half a
second's pause, as in Twilio's ``sendDigits``. Each tone sits at -12 dBFS (the pair at -6
dBFS peak): loud enough to detect after a lossy path, short of clipping.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from gateway.audio.g711 import float_to_int16

__all__ = ["KEYS", "dtmf_tones"]

#: Key -> (low group Hz, high group Hz), ITU-T Q.23 table 1.
KEYS: dict[str, tuple[int, int]] = {
    "1": (697, 1209), "2": (697, 1336), "3": (697, 1477), "A": (697, 1633),
    "4": (770, 1209), "5": (770, 1336), "6": (770, 1477), "B": (770, 1633),
    "7": (852, 1209), "8": (852, 1336), "9": (852, 1477), "C": (852, 1633),
    "*": (941, 1209), "0": (941, 1336), "#": (941, 1477), "D": (941, 1633),
}
_AMPLITUDE = 10 ** (-12 / 20)


def dtmf_tones(digits: str, *, rate: int = 8000, tone_ms: int = 100, gap_ms: int = 100,
               pause_ms: int = 500) -> npt.NDArray[np.int16]:
    """``digits`` (keys, and ``w`` for a pause) as int16 PCM at ``rate``."""
    tone_n, gap_n = rate * tone_ms // 1000, rate * gap_ms // 1000
    t = np.arange(tone_n) / rate
    # 5 ms raised-cosine edges: a hard-keyed tone splatters energy over the speech band.
    edge = min(tone_n // 2, rate // 200)
    window = np.ones(tone_n)
    ramp = 0.5 - 0.5 * np.cos(np.pi * np.arange(edge) / edge)
    window[:edge], window[tone_n - edge:] = ramp, ramp[::-1]
    parts: list[npt.NDArray[np.float64]] = []
    for digit in digits:
        if digit == "w":
            parts.append(np.zeros(rate * pause_ms // 1000))
            continue
        if digit not in KEYS:
            raise ValueError(f"{digit!r} is not a DTMF key (0-9, *, #, A-D; w pauses)")
        low, high = KEYS[digit]
        tone = _AMPLITUDE * (np.sin(2 * np.pi * low * t) + np.sin(2 * np.pi * high * t))
        parts.append(tone * window)
        parts.append(np.zeros(gap_n))
    audio = np.concatenate(parts) if parts else np.zeros(0)
    return float_to_int16(audio.astype(np.float32))
