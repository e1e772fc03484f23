"""A simulated device: an engine whose prefill, step and decode take the times a profile gives.

A planning and test instrument in the spirit of Vidur (the inference simulator that predicts
serving latency from profiled operation times): :class:`SimulatedEngine` is a
:class:`~gateway.tts.engine.BatchEngine` like the real one, driven by the same engine core and
scheduler, whose calls wait as long as a :class:`DeviceProfile` says the device would take (a
``time.sleep``, which releases the GIL as a wait on a GPU does), and whose rows produce real
24 kHz audio (a voiced, syllable-paced signal at speech level, deterministic per seed), so that
the whole phone path (levels, G.711, pacing, the transports) runs for every caller. It answers
"how many live callers would this gateway hold on that device" past the hardware we have.

It is selected only explicitly (``GATEWAY_ENGINE=simulated`` with ``GATEWAY_DEVICE_PROFILE``),
never as a fallback, and says so loudly: its name (in ``/readyz`` and every log line that names
the engine) starts with ``SIMULATED``.

Profiles (:func:`load_profile`): a built-in name from ``gateway/tts/profiles/`` or a JSON file.
A profile states where its numbers come from. ``h200-0.6b-anchors`` is estimated from published
anchors; the GPU run (``bench/gpu_batching.sh``) writes a measured one whenever a GPU is lent.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gateway.errors import ConfigError, EngineError
from gateway.tts.chunking import ChunkPlanner
from gateway.tts.engine import (
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    BatchEngine,
    EngineRow,
    SpeechRequest,
    VoicePrompt,
)
from gateway.tts.qwen import DEFAULT_CHUNK_SCHEDULE, default_max_frames, parse_chunk_schedule

log = logging.getLogger(__name__)

__all__ = ["PROFILES_DIR", "DeviceProfile", "SimulatedEngine", "load_profile"]

#: Built-in profiles (JSON), by file stem.
PROFILES_DIR = Path(__file__).with_name("profiles")
#: The batch sizes a graph-mode step runs at (as the real engine's buckets).
_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
_SPEAKERS = ("aiden", "dylan", "eric", "ono_anna", "ryan", "serena", "sohee", "uncle_fu",
             "vivian")
_LANGUAGES = ("Auto", "Chinese", "English", "French", "German", "Italian", "Japanese",
              "Korean", "Portuguese", "Russian", "Spanish")


@dataclass(frozen=True)
class DeviceProfile:
    """How long a device takes for each engine call (milliseconds), and where that comes from.

    The step: ``step_base_ms + step_per_row_ms * bucket + step_per_row_key_ms * bucket *
    attended / 1000`` (the batch runs at its bucket, as graphs do), unless a measured ``table``
    of step times by bucket and attended length is given (then looked up, interpolated between
    measured buckets and lengths). A prefill call: ``prefill_base_ms + prefill_per_token_ms *
    tokens`` (a batched call pays the base once). A decode call: ``decode_base_ms +
    decode_per_row_frame_ms * frames decoded`` over every row in it.
    """

    name: str
    device: str
    model: str
    source: str
    step_base_ms: float
    step_per_row_ms: float = 0.0
    step_per_row_key_ms: float = 0.0
    prefill_base_ms: float = 0.0
    prefill_per_token_ms: float = 0.0
    decode_base_ms: float = 0.0
    decode_per_row_frame_ms: float = 0.0
    #: Prompt tokens of a turn: ``prompt_base_tokens + len(text) / chars_per_token``.
    prompt_base_tokens: int = 20
    chars_per_token: float = 4.0
    max_rows: int = 64
    #: Measured step ms: ``{bucket: {attended_length: ms}}`` (keys as strings in JSON).
    table: dict[int, dict[int, float]] = field(default_factory=dict)
    #: Where each parameter comes from (free text per key).
    notes: dict[str, str] = field(default_factory=dict)

    def step_ms(self, bucket: int, attended: int) -> float:
        if self.table:
            return _lookup(self.table, bucket, attended)
        return (self.step_base_ms + self.step_per_row_ms * bucket
                + self.step_per_row_key_ms * bucket * attended / 1000)

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill_base_ms + self.prefill_per_token_ms * tokens

    def decode_ms(self, frames: int) -> float:
        return self.decode_base_ms + self.decode_per_row_frame_ms * frames

    def scaled(self, step_ms_at: tuple[int, float]) -> DeviceProfile:
        """This profile with every time scaled so that a step of ``bucket`` rows at 512
        attended positions takes ``ms`` (for sweeps: 'a device twice as slow')."""
        bucket, ms = step_ms_at
        factor = ms / self.step_ms(bucket, 512)
        return DeviceProfile(
            name=f"{self.name} x{factor:.2f}", device=f"{self.device}, times x{factor:.2f}",
            model=self.model, source=f"{self.source}; every time scaled x{factor:.2f}",
            step_base_ms=self.step_base_ms * factor,
            step_per_row_ms=self.step_per_row_ms * factor,
            step_per_row_key_ms=self.step_per_row_key_ms * factor,
            prefill_base_ms=self.prefill_base_ms * factor,
            prefill_per_token_ms=self.prefill_per_token_ms * factor,
            decode_base_ms=self.decode_base_ms * factor,
            decode_per_row_frame_ms=self.decode_per_row_frame_ms * factor,
            prompt_base_tokens=self.prompt_base_tokens, chars_per_token=self.chars_per_token,
            max_rows=self.max_rows,
            table={b: {n: ms * factor for n, ms in row.items()} for b, row in self.table.items()},
            notes=self.notes,
        )

    def to_json(self) -> str:
        data = {k: v for k, v in self.__dict__.items() if k != "table"}
        data["table"] = {str(b): {str(n): ms for n, ms in row.items()}
                         for b, row in self.table.items()}
        return json.dumps(data, indent=2) + "\n"


def _lookup(table: dict[int, dict[int, float]], bucket: int, attended: int) -> float:
    """Step ms from a measured table: the smallest measured bucket >= ``bucket`` (the largest
    beyond it, scaled by rows), the smallest measured length >= ``attended``."""
    buckets = sorted(table)
    fit = next((b for b in buckets if b >= bucket), buckets[-1])
    row = table[fit]
    lengths = sorted(row)
    length = next((n for n in lengths if n >= attended), lengths[-1])
    ms = row[length]
    if bucket > fit:
        ms *= bucket / fit
    return ms


def load_profile(spec: str) -> DeviceProfile:
    """A built-in profile by name (``gateway/tts/profiles/<name>.json``) or a JSON file."""
    builtin = PROFILES_DIR / f"{spec}.json"
    path = builtin if "/" not in spec and builtin.is_file() else Path(spec)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise ConfigError(f"device profile {spec!r} not found: give a JSON file or one of: "
                          f"{known}")
    try:
        data = json.loads(path.read_text())
        table = {int(b): {int(n): float(ms) for n, ms in row.items()}
                 for b, row in data.pop("table", {}).items()}
        return DeviceProfile(**data, table=table)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"device profile {path}: {exc}") from None


def _bucket(rows: int, cap: int) -> int:
    return next((b for b in _BUCKETS if b >= rows and b <= cap), cap)


def _voice_loop(f0: float, seconds: float = 2.0) -> np.ndarray:
    """A voiced, syllable-paced signal at speech level that loops without a click: a harmonic
    tone whose pitch wanders and whose loudness moves at ~4 syllables a second, plus a little
    breath noise (trimmed, levelled and detected as speech by the phone path like a voice)."""
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    # Whole cycles of every modulation in ``seconds``, so that the loop joins smoothly.
    vibrato = 1 + 0.08 * np.sin(2 * np.pi * (1 / seconds) * t)
    phase = 2 * np.pi * np.cumsum(f0 * vibrato) / SAMPLE_RATE
    phase *= round(float(phase[-1]) / (2 * np.pi)) * 2 * np.pi / float(phase[-1])
    voiced = np.sin(phase) + 0.5 * np.sin(2 * phase) + 0.25 * np.sin(3 * phase)
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * (8 / seconds) * t)
    breath = 0.004 * np.random.default_rng(int(f0)).standard_normal(n)
    return (0.12 * envelope * voiced + breath).astype(np.float32)


#: Pitches the simulated voices speak at (a loop each, made once per process).
_PITCHES = (110.0, 125.0, 140.0, 155.0, 170.0, 185.0, 200.0, 215.0)
_LOOPS: dict[float, np.ndarray] = {}


class _Voice:
    """One row's speech: a loop of one pitch from a seeded starting point (a slice per chunk:
    no synthesis on the engine's thread)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        f0 = _PITCHES[int(rng.integers(len(_PITCHES)))]
        loop = _LOOPS.get(f0)
        if loop is None:
            loop = _LOOPS.setdefault(f0, _voice_loop(f0))
        self.loop = loop
        self.sample = int(rng.integers(len(loop)))

    def chunk(self, frames: int) -> np.ndarray:
        n = frames * SAMPLES_PER_FRAME
        start = self.sample % len(self.loop)
        self.sample += n
        if start + n <= len(self.loop):
            return self.loop[start : start + n].copy()
        return np.resize(np.roll(self.loop, -start), n)


