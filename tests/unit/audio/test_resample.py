"""Decimator24kTo8k: one test per spec (a)-(f), plus the filter's basic invariants."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.audio.resample import (
    DELAY_SAMPLES_IN,
    DELAY_SECONDS,
    INPUT_RATE,
    NTAPS,
    TAPS,
    Decimator24kTo8k,
    decimate_24k_to_8k,
    output_length,
)

FS = INPUT_RATE
TTS_CHUNKS = (1920, 3840)  # one and two 80 ms Qwen3-TTS codec frames at 24 kHz


def noise(n: int, seed: int = 0) -> npt.NDArray[np.float32]:
    return (0.3 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def run_chunked(x: npt.NDArray[np.float32], sizes: list[int]) -> npt.NDArray[np.float32]:
    """Push ``x`` cut at ``sizes`` (the rest in one last push), flush, concatenate."""
    dec = Decimator24kTo8k()
    outs = []
    pos = 0
    for size in sizes:
        outs.append(dec.push(x[pos : pos + size]))
        pos += size
    outs.append(dec.push(x[pos:]))
    outs.append(dec.flush())
    for out in outs:
        assert out.dtype == np.float32
    return np.concatenate(outs)


def tone_power(freq: float, amplitude: float = 0.5, seconds: float = 1.0) -> float:
    """Steady-state output power of a tone, summed over sine and cosine phase.

    Summing the two phases makes the estimate phase-independent: a tone at 8 kHz aliases to DC,
    where a sine sampled at 8 kHz would read exactly zero whatever the filter did.
    """
    t = np.arange(int(FS * seconds)) / FS
    power = 0.0
    for wave in (np.sin, np.cos):
        y = decimate_24k_to_8k((amplitude * wave(2 * np.pi * freq * t)).astype(np.float32))
        steady = y[NTAPS:-NTAPS].astype(np.float64)  # well clear of the start/end transients
        power += float(np.mean(steady * steady))
    return power


def gain_db(freq: float) -> float:
    """Steady-state gain at ``freq`` relative to a 1 kHz tone of the same input amplitude."""
    return float(10 * np.log10(tone_power(freq) / tone_power(1000.0)))


def test_filter_shape() -> None:
    assert NTAPS % 2 == 1 and NTAPS % 3 == 0
    assert TAPS.shape == (NTAPS,) and TAPS.dtype == np.float32
    np.testing.assert_array_equal(TAPS, TAPS[::-1])  # exactly linear phase
    assert DELAY_SAMPLES_IN == (NTAPS - 1) // 2
    assert abs(20 * np.log10(float(TAPS.sum()))) < 0.5  # DC gain inside the passband ripple


def test_matches_float64_reference_convolution() -> None:
    # Output k is the filter's full convolution at input index 3k + D: delay-compensated.
    x = noise(10_001, seed=1)
    ref = np.convolve(x.astype(np.float64), TAPS.astype(np.float64))[DELAY_SAMPLES_IN::3]
    y = decimate_24k_to_8k(x)
    assert y.shape == (output_length(x.shape[0]),)
    np.testing.assert_allclose(y, ref[: y.shape[0]], rtol=0, atol=2e-6)


# --- (a) chunked == whole, bit for bit --------------------------------------------------------


chunk_size = st.one_of(st.sampled_from([0, 1, 2, 3, *TTS_CHUNKS]), st.integers(0, 2500))


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(chunk_size, max_size=16),
    tail=st.integers(0, 400),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_chunked_equals_whole_bit_identical(sizes: list[int], tail: int, seed: int) -> None:
    x = noise(sum(sizes) + tail, seed)
    assert np.array_equal(run_chunked(x, sizes), decimate_24k_to_8k(x))


@pytest.mark.parametrize("pattern", ["ones", "tts1920", "tts3840", "zeros_between", "random"])
def test_a_chunked_equals_whole_named_chunkings(pattern: str) -> None:
    n = 6_000 if pattern == "ones" else 3 * 24_000 + 7
    x = noise(n, seed=2)
    rng = np.random.default_rng(3)
    sizes: list[int] = {
        "ones": [1] * n,
        "tts1920": [1920] * (n // 1920),
        "tts3840": [3840] * (n // 3840),
        "zeros_between": [s for _ in range(n // 1921) for s in (0, 1920, 0, 1)],
        "random": [int(s) for s in rng.integers(0, 5000, n // 2500)],
    }[pattern]
    whole = decimate_24k_to_8k(x)
    assert np.array_equal(run_chunked(x, sizes), whole)


def test_a_returned_arrays_are_not_reused() -> None:
    dec = Decimator24kTo8k()
    first = dec.push(noise(1920, seed=4))
    snapshot = first.copy()
    dec.push(noise(1920, seed=5))
    dec.flush()
    np.testing.assert_array_equal(first, snapshot)


# --- (b) anti-alias: 4200-11900 Hz >= 60 dB down -----------------------------------------------


def test_b_stopband_tones_attenuated_60db() -> None:
    # Everything here folds into 0-3800 Hz at 8 kHz, inside the phone band: it must be gone.
    gains = {f: gain_db(f) for f in range(4200, 12000, 100)}
    worst = max(gains, key=lambda f: gains[f])
    assert gains[worst] <= -60.0, f"{worst} Hz only {-gains[worst]:.1f} dB down"


# --- (c) passband 300-3400 Hz flat within 1 dB -------------------------------------------------


def test_c_passband_flat_within_1db() -> None:
    gains = np.array([gain_db(f) for f in range(300, 3500, 100)])
    assert np.max(np.abs(gains)) <= 1.0, gains
    assert float(gains.max() - gains.min()) <= 1.0, gains


# --- (d) added delay <= 2 ms --------------------------------------------------------------------


def test_d_delay_constant() -> None:
    assert DELAY_SECONDS == (NTAPS - 1) / 2 / FS
    assert DELAY_SECONDS <= 0.002


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_d_measured_latency_of_an_impulse(offset: int) -> None:
    # Stream one sample at a time and note how many input samples had to arrive after the
    # impulse before the output sample that carries it was released: that is the added latency.
    target = 100
    where = 3 * target + offset
    x = np.zeros(900, dtype=np.float32)
    x[where] = 1.0
    dec = Decimator24kTo8k()
    out: list[float] = []
    released_after = None
    for i in range(x.shape[0]):
        out.extend(dec.push(x[i : i + 1]).tolist())
        if released_after is None and len(out) > target:
            released_after = i - where
    out.extend(dec.flush().tolist())
    assert released_after is not None
    assert released_after / FS <= 0.002
    assert released_after == DELAY_SAMPLES_IN - offset
    # And the impulse is not moved in time: the response peaks at the output sample nearest it.
    assert int(np.argmax(out)) == round(where / 3)


def test_d_measured_onset_timing() -> None:
    # A step at input 3m must come out centred on output m (linear phase, delay compensated).
    m = 200
    x = np.zeros(1800, dtype=np.float32)
    x[3 * m :] = 0.5
    y = decimate_24k_to_8k(x)
    half = 0.5 * float(np.median(y[m + 40 : m + 100]))
    crossing = int(np.argmax(y >= half))
    measured_delay_s = (3 * crossing - 3 * m) / FS
    assert abs(measured_delay_s) <= 3 / FS  # within one 8 kHz sample of the input's timing


# --- (e) flush loses nothing ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "n", [*range(120), 1919, 1920, 1921, 3839, 3840, 3841, 24_000, 24_001, 24_002]
)
def test_e_total_length_is_ceil_n_over_3(n: int) -> None:
    rng = np.random.default_rng(n)
    x = noise(n, seed=n)
    sizes = [int(s) for s in rng.integers(0, 200, 8)]
    y = run_chunked(x, sizes)
    assert y.shape[0] == -(-n // 3) == output_length(n)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 100, 101, 102, 1920, 1921, 1922])
def test_e_click_on_last_sample_survives(n: int) -> None:
    x = np.zeros(n, dtype=np.float32)
    x[-1] = 0.8
    dec = Decimator24kTo8k()
    y = np.concatenate([dec.push(x), dec.flush()])
    assert y.shape[0] == output_length(n)
    assert abs(float(y[-1])) >= 0.1  # the last output sample carries the click
    # Zero-padding on flush is exactly "the utterance is followed by silence".
    longer = decimate_24k_to_8k(np.concatenate([x, np.zeros(300, dtype=np.float32)]))
    assert np.array_equal(y, longer[: y.shape[0]])


# --- (f) reset between utterances -----------------------------------------------------------------


def test_f_second_utterance_after_flush_matches_fresh_instance() -> None:
    first, second = noise(5_000, seed=10), noise(4_321, seed=11)
    dec = Decimator24kTo8k()
    dec.push(first)
    dec.flush()
    again = np.concatenate([dec.push(second[:1000]), dec.push(second[1000:]), dec.flush()])
    assert np.array_equal(again, decimate_24k_to_8k(second))


def test_f_reset_mid_utterance_drops_state() -> None:
    # Barge-in: half an utterance is abandoned; nothing of it may leak into the next one.
    dec = Decimator24kTo8k()
    dec.push(noise(2_999, seed=12))
    dec.reset()
    second = noise(3_001, seed=13)
    again = np.concatenate([dec.push(second), dec.flush()])
    assert np.array_equal(again, decimate_24k_to_8k(second))


def test_f_flush_without_input_is_empty_and_idempotent() -> None:
    dec = Decimator24kTo8k()
    assert dec.flush().shape == (0,)
    assert dec.push(np.zeros(0, dtype=np.float32)).shape == (0,)
    assert dec.flush().shape == (0,)


def test_rejects_non_1d_and_converts_dtype() -> None:
    dec = Decimator24kTo8k()
    with pytest.raises(ValueError, match="1-D"):
        dec.push(np.zeros((2, 3), dtype=np.float32))
    x64 = noise(1_000, seed=14).astype(np.float64)
    assert np.array_equal(decimate_24k_to_8k(x64), decimate_24k_to_8k(x64.astype(np.float32)))
