"""Recognition off the event loop: the speech listener, the worker pool and its failure modes.

Every failure is a RecognizerError subclass, which the IVR turns into "fall back to keys with a
logged reason"; the pool keeps working for the next turn.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys

import numpy as np
import pytest

from gateway.asr.base import MatchStatus, RecognitionResult
from gateway.asr.grammar import SpeechGrammar
from gateway.asr.pool import PRE_ROLL_S, RecognizerPool, SpeechListener
from gateway.asr.sphinx import PocketSphinxRecognizer
from gateway.asr.synth import RATE, SynthVoice, phone_line, synthesize
from gateway.audio.vad import SpeechStartDetector
from gateway.errors import (
    GrammarError,
    RecognizerError,
    RecognizerTimeout,
    RecognizerUnavailable,
)
from tests.support import asr_fakes

MENU = SpeechGrammar.build({"agent": ["agent", "operator"], "billing": ["billing"]})
FRAME = 160
SPEECH = np.full(RATE // 2, 100, dtype=np.int16)


class _Captured:
    """An async recognise function that records the audio it was given."""

    def __init__(self) -> None:
        self.calls: list[np.ndarray] = []

    async def __call__(self, pcm: np.ndarray, grammar: SpeechGrammar) -> RecognitionResult:
        self.calls.append(pcm)
        return RecognitionResult(MatchStatus.MATCH, branch="agent", audio_s=len(pcm) / RATE)


async def test_session_without_speech_start_is_no_speech_and_decodes_nothing() -> None:
    rec = _Captured()
    s = SpeechListener(rec, MENU)
    for _ in range(200):
        assert s.feed(b"\xff" * FRAME)
    assert s.audio_s == pytest.approx(PRE_ROLL_S)
    assert s.dropped_s == pytest.approx(200 * 0.02 - PRE_ROLL_S)
    r = await s.finish()
    assert r.status is MatchStatus.NO_SPEECH
    assert rec.calls == []
    with pytest.raises(RuntimeError):
        await s.finish()
    # A frame that arrives after the gather stopped listening is dropped, never an error on
    # the call's frame path.
    assert s.feed(b"\xff" * FRAME) is False
    assert s.audio_s == 0


async def test_session_follows_pauses_and_recognises_the_audio_so_far() -> None:
    rec = _Captured()
    s = SpeechListener(rec, MENU)
    assert (await s.recognize()).status is MatchStatus.NO_SPEECH and rec.calls == []
    s.speech_paused(0.5)  # a pause before any speech is not the caller's
    assert s.paused_at is None and s.pauses == 0
    s.speech_started(1.0)
    for _ in range(10):
        s.feed(b"\x01" * FRAME)
    s.speech_paused(1.2)
    assert (s.started_at, s.paused_at, s.pauses) == (1.0, 1.2, 1)
    first = await s.recognize()
    assert first.matched and len(rec.calls[0]) == 10 * FRAME
    s.speech_resumed(1.3)
    assert s.paused_at is None
    s.feed(b"\x01" * FRAME)
    s.speech_paused(1.5)
    s.speech_started(2.0)  # speaking again after the detector's turn had ended
    assert (s.started_at, s.paused_at, s.pauses) == (1.0, None, 2)
    await s.finish()
    assert len(rec.calls[1]) == 11 * FRAME
    s.close()


async def test_session_keeps_the_pre_roll_then_speech_up_to_the_cap() -> None:
    rec = _Captured()
    s = SpeechListener(rec, MENU, max_speech_s=1.0)
    for _ in range(100):
        s.feed(b"\x01" * FRAME)
    s.speech_started()
    assert s.speech
    accepted = [s.feed(b"\x02" * FRAME) for _ in range(60)]
    assert accepted == [True] * 49 + [False] * 11
    assert s.full
    assert s.audio_s == pytest.approx(PRE_ROLL_S + 1.0)
    await s.finish()
    (pcm,) = rec.calls
    assert len(pcm) == round((PRE_ROLL_S + 1.0) * RATE)


async def test_session_without_vad_gating_keeps_everything_and_takes_l16() -> None:
    rec = _Captured()
    s = SpeechListener(rec, MENU, encoding="l16", vad_gated=False, max_speech_s=0.5)
    long = np.full(5000, 100, dtype=np.int16)
    s.feed(long[:1000].tobytes())
    s.feed(long.tobytes())
    assert s.full and s.dropped_s == pytest.approx(2000 / RATE)
    await s.finish()
    assert np.array_equal(rec.calls[0], np.full(4000, 100, dtype=np.int16))


def test_session_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="encoding"):
        SpeechListener(_Captured(), MENU, encoding="opus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_speech_s"):
        SpeechListener(_Captured(), MENU, max_speech_s=0)
    with pytest.raises(ValueError):
        RecognizerPool(asr_fakes.Echo, workers=0)
    with pytest.raises(ValueError):
        RecognizerPool(asr_fakes.Echo, timeout_s=0)


async def test_pocketsphinx_in_a_worker_recognises_a_vad_gated_turn_frame_by_frame() -> None:
    """The shape of the later integration: 20 ms mu-law frames, the VAD marks speech start."""
    pool = RecognizerPool(PocketSphinxRecognizer, workers=1, timeout_s=30.0)
    await pool.start()
    try:
        assert pool.name.startswith("pocketsphinx-5.")
        speech = synthesize("operator please", SynthVoice("flite", "slt"))
        mulaw = phone_line(speech, lead_s=2.0, tail_s=0.8)
        vad = SpeechStartDetector()
        listener = pool.listener(MENU)
        ended_at = None
        for i in range(0, len(mulaw), FRAME):
            frame = mulaw[i : i + FRAME]
            listener.feed(frame)
            if vad.push(frame):
                listener.speech_started()
            elif listener.speech and not vad.speaking:
                ended_at = i
                break
        assert ended_at is not None, "the VAD saw the end of speech"
        # 2 s of leading silence, of which only the pre-roll is recognised.
        assert listener.dropped_s > 1.0
        held_s = listener.audio_s
        r = await listener.finish()
        assert (r.status, r.branch, r.phrase) == (MatchStatus.MATCH, "agent", "operator"), r
        assert r.cpu_s > 0 and r.audio_s == pytest.approx(held_s)
        with pytest.raises(GrammarError) as exc:
            await pool.prepare(SpeechGrammar.build({"x": ["frobnicate"]}))
        assert exc.value.problems == [
            "\"frobnicate\" is not in the recogniser's dictionary (in 'frobnicate')"]
    finally:
        await pool.close()
    with pytest.raises(RecognizerUnavailable, match="closed"):
        await pool.recognize(SPEECH, MENU)


async def test_a_pool_that_was_not_started_is_unavailable() -> None:
    with pytest.raises(RecognizerUnavailable, match="not running"):
        await RecognizerPool(asr_fakes.Echo).recognize(SPEECH, MENU)


def _cue(value: int) -> np.ndarray:
    return np.full(RATE // 2, value, dtype=np.int16)


async def test_worker_failures_are_recognizer_errors_and_the_pool_recovers() -> None:
    pool = RecognizerPool(asr_fakes.Flaky, workers=1, timeout_s=1.5, max_pending=1)
    await pool.start()
    try:
        ok = await pool.recognize(SPEECH, MENU)
        assert (ok.branch, ok.digits) == ("agent", str(len(SPEECH)))

        with pytest.raises(RecognizerError, match="decoder failed on this turn"):
            await pool.recognize(_cue(asr_fakes.RAISE), MENU)
        assert (await pool.recognize(SPEECH, MENU)).matched

        with pytest.raises(RecognizerUnavailable, match="worker died"):
            await pool.recognize(_cue(asr_fakes.DIE), MENU)
        with pytest.raises(RecognizerUnavailable, match="restarting"):
            await pool.recognize(SPEECH, MENU)  # keys, not a wait, while it restarts
        await pool.ready()
        assert (await pool.recognize(SPEECH, MENU)).matched, "a fresh worker took over"

        # Tasks run in the order they were created, so the wedged turn holds the only slot
        # when the second one asks for it.
        wedged, shed = await asyncio.gather(pool.recognize(_cue(asr_fakes.WEDGE), MENU),
                                            pool.recognize(SPEECH, MENU),
                                            return_exceptions=True)
        assert isinstance(shed, RecognizerUnavailable) and "already waiting" in str(shed)
        assert isinstance(wedged, RecognizerTimeout) and "within 1.5 s" in str(wedged)
        assert pool.pending == 0
        await pool.ready()
        assert (await pool.recognize(SPEECH, MENU)).matched, "the wedged worker was replaced"
    finally:
        await pool.close()


async def test_workers_fork_from_one_clean_server_not_from_the_gateway() -> None:
    # Forking the gateway (an event loop, torch's threads) is never safe; spawning a fresh
    # interpreter per worker re-imports the recogniser each time (~1.3 CPU-s with scipy). The
    # fork server is both clean and paid once: every pool of the process forks from it.
    import torch  # noqa: F401  (the gateway's process holds it; its workers must not)

    assert "torch" in sys.modules
    parents = set()
    for _ in range(2):
        pool = RecognizerPool(asr_fakes.Whereabouts, workers=2)
        await pool.start()
        try:
            assert (await pool.recognize(SPEECH, MENU)).matched
            parent, heavy = pool.name.split(" ")
        finally:
            await pool.close()
        assert heavy == "-", f"a worker inherited the gateway's modules: {heavy}"
        parents.add(int(parent))
    assert len(parents) == 1 and os.getpid() not in parents, parents


async def test_a_recogniser_that_cannot_load_fails_start() -> None:
    pool = RecognizerPool(functools.partial(asr_fakes.cannot_load), workers=1)
    with pytest.raises(RecognizerUnavailable, match="failed to start"):
        await pool.start()
    await pool.close()
