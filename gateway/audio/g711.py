"""Vectorised ITU-T G.711 companding (mu-law "PCMU" and A-law "PCMA") plus float -> int16.

The coders are table lookups built once at import from the classic Sun Microsystems ``g711.c``
reference (the same code CPython's ``audioop`` carries), so they are bit-exact with
``audioop.lin2ulaw`` / ``lin2alaw`` / ``ulaw2lin`` / ``alaw2lin`` for every input:

* encode: one 65,536-entry ``uint8`` table indexed by the int16 sample reinterpreted as uint16
  (``pcm.view(np.uint16)``), so any int16 array encodes with one gather and no branches;
* decode: one 256-entry ``int16`` table indexed by the code byte.

Telephony carries 8 kHz G.711 (RFC 3551 section 4.5.14, payload types 0 = PCMU and 8 = PCMA; Twilio
Media Streams use ``audio/x-mulaw`` at 8 kHz), one byte per sample, so a 20 ms frame is 160 bytes.

All functions are pure; nothing here keeps state except :class:`Encoder`'s reusable scratch space.
"""

from __future__ import annotations

from typing import Final, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "ALAW_SILENCE",
    "ULAW_SILENCE",
    "Codec",
    "Encoder",
    "alaw_decode",
    "alaw_encode",
    "alaw_encode_array",
    "codec_silence",
    "float_to_int16",
    "ulaw_decode",
    "ulaw_encode",
    "ulaw_encode_array",
]

Codec = Literal["pcmu", "pcma"]
"""SDP encoding names (RFC 3551 table 4), lower-cased: ``pcmu`` = mu-law, ``pcma`` = A-law."""

ByteSource = bytes | bytearray | memoryview | npt.NDArray[np.uint8]
"""Anything holding G.711 code bytes."""

ULAW_SILENCE: Final[int] = 0xFF
"""mu-law code of linear 0. G.711 mu-law inverts all bits on the wire, so zero is 0xFF, not 0x00."""

ALAW_SILENCE: Final[int] = 0xD5
"""A-law code of linear 0: sign bit set for non-negative values, then even bits inverted (0x55)."""

# Sun g711.c constants. CPython's audioop (the oracle the tests pin against) runs the mu-law
# coder on 14-bit input (sample >> 2), i.e. the 16-bit BIAS 0x84 / CLIP 32635 algorithm scaled
# down by 4, and the A-law coder on 13-bit input (sample >> 3), G.711's native A-law range. The
# shifts are arithmetic (floor), so negative samples round towards -inf before the magnitude is
# taken; the textbook 16-bit variant that negates first differs by one code for some negative
# inputs (e.g. -1 -> 0x7F instead of audioop's 0x7E), so we follow the 14/13-bit form.
_ULAW_BIAS: Final[int] = 0x84 >> 2  # 33: shifts mu-law's segment ends onto powers of two
_ULAW_CLIP: Final[int] = 8159  # 32635 / 4 rounded up: g711.c's 14-bit clip level
_QUANT_MASK: Final[int] = 0x0F  # 4 mantissa bits per segment
_SEG_SHIFT: Final[int] = 4
_SEG_MASK: Final[int] = 0x70
_SIGN_BIT: Final[int] = 0x80


def _segment(magnitude: npt.NDArray[np.int32], seg_end: tuple[int, ...]) -> npt.NDArray[np.int32]:
    """Vectorised ``search()`` from g711.c: first segment end >= magnitude (8 = overflow)."""
    return np.searchsorted(np.asarray(seg_end, dtype=np.int32), magnitude, side="left").astype(
        np.int32
    )


def _build_ulaw_encode_table() -> npt.NDArray[np.uint8]:
    pcm = np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int32) >> 2
    mask = np.where(pcm < 0, 0x7F, 0xFF).astype(np.int32)
    mag = np.minimum(np.abs(pcm), _ULAW_CLIP) + _ULAW_BIAS
    seg = _segment(mag, (0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF))
    # CLIP + BIAS is 0x2000, one past segment 7, so clipped samples take g711.c's overflow branch
    # and become the largest code (0x7F before the sign mask).
    uval = np.where(
        seg >= 8, 0x7F, (np.minimum(seg, 7) << _SEG_SHIFT) | ((mag >> (seg + 1)) & _QUANT_MASK)
    )
    return (uval ^ mask).astype(np.uint8)