@dataclass(eq=False)
class SimRow:
    """One turn on the simulated device."""

    request: SpeechRequest
    prompt_tokens_: int
    max_frames: int
    voice: _Voice
    planner: ChunkPlanner
    prefilled: int = 0
    ready: bool = False
    frames: int = 0
    finished: str | None = None
    pending: int = 0
    target: int = 1
    epoch: int = 0
    #: The text track: tokens so far, and whether the text is complete (streaming turns).
    text_tokens: int = 0
    text_done: bool = True
    codes: list[Any] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_tokens_

    @property
    def prefilling(self) -> bool:
        return not self.ready

    @property
    def frames_to_chunk(self) -> int:
        return max(0, self.target - self.pending) if self.ready else 0

    @property
    def waiting_for_text(self) -> bool:
        return not self.text_done and self.frames >= self.text_tokens


class SimulatedEngine(BatchEngine):
    """A batch engine on a simulated device (see the module docstring)."""

    def __init__(
        self,
        profile: DeviceProfile,
        *,
        max_rows: int | None = None,
        chunk_schedule: str | Sequence[int] = DEFAULT_CHUNK_SCHEDULE,
        adaptive_chunks: bool = True,
        prefill_chunk: int = 0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.profile = profile
        self.max_rows = max_rows or profile.max_rows
        self.chunk_schedule = parse_chunk_schedule(chunk_schedule)
        self.adaptive_chunks = adaptive_chunks
        self.prefill_chunk = prefill_chunk
        self._sleep = sleep
        self._rows: list[SimRow] = []
        self._epoch = 0
        self._owner: object | None = None
        #: Seconds the simulated device was busy (prefill, step, decode), in all.
        self.device_s = 0.0
        log.warning("SIMULATED device: %s (profile %r: %s); no model runs, audio is synthetic",
                    profile.device, profile.name, profile.source)

    # --- Engine API -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return (f"SIMULATED device {self.profile.device} ({self.profile.model}, profile "
                f"{self.profile.name}; batched, {self.max_rows} rows)")

    @property
    def speakers(self) -> Sequence[str]:
        return _SPEAKERS

    @property
    def languages(self) -> Sequence[str]:
        return _LANGUAGES

    @property
    def fingerprint(self) -> str:
        return f"simulated:{self.profile.name}"

    def warmup(self, voices: Sequence[tuple[str, str] | VoicePrompt] = ()) -> None:
        """Nothing to capture or warm on a simulated device."""

    def stream(self, request: SpeechRequest, should_stop: Callable[[], bool] | None = None
               ) -> Generator[np.ndarray, None, None]:
        try:
            self.validate(request)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if self._owner is not None:
            raise RuntimeError("this engine is driven by a running engine core")
        return self._solo(request, should_stop)

    def _solo(self, request: SpeechRequest, should_stop: Callable[[], bool] | None
              ) -> Generator[np.ndarray, None, None]:
        row = self.open(request)
        try:
            while row.prefilling:
                self.prefill(row)
            while True:
                if row.finished is None:
                    if should_stop is not None and should_stop():
                        return
                    self.step([row])
                audio = self.next_chunk(row)
                if audio is not None:
                    yield audio
                elif row.finished is not None:
                    return
        finally:
            if row in self._rows:
                self.close(row)

    # --- BatchEngine --------------------------------------------------------------------------

    @property
    def free_rows(self) -> int:
        return self.max_rows - len(self._rows)

    def claim(self, owner: object) -> None:
        self._owner = owner

    def open(self, request: SpeechRequest) -> SimRow:
        if not self.free_rows:
            raise RuntimeError("no free row")
        profile = self.profile
        tokens = profile.prompt_base_tokens + math.ceil(len(request.text) / profile.chars_per_token)
        frames = request.max_frames or default_max_frames(request.text)
        planner = ChunkPlanner(self.chunk_schedule, adaptive=self.adaptive_chunks)
        row = SimRow(request=request, prompt_tokens_=tokens, max_frames=frames,
                     voice=_Voice(request.seed if request.seed is not None else id(request)),
                     planner=planner, epoch=self._epoch)
        row.target = planner.next_size()
        if request.text_stream:
            # As the real engine: the prompt holds the first text token, the rest is read
            # one token a frame; the turn runs until its text is done and read.
            row.text_tokens = max(0, tokens - profile.prompt_base_tokens - 1)
            row.text_done = False
            row.max_frames = request.max_frames or 10**6
        self._rows.append(row)
        return row

    def extend_text(self, row: EngineRow, text: str, last: bool) -> int:
        own = self._own(row)
        if own.text_done:
            raise EngineError("this turn's text is complete; nothing more can be added")
        added = math.ceil(len(text) / self.profile.chars_per_token) if text else 0
        own.text_tokens += added
        if last:
            own.text_done = True
            # Speech runs ~3 frames a text token past the text's end (a word's sound is
            # longer than its token), then the turn ends (the model's EOS).
            own.max_frames = min(own.max_frames, own.frames + 3 * max(1, own.text_tokens -
                                                                     own.frames) + 4)
        return added

    def prefill(self, row: EngineRow) -> int:
        own = self._own(row)
        left = own.prompt_tokens - own.prefilled
        tokens = left if self.prefill_chunk <= 0 else min(self.prefill_chunk, left)
        self._busy(self.profile.prefill_ms(tokens))
        own.prefilled += tokens
        own.ready = own.prefilled >= own.prompt_tokens
        return tokens

    def prefill_rows(self, rows: Sequence[EngineRow]) -> int:
        own = [self._own(row) for row in rows]
        if self.prefill_chunk > 0 or any(r.prefilled for r in own):
            return sum(self.prefill(row) for row in own)
        tokens = sum(r.prompt_tokens for r in own)
        self._busy(self.profile.prefill_ms(tokens))
        for row in own:
            row.prefilled, row.ready = row.prompt_tokens, True
        return tokens

    def step(self, rows: Sequence[EngineRow]) -> int:
        own = [self._own(row) for row in rows]
        if not own:
            return 0
        bucket = _bucket(len(self._rows), self.max_rows)
        attended = max(r.prompt_tokens + r.frames for r in own) + 1
        attended = 1 << max(8, math.ceil(math.log2(attended)))  # graph lengths 256, 512, ...
        self._busy(self.profile.step_ms(bucket, attended))
        for row in own:
            if not row.ready or row.finished is not None:
                raise ValueError("only ready, unfinished rows can step")
            if row.waiting_for_text:
                raise ValueError("a streaming row has read all its text: it waits for more")
            row.frames += 1
            row.pending += 1
            if row.frames >= max(row.max_frames, row.request.min_frames or 0):
                row.finished = "cap"
        return bucket

    def next_chunk(self, row: EngineRow) -> np.ndarray | None:
        return self.next_chunks([row])[0]

    def next_chunks(self, rows: Sequence[EngineRow]) -> list[np.ndarray | None]:
        own = [self._own(row) for row in rows]
        due = [r for r in own if r.pending and (r.pending >= r.target or r.finished is not None)]
        if due:
            self._busy(self.profile.decode_ms(sum(r.pending for r in due)))
        out: list[np.ndarray | None] = []
        due_ids = {id(r) for r in due}
        for row in own:
            if id(row) not in due_ids:
                out.append(None)
                continue
            audio = row.voice.chunk(row.pending)
            row.planner.chunk_done(row.pending)
            row.pending = 0
            row.target = row.planner.next_size()
            out.append(audio)
        return out

    def close(self, row: EngineRow) -> None:
        own = self._own(row)
        self._rows.remove(own)
        own.epoch = -1

    def rebuild(self) -> None:
        self._epoch += 1
        self._rows = []

    # --- helpers --------------------------------------------------------------------------------

    def _own(self, row: EngineRow) -> SimRow:
        if not isinstance(row, SimRow) or row.epoch != self._epoch:
            raise EngineError("this turn's row was lost when the engine was rebuilt")
        return row

    def _busy(self, ms: float) -> None:
        seconds = max(0.0, ms) / 1000
        self.device_s += seconds
        if seconds:
            self._sleep(seconds)
