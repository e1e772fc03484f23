"""G.711 coders pinned bit-exact to CPython's audioop (Sun g711.c) over their whole domains."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

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

ALL_PCM = np.arange(-32768, 32768, dtype=np.int16)
ALL_CODES = bytes(range(256))


@pytest.fixture(scope="module")
def audioop() -> ModuleType:
    # Stdlib up to 3.12; from 3.13 the audioop-lts distribution (a project dependency there)
    # provides the same module name. A missing oracle must fail, not skip.
    import audioop as module

    return module


def test_ulaw_encode_all_int16_matches_audioop(audioop: ModuleType) -> None:
    assert ulaw_encode(ALL_PCM) == audioop.lin2ulaw(ALL_PCM.tobytes(), 2)


def test_alaw_encode_all_int16_matches_audioop(audioop: ModuleType) -> None:
    assert alaw_encode(ALL_PCM) == audioop.lin2alaw(ALL_PCM.tobytes(), 2)


def test_ulaw_decode_all_codes_matches_audioop(audioop: ModuleType) -> None:
    expected = np.frombuffer(audioop.ulaw2lin(ALL_CODES, 2), dtype=np.int16)
    got = ulaw_decode(ALL_CODES)
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, expected)


def test_alaw_decode_all_codes_matches_audioop(audioop: ModuleType) -> None:
    expected = np.frombuffer(audioop.alaw2lin(ALL_CODES, 2), dtype=np.int16)
    got = alaw_decode(ALL_CODES)
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, expected)


def test_array_variants_match_bytes_variants() -> None:
    assert ulaw_encode_array(ALL_PCM).tobytes() == ulaw_encode(ALL_PCM)
    assert alaw_encode_array(ALL_PCM).tobytes() == alaw_encode(ALL_PCM)
    out = np.empty(ALL_PCM.shape, dtype=np.uint8)
    assert ulaw_encode_array(ALL_PCM, out=out) is out
    assert out.tobytes() == ulaw_encode(ALL_PCM)
    assert alaw_encode_array(ALL_PCM, out=out) is out
    assert out.tobytes() == alaw_encode(ALL_PCM)


def test_decode_accepts_every_byte_container() -> None:
    expected = ulaw_decode(ALL_CODES)
    for data in (bytearray(ALL_CODES), memoryview(ALL_CODES), np.arange(256, dtype=np.uint8)):
        np.testing.assert_array_equal(ulaw_decode(data), expected)
        np.testing.assert_array_equal(alaw_decode(data), alaw_decode(ALL_CODES))


def test_encode_accepts_non_contiguous_views() -> None:
    np.testing.assert_array_equal(
        ulaw_encode_array(ALL_PCM[::7]), ulaw_encode_array(ALL_PCM.copy()[::7].copy())
    )


def test_silence_constants_are_codes_of_zero() -> None:
    zero = np.zeros(1, dtype=np.int16)
    assert ulaw_encode(zero) == bytes([ULAW_SILENCE]) == b"\xff"
    assert alaw_encode(zero) == bytes([ALAW_SILENCE]) == b"\xd5"
    assert ulaw_decode(bytes([ULAW_SILENCE]))[0] == 0
    # A-law has no exact zero: its smallest step decodes to +/-8.
    assert alaw_decode(bytes([ALAW_SILENCE]))[0] == 8
    assert codec_silence("pcmu") == ULAW_SILENCE
    assert codec_silence("pcma") == ALAW_SILENCE
    with pytest.raises(ValueError, match=r"unknown G\.711 codec"):
        codec_silence("g722")  # type: ignore[arg-type]


Encode = Callable[[npt.NDArray[np.int16]], bytes]
Decode = Callable[[bytes], npt.NDArray[np.int16]]


@pytest.mark.parametrize(
    ("encode", "decode"), [(ulaw_encode, ulaw_decode), (alaw_encode, alaw_decode)]
)
def test_decode_encode_decode_is_stable(encode: Encode, decode: Decode) -> None:
    # Every decoded level is a reconstruction point, so re-encoding it must decode identically.
    levels = decode(ALL_CODES)
    np.testing.assert_array_equal(decode(encode(levels)), levels)


def test_encode_rejects_non_int16() -> None:
    with pytest.raises(TypeError, match="int16"):
        ulaw_encode(np.zeros(4, dtype=np.int32))
    with pytest.raises(TypeError, match="int16"):
        alaw_encode_array(np.zeros(4, dtype=np.float32))


def test_decode_rejects_non_uint8_arrays() -> None:
    with pytest.raises(TypeError, match="uint8"):
        ulaw_decode(np.zeros(4, dtype=np.int16))


def test_empty_inputs() -> None:
    empty = np.zeros(0, dtype=np.int16)
    assert ulaw_encode(empty) == b""
    assert alaw_encode(empty) == b""
    assert ulaw_decode(b"").shape == (0,)
    assert float_to_int16(np.zeros(0, dtype=np.float32)).shape == (0,)


def test_float_to_int16_convention() -> None:
    step = 1.0 / 32768
    x = np.array(
        [0.0, 1.0, -1.0, 0.5 * step, 1.5 * step, 2.5 * step, -2.5 * step, 2.0, -3.0],
        dtype=np.float32,
    )
    # Scale 32768, round half to even, clip: +1.0 clips to 32767, -1.0 is exactly -32768.
    expected = [0, 32767, -32768, 0, 2, 2, -2, 32767, -32768]
    np.testing.assert_array_equal(float_to_int16(x), np.array(expected, dtype=np.int16))


def test_float_to_int16_non_finite() -> None:
    x = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
    np.testing.assert_array_equal(float_to_int16(x), np.array([0, 32767, -32768], np.int16))


def test_float_to_int16_inverts_int16_to_float() -> None:
    # The int16 -> float convention used by soundfile/torchaudio is x / 32768; it must round-trip.
    np.testing.assert_array_equal(float_to_int16(ALL_PCM.astype(np.float32) / 32768), ALL_PCM)


def test_float_to_int16_out_parameter() -> None:
    x = np.linspace(-1, 1, 101, dtype=np.float32)
    out = np.empty(101, dtype=np.int16)
    assert float_to_int16(x, out=out) is out
    np.testing.assert_array_equal(out, float_to_int16(x))


@given(st.lists(st.floats(-1.5, 1.5, width=32), max_size=300))
def test_float_to_int16_matches_float64_reference(values: list[float]) -> None:
    x = np.array(values, dtype=np.float32)
    ref = np.clip(np.rint(x.astype(np.float64) * 32768), -32768, 32767).astype(np.int16)
    np.testing.assert_array_equal(float_to_int16(x), ref)


@pytest.mark.parametrize("codec", ["pcmu", "pcma"])
def test_encoder_composes_float_int16_g711(codec: Codec) -> None:
    rng = np.random.default_rng(7)
    encoder = Encoder(codec)
    encode = ulaw_encode if codec == "pcmu" else alaw_encode
    assert encoder.codec == codec
    assert encoder.silence == codec_silence(codec)
    # Varying sizes exercise the scratch growth and reuse paths.
    for n in (0, 1, 160, 7, 1000, 3, 640):
        x = rng.uniform(-1.1, 1.1, n).astype(np.float32)
        assert encoder.encode(x) == encode(float_to_int16(x))


def test_encoder_rejects_bad_codec_and_shape() -> None:
    with pytest.raises(ValueError, match=r"unknown G\.711 codec"):
        Encoder("opus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1-D"):
        Encoder().encode(np.zeros((2, 2), dtype=np.float32))