def _build_alaw_encode_table() -> npt.NDArray[np.uint8]:
    pcm = np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int32) >> 3
    # A-law is sign-magnitude with the one's complement for negatives (-x - 1), so -1 and 0 land
    # in mirror-image codes and there is no "negative zero" gap.
    mask = np.where(pcm >= 0, 0xD5, 0x55).astype(np.int32)
    mag = np.where(pcm >= 0, pcm, -pcm - 1)
    seg = _segment(mag, (0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF))
    # Segments 0 and 1 share a step size (the A-law curve's linear part), hence the shift of 1.
    shift = np.maximum(seg, 1)
    aval = (seg << _SEG_SHIFT) | ((mag >> shift) & _QUANT_MASK)
    aval = np.where(seg >= 8, 0x7F, aval)  # unreachable for 13-bit input; kept as in g711.c
    return (aval ^ mask).astype(np.uint8)


def _build_ulaw_decode_table() -> npt.NDArray[np.int16]:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & _QUANT_MASK) << 3) + 0x84) << ((u & _SEG_MASK) >> _SEG_SHIFT)
    return np.where(u & _SIGN_BIT, 0x84 - t, t - 0x84).astype(np.int16)


def _build_alaw_decode_table() -> npt.NDArray[np.int16]:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    t = a & _QUANT_MASK
    seg = (a & _SEG_MASK) >> _SEG_SHIFT
    mag = np.where(seg > 0, (2 * t + 1 + 32) << (seg + 2), (2 * t + 1) << 3)
    return np.where(a & _SIGN_BIT, mag, -mag).astype(np.int16)


_ULAW_ENC: Final = _build_ulaw_encode_table()
_ALAW_ENC: Final = _build_alaw_encode_table()
_ULAW_DEC: Final = _build_ulaw_decode_table()
_ALAW_DEC: Final = _build_alaw_decode_table()
for _table in (_ULAW_ENC, _ALAW_ENC, _ULAW_DEC, _ALAW_DEC):
    _table.flags.writeable = False
del _table


def _as_int16(pcm: npt.NDArray[np.int16]) -> npt.NDArray[np.int16]:
    arr = np.asarray(pcm)
    if arr.dtype != np.int16:
        # Casting wider ints would silently wrap; float needs float_to_int16's rounding/clipping.
        raise TypeError(f"G.711 encode needs int16 samples, got {arr.dtype}")
    return arr


def _as_codes(data: ByteSource) -> npt.NDArray[np.uint8]:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise TypeError(f"G.711 decode needs uint8 codes, got {data.dtype}")
        return data
    return np.frombuffer(data, dtype=np.uint8)


def _encode_into(
    table: npt.NDArray[np.uint8],
    pcm: npt.NDArray[np.int16],
    out: npt.NDArray[np.uint8] | None,
) -> npt.NDArray[np.uint8]:
    idx = _as_int16(pcm).view(np.uint16)
    if out is None:
        return table[idx]
    np.take(table, idx, out=out)
    return out


def ulaw_encode_array(
    pcm: npt.NDArray[np.int16], out: npt.NDArray[np.uint8] | None = None
) -> npt.NDArray[np.uint8]:
    """Encode int16 PCM to mu-law codes as a ``uint8`` array (into ``out`` when given).

    ``out`` must have ``pcm``'s shape; passing it lets per-frame callers avoid an allocation.
    """
    return _encode_into(_ULAW_ENC, pcm, out)


def alaw_encode_array(
    pcm: npt.NDArray[np.int16], out: npt.NDArray[np.uint8] | None = None
) -> npt.NDArray[np.uint8]:
    """Encode int16 PCM to A-law codes as a ``uint8`` array (into ``out`` when given)."""
    return _encode_into(_ALAW_ENC, pcm, out)


def ulaw_encode(pcm: npt.NDArray[np.int16]) -> bytes:
    """Encode int16 PCM to mu-law bytes, one byte per sample (== ``audioop.lin2ulaw(pcm, 2)``)."""
    return _ULAW_ENC[_as_int16(pcm).view(np.uint16)].tobytes()


def alaw_encode(pcm: npt.NDArray[np.int16]) -> bytes:
    """Encode int16 PCM to A-law bytes, one byte per sample (== ``audioop.lin2alaw(pcm, 2)``)."""
    return _ALAW_ENC[_as_int16(pcm).view(np.uint16)].tobytes()


def ulaw_decode(data: ByteSource) -> npt.NDArray[np.int16]:
    """Decode mu-law bytes (or a ``uint8`` array) to int16 PCM (== ``audioop.ulaw2lin(d, 2)``)."""
    return _ULAW_DEC[_as_codes(data)]


def alaw_decode(data: ByteSource) -> npt.NDArray[np.int16]:
    """Decode A-law bytes (or a ``uint8`` array) to int16 PCM (== ``audioop.alaw2lin(d, 2)``)."""
    return _ALAW_DEC[_as_codes(data)]


