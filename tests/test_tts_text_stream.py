"""Streaming text into a running turn: the talker's text track extended as a bot's words arrive.

In Qwen3-TTS's streaming mode the prompt holds the first text token and each later token is
added to the next frame's input, so a turn can start speaking from its first words. Checked
here on the tiny checkpoint: the codes do not depend on how the text arrived (all at once, or
piece by piece ahead of need), a row that catches up with its text sits the steps out instead
of reading padding (a counted text underrun), and the stream hands the engine whole words.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from clocks import ManualClock, until

from gateway.errors import EngineError
from gateway.tts.batched import BatchedQwenEngine, BatchRow
from gateway.tts.engine import SAMPLES_PER_FRAME, SpeechRequest
from gateway.tts.qwen import QwenModel
from gateway.tts.service import SpeechService
from gateway.tts.simulated import DeviceProfile, SimulatedEngine

TEXT = "Your balance is forty two dollars, due on March third. Anything else?"
PIECES = ["Your", " balance is", " forty", " two dollars,", " due on March", " third.",
          " Anything else?"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> BatchedQwenEngine:
    shared = QwenModel(str(tiny_model_dir), device="cpu")
    return BatchedQwenEngine(shared, max_rows=4, record_codes=True, trim_leading_silence=False)


def _run(engine: BatchedQwenEngine, row: BatchRow, feed: dict[int, tuple[str, bool]],
         frames: int) -> tuple[torch.Tensor, int]:
    """Step ``row`` to ``frames`` frames, extending its text at the frames ``feed`` names;
    returns its codes and the steps it had to sit out waiting for text."""
    while row.prefilling:
        engine.prefill(row)
    waited = 0
    while row.frames < frames and row.finished is None:
        if row.frames in feed:
            engine.extend_text(row, *feed.pop(row.frames))
        if row.waiting_for_text:
            waited += 1
            engine.extend_text(row, *feed.pop(min(feed)))
            continue
        engine.step([row])
        engine.drop_pending(row)  # the codec is not under test
    codes = torch.stack(row.codes)
    engine.close(row)
    return codes, waited


def _request(text: str) -> SpeechRequest:
    return SpeechRequest(text=text, seed=42, max_frames=60, min_frames=60, text_stream=True)


def test_the_codes_do_not_depend_on_how_the_text_arrived(engine: BatchedQwenEngine) -> None:
    with torch.inference_mode():
        whole = engine.open(_request(TEXT))
        tokens = whole.text_tokens
        codes_whole, waited = _run(engine, whole, {0: ("", True)}, 60)
        assert waited == 0
        # The first word opens the turn; the rest arrives while it speaks, always ahead of
        # the frame that reads it (one text token a frame).
        piecewise = engine.open(_request(PIECES[0]))
        assert piecewise.text_tokens < tokens
        feed = {2 * i: (piece, i == len(PIECES) - 1) for i, piece in enumerate(PIECES[1:], 1)}
        codes_pieces, waited = _run(engine, piecewise, feed, 60)
    assert waited == 0
    assert torch.equal(codes_whole, codes_pieces)


def test_a_row_that_catches_up_with_its_text_sits_out_instead_of_reading_padding(
    engine: BatchedQwenEngine,
) -> None:
    with torch.inference_mode():
        whole = engine.open(_request(TEXT))
        codes_whole, _ = _run(engine, whole, {0: ("", True)}, 60)
        # The text arrives late: the row reaches the end of what it has and must wait.
        slow = engine.open(_request(PIECES[0]))
        feed = {40 + i: (piece, i == len(PIECES) - 2) for i, piece in enumerate(PIECES[1:])}
        codes_slow, waited = _run(engine, slow, feed, 60)
    assert waited >= 1
    # Waiting changed when the text was read, never what: the same codes.
    assert torch.equal(codes_whole, codes_slow)
    with torch.inference_mode():
        done = engine.open(_request("Hi."))
        engine.extend_text(done, "", True)
        with pytest.raises(EngineError, match="complete"):
            engine.extend_text(done, " more", False)
        engine.close(done)


def test_a_streaming_turn_needs_its_first_words_and_a_built_in_speaker(
    engine: BatchedQwenEngine,
) -> None:
    with pytest.raises(EngineError, match="first words"), torch.inference_mode():
        engine.open(_request("   "))


def test_the_stream_hands_the_engine_whole_words_only() -> None:
    loop = asyncio.new_event_loop()
    try:
        from gateway.tts.stream import SpeechStream

        stream = SpeechStream(_request("Hello"), loop, 0.0, 0.2, ManualClock())
        stream.feed(" wor")
        assert stream.take_text() is None  # a word cut short waits
        stream.feed("ld, how")
        assert stream.take_text() == (" world,", False)
        stream.feed(" are you?", last=True)
        assert stream.take_text() == (" how are you?", True)
        with pytest.raises(EngineError, match="ended"):
            stream.feed(" more")
        whole = SpeechStream(SpeechRequest(text="x"), loop, 0.0, 0.2, ManualClock())
        with pytest.raises(EngineError, match="given whole"):
            whole.feed("y")
    finally:
        loop.close()


async def test_a_bot_streaming_slower_than_speech_is_heard_to_the_end_with_underruns_counted(
    engine: BatchedQwenEngine,
) -> None:
    service = SpeechService([engine])
    service.start()
    try:
        stream = service.stream(SpeechRequest(text=PIECES[0], seed=3, text_stream=True,
                                              max_frames=40, min_frames=40))
        chunks: list[object] = []

        async def listen() -> None:
            async for chunk in stream:
                chunks.append(chunk)

        listener = asyncio.create_task(listen())
        for i, piece in enumerate(PIECES[1:]):
            # The bot's next tokens come only once the row has read all it had and sat out
            # (slower than frames are made, whatever this machine's speed), or once the turn
            # has its 40 frames (the tiny tokenizer's pieces can be long enough to fill them):
            # each wait is an underrun counted once, and the turn still ends with every frame.
            await until(lambda n=i: service.stats.text_underruns > n or listener.done(),
                        what=f"underrun {i + 1}")
            stream.feed(piece, last=i == len(PIECES) - 2)
        await asyncio.wait_for(listener, 60)
        assert sum(len(c) for c in chunks) == 40 * SAMPLES_PER_FRAME  # type: ignore[arg-type]
        assert service.stats.text_underruns >= 2
    finally:
        service.stop()


def test_the_simulated_device_takes_streamed_text_too() -> None:
    profile = DeviceProfile(name="instant", device="none", model="none", source="a test",
                            step_base_ms=0.0)
    sim = SimulatedEngine(profile, max_rows=2)
    row = sim.open(SpeechRequest(text="Hello there", seed=1, text_stream=True))
    sim.prefill(row)
    while not row.waiting_for_text:
        sim.step([row])
    assert row.finished is None
    sim.extend_text(row, " and welcome.", True)
    while row.finished is None:
        sim.step([row])
    assert row.frames > row.text_tokens
