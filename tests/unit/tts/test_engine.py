"""The engine on CPU with the tiny checkpoint: streaming, chunking, seeds, stopping, errors."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.errors import EngineError, ModelLoadError
from gateway.tts.batched import BatchedQwenEngine
from gateway.tts.engine import SAMPLES_PER_FRAME, Engine, SpeechRequest
from gateway.tts.qwen import default_max_frames, parse_chunk_schedule
from gateway.tts.service import SpeechService
from gateway.tts.tiny import TINY_MAX_NEW_TOKENS


def test_chunks_follow_the_schedule_then_repeat_its_last_entry(
    tiny_engine: BatchedQwenEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fixed schedule here; adaptive shrinking is tested in test_tts_chunking.py.
    monkeypatch.setattr(tiny_engine, "adaptive_chunks", False)
    request = SpeechRequest(text="Press one for billing.", seed=1, max_frames=23)
    sizes = [len(c) // SAMPLES_PER_FRAME for c in tiny_engine.stream(request)]
    assert all(
        len(c) % SAMPLES_PER_FRAME == 0
        for c in tiny_engine.stream(SpeechRequest(text="x", seed=1, max_frames=5))
    )
    # (1, 2, 4, 8) then 8s; the random model may stop early by sampling EOS.
    expected = [1, 2, 4, 8, 8]
    assert sizes[: len(sizes) - 1] == expected[: len(sizes) - 1]
    assert sum(sizes) <= 23 and sizes[-1] <= expected[min(len(sizes) - 1, 4)]


def test_first_chunk_is_one_codec_frame(tiny_engine: BatchedQwenEngine) -> None:
    first = next(iter(tiny_engine.stream(SpeechRequest(text="Hello there.", seed=3))))
    assert first.dtype == np.float32 and first.shape == (SAMPLES_PER_FRAME,)
    assert np.isfinite(first).all() and np.abs(first).max() <= 1.0


def test_same_seed_same_audio_different_seed_different_audio(
    tiny_engine: BatchedQwenEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def render(seed: int) -> tuple[np.ndarray, torch.Tensor]:
        request = SpeechRequest(text="Your balance is ten dollars.", seed=seed, max_frames=12)
        audio = np.concatenate(list(tiny_engine.stream(request)))
        return audio, torch.cat(tiny_engine.last_codes)

    # With adaptive chunking the chunk boundaries follow the measured speed (a busy machine
    # splits a turn into more, smaller chunks), and the codec decodes a frame with slightly
    # different float rounding depending on where its chunk starts: the codes must be identical,
    # the audio the same within float noise relative to the signal.
    (a, codes_a), (_, codes_b), (c, codes_c) = render(7), render(3), render(7)
    assert torch.equal(codes_a, codes_c)
    assert np.abs(a - c).max() <= 1e-4 * np.abs(a).max()
    assert not (codes_a.shape == codes_b.shape and torch.equal(codes_a, codes_b))
    # With a fixed schedule the boundaries are fixed too, and the audio is bit for bit the same.
    monkeypatch.setattr(tiny_engine, "adaptive_chunks", False)
    (d, _), _, (e, _) = render(7), render(3), render(7)
    assert np.array_equal(d, e)


def test_a_production_engine_keeps_no_codes_of_its_last_utterance(
    tiny_engine: BatchedQwenEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Code tensors are recorded only when asked (tests, debugging): an idle production engine
    must not hold its last utterance's codes until its next one."""
    monkeypatch.setattr(tiny_engine, "record_codes", False)
    chunks = list(tiny_engine.stream(SpeechRequest(text="Press two.", seed=5, max_frames=6)))
    assert chunks and tiny_engine.last_codes == []
    assert inspect.signature(BatchedQwenEngine).parameters["record_codes"].default is False


