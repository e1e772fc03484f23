"""One answer of a bot, spoken while it is still being written, and what the caller heard of it.

A :class:`TalkStream` is the audio of one answer (a *talk*: ConversationRelay's tokens up to
``last``) as one :class:`~gateway.call.session.AudioStream`: the call speaks it as one
utterance (:meth:`~gateway.call.session.Call.speak`), so barge-in, marks and first-audio
latency work as for any sentence. Underneath it is one or more engine turns (*segments*):

- **Streaming text** (``streaming=True``, built-in speakers): a segment's engine turn opens with
  its first words in Qwen3-TTS's streaming mode, and each later :class:`~gateway.bot.text.Piece`
  is fed to the running turn (:meth:`gateway.tts.stream.SpeechStream.feed`), so the caller hears
  the answer's first words while the bot is still writing the rest. A long answer is cut into
  segments at the end of a sentence once a segment holds :data:`SPLIT_CHARS` characters (and
  at any piece past :data:`MAX_SEGMENT_CHARS`): a turn's text and frames stay bounded, as the
  engine's rows are.
- **Sentence at a time** (``streaming=False``: cloned voices, whose prompt holds the whole
  text, or a node's ``text_mode: sentence``): a segment is one sentence, spoken whole once its
  end has arrived, as other voice-agent platforms do.

Segments are opened one after the other as the audio reaches them: the call pulls audio no
more than its playout buffer ahead of the caller, so the next segment starts generating about
that long before it is needed, and holds an engine row only while it is heard.

:meth:`TalkStream.heard` answers "what had the caller heard when they cut in": the bot's own
words up to the point of the audio that was played. Qwen3-TTS gives no word timings, so within
a segment the point is placed by characters: a finished segment's audio spreads over its text
evenly; one still generating is read at the talk's measured rate (characters per second of the
segments already finished), else :data:`CHARS_PER_S`. A word counts as heard once the point
has passed its end; a piece the line reads differently (a number, a lexicon entry) counts once
heard whole. ``bench/bot_relay.py`` measures this against speech with known word timings.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from gateway.bot.text import Piece
from gateway.tts.engine import SAMPLE_RATE, SAMPLES_PER_FRAME
from gateway.tts.qwen import default_max_frames

__all__ = ["CHARS_PER_S", "MAX_SEGMENT_CHARS", "SPLIT_CHARS", "Segment", "TalkStream",
           "TurnStream", "heard_text"]

#: Characters of text a segment gathers before it may end at a sentence's end.
SPLIT_CHARS = 160
#: Characters after which a segment ends at the next piece, sentence or not.
MAX_SEGMENT_CHARS = 400
#: Speaking rate assumed before any segment of the talk has finished (English, telephone pace).
CHARS_PER_S = 14.0
#: A sentence ends here (closing quotes and brackets after the mark belong to it).
_SENTENCE_END = re.compile(r"[.!?…。！？][\"'”’)\]]*$")


class TurnStream(Protocol):
    """One engine turn's audio (:class:`gateway.tts.stream.SpeechStream`)."""

    def __aiter__(self) -> AsyncIterator[npt.NDArray[np.float32]]: ...

    async def __anext__(self) -> npt.NDArray[np.float32]: ...

    def feed(self, text: str, last: bool = False) -> None: ...

    def cancel(self) -> None: ...


#: Opens an engine turn: ``(text, streaming)`` -> its stream. With ``streaming`` the text is
#: the turn's first words and more is fed; without, it is the whole text.
TurnOpener = Callable[[str, bool], TurnStream]


