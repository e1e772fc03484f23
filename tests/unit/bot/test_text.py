"""A bot's streamed text read a piece at a time (gateway.bot.text): the pieces read exactly as the
whole answer does, however the bot cut it into tokens, in every free-text mode and with a
lexicon; a plain word is released as soon as the space after it arrives; what could still
change is held (a number's digits, a month before its day, a currency sign, a lexicon phrase).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.bot.text import TextFeed
from gateway.text import LexiconEntry, Reader, Reading

CORPUS = [
    "Your balance is $42.10, due on December 15, 2026. Anything else?",
    "Call us at +1 555 010 0199 ext. 12 between 9:30 AM and 5 PM.",
    "Your order 0045123 ships on 2026-12-15 and costs 12 EUR, 50% off.",
    "It is the 3rd time, at 3 p.m. then again at 4 p.m. Thanks.",
    "We moved to 12 St. Mary Road in New York last March 3rd, 2025.",
    "Balance: 1,234.56 dollars. Minus -5 degrees, 24/7 support, MP3 and 4G.",
    "On 15 December 2026 at 15:45 we close. See you December 3.",
    "Press 1 for sales or 2 for support; your code is 7 7 3 1.",
    "Sure!\n\nHere are the  options:\n- Acme Gold, $ 30 a month\n- Acme Silver, € 20.",
    "Your appointment is on 03/04/2026 at 10 a.m. with Dr. Smith, (555) 010-0199.",
]
SPANISH = [
    "Su saldo es de 42,10 €, con vencimiento el 15 de diciembre de 2026.",
    "Llame al +34 912 345 678 antes de las 15:30, por favor.",
]
LEXICON = [
    LexiconEntry(text="New York", say="New Yawk"),
    LexiconEntry(pattern=r"\bSt\.(?= [A-Z])", say="Street"),
    LexiconEntry(pattern=r"\bDr\. (?=[A-Z])", say="Doctor "),
    LexiconEntry(text="Acme", say="Ack-mee"),
]


def _whole(reader: Reader, text: str, language: str = "English") -> str:
    return reader.free(re.sub(r"\s+", " ", text).strip(), language)


def _streamed(reader: Reader, tokens: list[str], language: str = "English") -> str:
    feed = TextFeed(reader, language)
    pieces = []
    for token in tokens:
        pieces += feed.push(token)
    pieces += feed.finish()
    assert "".join(p.written for p in pieces) == re.sub(r"\s+", " ", "".join(tokens)).strip()
    return "".join(p.spoken for p in pieces)


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted(set(c for c in cuts if 0 < c < len(text)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@pytest.mark.parametrize("mode", ["off", "numbers", "full"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_pieces_read_as_the_whole_answer_however_it_was_cut(mode: str,
                                                                data: st.DataObject) -> None:
    reader = Reader("English", Reading(free_text=mode), LEXICON)  # type: ignore[arg-type]
    text = data.draw(st.sampled_from(CORPUS))
    cuts = data.draw(st.lists(st.integers(1, len(text) - 1), max_size=len(text)))
    assert _streamed(reader, _cut(text, cuts)) == _whole(reader, text)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_spanish_reads_the_same_streamed_and_whole(data: st.DataObject) -> None:
    reader = Reader("Spanish", Reading(free_text="full"))
    text = data.draw(st.sampled_from(SPANISH))
    cuts = data.draw(st.lists(st.integers(1, len(text) - 1), max_size=len(text)))
    assert _streamed(reader, _cut(text, cuts), "Spanish") == _whole(reader, text, "Spanish")


def test_every_token_boundary_of_the_corpus_character_by_character() -> None:
    reader = Reader("English", Reading(free_text="full"), LEXICON)
    for text in CORPUS:
        assert _streamed(reader, list(text)) == _whole(reader, text)


def test_a_plain_word_goes_as_soon_as_the_space_after_it_arrives() -> None:
    feed = TextFeed(Reader("English", Reading(free_text="full")), "English")
    assert feed.push("Hel") == []
    assert feed.push("lo") == []  # it may go on ("Hellooo")
    [piece] = feed.push(" th")
    assert (piece.written, piece.spoken) == ("Hello", "Hello")
    [piece] = feed.push("ere, how")
    assert piece.written == " there,"
    assert [p.written for p in feed.finish()] == [" how"]


@pytest.mark.parametrize(("tokens", "held"), [
    # Digits may go on, and a number's words may follow it ("42 EUR", "3:30 PM").
    (["It costs 4", "2 dollars and"], "4"),
    # A month may be a date's beginning ("December 15").
    (["See you in December"], "December"),
    # A currency sign alone waits for its amount.
    (["That is $", " "], "$"),
    # The first word of a lexicon phrase waits for the rest.
    (["I live in New", " "], "New"),
])
def test_what_may_still_change_is_held(tokens: list[str], held: str) -> None:
    reader = Reader("English", Reading(free_text="full"), LEXICON)
    feed = TextFeed(reader, "English")
    out = []
    for token in tokens:
        out += feed.push(token)
    assert held in feed.pending
    assert held not in "".join(p.written for p in out)


def test_a_number_goes_once_enough_words_follow_it() -> None:
    feed = TextFeed(Reader("English", Reading(free_text="numbers")), "English")
    pieces = feed.push("You owe 42 dollars in total for the month ")
    spoken = "".join(p.spoken for p in pieces)
    assert "forty-two dollars" in spoken
    # Each piece keeps the bot's words beside the engine's.
    assert "".join(p.written for p in pieces) + feed.pending == \
        "You owe 42 dollars in total for the month "


def test_whitespace_runs_are_one_space_and_text_after_the_end_is_refused() -> None:
    feed = TextFeed(Reader(), "English")
    out = feed.push("  Hello\n\n  there  ") + feed.push(" you") + feed.finish()
    assert "".join(p.written for p in out) == "Hello there you"
    with pytest.raises(ValueError, match="ended"):
        feed.push("more")