def test_closing_the_stream_stops_generation_and_the_engine_stays_usable(
    tiny_engine: BatchedQwenEngine,
) -> None:
    stream = tiny_engine.stream(SpeechRequest(text="A long sentence. " * 20, seed=5))
    next(stream)
    t0 = time.perf_counter()
    stream.close()
    assert time.perf_counter() - t0 < 0.5
    again = list(tiny_engine.stream(SpeechRequest(text="Again.", seed=5, max_frames=3)))
    assert sum(len(c) for c in again) <= 3 * SAMPLES_PER_FRAME and again


def test_max_frames_defaults_from_text_length(tiny_engine: BatchedQwenEngine) -> None:
    text = "Hi."
    total = sum(len(c) for c in tiny_engine.stream(SpeechRequest(text=text, seed=2)))
    assert total <= default_max_frames(text) * SAMPLES_PER_FRAME
    assert default_max_frames("a" * 100) > default_max_frames("a")


def test_the_checkpoints_max_new_tokens_bounds_a_request_that_names_no_length(
    tiny_engine: BatchedQwenEngine,
) -> None:
    """The tiny checkpoint's generation_config.json says ``max_new_tokens: 64`` (it never
    samples EOS): a request that names no length stops there, as qwen-tts's own ``generate``
    would, however long its text; one that names its length gets it."""
    long = "Thank you for calling Acme Energy, we are glad to help you today. " * 3
    assert tiny_engine.shared.max_new_tokens == TINY_MAX_NEW_TOKENS
    assert default_max_frames(long) > 2 * TINY_MAX_NEW_TOKENS
    assert tiny_engine.shared.default_frames(long) == TINY_MAX_NEW_TOKENS
    assert tiny_engine.shared.default_frames("Hi.") == default_max_frames("Hi.")

    def frames(request: SpeechRequest) -> int:
        for _ in tiny_engine.stream(request):
            pass
        return int(torch.cat(tiny_engine.last_codes).shape[0])

    assert frames(SpeechRequest(text=long, seed=4)) == TINY_MAX_NEW_TOKENS
    named = TINY_MAX_NEW_TOKENS + 6
    assert frames(SpeechRequest(text=long, seed=4, max_frames=named, min_frames=named)) == named


def test_unknown_speaker_or_language_is_a_clear_error(tiny_engine: BatchedQwenEngine) -> None:
    with pytest.raises(EngineError, match=r"unknown speaker 'nobody'.*ryan"):
        tiny_engine.stream(SpeechRequest(text="Hi.", speaker="nobody"))
    with pytest.raises(EngineError, match="unknown language 'Klingon'"):
        tiny_engine.stream(SpeechRequest(text="Hi.", language="Klingon"))
    with pytest.raises(EngineError, match="empty text"):
        tiny_engine.stream(SpeechRequest(text="   "))


def test_engine_reports_the_published_speakers(tiny_engine: BatchedQwenEngine) -> None:
    assert {"ryan", "vivian", "serena", "aiden"} <= set(tiny_engine.speakers)
    assert "English" in tiny_engine.languages
    assert "cpu" in tiny_engine.name


def test_missing_local_model_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError) as info:
        BatchedQwenEngine(model=str(missing), device="cpu")
    message = str(info.value)
    assert str(missing) in message and "--model" in message and "\n" not in message