@dataclass
class Segment:
    """One engine turn of a talk: its text, and where its audio sits in the talk's."""

    pieces: list[Piece] = field(default_factory=list)
    #: No more text comes to this segment.
    text_done: bool = False
    stream: TurnStream | None = None
    #: Seconds into the talk's audio where this segment's begins, and its audio so far.
    start_s: float = 0.0
    audio_s: float = 0.0
    #: Its audio has all been generated (or it was cut at its cap).
    done: bool = False
    #: Pieces handed to the engine turn so far.
    fed: int = 0
    #: The turn's stream holds a space back (the one after the last word fed).
    spaced: bool = False
    #: The turn has been told its text is complete.
    ended: bool = False

    def give(self, spoken: str) -> None:
        """Feed ``spoken`` (a piece, the space before it included) to the streaming turn,
        with the space that will follow it: the stream keeps a word back until the text after
        it arrives, and a piece ends on a whole word, so that word is taken at once."""
        assert self.stream is not None
        if self.spaced and spoken.startswith(" "):
            spoken = spoken[1:]
        self.stream.feed(spoken + " ")
        self.spaced = True

    @property
    def spoken(self) -> str:
        return "".join(p.spoken for p in self.pieces)

    @property
    def chars(self) -> int:
        return sum(len(p.spoken) for p in self.pieces)


class TalkStream:
    """One talk's audio over its segments' engine turns (see the module docstring)."""

    def __init__(self, opener: TurnOpener, *, streaming: bool = True,
                 split_chars: int = SPLIT_CHARS, max_chars: int = MAX_SEGMENT_CHARS) -> None:
        self._opener = opener
        self.streaming = streaming
        self._split = split_chars if streaming else 0
        self._max = max_chars
        self.segments: list[Segment] = [Segment()]
        self._at = 0
        self._closed = False
        self._cancelled = False
        self._changed = asyncio.Event()
        #: Seconds of audio yielded so far.
        self.audio_s = 0.0

    # --- the bot's side --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """The talk's text is complete."""
        return self._closed

    @property
    def written(self) -> str:
        """The bot's words so far."""
        return "".join(p.written for s in self.segments for p in s.pieces)

    def add(self, piece: Piece) -> None:
        """More of the answer (pieces in order, each safe to speak)."""
        if self._closed:
            raise ValueError("this talk's text is complete")
        if not piece.spoken.strip():
            return
        segment = self.segments[-1]
        segment.pieces.append(piece)
        chars = segment.chars
        if chars >= self._max or (chars >= self._split
                                  and _SENTENCE_END.search(piece.spoken.rstrip())):
            segment.text_done = True
            self.segments.append(Segment())
        self._feed(segment)
        self._changed.set()

    def close(self) -> None:
        """The answer's text is complete (the bot's ``last``)."""
        if self._closed:
            return
        self._closed = True
        last = self.segments[-1]
        if not last.pieces and len(self.segments) > 1:
            self.segments.pop()
        else:
            last.text_done = True
            self._feed(last)
        self._changed.set()

    def _feed(self, segment: Segment) -> None:
        """Hand an open streaming turn the pieces it has not had, and its end."""
        stream = segment.stream
        if stream is None or not self.streaming or segment.done:
            return
        for piece in segment.pieces[segment.fed:]:
            segment.give(piece.spoken)
        segment.fed = len(segment.pieces)
        if segment.text_done and not segment.ended:
            segment.ended = True
            stream.feed("", last=True)

    # --- the call's side (AudioStream) -----------------------------------------------------------

    def __aiter__(self) -> TalkStream:
        return self

    async def __anext__(self) -> npt.NDArray[np.float32]:
        while True:
            if self._cancelled:
                raise StopAsyncIteration
            if self._at >= len(self.segments):
                raise StopAsyncIteration
            segment = self.segments[self._at]
            if segment.stream is None:
                if not segment.pieces and self._closed:
                    raise StopAsyncIteration
                if not segment.pieces or (not self.streaming and not segment.text_done):
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                self._open(segment)
            assert segment.stream is not None
            try:
                chunk = await segment.stream.__anext__()
            except StopAsyncIteration:
                self._next(segment)
                continue
            if self._cancelled:
                raise StopAsyncIteration
            seconds = len(chunk) / SAMPLE_RATE
            segment.audio_s += seconds
            self.audio_s += seconds
            if segment.text_done and self.streaming:
                # Streaming turns have no length cap of their own (their text was unknown when
                # they opened): the one a whole sentence gets, once the text is known.
                cap = default_max_frames(segment.spoken) * SAMPLES_PER_FRAME / SAMPLE_RATE
                if segment.audio_s >= cap:
                    segment.stream.cancel()
                    self._next(segment)
            return chunk

    def _open(self, segment: Segment) -> None:
        segment.start_s = self.audio_s
        if self.streaming:
            first = segment.pieces[0].spoken.strip()
            segment.stream = self._opener(first, True)
            segment.fed = 1
            if len(segment.pieces) == 1 and not segment.text_done:
                # The space after the first words: the next piece is then taken at once.
                segment.give("")
            self._feed(segment)
        else:
            segment.stream = self._opener(segment.spoken.strip(), False)

    def _next(self, segment: Segment) -> None:
        segment.done = True
        self._at += 1

    @property
    def gaps(self) -> int:
        """Engine underruns of its turns (:attr:`gateway.tts.stream.SpeechStream.gaps`): chunks
        that came after the audio before them would have played out."""
        return sum(getattr(s.stream, "gaps", 0) for s in self.segments if s.stream is not None)

    @property
    def next_chunk_eta_s(self) -> float | None:
        """The current turn's estimate of its next chunk (the phone path's start buffer)."""
        if self._at >= len(self.segments):
            return None
        stream = self.segments[self._at].stream
        return getattr(stream, "next_chunk_eta_s", None) if stream is not None else None

    def cancel(self) -> None:
        """Stop: the current turn is cancelled, nothing more is opened."""
        self._cancelled = True
        self._changed.set()
        for segment in self.segments:
            if segment.stream is not None and not segment.done:
                segment.stream.cancel()

    async def aclose(self) -> None:
        self.cancel()

    # --- what was heard --------------------------------------------------------------------------

    def heard(self, heard_s: float) -> str:
        """The bot's words the caller had heard after ``heard_s`` seconds of this talk."""
        return heard_text(self.segments, heard_s)


