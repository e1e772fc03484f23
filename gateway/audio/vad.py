"""Caller speech-start detection for barge-in, on Silero VAD.

The model is the ONNX export shipped inside the ``silero-vad`` wheel (pinned in pyproject.toml;
MIT licence; nothing is downloaded). It takes 8 kHz audio directly in 256-sample (32 ms) windows,
each preceded by the last 32 samples of the previous window as context, and carries a
``(2, batch, 128)`` LSTM state that the caller passes in and gets back (silero-vad's own
``OnnxWrapper.__call__`` in ``utils_vad.py`` is the reference for this contract). Because the
state is an explicit input and output, one :class:`onnxruntime.InferenceSession` serves every
call in the process and each :class:`SpeechStartDetector` keeps only its own ~1 KiB of state.
(The TorchScript export keeps its state inside the module, so there it would take one loaded
model, ~45 ms and ~8 MiB, per call; it is also about twice as slow per window on CPU.)

The per-window probability becomes one event per caller turn:

* a *run* starts at a window with probability >= ``threshold`` and continues while windows stay
  >= ``threshold - 0.15`` (Silero's own hysteresis, ``neg_threshold`` in
  ``get_speech_timestamps``); one window below that ends the run;
* inside a run, a window counts towards ``min_speech_ms`` only if it is also *audible*: at least
  6 dB above the call's noise floor (the quietest window of the last second; until a second
  has been heard, none: the speech of a caller talking from the first window would be its own
  floor) and above -64 dBFS.
  Silero's probability lags the audio: it often stays above 0.8 for one to three windows
  (30-100 ms) after speech stops, so counting probability alone turns some 150 ms "mm-hm"s into
  256 ms of "speech" (measured on espeak-ng backchannels and 150 ms slices of speech). Quiet
  windows inside a run (a soft fricative under line noise) pause the count without ending it;
* the run becomes a speech start once its audible windows add up to ``min_speech_ms`` (rounded
  up to whole 32 ms windows), so a click, a noise burst or an "mm-hm" does not cut the prompt;
* after that the detector is :attr:`~SpeechStartDetector.speaking` until windows below
  ``threshold - 0.15`` have lasted ``min_silence_ms``, and only then can the next start fire;
* a pause inside a turn begins with the first such window and ends at the next window back at
  or above ``threshold``. It *starts* (:attr:`~SpeechStartDetector.pause_start`, which a speech
  gather's end-of-turn timing counts from) where the audible windows stopped, up to
  :data:`MAX_LAG_WINDOWS` earlier: the probability's lag after speech, 30-125 ms on clean
  phrases and up to 280 ms in 20 dB line noise (flite and espeak-ng, measured), would otherwise
  make every caller wait that much longer than the gather's ``complete_timeout``. The silence
  counts from there too; after ``min_silence_ms`` of it the turn is over, and the pause start
  stays until the next speech start, since it is when the caller stopped talking.

All of this is synchronous CPU work with per-call state (STYLE.md rules 1 and 6). The model
costs about 0.17 ms per 32 ms window on one core (0.11 ms per 20 ms frame), which on every frame
of every call would saturate one event loop near 180 calls. So the model runs only on windows
whose outcome can depend on it (``skip_quiet``, the default): while the detector is idle (no
run, not speaking) a window that is not audible can neither count towards ``min_speech_ms`` nor
end anything, so it is not run; its power still feeds the noise floor. A quiet line (digital
silence, stationary line noise: a window's power never reaches 6 dB over the line's own
one-second minimum) then costs a few microseconds a frame, once its first second has been heard
(before that the floor is the absolute one, so line noise runs the model on up to 31 windows).
The model's recurrent state does depend on the background it has heard (started cold on speech
in noise it fires up to 0.5 s late), so the last :data:`LOOKBACK_WINDOWS` skipped windows are
kept and run first when an audible window arrives: the model meets the speech with the state the
line's recent background gives it, and decides as it does when it sees every window
(``tests/unit/audio/test_vad.py`` compares the two on speech, noise and backchannels). The call
feeds the detector only while something interruptible plays
(:class:`gateway.call.session.Call`), so all of it runs inline on the event loop.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from gateway.audio.g711 import Codec, alaw_decode, ulaw_decode
from gateway.errors import ModelLoadError

__all__ = [
    "ABSOLUTE_FLOOR_DBFS",
    "AUDIBLE_MARGIN_DB",
    "LOOKBACK_WINDOWS",
    "MAX_LAG_WINDOWS",
    "NEG_THRESHOLD_OFFSET",
    "NOISE_FLOOR_S",
    "SpeechStartDetector",
    "load_session",
    "model_path",
    "window_samples",
]

NEG_THRESHOLD_OFFSET: Final[float] = 0.15
"""A run continues while the probability stays >= ``threshold`` minus this (Silero's default)."""

AUDIBLE_MARGIN_DB: Final[float] = 6.0
"""A window is audible when its power is this far above the noise floor."""

ABSOLUTE_FLOOR_DBFS: Final[float] = -70.0
"""The noise floor never counts as lower than this (digital silence has no floor to stand on)."""

NOISE_FLOOR_S: Final[float] = 1.0
"""The noise floor is the quietest window of this much recent audio (minimum statistics)."""

LOOKBACK_WINDOWS: Final[int] = 8
"""Skipped quiet windows replayed through the model before an audible one (256 ms at 8 kHz)."""

MAX_LAG_WINDOWS: Final[int] = 4
"""How far a pause start is moved back, over quiet windows, from the first window the model
calls silence (128 ms at 8 kHz): the model's lag on clean speech, where the energy says exactly
when the speech stopped (measured on flite and espeak-ng phrases: 72 ms at the median, 125 ms
at most). In line noise a word's weak last consonant can fall under the audible margin, so a
longer move back would put the pause inside the word."""

_STATE_SHAPE: Final[tuple[int, int, int]] = (2, 1, 128)
_MARGIN: Final[float] = 10.0 ** (AUDIBLE_MARGIN_DB / 10.0)
_ABS_FLOOR: Final[float] = 10.0 ** (ABSOLUTE_FLOOR_DBFS / 10.0)

# G.711 code -> float sample in [-1, 1), built from the project's bit-exact decoders so that
# decoding a frame is one gather into the model's input buffer, whichever codec the call uses
# (an A-law call is decoded as A-law once, never transcoded to mu-law first).
_ULAW_FLOAT: Final = (ulaw_decode(np.arange(256, dtype=np.uint8)) / 32768.0).astype(np.float32)
_ULAW_FLOAT.flags.writeable = False
_ALAW_FLOAT: Final = (alaw_decode(np.arange(256, dtype=np.uint8)) / 32768.0).astype(np.float32)
_ALAW_FLOAT.flags.writeable = False

_session: Any = None
_session_lock = threading.Lock()


def window_samples(sample_rate: int) -> tuple[int, int]:
    """(window, context) sizes in samples that the Silero model takes at ``sample_rate``."""
    if sample_rate == 8000:
        return 256, 32
    if sample_rate == 16000:
        return 512, 64
    raise ValueError(f"Silero VAD runs at 8000 or 16000 Hz, not {sample_rate}")


def model_path() -> Path:
    """Path of ``silero_vad.onnx`` inside the installed ``silero-vad`` package.

    Found without importing ``silero_vad``: its ``model.py`` calls ``torch.set_num_threads(1)`` at
    import time, which would throttle CPU TTS in the same process.
    """
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or spec.origin is None:
        raise ModelLoadError("silero-vad is not installed; pip install 'silero-vad[onnx-cpu]'")
    path = Path(spec.origin).parent / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise ModelLoadError(f"silero-vad is installed but {path} is missing")
    return path


def load_session() -> Any:
    """The process-wide ONNX Runtime session for Silero VAD, loaded and warmed up once.

    Loading takes ~40 ms and ~25 MiB; call this at startup so the first call does not pay it on
    the event loop. ``InferenceSession.run`` is thread-safe and keeps no state between runs.
    """
    global _session
    with _session_lock:
        if _session is None:
            try:
                import onnxruntime as ort
            except ImportError as exc:
                raise ModelLoadError(
                    "onnxruntime is missing; pip install 'silero-vad[onnx-cpu]'"
                ) from exc
            opts = ort.SessionOptions()
            # One 32 ms window is a few hundred kFLOP: a thread pool costs more than it saves.
            opts.intra_op_num_threads = 1
            opts.inter_op_num_threads = 1
            session = ort.InferenceSession(
                str(model_path()), sess_options=opts, providers=["CPUExecutionProvider"]
            )
            window, context = window_samples(8000)
            session.run(
                None,
                {
                    "input": np.zeros((1, context + window), dtype=np.float32),
                    "state": np.zeros(_STATE_SHAPE, dtype=np.float32),
                    "sr": np.array(8000, dtype=np.int64),
                },
            )
            _session = session
        return _session


class SpeechStartDetector:
    """Turns one call's inbound G.711 frames into "the caller started speaking" events.

    One per call (STYLE.md rule 6); not thread-safe. Feed every inbound frame to :meth:`push`,
    in order. Durations are counted in audio samples, not wall-clock time, and have a resolution
    of one model window (32 ms at 8 kHz). The result does not depend on how the audio is chunked:
    only the timing of the ``True`` return moves with frame boundaries.
    """

    __slots__ = (
        "_context",
        "_feeds",
        "_floor_i",
        "_history",
        "_in_run",
        "_min_silence",
        "_min_speech",
        "_neg_threshold",
        "_pending",
        "_powers",
        "_quiet",
        "_run",
        "_session",
        "_silence",
        "_skip_quiet",
        "_skipped",
        "_speaking",
        "_table",
        "_threshold",
        "_views",
        "_window",
        "_x",
        "events",
        "last_event_sample",
        "model_windows",
        "pause_start",
        "probability",
        "samples",
    )

    def __init__(
        self,
        min_speech_ms: int = 250,
        threshold: float = 0.5,
        min_silence_ms: int = 300,
        sample_rate: int = 8000,
        *,
        session: Any = None,
        codec: Codec = "pcmu",
        skip_quiet: bool = True,
    ) -> None:
        """Create a detector for ``codec`` frames; ``session`` defaults to the shared
        :func:`load_session` one. ``skip_quiet=False`` runs the model on every window (its
        :attr:`probability` then follows silero-vad's own wrapper window by window)."""
        if min_speech_ms < 0 or min_silence_ms < 0:
            raise ValueError("min_speech_ms and min_silence_ms must be >= 0")
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be between 0 and 1, got {threshold}")
        if codec not in ("pcmu", "pcma"):
            raise ValueError(f"unknown G.711 codec {codec!r}; expected 'pcmu' or 'pcma'")
        self._table = _ULAW_FLOAT if codec == "pcmu" else _ALAW_FLOAT
        self._window, self._context = window_samples(sample_rate)
        self._threshold = float(threshold)
        self._neg_threshold = max(self._threshold - NEG_THRESHOLD_OFFSET, 0.01)
        self._min_speech = min_speech_ms * sample_rate // 1000
        self._min_silence = min_silence_ms * sample_rate // 1000
        self._session = session if session is not None else load_session()
        # The model input: [context | window], filled in place window by window; views of its
        # window, of its context and of the window's tail (the next context).
        self._x = np.zeros((1, self._context + self._window), dtype=np.float32)
        self._views = (self._x[0, self._context :], self._x[0, : self._context],
                       self._x[0, -self._context :])
        self._feeds: dict[str, npt.NDArray[Any]] = {
            "input": self._x,
            "state": np.zeros(_STATE_SHAPE, dtype=np.float32),
            "sr": np.array(sample_rate, dtype=np.int64),
        }
        self._skip_quiet = skip_quiet
        # The model inputs of the latest skipped windows, a ring, and how many were skipped
        # since the model last ran.
        self._history = np.zeros((LOOKBACK_WINDOWS, 1, self._context + self._window),
                                 dtype=np.float32)
        self._skipped = 0
        # Mean power of recent windows, a ring. A list: the builtin min() of 31 floats costs a
        # fraction of numpy's per-call overhead. A slot not heard yet holds 0.0, so until a
        # second of the line has been heard the floor is the absolute one: learned from the
        # first windows alone, it would be the speech of a caller already talking when the
        # detector starts (espeak-ng's "agent" then never stood 6 dB above itself).
        self._powers = [0.0] * max(1, round(NOISE_FLOOR_S * sample_rate / self._window))
        self._floor_i = 0
        # Inbound codes not yet a whole window.
        self._pending = bytearray()
        self._in_run = False
        self._run = 0
        self._silence = 0
        self._speaking = False
        # Consecutive windows, up to the latest, that were not audible: where the speech's
        # energy ended, which the model's probability follows only 30-250 ms later.
        self._quiet = 0
        #: Speech starts detected since construction or :meth:`reset`.
        self.events = 0
        #: Speech probability of the latest window the model ran on (0.0 before the first).
        self.probability = 0.0
        #: Samples consumed since construction or :meth:`reset`.
        self.samples = 0
        #: Sample count (as in :attr:`samples`) at which the latest speech start completed.
        self.last_event_sample: int | None = None
        #: Windows the model ran on (replayed look-back windows included).
        self.model_windows = 0
        #: Sample count at which the caller's current pause began: where the audible windows
        #: before the first window below ``threshold - 0.15`` after a speech start stopped, at
        #: most :data:`MAX_LAG_WINDOWS` earlier (None while they speak, and before any).
        self.pause_start: int | None = None

    @property
    def speaking(self) -> bool:
        """True from a speech start until ``min_silence_ms`` of silence has followed it."""
        return self._speaking

    @property
    def threshold(self) -> float:
        """Probability at or above which a window starts a speech run."""
        return self._threshold

    def reset(self) -> None:
        """Forget all audio and state, as if newly constructed (the event count restarts too)."""
        self._x.fill(0.0)
        self._feeds["state"] = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self._powers = [0.0] * len(self._powers)
        self._skipped = 0
        self._floor_i = 0
        self._pending.clear()
        self._in_run = False
        self._run = 0
        self._silence = 0
        self._speaking = False
        self._quiet = 0
        self.events = 0
        self.probability = 0.0
        self.samples = 0
        self.last_event_sample = None
        self.model_windows = 0
        self.pause_start = None

    def push(self, frame: bytes | bytearray | memoryview) -> bool:
        """Feed inbound G.711 audio in the detector's codec (normally one 160-byte 20 ms frame;
        any length works).

        Returns True when a speech start completed inside this audio: exactly once per caller
        turn, at the moment the speech has lasted ``min_speech_ms``.
        """
        pending = self._pending
        pending += frame
        n = len(frame)
        self.samples += n
        window = self._window
        if len(pending) < window:
            return False
        # Whole windows only reach numpy: one decode (a gather into the model's input) per 32 ms
        # window instead of one or two per 20 ms frame.
        first = self.samples - len(pending)  # the sample number of pending[0]
        out = self._views[0]
        table = self._table
        started = False
        offset = 0
        while len(pending) - offset >= window:
            # mode="clip" lets take write straight into ``out`` (the default "raise" buffers);
            # a uint8 index can never be out of range of the 256-entry table anyway.
            table.take(np.frombuffer(pending, np.uint8, window, offset), out=out, mode="clip")
            offset += window
            if self._step(first + offset):
                started = True
                self.last_event_sample = first + offset
        del pending[:offset]
        return started

    def _step(self, end: int) -> bool:
        """One model window ending at sample ``end``; True when it completed a speech start."""
        body, head, tail = self._views
        power = float(body.dot(body)) / self._window
        powers = self._powers
        powers[self._floor_i] = power
        self._floor_i = (self._floor_i + 1) % len(powers)
        audible = power >= max(min(powers), _ABS_FLOOR) * _MARGIN
        self._quiet = 0 if audible else self._quiet + 1
        if not audible and self._skip_quiet and not (self._in_run or self._speaking):
            # Idle and quiet: whatever the model said, this window could not count towards a
            # start nor end anything (module docstring). Keep it for the look-back.
            self._history[self._skipped % LOOKBACK_WINDOWS] = self._x
            self._skipped += 1
            head[...] = tail
            return False
        feeds = self._feeds
        if self._skipped:
            self._replay(feeds)
        out, state = self._session.run(None, feeds)
        self.model_windows += 1
        feeds["state"] = state
        # The next window's context is the tail of this one (OnnxWrapper keeps it the same way).
        head[...] = tail
        p = float(out[0, 0])
        self.probability = p
        if not self._speaking:
            if p >= self._threshold or (self._in_run and p >= self._neg_threshold):
                self._in_run = True
                if audible:
                    self._run += self._window
                    if self._run >= self._min_speech:
                        self._speaking = True
                        self._in_run = False
                        self._run = 0
                        self._silence = 0
                        self.events += 1
                        self.pause_start = None
                        return True
            else:
                self._in_run = False
                self._run = 0
            return False
        # Speaking: as in silero-vad's VADIterator, silence starts at the first window below the
        # negative threshold and is only cancelled by a window back at or above ``threshold``.
        if p >= self._threshold:
            self._silence = 0
            self.pause_start = None
        elif p < self._neg_threshold or self._silence:
            if not self._silence:
                # The caller stopped where the audible windows stopped: the quiet ones just
                # before this one (up to the model's lag) were silence already.
                self._silence = min(max(self._quiet, 1), MAX_LAG_WINDOWS) * self._window
                self.pause_start = end - self._silence
            else:
                self._silence += self._window
            if self._silence >= self._min_silence:
                self._speaking = False
                self._silence = 0
        return False

    def _replay(self, feeds: dict[str, npt.NDArray[Any]]) -> None:
        """Run the latest skipped windows through the model, oldest first, so that it meets
        this audible window with the state the line's recent background gives it."""
        skipped, self._skipped = self._skipped, 0
        count = min(skipped, LOOKBACK_WINDOWS)
        history = self._history
        model_input = feeds["input"]
        for i in range(skipped - count, skipped):
            feeds["input"] = history[i % LOOKBACK_WINDOWS]
            feeds["state"] = self._session.run(None, feeds)[1]
        feeds["input"] = model_input
        self.model_windows += count
