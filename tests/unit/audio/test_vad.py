"""SpeechStartDetector on real speech (espeak-ng, synthesised at run time) and on line noise.

Everything goes through the real path: float audio -> int16 -> the project's mu-law encoder ->
160-byte frames -> the shipped Silero VAD model. Times are frame ends in seconds of audio.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import time
import wave
from importlib.metadata import version
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from scipy import signal

from gateway.audio.g711 import ULAW_SILENCE, float_to_int16, ulaw_decode, ulaw_encode
from gateway.audio.vad import MAX_LAG_WINDOWS, NOISE_FLOOR_S, SpeechStartDetector

RATE = 8000
FRAME = 160
WINDOW_S = 256 / RATE
SPEECH_DBFS = -20.0
ONSET_DBFS = -45.0

Audio = npt.NDArray[np.float64]

ESPEAK_MISSING = (
    "espeak-ng is not installed; these tests synthesise caller speech with it. "
    "Install it with `apt-get install -y espeak-ng` (.ci/run does)."
)


def _level(x: Audio, dbfs: float) -> Audio:
    return x * (10 ** (dbfs / 20) / np.sqrt(np.mean(x**2)))


@functools.cache
def _say(text: str, speed: int = 175, rate: int = RATE) -> Audio:
    """espeak-ng's voice at ``rate`` Hz, trimmed to its audible part, at SPEECH_DBFS RMS."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.fail(ESPEAK_MISSING)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "say.wav"
        subprocess.run([exe, "-s", str(speed), "-w", str(path), text], check=True)
        with wave.open(str(path)) as w:
            native = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    g = np.gcd(rate, native)
    x = signal.resample_poly(pcm / 32768.0, rate // g, native // g)
    loud = np.flatnonzero(np.abs(x) > 10 ** (-40 / 20))
    return _level(x[loud[0] : loud[-1] + 1], SPEECH_DBFS)


def _silence(seconds: float) -> Audio:
    return np.zeros(round(seconds * RATE))


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _white(seconds: float, dbfs: float, seed: int = 0) -> Audio:
    return _level(_rng(seed).standard_normal(round(seconds * RATE)), dbfs)


def _hum(seconds: float, dbfs: float, mains_hz: float) -> Audio:
    """Mains hum with its odd harmonics, as a ground loop puts on an analogue line."""
    t = np.arange(round(seconds * RATE)) / RATE
    h = sum(a * np.sin(2 * np.pi * k * mains_hz * t) for k, a in ((1, 1.0), (3, 0.5), (5, 0.3)))
    return _level(np.asarray(h), dbfs)


def _pink(seconds: float, dbfs: float, seed: int = 1) -> Audio:
    # Paul Kellet's economy 1/f filter (accurate to +-0.05 dB above 9 Hz at 44.1 kHz; close
    # enough at 8 kHz for "pink-ish").
    b = [0.049922035, -0.095993537, 0.050612699, -0.004408786]
    a = [1.0, -2.494956002, 2.017265875, -0.522189400]
    return _level(signal.lfilter(b, a, _rng(seed).standard_normal(round(seconds * RATE))), dbfs)


def _line_noise(seconds: float, dbfs: float = -30.0, mains_hz: float = 50.0) -> Audio:
    return _white(seconds, dbfs) + _hum(seconds, dbfs - 6, mains_hz)


def _ulaw(x: Audio) -> bytes:
    return ulaw_encode(float_to_int16(x.astype(np.float32)))


def _frames(data: bytes, size: int = FRAME) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def _run(det: SpeechStartDetector, x: Audio) -> list[float]:
    """Feed ``x`` frame by frame; the end times (s) of the frames where push returned True."""
    fired = []
    for i, frame in enumerate(_frames(_ulaw(x))):
        if det.push(frame):
            fired.append((i + 1) * FRAME / RATE)
    return fired


def _onset(x: Audio) -> float:
    """First 5 ms block above ONSET_DBFS: where the speech starts, from the signal energy."""
    block = RATE // 200
    power = np.mean(x[: len(x) // block * block].reshape(-1, block) ** 2, axis=1)
    return float(np.flatnonzero(power > 10 ** (ONSET_DBFS / 10))[0] * block / RATE)


@pytest.mark.parametrize("text", ["I'd like to check my balance", "operator please"])
def test_speech_after_silence_fires_once_after_min_speech(text: str) -> None:
    x = np.concatenate([_silence(1.0), _say(text), _silence(1.0)])
    onset = _onset(x)
    det = SpeechStartDetector()
    fired = _run(det, x)
    assert len(fired) == 1, fired
    assert det.events == 1
    latency = fired[0] - onset
    # Counted in whole 32 ms windows, so the first window may start just before the onset.
    assert 0.250 - WINDOW_S <= latency <= 0.250 + 0.100, latency
    assert not det.speaking, "1 s of trailing silence outlasts min_silence_ms"


@pytest.mark.parametrize("text", ["agent", "operator please", "I'd like to check my balance"])
@pytest.mark.parametrize("lead_s", [0.0, 0.02])
def test_speech_from_the_first_window_fires(text: str, lead_s: float) -> None:
    """A caller already talking when the detector starts to listen (they speak over the first
    instant of a greeting, or the next interruptible prompt starts mid-sentence): the detector
    has heard no line yet, so its noise floor, the quietest window of the last second, was the
    speech itself, and "agent" from espeak-ng never stood 6 dB above it: never a speech start
    (a softphone test's phrase went unheard in a CI run). Until a second of the line is heard,
    the floor is the absolute one."""
    x = np.concatenate([_silence(lead_s), _say(text), _silence(0.5)])
    fired = _run(SpeechStartDetector(), x)
    assert len(fired) == 1, fired
    assert fired[0] - _onset(x) <= 0.250 + 0.100, fired


def test_speaking_lasts_through_the_utterance() -> None:
    speech = _say("I'd like to check my balance")
    det = SpeechStartDetector()
    assert _run(det, np.concatenate([_silence(1.0), speech])) != []
    assert det.speaking
    assert _run(det, _silence(0.2)) == []
    assert det.speaking, "200 ms is shorter than min_silence_ms"
    assert _run(det, _silence(0.5)) == []
    assert not det.speaking


def test_digital_silence_never_fires() -> None:
    det = SpeechStartDetector(min_speech_ms=100)
    for _ in range(250):
        assert not det.push(bytes([ULAW_SILENCE]) * FRAME)
    assert det.events == 0
    assert not det.speaking


def test_low_level_noise_never_fires() -> None:
    det = SpeechStartDetector(min_speech_ms=100)
    assert _run(det, _white(5.0, -60.0)) == []
    assert det.events == 0


@pytest.mark.parametrize("mains_hz", [50.0, 60.0])
@pytest.mark.parametrize("min_speech_ms", [250, 100])
def test_line_noise_never_fires(mains_hz: float, min_speech_ms: int) -> None:
    x = _line_noise(6.0, -30.0, mains_hz)
    burst = slice(2 * RATE, 3 * RATE)
    x[burst] += _pink(1.0, -15.0)
    det = SpeechStartDetector(min_speech_ms=min_speech_ms)
    assert _run(det, x) == []
    assert det.events == 0


@pytest.mark.parametrize("snr_db", [20.0, 15.0])
@pytest.mark.parametrize("text", ["I'd like to check my balance", "operator please"])
def test_speech_in_line_noise_fires(snr_db: float, text: str) -> None:
    speech = _level(_say(text), -30.0 + snr_db)
    x = _line_noise(len(speech) / RATE + 2.0)
    x[RATE : RATE + len(speech)] += speech
    det = SpeechStartDetector()
    fired = _run(det, x)
    assert len(fired) == 1, fired
    # Windows where the speech barely clears the noise do not count towards min_speech_ms,
    # so noise costs some latency (measured: 30-110 ms at 15-20 dB SNR).
    assert 0.250 - WINDOW_S <= fired[0] - 1.0 <= 0.250 + 0.150, fired


BACKCHANNELS = [("uh huh", 300), ("mm", 450)]


@pytest.mark.parametrize(("text", "speed"), BACKCHANNELS)
@pytest.mark.parametrize("noisy", [False, True])
def test_short_backchannel_does_not_fire_unless_configured(
    text: str, speed: int, noisy: bool
) -> None:
    utterance = _say(text, speed)
    assert 0.120 <= len(utterance) / RATE <= 0.180, "the fixture should be a ~150 ms 'mm-hm'"
    x = np.concatenate([_silence(1.0), utterance, _silence(1.0)])
    if noisy:
        x += _line_noise(len(x) / RATE, SPEECH_DBFS - 20.0)
    assert _run(SpeechStartDetector(min_speech_ms=250), x) == []
    assert len(_run(SpeechStartDetector(min_speech_ms=100), x)) == 1


def test_two_utterances_a_second_apart_fire_twice() -> None:
    speech = _say("I'd like to check my balance")
    x = np.concatenate([_silence(1.0), speech, _silence(1.0), speech, _silence(0.5)])
    det = SpeechStartDetector()
    fired = _run(det, x)
    assert len(fired) == 2, fired
    assert det.events == 2
    second_onset = 1.0 + len(speech) / RATE + 1.0
    assert second_onset < fired[1] <= second_onset + 0.350


def test_a_pause_shorter_than_min_silence_is_one_turn() -> None:
    first, second = _say("I'd like to check"), _say("my balance")
    x = np.concatenate([_silence(1.0), first, _silence(0.15), second, _silence(1.0)])
    det = SpeechStartDetector(min_silence_ms=300)
    assert len(_run(det, x)) == 1


def test_a_pause_starts_where_the_speech_stops_and_ends_when_it_resumes() -> None:
    first, second = _say("I'd like to check"), _say("my balance")
    x = np.concatenate([_silence(1.0), first, _silence(0.6), second, _silence(1.0)])
    end_first = 1.0 + len(first) / RATE
    end_second = end_first + 0.6 + len(second) / RATE
    det = SpeechStartDetector(min_silence_ms=300)
    ends: list[tuple[float, float]] = []  # (frame end where the turn ended, its pause start)
    resumed = 0
    for i, frame in enumerate(_frames(_ulaw(x))):
        before, speaking = det.pause_start, det.speaking
        if det.push(frame):
            assert det.pause_start is None
        if before is not None and det.pause_start is None and det.speaking:
            resumed += 1  # a dip inside a word: the pause ended when the speech came back
        if speaking and not det.speaking:
            assert det.pause_start is not None
            ends.append(((i + 1) * FRAME / RATE, det.pause_start / RATE))
    assert det.events == 2
    assert len(ends) == 2, ends
    for (seen, start), end in zip(ends, (end_first, end_second), strict=True):
        # Where the audio stopped, not one to three windows later, when Silero's probability
        # fell (module docstring).
        assert end - 0.05 <= start <= end + 0.05, (start, end)
        assert start + 0.3 <= seen <= start + 0.3 + 2 * WINDOW_S
    print(f"\npauses that resumed inside the speech: {resumed}")
    # The turn is over, but when the caller stopped talking stays known.
    assert not det.speaking and det.pause_start is not None


PAUSE_PHRASES = [("repeat", 175), ("say that again", 175), ("say that again", 130),
                 ("no thanks", 175), ("no thanks", 130), ("correct", 130),
                 ("operator please", 175), ("operator please", 130), ("billing", 175),
                 ("billing", 130)]


def _final_pause_lag(text: str, speed: int, noisy: bool) -> float:
    """Seconds from the true end of ``text`` to the pause start the detector reports."""
    speech = _say(text, speed)
    x = np.concatenate([_silence(1.0), speech, _silence(1.0)])
    if noisy:
        x += _line_noise(len(x) / RATE, SPEECH_DBFS - 20.0)
    det = SpeechStartDetector()
    fired = _run(det, x)
    assert len(fired) == 1, (text, speed, fired)
    assert det.pause_start is not None, (text, speed)
    return det.pause_start / RATE - (1.0 + len(speech) / RATE)


def test_a_pause_starts_where_the_audio_stops_not_where_the_model_notices() -> None:
    """Silero's probability stays up 50-110 ms after these phrases end (clean) and 50-180 ms
    in 20 dB line noise; a gather's complete_timeout counted from there made every caller wait
    that much longer. The pause now starts where the audible windows stopped."""
    clean = [_final_pause_lag(text, speed, noisy=False) for text, speed in PAUSE_PHRASES]
    assert all(-0.05 <= lag <= 0.04 for lag in clean), np.round(clean, 3)
    noisy = [_final_pause_lag(text, speed, noisy=True) for text, speed in PAUSE_PHRASES]
    # In noise a weak last consonant can fall under the audible margin: the move back is
    # capped at the model's lag on clean speech, so the pause never starts further inside.
    assert float(np.median(noisy)) <= 0.04, np.round(noisy, 3)
    assert min(noisy) >= -(MAX_LAG_WINDOWS + 1) * WINDOW_S, np.round(noisy, 3)


def test_reset_clears_state() -> None:
    x = np.concatenate([_silence(0.5), _say("I'd like to check my balance"), _silence(0.2)])
    det = SpeechStartDetector()
    first = _run(det, x)
    assert det.speaking
    assert det.events == 1
    det.reset()
    assert not det.speaking
    assert det.events == 0
    assert det.samples == 0
    assert det.probability == 0.0
    assert det.last_event_sample is None
    assert det.pause_start is None
    # Nothing survives a reset: model state, context, noise floor, run and silence counters.
    assert _run(det, x) == first
    det.reset()
    half = len(x) // 2
    _run(det, x[:half])
    det.reset()
    assert _run(det, x) == first


def test_chunking_does_not_change_decisions() -> None:
    speech = _say("I'd like to check my balance")
    data = _ulaw(np.concatenate([_silence(1.0), speech, _silence(1.0), speech, _silence(0.5)]))
    reference = SpeechStartDetector()
    events = []
    for frame in _frames(data):
        if reference.push(frame):
            events.append(reference.last_event_sample)
    sizes = _rng(7).integers(0, 700, size=len(data))
    det, pos, chunked = SpeechStartDetector(), 0, []
    for size in sizes:
        if pos >= len(data):
            break
        if det.push(data[pos : pos + size]):
            chunked.append(det.last_event_sample)
        pos += int(size)
    assert len(events) == 2
    assert chunked == events
    assert det.probability == reference.probability


# silero-vad's own loader uses importlib.resources.path, deprecated since Python 3.11.
@pytest.mark.filterwarnings("ignore:path is deprecated:DeprecationWarning")
def test_probabilities_match_silero_reference_wrapper() -> None:
    """Our streaming loop feeds the model exactly as silero-vad's own OnnxWrapper does."""
    import torch
    from silero_vad import load_silero_vad

    assert version("silero-vad") == "6.2.3", "re-check the ONNX input contract in vad.py"
    data = _ulaw(np.concatenate([_silence(0.3), _say("operator please"), _white(0.5, -30.0)]))
    reference = load_silero_vad(onnx=True)
    det = SpeechStartDetector(skip_quiet=False)  # every window through the model
    ours, theirs = [], []
    for window in _frames(data[: len(data) // 256 * 256], 256):
        det.push(window)
        ours.append(det.probability)
        samples = torch.from_numpy(ulaw_decode(window).astype(np.float32) / 32768.0)
        theirs.append(float(reference(samples, RATE)))
    assert ours == theirs
    assert max(ours) > 0.9


def test_wideband_16k() -> None:
    speech = _say("operator please", rate=16000)
    x = np.concatenate([np.zeros(16000), speech, np.zeros(8000)])
    det = SpeechStartDetector(sample_rate=16000)
    fired = [i for i, frame in enumerate(_frames(_ulaw(x), 320)) if det.push(frame)]
    assert len(fired) == 1
    assert 0.250 - 0.032 <= (fired[0] + 1) * 0.020 - 1.0 <= 0.350


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sample_rate": 44100},
        {"threshold": 0.0},
        {"threshold": 1.0},
        {"min_speech_ms": -1},
        {"min_silence_ms": -1},
    ],
)
def test_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SpeechStartDetector(**kwargs)  # type: ignore[arg-type]


def test_per_frame_cost_is_small_enough_to_run_on_the_event_loop() -> None:
    frames = _frames(_ulaw(np.concatenate([_say("I'd like to check my balance"), _white(4, -30)])))
    det = SpeechStartDetector()
    start = time.perf_counter()
    for frame in frames:
        det.push(frame)
    per_frame = (time.perf_counter() - start) / len(frames)
    # Measured ~0.1 ms per 20 ms frame on one core; a loaded 2-core CI box gets 10x headroom.
    assert per_frame < 1e-3, f"{per_frame * 1e6:.0f} us per frame"


# --- quiet windows skip the model ----------------------------------------------------------------


def _events(x: Audio, **kwargs: object) -> tuple[list[int], SpeechStartDetector]:
    det = SpeechStartDetector(**kwargs)  # type: ignore[arg-type]
    events = []
    for frame in _frames(_ulaw(x)):
        if det.push(frame):
            assert det.last_event_sample is not None
            events.append(det.last_event_sample)
    return events, det


def _speech_in_noise(text: str, snr_db: float, lead_s: float, seed: int = 0) -> Audio:
    speech = _level(_say(text), -30.0 + snr_db)
    x = _white(lead_s + len(speech) / RATE + 1.0, -30.0, seed) + _hum(
        lead_s + len(speech) / RATE + 1.0, -36.0, 60.0)
    start = round(lead_s * RATE)
    x[start : start + len(speech)] += speech
    return x


def _corpus() -> dict[str, Audio]:
    cases: dict[str, Audio] = {}
    for text in ("I'd like to check my balance", "operator please"):
        speech = _say(text)
        cases[f"clean: {text}"] = np.concatenate(
            [_silence(1.0), speech, _silence(1.0), speech, _silence(0.5)])
        for snr in (20.0, 10.0, 6.0):
            cases[f"{snr:g} dB SNR: {text}"] = _speech_in_noise(text, snr, 1.0)
        cases[f"after 10 s of line noise: {text}"] = _speech_in_noise(text, 12.0, 10.0, seed=2)
    for text, speed in BACKCHANNELS:
        x = np.concatenate([_silence(1.0), _say(text, speed), _silence(1.0)])
        cases[f"backchannel: {text}"] = x
        cases[f"backchannel in noise: {text}"] = x + _line_noise(len(x) / RATE, -40.0)
    burst = _line_noise(6.0)
    burst[2 * RATE : 3 * RATE] += _pink(1.0, -15.0)
    cases["pink noise burst"] = burst
    return cases


@pytest.mark.parametrize("min_speech_ms", [250, 100])
def test_skipping_quiet_windows_decides_like_running_the_model_on_every_window(
    min_speech_ms: int,
) -> None:
    """Quiet windows while idle never reach the model; the look-back replays the latest of them
    before an audible one. Every case fires as often as with the model on every window, at
    the same window on clean speech and within one window (32 ms, the detector's resolution)
    in noise, where the model's state carries a slightly different background."""
    for name, x in _corpus().items():
        every, full = _events(x, min_speech_ms=min_speech_ms, skip_quiet=False)
        gated, det = _events(x, min_speech_ms=min_speech_ms)
        assert len(gated) == len(every), (name, gated, every)
        tolerance = 0 if name.startswith("clean") else 256
        assert all(abs(a - b) <= tolerance for a, b in zip(gated, every, strict=True)), (
            name, gated, every)
        assert full.model_windows == full.samples // 256
        assert det.model_windows < 0.85 * full.model_windows, name


@pytest.mark.parametrize(
    "line", ["digital silence", "line noise -30 dBFS", "line noise -50 dBFS", "60 Hz hum"])
def test_a_quiet_line_never_runs_the_model(line: str) -> None:
    """What a caller's line carries while they listen to a prompt costs no model run once the
    detector has heard a second of it (the model is ~95% of the detector's cost: 0.17 ms a
    window). In that first second the floor is the absolute one (a caller may be talking from
    the first window), so a noisy line runs the model on at most that second's 31 windows
    (~5 ms of CPU per start of listening); digital silence never does."""
    seconds = 10.0
    x = {
        "digital silence": _silence(seconds),
        "line noise -30 dBFS": _line_noise(seconds, -30.0),
        "line noise -50 dBFS": _line_noise(seconds, -50.0, 60.0),
        "60 Hz hum": _hum(seconds, -30.0, 60.0),
    }[line]
    det = SpeechStartDetector()
    first = round(NOISE_FLOOR_S * RATE)
    fired = _run(det, x[:first])
    in_first_second = det.model_windows
    fired += _run(det, x[first:])
    assert fired == [] and det.samples == seconds * RATE
    assert in_first_second <= round(NOISE_FLOOR_S / WINDOW_S)
    if line == "digital silence":
        assert in_first_second == 0
    assert det.model_windows == in_first_second, "the model ran after the first second"


# --- A-law calls: decoded as A-law, once ---------------------------------------------------------


@pytest.mark.parametrize("text", ["I'd like to check my balance", "operator please"])
def test_an_alaw_call_is_detected_like_a_mulaw_call(text: str) -> None:
    """A SIP call negotiated on PCMA feeds its A-law frames straight in (no transcoding to
    mu-law per packet): the same speech fires once, within a window of the mu-law detector."""
    from gateway.audio.g711 import alaw_encode

    x = np.concatenate([_silence(1.0), _say(text), _silence(1.0)])
    mulaw = _run(SpeechStartDetector(), x)
    det = SpeechStartDetector(codec="pcma")
    fired = []
    for i, frame in enumerate(_frames(alaw_encode(float_to_int16(x.astype(np.float32))))):
        if det.push(frame):
            fired.append((i + 1) * FRAME / RATE)
    assert len(fired) == 1 and len(mulaw) == 1, (fired, mulaw)
    assert abs(fired[0] - mulaw[0]) <= WINDOW_S + 1e-9
    # A-law's linear zero is 0xD5: digital silence on an A-law call is silence too.
    silent = SpeechStartDetector(min_speech_ms=100, codec="pcma")
    assert not any(silent.push(bytes([0xD5]) * FRAME) for _ in range(200))


def test_an_unknown_codec_is_refused() -> None:
    with pytest.raises(ValueError, match=r"G\.711 codec"):
        SpeechStartDetector(codec="opus")  # type: ignore[arg-type]
