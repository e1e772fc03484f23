"""Telephony audio: 24 kHz TTS float32 -> 8 kHz G.711 (PCMU/PCMA) 20 ms frames, paced.

Pure, synchronous, I/O-free building blocks with per-call state (STYLE.md rules 1 and 6):

* :mod:`gateway.audio.g711` - bit-exact vectorised mu-law / A-law and float -> int16;
* :mod:`gateway.audio.resample` - streaming, chunk-invariant 24 kHz -> 8 kHz decimator;
* :mod:`gateway.audio.framer` - 160-byte framing and the composed :class:`PhonePipeline`;
* :mod:`gateway.audio.pacer` - monotonic-deadline pacing of 20 ms frames.
"""

from gateway.audio.framer import FRAME_BYTES, Framer, PhonePipeline
from gateway.audio.g711 import (
    ALAW_SILENCE,
    ULAW_SILENCE,
    Codec,
    Encoder,
    alaw_decode,
    alaw_encode,
    alaw_encode_array,
    codec_silence,
    float_to_int16,
    ulaw_decode,
    ulaw_encode,
    ulaw_encode_array,
)
from gateway.audio.pacer import Pacer
from gateway.audio.resample import DELAY_SECONDS, NTAPS, Decimator24kTo8k, decimate_24k_to_8k

__all__ = [
    "ALAW_SILENCE",
    "DELAY_SECONDS",
    "FRAME_BYTES",
    "NTAPS",
    "ULAW_SILENCE",
    "Codec",
    "Decimator24kTo8k",
    "Encoder",
    "Framer",
    "Pacer",
    "PhonePipeline",
    "alaw_decode",
    "alaw_encode",
    "alaw_encode_array",
    "codec_silence",
    "decimate_24k_to_8k",
    "float_to_int16",
    "ulaw_decode",
    "ulaw_encode",
    "ulaw_encode_array",
]