def codec_silence(codec: Codec) -> int:
    """The code byte of linear zero for ``codec`` (what padding and comfort silence use)."""
    if codec == "pcmu":
        return ULAW_SILENCE
    if codec == "pcma":
        return ALAW_SILENCE
    raise ValueError(f"unknown G.711 codec {codec!r}; expected 'pcmu' or 'pcma'")


def _float_to_int16_into(
    x: npt.NDArray[np.floating],
    scaled: npt.NDArray[np.float32],
    nan_mask: npt.NDArray[np.bool_],
    out: npt.NDArray[np.int16],
) -> None:
    # float32 suffices: x * 2**15 is exact (a power-of-two scale only shifts the exponent), so
    # rint sees the exact product. Plain ufuncs with out= instead of np.clip / np.nan_to_num,
    # whose Python-level wrappers cost several times the arithmetic on a 20 ms frame.
    # Python float scalars keep the float32 loop; float64 x is computed in float64 and its product
    # rounded to float32 before rint, which only matters within 2**-9 of a rounding midpoint.
    np.multiply(x, 32768.0, out=scaled)
    np.isnan(scaled, out=nan_mask)
    np.copyto(scaled, 0.0, where=nan_mask)
    np.rint(scaled, out=scaled)
    np.maximum(scaled, -32768.0, out=scaled)
    np.minimum(scaled, 32767.0, out=scaled)
    np.copyto(out, scaled, casting="unsafe")


def float_to_int16(
    x: npt.NDArray[np.floating], out: npt.NDArray[np.int16] | None = None
) -> npt.NDArray[np.int16]:
    """Convert float samples in [-1, 1) to int16 (into ``out`` when given, same shape as ``x``).

    Convention (the one libsndfile/soundfile and torchaudio use, so int16 -> float -> int16 is
    lossless): scale by 32768, round half to even (``np.rint``: unbiased, so quiet passages gain no
    DC offset), clip to [-32768, 32767]. Full-scale +1.0 therefore clips to 32767 instead of
    wrapping to -32768. NaN becomes 0 and +/-inf clip to full scale: a broken TTS frame must reach
    the line as silence or a clipped sample, never as an undefined float -> int cast.
    """
    arr = np.asarray(x)
    if out is None:
        out = np.empty(arr.shape, dtype=np.int16)
    _float_to_int16_into(
        arr, np.empty(arr.shape, dtype=np.float32), np.empty(arr.shape, dtype=np.bool_), out
    )
    return out


class Encoder:
    """Float32 8 kHz samples -> G.711 bytes in one call, reusing scratch buffers across calls.

    One per call and direction (STYLE.md rule 6); not thread-safe because of the scratch space.
    """

    __slots__ = ("_codec", "_codes", "_nan", "_pcm", "_scaled", "_silence", "_table")

    def __init__(self, codec: Codec = "pcmu") -> None:
        self._silence = codec_silence(codec)
        self._codec: Codec = codec
        self._table = _ULAW_ENC if codec == "pcmu" else _ALAW_ENC
        self._scaled = np.empty(0, dtype=np.float32)
        self._nan = np.empty(0, dtype=np.bool_)
        self._pcm = np.empty(0, dtype=np.int16)
        self._codes = np.empty(0, dtype=np.uint8)

    @property
    def codec(self) -> Codec:
        """The codec's SDP name, ``pcmu`` or ``pcma``."""
        return self._codec

    @property
    def silence(self) -> int:
        """The code byte of linear zero for this codec."""
        return self._silence

    def encode_array(self, x: npt.NDArray[np.floating]) -> npt.NDArray[np.uint8]:
        """Encode 1-D float samples; returns a view of scratch space valid until the next call."""
        if x.ndim != 1:
            raise ValueError(f"expected a 1-D sample array, got shape {x.shape}")
        n = x.shape[0]
        if self._pcm.shape[0] < n:
            # Grow geometrically so a stream settles on one set of buffers after a few chunks.
            cap = max(n, 2 * self._pcm.shape[0])
            self._scaled = np.empty(cap, dtype=np.float32)
            self._nan = np.empty(cap, dtype=np.bool_)
            self._pcm = np.empty(cap, dtype=np.int16)
            self._codes = np.empty(cap, dtype=np.uint8)
        pcm = self._pcm[:n]
        _float_to_int16_into(x, self._scaled[:n], self._nan[:n], pcm)
        codes = self._codes[:n]
        np.take(self._table, pcm.view(np.uint16), out=codes)
        return codes

    def encode(self, x: npt.NDArray[np.floating]) -> bytes:
        """Encode 1-D float samples in [-1, 1) to G.711 bytes (one byte per sample)."""
        return self.encode_array(x).tobytes()
