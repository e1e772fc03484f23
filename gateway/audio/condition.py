"""Phone-audio conditioning of TTS output (24 kHz float, before it is resampled to 8 kHz).

Three things stand between what the model says and what the caller should hear, all in the
call's phone path (:class:`gateway.audio.framer.PhonePipeline`), so live speech and cached
prompts (rendered through the same path) sound the same:

- :class:`LeadingSilenceTrimmer`: Qwen3-TTS often starts an utterance with tens of milliseconds
  of near silence (the Nari Labs latency write-up recovered ~80 ms of first audio by not sending
  it). It drops samples until the onset of speech, keeps a short pre-roll before the onset so a
  soft consonant is not clipped, and fades that pre-roll in with a raised cosine so the first
  sample sent is not a step (a click). Samples from the onset on pass through bit-identical.
  Trailing audio is never touched: an utterance ends where the model ends it, never mid-word.
- :class:`LevelNormalizer`: brings each utterance towards one active-speech level and limits its
  peaks below full scale with a look-ahead limiter, so a loud voice never clips in G.711 (whose
  codes saturate at full scale: clipping is heard as harsh distortion on every peak).
- :func:`fade_out_frame`: the short fade that replaces the next 20 ms when a barge-in stops a
  prompt, so the caller hears the prompt fade instead of a step to silence (a click).

:class:`SpeechConditioner` chains trim and level for one utterance at a time. Everything here is
chunk-invariant (the output depends only on the samples, never on how they were chunked), which
keeps a live render and its cached copy identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gateway.audio.g711 import Codec, alaw_decode, alaw_encode, ulaw_decode, ulaw_encode

__all__ = [
    "Conditioning",
    "LeadingSilenceTrimmer",
    "LevelNormalizer",
    "SpeechConditioner",
    "fade_out_frame",
]

_EMPTY = np.zeros(0, dtype=np.float32)

#: Onset threshold: -50 dBFS peak. Speech onsets cross it within a few ms; codec noise floors of
#: a silent start stay below it.
DEFAULT_THRESHOLD = 10 ** (-50 / 20)


class LeadingSilenceTrimmer:
    """Streaming trimmer for one utterance at a time (24 kHz float32 in, same out).

    ``push(chunk)`` returns what may be sent now. Until the onset is found nothing is returned;
    after ``max_trim_s`` of audio without an onset the trimmer gives up and passes everything
    (a very quiet utterance is still spoken, never swallowed). ``reset()`` starts a new utterance.
    """

    def __init__(
        self,
        sample_rate: int = 24_000,
        threshold: float = DEFAULT_THRESHOLD,
        preroll_s: float = 0.005,
        max_trim_s: float = 1.0,
    ) -> None:
        self.threshold = float(threshold)
        self.preroll = max(0, round(preroll_s * sample_rate))
        self.max_trim = round(max_trim_s * sample_rate)
        # Raised-cosine ramp from 0 (exclusive) up to 1 (exclusive) over the pre-roll.
        n = self.preroll
        self._ramp = (0.5 - 0.5 * np.cos(np.pi * (np.arange(n) + 1) / (n + 1))).astype(np.float32)
        self.reset()

    def reset(self) -> None:
        self._done = False
        self._held = np.zeros(0, dtype=np.float32)
        #: Samples dropped before the onset in the current utterance.
        self.trimmed = 0

    @property
    def passing(self) -> bool:
        """True once the onset was found (everything now passes untouched)."""
        return self._done

    def push(self, chunk: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Return the part of ``chunk`` (plus held pre-roll) to send now."""
        if self._done:
            return chunk
        x = np.concatenate([self._held, np.asarray(chunk, dtype=np.float32)])
        loud = np.flatnonzero(np.abs(x) > self.threshold)
        if loud.size == 0:
            if self.trimmed + len(x) >= self.max_trim:
                self._done = True
                self._held = np.zeros(0, dtype=np.float32)
                return x
            # Keep only a pre-roll's worth: that is all the onset can still need.
            keep = min(len(x), self.preroll)
            self.trimmed += len(x) - keep
            self._held = x[len(x) - keep :].copy()
            return np.zeros(0, dtype=np.float32)
        onset = int(loud[0])
        # The pre-roll never includes exact digital silence: leading zeros always go.
        nonzero = np.flatnonzero(x[:onset])
        first_sound = int(nonzero[0]) if nonzero.size else onset
        start = max(onset - self.preroll, first_sound)
        self.trimmed += start
        out = x[start:].copy()
        n_pre = onset - start
        if n_pre:
            out[:n_pre] *= self._ramp[self.preroll - n_pre :]
        self._done = True
        self._held = np.zeros(0, dtype=np.float32)
        return out


def _db(value: float) -> float:
    return float(10 ** (value / 20))


