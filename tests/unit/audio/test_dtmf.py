"""In-band DTMF (gateway.audio.dtmf): each key's two Q.23 frequencies and no others, at the
timing a DTMF receiver accepts, through G.711 as a Twilio call carries it."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.audio.dtmf import KEYS, dtmf_tones
from gateway.audio.g711 import ulaw_decode, ulaw_encode

_LOW, _HIGH = (697, 770, 852, 941), (1209, 1336, 1477, 1633)


def _goertzel(x: np.ndarray, freq: float, rate: int = 8000) -> float:
    """Power of ``x`` at ``freq`` (the detector every DTMF receiver is built on)."""
    k = 2 * np.cos(2 * np.pi * freq / rate)
    s1 = s2 = 0.0
    for v in x:
        s1, s2 = v + k * s1 - s2, s1
    return float(s1 * s1 + s2 * s2 - k * s1 * s2)


def _key(tone: np.ndarray) -> str:
    low = max(_LOW, key=lambda f: _goertzel(tone, f))
    high = max(_HIGH, key=lambda f: _goertzel(tone, f))
    powers = sorted(_goertzel(tone, f) for f in _LOW + _HIGH)
    # The two tones stand far above the other six (a receiver's twist and purity checks).
    assert powers[-2] > 100 * powers[-3]
    return next(key for key, pair in KEYS.items() if pair == (low, high))


def test_each_key_is_its_two_frequencies_through_g711() -> None:
    pcm = ulaw_decode(ulaw_encode(dtmf_tones("159#*0D"))).astype(np.float64)
    keys = []
    for start in range(0, len(pcm), 1600):  # 100 ms tone + 100 ms gap per key
        tone, gap = pcm[start:start + 800], pcm[start + 800:start + 1600]
        keys.append(_key(tone[100:700]))
        assert np.abs(gap).max() == 0
    assert "".join(keys) == "159#*0D"
    assert np.abs(pcm).max() < 0.6 * 32768  # no clipping


def test_w_is_half_a_second_of_silence() -> None:
    assert len(dtmf_tones("w")) == 4000 and not dtmf_tones("w").any()
    assert len(dtmf_tones("1w2")) == 1600 + 4000 + 1600
    with pytest.raises(ValueError, match="'x' is not a DTMF key"):
        dtmf_tones("1x")
