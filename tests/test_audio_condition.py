"""Phone-audio conditioning: the leading-silence trim drops what precedes speech and keeps the
rest bit-identical; the level normaliser's limiter never lets a sample past its ceiling, gives
the same output however the audio is chunked, and holds back one 10 ms block per chunk."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.audio.condition import LeadingSilenceTrimmer, LevelNormalizer

RATE = 24_000


def _speech(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal(n)).astype(np.float32)


def _run(trimmer: LeadingSilenceTrimmer, x: np.ndarray, sizes: list[int]) -> np.ndarray:
    out, i = [], 0
    for size in sizes:
        out.append(trimmer.push(x[i : i + size]))
        i += size
    out.append(trimmer.push(x[i:]))
    return np.concatenate(out)


@pytest.mark.parametrize("sizes", [[], [1920], [100, 1, 0, 1819, 3840], [7] * 500])
def test_leading_zeros_are_removed_and_the_rest_is_bit_identical(sizes: list[int]) -> None:
    speech = _speech(12_000)
    x = np.concatenate([np.zeros(1_900, dtype=np.float32), speech])
    out = _run(LeadingSilenceTrimmer(), x, sizes)
    assert np.array_equal(out, speech)


def test_sub_threshold_preroll_is_kept_and_faded_in() -> None:
    trimmer = LeadingSilenceTrimmer(preroll_s=0.005)
    hum = np.full(2_400, 0.001, dtype=np.float32)  # -60 dBFS: below the onset threshold
    speech = _speech(4_800)
    out = trimmer.push(np.concatenate([hum, speech]))
    preroll = trimmer.preroll
    assert len(out) == preroll + len(speech)
    assert np.array_equal(out[preroll:], speech)
    ramp = out[:preroll] / 0.001
    assert np.all(np.diff(ramp) > 0) and 0 < ramp[0] < 0.05 and 0.95 < ramp[-1] < 1
    assert trimmer.trimmed == len(hum) - preroll


def test_an_utterance_that_starts_loud_is_untouched() -> None:
    speech = _speech(5_000)
    assert np.array_equal(LeadingSilenceTrimmer().push(speech), speech)


def test_gives_up_after_max_trim_so_quiet_speech_is_never_swallowed() -> None:
    trimmer = LeadingSilenceTrimmer(max_trim_s=0.2)
    quiet = np.full(RATE, 0.0005, dtype=np.float32)
    out = np.concatenate([trimmer.push(c) for c in np.split(quiet, 10)])
    assert trimmer.passing and len(out) >= len(quiet) - 0.2 * RATE


def test_trailing_audio_is_never_cut() -> None:
    speech = np.concatenate([_speech(4_000), np.zeros(3_000, dtype=np.float32)])
    trimmer = LeadingSilenceTrimmer()
    out = np.concatenate([trimmer.push(c) for c in np.array_split(speech, 7)])
    assert np.array_equal(out, speech)


def test_reset_starts_a_new_utterance() -> None:
    trimmer = LeadingSilenceTrimmer()
    trimmer.push(_speech(100))
    trimmer.reset()
    x = np.concatenate([np.zeros(500, dtype=np.float32), _speech(100, 1)])
    assert np.array_equal(trimmer.push(x), x[500:])


def _bursts(seed: int = 3) -> np.ndarray:
    """Quiet speech-like noise with sudden full-scale bursts (the limiter's worst case)."""
    rng = np.random.default_rng(seed)
    x = 0.02 * rng.standard_normal(RATE).astype(np.float32)
    for start in rng.integers(0, RATE - 600, 12):
        x[start:start + int(rng.integers(20, 600))] = rng.choice([-0.99, 0.99])
    return x


@pytest.mark.parametrize("sizes", [[1920] * 13, [1920, 3840, 7680, 7680], [7] * 3500])
def test_the_limiter_keeps_every_sample_under_its_ceiling_however_the_audio_is_chunked(
        sizes: list[int]) -> None:
    x = _bursts()
    whole = LevelNormalizer()
    reference = np.concatenate([whole.push(x), whole.flush()])
    chunked = LevelNormalizer()
    out, i = [], 0
    for size in sizes:
        out.append(chunked.push(x[i:i + size]))
        i += size
    out += [chunked.push(x[i:]), chunked.flush()]
    y = np.concatenate(out)
    assert np.array_equal(y, reference)  # chunked == whole: a live render is its cached copy
    assert len(y) == len(x)
    # The bursts at +6 dB of level gain would reach twice full scale: all limited to -1 dBFS.
    assert float(np.max(np.abs(y))) <= 10 ** (-1 / 20) + 1e-6


def test_the_limiter_holds_back_one_block_of_each_chunk() -> None:
    """What a live caller waits for: of an 80 ms chunk, all but the last 10 ms block goes on at
    once (the look-ahead); the rest comes with the next chunk."""
    level = LevelNormalizer()
    x = _bursts()
    assert len(level.push(x[:1920])) == 1920 - 240
    assert len(level.push(x[1920:3840])) == 1920
    assert len(level.flush()) == 240
