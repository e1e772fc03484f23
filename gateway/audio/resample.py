"""Streaming 24 kHz -> 8 kHz decimation for Qwen3-TTS output headed to a G.711 phone line.

Qwen3-TTS speaks at 24 kHz; G.711 (ITU-T G.711, RFC 3551 section 4.5.14) carries 8 kHz. Dropping
every third sample would fold everything between 4 and 12 kHz (sibilants, breath noise) back into
the 0-4 kHz phone band, so we low-pass first. The filter is a linear-phase equiripple FIR
(Parks-McClellan, ``scipy.signal.remez``) designed once at import:

* passband 0-3400 Hz, the upper edge of the ITU-T G.712 telephone channel;
* stopband from 4200 Hz: a tone at 4000 + d Hz aliases to 4000 - d Hz, so 4200 Hz is the lowest
  input whose alias lands below 3800 Hz, inside the band a handset reproduces. (4000-4200 Hz is
  the transition band; what folds from there lands at 3800-4000 Hz, above the G.712 band.);
* 87 taps, i.e. 43 samples = 1.79 ms of group delay. Odd length makes the delay a whole number of
  input samples, so output sample k lands exactly on input sample 3k. A multiple of 3 splits the
  taps into 29 whole three-sample frames, which is what the polyphase loop below walks.

Chunk invariance is exact (``np.array_equal``), not approximate. Each output sample is computed by
the same sequence of element-wise float32 multiplies and adds (a fixed pairwise tree) over the same
87 input values no matter how the input was chunked; element-wise IEEE-754 operations round per
element, so the result cannot depend on array length, alignment or SIMD width. (A BLAS dot or
``np.convolve`` would be shorter to write but may reorder its sums with buffer alignment and
length, and ``scipy.signal.resample_poly`` per chunk restarts the filter at every chunk edge.)
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt
from scipy import signal

__all__ = [
    "DELAY_SAMPLES_IN",
    "DELAY_SECONDS",
    "INPUT_RATE",
    "NTAPS",
    "OUTPUT_RATE",
    "PASSBAND_HZ",
    "STOPBAND_HZ",
    "TAPS",
    "Decimator24kTo8k",
    "decimate_24k_to_8k",
    "output_length",
]

INPUT_RATE: Final[int] = 24_000
OUTPUT_RATE: Final[int] = 8_000
_FACTOR: Final[int] = INPUT_RATE // OUTPUT_RATE

PASSBAND_HZ: Final[float] = 3400.0
STOPBAND_HZ: Final[float] = 4200.0

NTAPS: Final[int] = 87
"""Filter length. Odd (type I linear phase) and a multiple of the decimation factor 3."""

DELAY_SAMPLES_IN: Final[int] = (NTAPS - 1) // 2
"""Group delay in 24 kHz input samples: what :meth:`Decimator24kTo8k.push` holds back."""

DELAY_SECONDS: Final[float] = DELAY_SAMPLES_IN / INPUT_RATE
"""Latency the decimator adds (its group delay), about 1.79 ms."""

# Stopband weight 100 trades passband ripple (about 0.3 dB, against a 1 dB budget) for about
# 74 dB of stopband attenuation (against 60 dB needed); G.711 mu-law's own SNR is ~38 dB, so
# aliases 74 dB down are far below its quantisation noise.
_STOPBAND_WEIGHT: Final[float] = 100.0


def _design() -> npt.NDArray[np.float32]:
    h = signal.remez(
        NTAPS,
        [0.0, PASSBAND_HZ, STOPBAND_HZ, INPUT_RATE / 2],
        [1.0, 0.0],
        weight=[1.0, _STOPBAND_WEIGHT],
        fs=INPUT_RATE,
        maxiter=200,
    )
    # Force exact symmetry (remez is symmetric up to rounding) so the phase is exactly linear.
    h = 0.5 * (h + h[::-1])
    taps = h.astype(np.float32)
    taps.flags.writeable = False
    return taps


TAPS: Final[npt.NDArray[np.float32]] = _design()
"""The anti-alias FIR taps (float32, read-only)."""

_FRAMES_PER_WINDOW: Final[int] = NTAPS // _FACTOR

_BLOCK: Final[int] = 640
"""Most outputs computed per pass: one 80 ms Qwen3-TTS codec frame (1920 input samples)."""


def _tiled_taps() -> npt.NDArray[np.float32]:
    # Output k = sum_i TAPS[NTAPS-1-i] * x[3k - D + i]. Cut the reversed taps into 29 rows of 3
    # (one row per 3-sample input frame of the window) and repeat each row _BLOCK times, so
    # row m lines up element-for-element with the input shifted by m frames. Pre-tiling costs
    # 29 x 1920 floats once, and makes every multiply a plain contiguous ufunc call instead of
    # a length-3 broadcast, which numpy runs 5-7x slower.
    rows = TAPS[::-1].reshape(_FRAMES_PER_WINDOW, _FACTOR)
    tiled = np.ascontiguousarray(np.tile(rows, (1, _BLOCK)))
    tiled.flags.writeable = False
    return tiled


_TILED_TAPS: Final[npt.NDArray[np.float32]] = _tiled_taps()


def _tree_plan(rows: int) -> tuple[tuple[int, int, int], ...]:
    """Pairwise-sum schedule over ``rows`` rows, as (half, lo, hi) per level.

    Each level adds rows ``lo:hi`` onto rows ``0:half``; with an odd count the middle row
    stays where it is and joins the next level, so no level needs a copy.
    """
    plan: list[tuple[int, int, int]] = []
    while rows > 1:
        half, odd = rows // 2, rows & 1
        plan.append((half, half + odd, rows))
        rows = half + odd
    return tuple(plan)


# The sum over the 29 frame products always follows this one tree, whatever the chunking. That
# fixed order is what makes chunked output bit-identical, and it costs 5 vector adds instead of 28.
_SUM_PLAN: Final[tuple[tuple[int, int, int], ...]] = _tree_plan(_FRAMES_PER_WINDOW)


class Decimator24kTo8k:
    """Stateful streaming 24 kHz -> 8 kHz converter for float32 chunks of any size.

    Output sample ``k`` is time-aligned with input sample ``3k``: the filter's group delay is
    compensated by holding back the last :data:`DELAY_SAMPLES_IN` input samples until more input
    or :meth:`flush` arrives, so the only latency added is :data:`DELAY_SECONDS`.

    Over one utterance, ``push(a) + push(b) + ... + flush()`` equals the whole-signal output
    bit for bit, for any chunking, and has exactly ``ceil(n_in / 3)`` samples. The input is taken
    as zero before its first and after its last sample.

    One instance per call and direction (STYLE.md rule 6). Not thread-safe.
    """

    __slots__ = ("_buf", "_len", "_n_in", "_n_out", "_prod", "_windows")

    def __init__(self) -> None:
        # _buf[0] is always the first sample of the next output's window (absolute input index
        # 3 * n_out - DELAY_SAMPLES_IN), so output n_out + k's window starts at _buf[3k].
        self._buf = np.zeros(0, dtype=np.float32)
        self._windows = np.zeros((_FRAMES_PER_WINDOW, 0), dtype=np.float32)
        self._prod = np.empty((_FRAMES_PER_WINDOW, 0), dtype=np.float32)
        self._len = 0
        self._n_in = 0
        self._n_out = 0
        self._reserve(NTAPS + _FACTOR * _BLOCK)
        self.reset()

    def reset(self) -> None:
        """Drop all state, e.g. on barge-in. The next push starts a new utterance."""
        # Output 0's window reaches DELAY_SAMPLES_IN samples before the utterance: zeros.
        self._buf[:DELAY_SAMPLES_IN] = 0.0
        self._len = DELAY_SAMPLES_IN
        self._n_in = 0
        self._n_out = 0

    def push(self, chunk: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
        """Feed 24 kHz samples (1-D, any length); return the 8 kHz samples now fully determined.

        Input that is not float32 is converted to float32 first.
        """
        x = np.asarray(chunk, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"expected a 1-D sample array, got shape {x.shape}")
        n = x.shape[0]
        if n:
            end = self._len + n
            self._reserve(end)
            self._buf[self._len : end] = x
            self._len = end
            self._n_in += n
        # Output k needs input up to 3k + D, i.e. its whole window inside the buffer.
        if self._len < NTAPS:
            return np.empty(0, dtype=np.float32)
        return self._emit((self._len - NTAPS) // _FACTOR + 1)

    def flush(self) -> npt.NDArray[np.float32]:
        """End of utterance: zero-pad, return the remaining output, and reset for the next one.

        After this, the utterance has produced exactly ``ceil(n_in / 3)`` output samples.
        """
        remaining = output_length(self._n_in) - self._n_out
        if remaining <= 0:
            self.reset()
            return np.empty(0, dtype=np.float32)
        needed = _FACTOR * (remaining - 1) + NTAPS
        if needed > self._len:
            self._reserve(needed)
            self._buf[self._len : needed] = 0.0
            self._len = needed
        out = self._emit(remaining)
        self.reset()
        return out

    def _reserve(self, size: int) -> None:
        if size <= self._buf.shape[0]:
            return
        grown = np.zeros(max(size, 2 * self._buf.shape[0]), dtype=np.float32)
        grown[: self._len] = self._buf[: self._len]
        self._buf = grown
        # A strided view with one row per window frame: row m, column j is _buf[3m + j], so the
        # products for outputs k..k+c are one ufunc call over _windows[:, 3k : 3(k+c)].
        step = grown.strides[0]
        self._windows = np.ndarray(
            shape=(_FRAMES_PER_WINDOW, grown.shape[0] - _FACTOR * (_FRAMES_PER_WINDOW - 1)),
            dtype=np.float32,
            buffer=grown,
            strides=(_FACTOR * step, step),
        )

    def _emit(self, count: int) -> npt.NDArray[np.float32]:
        out = np.empty(count, dtype=np.float32)
        if self._prod.shape[1] < _FACTOR * min(count, _BLOCK):
            self._prod = np.empty((_FRAMES_PER_WINDOW, _FACTOR * min(count, _BLOCK)), np.float32)
        for start in range(0, count, _BLOCK):
            c = min(_BLOCK, count - start)
            width = _FACTOR * c
            prod = self._prod[:, :width]
            col = _FACTOR * start
            np.multiply(self._windows[:, col : col + width], _TILED_TAPS[:, :width], out=prod)
            for half, lo, hi in _SUM_PLAN:
                np.add(prod[:half], prod[lo:hi], out=prod[:half])
            phases = prod[0].reshape(c, _FACTOR)
            block = out[start : start + c]
            np.add(phases[:, 0], phases[:, 1], out=block)
            block += phases[:, 2]
        consumed = _FACTOR * count
        keep = self._len - consumed
        # Fewer than NTAPS + 3 samples remain, so the shift is cheap (numpy handles the overlap).
        self._buf[:keep] = self._buf[consumed : self._len]
        self._len = keep
        self._n_out += count
        return out


def decimate_24k_to_8k(x: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    """Whole-utterance decimation: what any chunking of ``x`` through a fresh decimator yields."""
    dec = Decimator24kTo8k()
    head = dec.push(x)
    tail = dec.flush()
    return np.concatenate((head, tail)) if tail.shape[0] else head


def output_length(n_in: int) -> int:
    """Number of 8 kHz samples one utterance of ``n_in`` 24 kHz samples yields: ceil(n_in / 3)."""
    return -(-n_in // _FACTOR)
