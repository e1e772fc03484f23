"""Telephone-band conditioning of TTS output before it is resampled: leading-silence trim.

Qwen3-TTS often starts an utterance with tens of milliseconds of near silence (the Nari Labs
latency write-up recovered ~80 ms of first audio by not sending it). :class:`LeadingSilenceTrimmer`
drops samples until the onset of speech, keeps a short pre-roll before the onset so a soft
consonant is not clipped, and fades that pre-roll in with a raised cosine so the first sample
sent is not a step (a click). Samples from the onset on pass through bit-identical. Trailing
audio is never touched: an utterance ends where the model ends it, never mid-word.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

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