class LevelNormalizer:
    """Streaming level normalisation and peak limiting for one utterance (24 kHz float32).

    Audio is processed in fixed 10 ms blocks counted from the utterance's first sample, each
    with ``lookahead_blocks`` of look-ahead, so the output depends only on the samples (chunked
    == whole) and a block is emitted as soon as its look-ahead has arrived (a TTS chunk is 80 ms
    or more: only its last ``lookahead_blocks`` wait for the next chunk or :meth:`flush`).

    One block of look-ahead is all the limiter needs (below), and every block held back is
    audio a live caller gets one chunk later: with two, 40 ms of an 80 ms first chunk reached
    the phone (the resampler's delay and the framer's partial frame take the rest), with one,
    60 ms; the call's start buffer (:mod:`gateway.call.playout`) holds a live utterance's start
    by exactly what is held back, so each block costs every live turn 10-20 ms of first audio.

    The gain of block ``k`` is the smaller of

    - the level gain: ``target / level`` clamped to ``[min_gain_db, max_gain_db]``, where
      ``level`` is the RMS of the active blocks (above ``gate_dbfs``) from the utterance's start
      up to the end of block ``k``'s look-ahead, moved at most ``agc_db_per_s`` from block to
      block (no pumping), and
    - the limiter gain: ``ceiling / peak`` over block ``k`` and its look-ahead, so the gain is
      already down when a peak arrives; after a peak it recovers at ``release_db_per_s``.

    Within a block the gain ramps linearly from the previous block's end value, so gain changes
    never step. No output sample exceeds ``ceiling_dbfs``: each block's ramp stays at or below
    the limiter gain of that block, which the previous block's look-ahead already respected
    (its end gain was computed over it and the next block, so one block of look-ahead keeps
    the guarantee; the gain then falls over the 10 ms before a peak).
    """

    def __init__(
        self,
        sample_rate: int = 24_000,
        target_dbfs: float = -20.0,
        ceiling_dbfs: float = -1.0,
        max_gain_db: float = 6.0,
        min_gain_db: float = -18.0,
        gate_dbfs: float = -45.0,
        block_s: float = 0.01,
        lookahead_blocks: int = 1,
        agc_db_per_s: float = 20.0,
        release_db_per_s: float = 30.0,
    ) -> None:
        if lookahead_blocks < 1:
            raise ValueError("lookahead_blocks must be >= 1 (the limiter needs it)")
        if ceiling_dbfs > 0:
            raise ValueError(f"ceiling_dbfs must be <= 0, got {ceiling_dbfs}")
        self.block = max(1, round(block_s * sample_rate))
        self.lookahead = lookahead_blocks
        self.target = _db(target_dbfs)
        self.ceiling = _db(ceiling_dbfs)
        self.max_gain = _db(max_gain_db)
        self.min_gain = _db(min_gain_db)
        self._gate_power = _db(gate_dbfs) ** 2
        blocks_per_s = sample_rate / self.block
        self._agc_step = _db(agc_db_per_s / blocks_per_s)
        self._release = _db(release_db_per_s / blocks_per_s)
        self._ramp = ((np.arange(self.block) + 1) / self.block).astype(np.float32)
        self.reset()

    def reset(self) -> None:
        """Forget the utterance: the next sample is the first of a new one."""
        self._pending = _EMPTY
        #: Per measured block (not yet emitted): peak and the cumulative active power/count.
        self._peaks: list[float] = []
        self._levels: list[float | None] = []
        self._power_sum = 0.0
        self._active = 0
        self._measured = 0
        self._gain: float | None = None
        self._agc: float | None = None
        #: Lowest gain applied so far in this utterance (1.0 = untouched).
        self.min_applied = 1.0

    def push(self, chunk: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
        """Feed samples; returns the conditioned samples that may be sent now."""
        x = np.concatenate([self._pending, np.asarray(chunk, dtype=np.float32)])
        full = len(x) // self.block
        self._measure(x, full)
        emit = max(0, full - self.lookahead)
        out = self._emit(x, emit, final=False)
        self._pending = x[emit * self.block :]
        return out

    def flush(self) -> npt.NDArray[np.float32]:
        """End of utterance: emit everything held back (the last block may be short)."""
        x = self._pending
        full = len(x) // self.block
        self._measure(x, full, partial=len(x) % self.block != 0)
        blocks = full + (1 if len(x) % self.block else 0)
        out = self._emit(x, blocks, final=True)
        self.reset()
        return out

    def _measure(self, x: npt.NDArray[np.float32], full: int, partial: bool = False) -> None:
        # Blocks already measured are the first len(self._peaks) of x (not yet emitted).
        # Every new block at once: a block's peak and power depend on its own samples only
        # (a row reduction), so how the audio was chunked never changes them.
        b = self.block
        start = len(self._peaks)
        if full > start:
            blocks = x[start * b : full * b].reshape(full - start, b)
            self._add_blocks(np.abs(blocks).max(axis=1),
                             np.square(blocks, dtype=np.float64).sum(axis=1) / b)
        if partial:
            tail = x[full * b :]
            peak = float(np.max(np.abs(tail))) if tail.size else 0.0
            power = float(np.square(tail, dtype=np.float64).sum()) / max(1, tail.size)
            self._add_blocks(np.array([peak]), np.array([power]))

    def _add_blocks(self, peaks: npt.NDArray[np.floating],
                    powers: npt.NDArray[np.floating]) -> None:
        """Record measured blocks: each block's peak, and the utterance's active level after
        it (RMS of the blocks above the gate so far; None before the first)."""
        active = powers >= self._gate_power
        sums = self._power_sum + np.cumsum(np.where(active, powers, 0.0))
        counts = self._active + np.cumsum(active)
        self._power_sum = float(sums[-1])
        self._active = int(counts[-1])
        self._peaks.extend(peaks.tolist())
        levels = np.sqrt(sums / np.maximum(counts, 1))
        self._levels.extend(float(level) if count else None
                            for level, count in zip(levels.tolist(), counts.tolist(),
                                                    strict=True))

    def _emit(self, x: npt.NDArray[np.float32], blocks: int, *, final: bool
              ) -> npt.NDArray[np.float32]:
        if blocks <= 0:
            return _EMPTY
        b = self.block
        # Each block's gain ramps from the last block's end gain to its own (the AGC and the
        # limiter's rules, scalar and sequential); the samples are then scaled in one pass.
        starts = np.empty(blocks, dtype=np.float32)
        ends = np.empty(blocks, dtype=np.float32)
        peaks, levels = self._peaks, self._levels
        for k in range(blocks):
            level = levels[min(k + self.lookahead, len(levels) - 1)]
            wanted = 1.0 if level is None or level <= 0 else min(
                self.max_gain, max(self.min_gain, self.target / level))
            if self._agc is None:
                self._agc = wanted
            elif wanted > self._agc:
                self._agc = min(wanted, self._agc * self._agc_step)
            else:
                self._agc = max(wanted, self._agc / self._agc_step)
            ahead = peaks[k : k + self.lookahead + 1]
            peak = max(ahead) if ahead else 0.0
            limit = self.ceiling / peak if peak > 0 else float("inf")
            end = min(self._agc, limit)
            start = end if self._gain is None else self._gain
            end = min(end, start * self._release)
            self._gain = end
            self.min_applied = min(self.min_applied, start, end)
            starts[k], ends[k] = start, end
        n = min(len(x), blocks * b)
        out = np.empty(n, dtype=np.float32)
        whole = n // b
        if whole:
            gains = starts[:whole, None] + (ends[:whole] - starts[:whole])[:, None] * self._ramp
            np.multiply(x[: whole * b].reshape(whole, b), gains, out=out[: whole * b].reshape(
                whole, b))
        if n > whole * b:  # the utterance's last, short block
            rest = n - whole * b
            ramp = starts[whole] + (ends[whole] - starts[whole]) * self._ramp[:rest]
            np.multiply(x[whole * b : n], ramp, out=out[whole * b :])
        del self._peaks[:blocks]
        del self._levels[:blocks]
        return out


@dataclass(frozen=True)
class Conditioning:
    """Which conditioning the phone path applies (from settings; see the README table)."""

    trim_leading_silence: bool = True
    normalize_level: bool = True
    target_dbfs: float = -20.0

    @property
    def identity(self) -> str:
        """What this conditioning does to the audio, as text (part of prompt-cache keys)."""
        trim = "on" if self.trim_leading_silence else "off"
        level = f"{self.target_dbfs:g}dBFS" if self.normalize_level else "off"
        return f"trim={trim},level={level}"

    def new(self) -> SpeechConditioner:
        """A conditioner for one call (reset between utterances)."""
        return SpeechConditioner(
            LeadingSilenceTrimmer() if self.trim_leading_silence else None,
            LevelNormalizer(target_dbfs=self.target_dbfs) if self.normalize_level else None,
        )


class SpeechConditioner:
    """Trim, then level, one utterance at a time (24 kHz float32 in and out)."""

    __slots__ = ("level", "trimmer")

    def __init__(self, trimmer: LeadingSilenceTrimmer | None,
                 level: LevelNormalizer | None) -> None:
        self.trimmer = trimmer
        self.level = level

    def push(self, chunk: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
        x = np.asarray(chunk, dtype=np.float32)
        if self.trimmer is not None:
            x = self.trimmer.push(x)
        if self.level is not None:
            x = self.level.push(x)
        return x

    def flush(self) -> npt.NDArray[np.float32]:
        out = self.level.flush() if self.level is not None else _EMPTY
        if self.trimmer is not None:
            self.trimmer.reset()
        return out

    def reset(self) -> None:
        if self.trimmer is not None:
            self.trimmer.reset()
        if self.level is not None:
            self.level.reset()


def fade_out_frame(frame: bytes, codec: Codec) -> bytes:
    """``frame`` (G.711) faded from full level to silence with a raised cosine.

    Sent in place of the next 20 ms when a barge-in stops a prompt: the caller hears the prompt
    fade out over one frame instead of a step from mid-waveform to silence.
    """
    pcm = ulaw_decode(frame) if codec == "pcmu" else alaw_decode(frame)
    n = len(pcm)
    ramp = 0.5 + 0.5 * np.cos(np.pi * (np.arange(n) + 1) / n)
    faded = np.rint(pcm * ramp).astype(np.int16)
    return ulaw_encode(faded) if codec == "pcmu" else alaw_encode(faded)
