"""A bot's streamed text, read as the line reads its sentences, a piece at a time.

A bot streams its answer token by token ("Your", " balance", " is", " $4", "2.10", ...). The
engine should get each word as soon as it is complete, but after the line's lexicon and its
free-text normaliser (:meth:`gateway.text.Reader.free`), and those read spans of several
words: ``$42.10`` is an amount only once its digits stop, ``December 15, 2026`` is a date only
with the number after the month, ``+1 555 010 0199`` is one phone number over four words. A
word released too early would be read differently from the whole text ("December" then
"fifteen" instead of "December fifteenth").

:class:`TextFeed` therefore releases the text in :class:`Piece`\\ s cut only at word boundaries
where nothing later can change how the text before is read:

- **Whole words**: the last word waits for the whitespace after it (or the end of the answer).
- **Numbers**: every rule of the normaliser (amounts, dates, times, percentages, phone numbers,
  ordinals, digit strings) reads a span holding a digit, and its words reach at most three
  words past the last digit ("15 de diciembre de 2026", "3:30 PM", "ext. 12"). A cut is made
  only once :data:`AFTER_DIGITS` words without a digit follow the last word with one.
- **Words that may start a number's span**: a month's name ("December 15") and a word of
  currency or sign characters alone ("$ 12", "+ 1 555 ...") wait for :data:`BEFORE_DIGITS`
  words after them.
- **The lexicon**: a cut never splits a multi-word entry ("New York"): words that begin one
  wait for the rest. A pattern entry that can match across whitespace (``\\bSt\\.(?= [A-Z])``)
  is checked on the text known around the cut, which waits until as many words follow as the
  pattern has spaces.

Each piece is read alone, and the pieces together read exactly as the whole answer would
(``tests/unit/bot/test_text.py`` checks it on every way of cutting a corpus of sentences into
tokens). Whitespace runs (an LLM's newlines and indentation) are one space: the engine hears no
difference, and the pieces tokenise as the whole text does.

Each piece keeps the bot's words beside the engine's: what the caller heard is reported to the
bot in its own words (``utteranceUntilInterrupt``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.text import Reader
from gateway.text.lexicon import compile_entry
from gateway.text.sayas import month_names

__all__ = ["AFTER_DIGITS", "BEFORE_DIGITS", "Piece", "TextFeed"]

#: Words without a digit that must follow the last word with one before a cut.
AFTER_DIGITS = 4
#: Words a month's name or a lone currency or sign word waits for before a cut.
BEFORE_DIGITS = 2
_WS = re.compile(r"\s+")
#: A word of currency signs, plus or minus signs and brackets alone ("$", "+", "(", "€").
_SIGN_WORD = re.compile(r"[\W_]+")


@dataclass(frozen=True)
class Piece:
    """Words released together: as the bot wrote them and as the engine gets them. Every piece
    but an answer's first starts with the space before its first word."""

    written: str
    spoken: str


class TextFeed:
    """One answer's text as it streams in -> pieces safe to speak (see the module docstring)."""

    def __init__(self, reader: Reader, language: str) -> None:
        self.reader = reader
        self.language = language
        lang = reader.language(language)
        self._months = frozenset(month_names(lang.locale)) if lang is not None else frozenset()
        words: list[tuple[str, ...]] = []
        self._patterns: list[tuple[re.Pattern[str], int]] = []
        wanted = language.lower()
        for entry in reader.lexicon.entries:
            if entry.language is not None and entry.language.lower() != wanted:
                continue
            if entry.text is not None:
                parts = tuple(entry.text.lower().split() if entry.ignore_case
                              else entry.text.split())
                if len(parts) > 1:
                    words.append(parts)
            else:
                spaces = len(re.findall(r"\\s| ", entry.pattern or ""))
                if spaces:
                    self._patterns.append((compile_entry(entry).regex, spaces))
        self._phrases = words
        self._lookahead = max((n for _, n in self._patterns), default=0)
        #: Text received and not released yet.
        self._buffer = ""
        #: The last words released (the window the rules look back over).
        self._tail: list[str] = []
        self._finished = False
        #: Everything released so far, as written.
        self.written = ""

    @property
    def pending(self) -> str:
        """Text received but held back."""
        return self._buffer

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, token: str) -> list[Piece]:
        """Add ``token``; the pieces it completes (often none)."""
        if self._finished:
            raise ValueError("this answer's text has ended")
        text = _WS.sub(" ", token)
        if not self._buffer and not self.written:
            text = text.lstrip(" ")
        elif text.startswith(" ") and (self._buffer or self.written).endswith(" "):
            text = text[1:]
        self._buffer += text
        cut = self._cut()
        if cut <= 0:
            return []
        return [self._release(cut)]

    def finish(self) -> list[Piece]:
        """The answer is complete: whatever is held, read now."""
        if self._finished:
            return []
        self._finished = True
        rest = self._buffer.rstrip(" ")
        self._buffer = ""
        if not rest.strip():
            return []
        return [self._release_text(rest)]

    # --- where to cut ----------------------------------------------------------------------------

    def _cut(self) -> int:
        """The furthest safe cut in the buffer (0: none): the index of the space before a word."""
        buffer = self._buffer
        # Spaces that end a complete word: a space with a word before it.
        candidates = [m.start() for m in re.finditer(r"(?<=\S) ", buffer)]
        for cut in reversed(candidates):
            if self._safe(cut):
                return cut
        return 0

    def _safe(self, cut: int) -> bool:
        buffer = self._buffer
        before = self._tail + buffer[:cut].split()
        after = buffer[cut:].split()
        if not buffer.endswith(" ") and after:
            after = after[:-1]  # the last word may go on
        # A number's span reaches a few words past its last digit.
        for word in before[-AFTER_DIGITS:]:
            if any(c.isdigit() for c in word):
                return False
        # ... and may start a word or two before its first (a month, a currency sign).
        for word in before[-BEFORE_DIGITS:]:
            bare = word.lower().rstrip(".,;:")
            if bare in self._months or _SIGN_WORD.fullmatch(word):
                return False
        for phrase in self._phrases:
            for n in range(1, len(phrase)):
                if len(before) >= n and _same(before[-n:], phrase[:n]):
                    return False
        if self._patterns:
            if len(after) < self._lookahead and not self._finished:
                return False
            left = " ".join(before[-self._lookahead - 1:])
            right = " " + " ".join(after)
            for regex, _ in self._patterns:
                # The pattern finds the same matches in the two halves as across them (a
                # lookahead past the cut, a match over it, would differ).
                whole = [m.span() for m in regex.finditer(left + right)]
                apart = [m.span() for m in regex.finditer(left)] + [
                    (a + len(left), b + len(left)) for a, b in
                    (m.span() for m in regex.finditer(right))]
                if whole != apart:
                    return False
        return True

    # --- releasing -------------------------------------------------------------------------------

    def _release(self, cut: int) -> Piece:
        written, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return self._release_text(written)

    def _release_text(self, written: str) -> Piece:
        self.written += written
        self._tail = (self._tail + written.split())[-(AFTER_DIGITS + 4):]
        return Piece(written, self.reader.free(written, self.language))


def _same(tail: list[str], phrase: tuple[str, ...]) -> bool:
    """``tail`` ends a text with the first words of a lexicon phrase (case-insensitively: a
    case-sensitive entry then waits for nothing it would not have matched anyway)."""
    return [w.lower().strip(",;:") for w in tail] == [p.lower() for p in phrase]
