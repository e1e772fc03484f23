"""One answer spoken while it is written (gateway.bot.talk.TalkStream), over stand-in engine turns
that record the text they are given through a real SpeechStream's feed: the engine gets the
answer's first words at once and each later word as soon as it is complete, exactly the text a
whole request would carry; a long answer becomes several turns cut at sentence ends, opened one
after the other; sentence mode waits for each sentence; and what the caller heard is placed in
the bot's own words."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from gateway.bot.talk import CHARS_PER_S, Segment, TalkStream, heard_text
from gateway.bot.text import Piece, TextFeed
from gateway.text import Reader, Reading
from gateway.tts.engine import SAMPLE_RATE, SpeechRequest
from gateway.tts.stream import SpeechStream
from tests.support.clocks import ManualClock

CHUNK_S = 0.25


class StandInTurn:
    """An engine turn: takes text as the real stream does (whole words), yields ``chunks``
    chunks of audio (speaking before its text is complete, as a streaming turn does) and ends
    once its text is complete."""

    def __init__(self, text: str, streaming: bool, chunks: int = 4) -> None:
        self.stream = SpeechStream(SpeechRequest(text=text, text_stream=streaming),
                                   asyncio.get_running_loop(), 0.0, 0.2, ManualClock())
        self.text = text
        self.fed: list[tuple[str, bool]] = []
        self.complete = asyncio.Event()
        if not streaming:
            self.complete.set()
        self.chunks = chunks
        self.cancelled = False

    def feed(self, text: str, last: bool = False) -> None:
        self.stream.feed(text, last)
        taken = self.stream.take_text()
        if taken is not None:
            self.fed.append(taken)
        if last:
            self.complete.set()

    @property
    def engine_text(self) -> str:
        return self.text + "".join(text for text, _ in self.fed)

    def __aiter__(self) -> StandInTurn:
        return self

    async def __anext__(self) -> np.ndarray:
        await asyncio.sleep(0)
        if self.chunks == 0:
            await self.complete.wait()
        if self.chunks == 0 or self.cancelled:
            raise StopAsyncIteration
        self.chunks -= 1
        return np.zeros(round(CHUNK_S * SAMPLE_RATE), np.float32)

    def cancel(self) -> None:
        self.cancelled = True
        self.complete.set()


class Opened(list[StandInTurn]):
    def __call__(self, text: str, streaming: bool) -> StandInTurn:
        turn = StandInTurn(text, streaming)
        self.append(turn)
        return turn


async def _play(talk: TalkStream) -> float:
    seconds = 0.0
    async for chunk in talk:
        seconds += len(chunk) / SAMPLE_RATE
    return seconds


def _pieces(text: str, reader: Reader | None = None) -> list[Piece]:
    """``text`` as a bot streams it: a word (and the space before it) at a time."""
    feed = TextFeed(reader or Reader(), "English")
    pieces = [p for word in re.findall(r"\s*\S+", text) for p in feed.push(word)]
    return pieces + feed.finish()


async def test_the_first_words_open_the_turn_and_each_word_follows_once_complete() -> None:
    opened = Opened()
    talk = TalkStream(opened)
    playing = asyncio.ensure_future(_play(talk))
    feed = TextFeed(Reader("English", Reading(free_text="numbers")), "English")
    for token in ["Sure", ", you", " owe", " 42", " dollars", " in", " all", " this", " month."]:
        for piece in feed.push(token):
            talk.add(piece)
        await asyncio.sleep(0)
    [turn] = opened
    assert turn.text == "Sure,"  # opened with the first complete words, before the rest came
    assert turn.engine_text.startswith("Sure, you owe")
    for piece in feed.finish():
        talk.add(piece)
    talk.close()
    assert await playing == pytest.approx(4 * CHUNK_S)
    # Exactly the text a whole request would carry: no doubled or trailing spaces, the number
    # read as the line reads it, the end marked once.
    assert turn.engine_text == "Sure, you owe forty-two dollars in all this month."
    assert [last for _, last in turn.fed].count(True) == 1


async def test_a_long_answer_is_several_turns_cut_at_sentence_ends_opened_in_turn() -> None:
    opened = Opened()
    talk = TalkStream(opened, split_chars=30)
    playing = asyncio.ensure_future(_play(talk))
    for piece in _pieces("This is the first sentence of it. And this is the second one. "
                         "Third."):
        talk.add(piece)
    talk.close()
    await playing
    assert [t.engine_text for t in opened] == [
        "This is the first sentence of it.", "And this is the second one. Third."]
    assert [s.start_s for s in talk.segments] == [0.0, 4 * CHUNK_S]


async def test_sentence_mode_speaks_each_sentence_whole_once_it_is_complete() -> None:
    opened = Opened()
    talk = TalkStream(opened, streaming=False)
    playing = asyncio.ensure_future(_play(talk))
    feed = TextFeed(Reader(), "English")
    for token in ["One sentence", " here. Another", " one."]:
        for piece in feed.push(token):
            talk.add(piece)
        await asyncio.sleep(0)
        if token == " here. Another":
            assert [t.text for t in opened] == ["One sentence here."]
    for piece in feed.finish():
        talk.add(piece)
    talk.close()
    await playing
    assert [(t.text, t.fed) for t in opened] == [("One sentence here.", []),
                                                 ("Another one.", [])]


async def test_a_streaming_turn_is_capped_as_a_whole_sentence_would_be() -> None:
    class Endless(StandInTurn):
        async def __anext__(self) -> np.ndarray:
            if self.cancelled:
                raise StopAsyncIteration
            return np.zeros(round(CHUNK_S * SAMPLE_RATE), np.float32)

    turns: list[Endless] = []

    def opener(text: str, streaming: bool) -> Endless:
        turns.append(Endless(text, streaming))
        return turns[-1]

    talk = TalkStream(opener)
    for piece in _pieces("Hi."):
        talk.add(piece)
    talk.close()
    seconds = await asyncio.wait_for(_play(talk), 10)
    # default_max_frames("Hi."): 2 s + 0.15 s a character, at most.
    assert 2.0 < seconds <= 2.0 + 0.15 * 3 + CHUNK_S
    assert turns[0].cancelled


async def test_cancel_stops_the_turn_and_opens_nothing_more() -> None:
    opened = Opened()
    talk = TalkStream(opened)
    for piece in _pieces("Hello there."):
        talk.add(piece)
    iterator = talk.__aiter__()
    await iterator.__anext__()
    talk.cancel()
    assert opened[0].cancelled
    with pytest.raises(StopAsyncIteration):
        await iterator.__anext__()


def _segments(text: str, *spans: tuple[str, float, float, bool]) -> list[Segment]:
    """``text`` streamed word by word, cut into segments at the given sentences: each span is
    (its last words, start, audio seconds, done)."""
    pieces = _pieces(text, Reader("English", Reading(free_text="numbers")))
    segments, at = [], 0
    for ending, start, audio, done in spans:
        taken: list[Piece] = []
        while at < len(pieces) and not "".join(p.written for p in taken).endswith(ending):
            taken.append(pieces[at])
            at += 1
        segments.append(Segment(pieces=taken, text_done=True, stream=object(),  # type: ignore
                                start_s=start, audio_s=audio, done=done))
    return segments


def test_what_was_heard_is_placed_by_characters_in_the_bots_own_words() -> None:
    text = "Your balance is 42 dollars and it is due on Friday."
    [segment] = _segments(text, ("Friday.", 0.0, 4.0, True))
    spoken = segment.spoken
    assert "forty-two" in spoken
    assert heard_text([segment], 0.0) == ""
    assert heard_text([segment], 4.0) == text
    # A word counts once its end has been heard.
    upto = spoken.index("balance") + len("balance")
    assert heard_text([segment], 4.0 * upto / len(spoken)) == "Your balance"
    assert heard_text([segment], 4.0 * (upto - 1) / len(spoken)) == "Your"
    # A piece read differently from its writing (the number and the words held with it)
    # counts once heard whole: the bot gets its own words, never half of a number.
    assert heard_text([segment], 4.0 * (spoken.index("forty") + 5) / len(spoken)) == \
        "Your balance is"


def test_a_segment_still_generating_is_read_at_the_talks_measured_rate() -> None:
    first, second = _segments("Hello there. How are you doing today?",
                              ("there.", 0.0, 1.0, True), ("today?", 1.0, 0.5, False))
    rate = len(first.spoken) / 1.0  # measured on the finished segment
    assert heard_text([first, second], 1.0 + len(" How are") / rate) == "Hello there. How are"
    # With nothing finished, the usual pace.
    [only] = _segments("How are you doing today?", ("today?", 0.0, 0.5, False))
    assert heard_text([only], len("How are") / CHARS_PER_S) == "How are"