def heard_text(segments: list[Segment], heard_s: float,
               chars_per_s: float | None = None) -> str:
    """The written words heard after ``heard_s`` seconds of audio (module docstring)."""
    if chars_per_s is None:
        finished = [s for s in segments if s.done and s.audio_s > 0 and s.text_done]
        chars = sum(s.chars for s in finished)
        seconds = sum(s.audio_s for s in finished)
        chars_per_s = chars / seconds if chars and seconds else CHARS_PER_S
    out: list[str] = []
    for segment in segments:
        if segment.stream is None and not segment.audio_s:
            break
        spoken = segment.chars
        into = heard_s - segment.start_s
        if into <= 0:
            break
        if segment.done and segment.audio_s > 0:
            position = spoken * min(1.0, into / segment.audio_s)
        else:
            position = min(float(spoken), into * chars_per_s)
        out.append(_written_upto(segment.pieces, position))
        if position < spoken:
            break
    return "".join(out).strip()


def _written_upto(pieces: list[Piece], position: float) -> str:
    """The written text of ``pieces`` whose spoken text ends by ``position`` characters (a
    piece read as written is cut after its last word that ends by then)."""
    out: list[str] = []
    at = 0
    position += 1e-6  # a word that ends exactly there was heard (float rounding aside)
    for piece in pieces:
        end = at + len(piece.spoken)
        if end <= position:
            out.append(piece.written)
        else:
            if piece.written == piece.spoken:
                within = position - at
                words = [m.end() for m in re.finditer(r"\S+", piece.written) if m.end() <= within]
                if words:
                    out.append(piece.written[:words[-1]])
            break
        at = end
    return "".join(out)