def test_unreachable_hub_model_is_one_clear_line(tmp_path: Path) -> None:
    """Through the CLI in a fresh process: huggingface_hub reads HF_HUB_OFFLINE at import."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "say", "Hello.", "-o", str(tmp_path / "x.wav"),
         "--model", "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice" in errors[0]
    assert "--model /path/to/model" in errors[0]
    assert not (tmp_path / "x.wav").exists()


def test_broken_local_directory_names_the_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="local directory"):
        BatchedQwenEngine(model=str(tmp_path), device="cpu")


def test_base_model_is_refused_for_custom_voice_speech(tiny_base_model_dir: Path) -> None:
    engine = BatchedQwenEngine(model=str(tiny_base_model_dir), device="cpu")
    with pytest.raises(EngineError, match="'base' model"):
        engine.stream(SpeechRequest(text="Hi."))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("1,2,4,8", (1, 2, 4, 8)), ("2", (2,)), (" 1, 3 ", (1, 3)), ((4, 4), (4, 4))],
)
def test_chunk_schedule_parsing(spec: str, expected: tuple[int, ...]) -> None:
    assert parse_chunk_schedule(spec) == expected


@pytest.mark.parametrize("spec", ["", "0", "1,x", "-1", "100"])
def test_chunk_schedule_rejects_nonsense(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_chunk_schedule(spec)


# --- the service: worker thread <-> asyncio ---------------------------------------------------


async def test_service_streams_chunks_into_asyncio(tiny_engine: Engine) -> None:
    service = SpeechService([tiny_engine])
    service.start()
    try:
        stream = service.stream(SpeechRequest(text="Hello.", seed=1, max_frames=7))
        chunks = [chunk async for chunk in stream]
        sizes = [len(c) // SAMPLES_PER_FRAME for c in chunks]
        assert sizes[0] == 1 and 0 < sum(sizes) <= 7
        await asyncio.wait_for(stream.finished.wait(), 5)
        assert service.stats.completed >= 1 and service.busy_slots == 0
    finally:
        service.stop()


async def test_cancel_frees_the_slot_within_one_chunk(tiny_engine: Engine) -> None:
    service = SpeechService([tiny_engine])
    service.start()
    try:
        stream = service.stream(SpeechRequest(text="A long sentence. " * 30, seed=1))
        first = await stream.__anext__()
        assert len(first) == SAMPLES_PER_FRAME
        t0 = time.monotonic()
        stream.cancel()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await asyncio.wait_for(stream.finished.wait(), 5)
        freed_after = time.monotonic() - t0
        assert service.stats.cancelled == 1 and service.busy_slots == 0
        # The slot frees within the chunk in flight (at most 8 frames of the tiny model on CPU).
        assert freed_after < 2.0, freed_after
        assert service.stats.cancel_to_free_s[0] < 2.0
        # A queued request that is cancelled before it starts never runs (the blocker may or
        # may not have started before its own cancel: either way the queued one must not).
        started = service.stats.started
        blocker = service.stream(SpeechRequest(text="Block. " * 10, seed=1,
                                               tags={"turn": "blocker"}))
        queued = service.stream(SpeechRequest(text="Never.", seed=1, tags={"turn": "never"}))
        queued.cancel()
        blocker.cancel()
        await asyncio.wait_for(queued.finished.wait(), 5)
        await asyncio.wait_for(blocker.finished.wait(), 5)
        assert "never" not in service.stats.start_order
        assert service.stats.started - started == service.stats.start_order.count("blocker")
        assert queued.started_at is None
    finally:
        service.stop()


class _FailingEngine(BatchedQwenEngine):
    """The real engine whose codec fails when a poisoned turn's second chunk is due."""

    def next_chunks(self, rows):  # type: ignore[no-untyped-def]
        if any(row.request.text == "Poison." and row.frames > 1 for row in rows):
            raise RuntimeError("CUDA error: device-side assert triggered")
        return super().next_chunks(rows)


async def test_engine_failure_mid_utterance_surfaces_as_engine_error(
    tiny_engine: BatchedQwenEngine,
) -> None:
    failing = _FailingEngine(tiny_engine.shared, max_rows=2, adaptive_chunks=False)
    service = SpeechService([failing])
    service.start()
    try:
        stream = service.stream(SpeechRequest(text="Poison.", seed=1, max_frames=8,
                                              min_frames=8))
        assert len(await stream.__anext__()) == SAMPLES_PER_FRAME
        with pytest.raises(EngineError, match="device-side assert"):
            await stream.__anext__()
        assert service.stats.failed == 1 and service.stats.recovered == 1
        # The engine survives (rebuilt): the next request is served.
        stream2 = service.stream(SpeechRequest(text="Again.", seed=1, max_frames=2))
        assert len(await stream2.__anext__()) == SAMPLES_PER_FRAME
    finally:
        service.stop()
