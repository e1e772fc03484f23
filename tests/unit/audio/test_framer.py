"""Framer and PhonePipeline: exact 20 ms frames, padding only at the end, chunk invariance."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.audio.framer import FRAME_BYTES, Framer, PhonePipeline
from gateway.audio.g711 import (
    ALAW_SILENCE,
    ULAW_SILENCE,
    Codec,
    alaw_encode,
    codec_silence,
    float_to_int16,
    ulaw_encode,
)
from gateway.audio.resample import decimate_24k_to_8k, output_length


def speechish(n: int, seed: int = 0) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 24_000
    x = sum(0.2 / k * np.sin(2 * np.pi * 150 * k * t) for k in range(1, 20))
    return (x + 0.01 * rng.standard_normal(n)).astype(np.float32)


def reference_bytes(x: npt.NDArray[np.float32], codec: Codec) -> bytes:
    encode = ulaw_encode if codec == "pcmu" else alaw_encode
    return encode(float_to_int16(decimate_24k_to_8k(x)))


def cut(data: bytes, sizes: list[int]) -> list[bytes]:
    pieces, pos = [], 0
    for size in sizes:
        pieces.append(data[pos : pos + size])
        pos += size
    pieces.append(data[pos:])
    return pieces


# --- Framer -------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=2000),
    sizes=st.lists(st.integers(0, 500), max_size=12),
    silence=st.sampled_from([ULAW_SILENCE, ALAW_SILENCE]),
)
def test_framer_frames_are_exact_and_only_last_is_padded(
    data: bytes, sizes: list[int], silence: int
) -> None:
    framer = Framer(silence)
    frames: list[bytes] = []
    for piece in cut(data, sizes):
        frames.extend(framer.push(piece))
        assert framer.pending < FRAME_BYTES
    body = len(frames)
    frames.extend(framer.flush())
    assert all(len(f) == FRAME_BYTES for f in frames)
    assert len(frames) == -(-len(data) // FRAME_BYTES)
    assert body == len(data) // FRAME_BYTES  # everything before flush is real audio, unpadded
    pad = len(frames) * FRAME_BYTES - len(data)
    assert b"".join(frames) == data + bytes([silence]) * pad
    assert framer.pending == 0
    assert framer.flush() == []


def test_framer_accepts_buffer_types() -> None:
    framer = Framer(ULAW_SILENCE)
    assert framer.push(bytearray(100)) == []
    assert framer.push(memoryview(bytes(range(60)))) == [bytes(100) + bytes(range(60))]


def test_framer_flush_with_nothing_pending() -> None:
    framer = Framer(ALAW_SILENCE)
    assert framer.flush() == []
    assert framer.push(b"\x01" * FRAME_BYTES) == [b"\x01" * FRAME_BYTES]
    assert framer.flush() == []  # a whole frame already went out; nothing to pad


def test_framer_reset_drops_pending() -> None:
    framer = Framer(ULAW_SILENCE)
    framer.push(b"\x00" * 150)
    framer.reset()
    assert framer.pending == 0
    assert framer.push(b"\x01" * 10) == []
    assert framer.flush() == [b"\x01" * 10 + b"\xff" * 150]


def test_framer_validates_arguments() -> None:
    with pytest.raises(ValueError, match="one byte"):
        Framer(256)
    with pytest.raises(ValueError, match="positive"):
        Framer(0xFF, frame_bytes=0)
    assert Framer(0x7F, frame_bytes=80).push(b"\x00" * 80) == [b"\x00" * 80]


# --- PhonePipeline ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["pcmu", "pcma"])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 479, 480, 481, 1920, 24_000 + 5])
def test_pipeline_preserves_samples_and_pads_only_last(codec: Codec, n: int) -> None:
    x = speechish(n, seed=n)
    pipe = PhonePipeline(codec)
    assert pipe.codec == codec
    frames = pipe.push(x)
    tail = pipe.flush()
    assert len(tail) <= 2  # at most the held-back samples' frame plus the padded one
    stream = b"".join(frames + tail)
    real = output_length(n)
    assert all(len(f) == FRAME_BYTES for f in frames + tail)
    assert len(frames + tail) == -(-real // FRAME_BYTES)
    assert stream[:real] == reference_bytes(x, codec)
    assert stream[real:] == bytes([codec_silence(codec)]) * (len(stream) - real)


@pytest.mark.parametrize("codec", ["pcmu", "pcma"])
@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(
        st.one_of(st.sampled_from([0, 1, 1920, 3840]), st.integers(0, 3000)), max_size=10
    ),
    tail=st.integers(0, 500),
)
def test_pipeline_output_is_chunking_invariant(codec: Codec, sizes: list[int], tail: int) -> None:
    x = speechish(sum(sizes) + tail, seed=len(sizes))
    whole = PhonePipeline(codec)
    expected = whole.push(x) + whole.flush()
    pipe = PhonePipeline(codec)
    frames: list[bytes] = []
    pos = 0
    for size in [*sizes, tail]:
        frames.extend(pipe.push(x[pos : pos + size]))
        pos += size
    frames.extend(pipe.flush())
    assert frames == expected


def test_pipeline_reset_and_consecutive_utterances() -> None:
    a, b = speechish(5_000, seed=1), speechish(3_333, seed=2)
    fresh = PhonePipeline()
    expected = fresh.push(b) + fresh.flush()
    pipe = PhonePipeline()
    pipe.push(a)
    pipe.flush()
    assert pipe.push(b) + pipe.flush() == expected  # after flush: a clean next utterance
    pipe.push(a[:2_500])
    pipe.reset()  # barge-in mid-utterance
    assert pipe.push(b) + pipe.flush() == expected


def test_pipeline_rejects_unknown_codec() -> None:
    with pytest.raises(ValueError, match=r"unknown G\.711 codec"):
        PhonePipeline("g729")  # type: ignore[arg-type]
