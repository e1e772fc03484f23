"""What a speech gather listens for: phrases per branch (with synonyms) and/or a digit string.

A :class:`SpeechGrammar` is recogniser-independent, immutable and picklable (it crosses into
the recogniser's worker processes). It is built from what a script author writes::

    SpeechGrammar.build({"agent": ["agent", "representative", "operator"],
                         "balance": ["account balance", "my balance"]})
    SpeechGrammar.build({}, digits=6)          # "four one seven oh two nine" -> "417029"

Phrases are normalised the way the recogniser's dictionary spells words: lower case, split on
anything that is not a letter, digit or apostrophe (so "Tech-Support!" is ``tech support``).
:func:`tokenize` keeps each word's character offset, so a validator can point at the exact
column of a word the dictionary lacks. Numerals stay as written ("press 1" keeps ``1``) and fail
the dictionary check with a hint to spell numbers out, because "1" could be said "one" or
"first".

A caller rarely says only the phrase: "agent, please", "uh, billing". :func:`match` therefore
accepts a phrase with a few filler words around it (:data:`EDGE_FILLERS`), never inside it.

``SpeechGrammar.free_form(language)`` listens for anything: the turn's transcript (with its
words' timings and confidence) is the answer, for a bot that takes the caller's own words. Only
an open-vocabulary recogniser (Whisper) can take it.

:func:`spoken_digits` reads a digit string out of a transcript however it was written:
"479201", "479-201", "4, 7, 9, 2, 0, 1", "four seven nine two oh one" all give ``479201``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from gateway.errors import GrammarError

__all__ = [
    "DIGIT_WORDS",
    "EDGE_FILLERS",
    "POLITE_WORDS",
    "Match",
    "SpeechGrammar",
    "Token",
    "language_code",
    "language_name",
    "match",
    "phrase_words",
    "spoken_digits",
    "tokenize",
]

DIGIT_WORDS: Final[Mapping[str, str]] = {
    "zero": "0", "oh": "0", "one": "1", "two": "2", "three": "3", "four": "4",
    "five": "5", "six": "6", "seven": "7", "eight": "8", "nine": "9",
}
"""Spoken digit -> digit. "oh" is how most English speakers say 0 inside a number."""

POLITE_WORDS: Final[tuple[str, ...]] = ("please",)
"""Words the built grammars accept after any phrase ("agent please")."""

EDGE_FILLERS: Final[frozenset[str]] = frozenset(
    {"please", "uh", "um", "ah", "er", "hmm", "the", "a", "and", "of", "in"}
)
"""Words ignored before or after a phrase when matching a transcript: hesitations, "please",
and the short function words an open-vocabulary pass inserts into trailing line noise."""

MAX_DIGITS: Final[int] = 32
MAX_PHRASE_WORDS: Final[int] = 12

# Apostrophes only inside a word ("that's"), never as quotes around it.
_SPLIT = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")
_NAMES: Final[Mapping[str, str]] = {
    "english": "en", "chinese": "zh", "french": "fr", "german": "de", "italian": "it",
    "japanese": "ja", "korean": "ko", "portuguese": "pt", "russian": "ru", "spanish": "es",
}


@dataclass(frozen=True)
class Token:
    """One normalised word of a phrase and where it was in the text (0-based character)."""

    word: str
    offset: int


def tokenize(text: str) -> list[Token]:
    """Normalised words of ``text`` with their character offsets (see the module docstring)."""
    # str.lower() can change the length of a few characters (e.g. U+0130); offsets then refer
    # to the lowered text, which only matters for such characters.
    return [Token(m.group(), m.start()) for m in _SPLIT.finditer(text.lower())]


def phrase_words(text: str) -> tuple[str, ...]:
    """Normalised words of ``text`` (``tokenize`` without offsets)."""
    return tuple(t.word for t in tokenize(text))


def language_code(language: str) -> str | None:
    """Primary language subtag for a script language name or BCP 47 tag, None if unknown.

    ``"English"`` (the script's voice language names), ``"en"``, ``"en-US"`` and ``"en_GB"`` all
    give ``"en"``; ``"Auto"`` gives None: a speech gather must name its language.
    """
    value = language.strip().lower().replace("_", "-")
    if value in _NAMES:
        return _NAMES[value]
    primary = value.split("-", 1)[0]
    return primary if re.fullmatch(r"[a-z]{2,3}", primary) else None


def language_name(code: str) -> str:
    """``"en"`` -> ``"English"`` (the script's spelling); other codes as they are."""
    for name, known in _NAMES.items():
        if known == code:
            return name.capitalize()
    return code


@dataclass(frozen=True)
class SpeechGrammar:
    """Phrases per branch and/or an exact-length spoken digit string, in one language.

    Build it with :meth:`build`; the constructor takes the normalised form. ``branches`` keeps
    the author's order; each phrase is stored as written (for results and logs) with its
    normalised words beside it.
    """

    branches: tuple[tuple[str, tuple[str, ...]], ...] = ()
    digits: int | None = None
    language: str = "en"
    #: No phrases, no digits: the caller's words are the answer (see the module docstring).
    transcribe: bool = False
    _index: dict[tuple[str, ...], tuple[str, str]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.transcribe and (self.branches or self.digits is not None):
            problems.append("a free-form grammar has no phrases or digits")
        if not self.branches and self.digits is None and not self.transcribe:
            problems.append("a speech grammar needs phrases, digits, or both")
        if self.digits is not None and not 1 <= self.digits <= MAX_DIGITS:
            problems.append(f"digits must be between 1 and {MAX_DIGITS}, not {self.digits}")
        for branch, phrases in self.branches:
            if not phrases:
                problems.append(f"branch {branch!r} has no phrases")
            for phrase in phrases:
                words = phrase_words(phrase)
                if not words:
                    problems.append(f"phrase {phrase!r} (branch {branch!r}) has no words")
                    continue
                if len(words) > MAX_PHRASE_WORDS:
                    problems.append(f"phrase {phrase!r} has {len(words)} words; keep menu "
                                    f"phrases to {MAX_PHRASE_WORDS} or fewer")
                if self.digits is not None and all(w in DIGIT_WORDS for w in words):
                    problems.append(f"phrase {phrase!r} (branch {branch!r}) is spoken digits, "
                                    "which this gather already takes as its digit string")
                other = self._index.get(words)
                if other is not None and other[0] != branch:
                    problems.append(f"phrase {phrase!r} is in branches {other[0]!r} and "
                                    f"{branch!r}; a phrase must choose one")
                self._index.setdefault(words, (branch, phrase))
        if problems:
            raise GrammarError(problems)

    @classmethod
    def build(
        cls,
        phrases: Mapping[str, str | Sequence[str]],
        *,
        digits: int | None = None,
        language: str = "en",
    ) -> SpeechGrammar:
        """From ``{branch: phrase or [synonyms]}``, an optional digit count, and a language."""
        code = language_code(language)
        if code is None:
            raise GrammarError([f"{language!r} is not a language a recogniser can be chosen "
                                "for; name it (e.g. English or en-US)"])
        branches = tuple(
            (str(branch), (value,) if isinstance(value, str) else tuple(value))
            for branch, value in phrases.items()
        )
        return cls(branches=branches, digits=digits, language=code)

    @classmethod
    def free_form(cls, language: str = "en") -> SpeechGrammar:
        """Listen for anything: the transcript is the answer (module docstring)."""
        code = language_code(language)
        if code is None:
            raise GrammarError([f"{language!r} is not a language a recogniser can be chosen "
                                "for; name it (e.g. English or en-US)"])
        return cls(language=code, transcribe=True)

    @property
    def phrases(self) -> Mapping[tuple[str, ...], tuple[str, str]]:
        """Normalised words -> (branch, phrase as written), for every phrase."""
        return self._index

    def words(self) -> set[str]:
        """Every word the grammar can recognise (digit words included in digits mode)."""
        out = {w for words in self._index for w in words} | set(POLITE_WORDS)
        if self.digits is not None:
            out |= set(DIGIT_WORDS)
        return out

    def key(self) -> str:
        """Stable content hash: recognisers cache compiled grammars under it."""
        text = repr((self.branches, self.digits, self.language, self.transcribe))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Match:
    """What a transcript matched: a branch's phrase, or a digit string."""

    branch: str | None
    phrase: str | None
    digits: str | None
    #: Indices (into the transcript's words) of the words that make up the match.
    span: tuple[int, int]


def _strip(words: Sequence[str]) -> tuple[int, int]:
    lo, hi = 0, len(words)
    while lo < hi and words[lo] in EDGE_FILLERS:
        lo += 1
    while hi > lo and words[hi - 1] in EDGE_FILLERS:
        hi -= 1
    return lo, hi


def match(grammar: SpeechGrammar, words: Iterable[str]) -> Match | None:
    """The phrase or digit string ``words`` says, allowing fillers only at the edges."""
    seq = list(words)
    spans = [(0, len(seq)), _strip(seq)]
    # A phrase that itself starts or ends with a filler word ("the main menu") matches whole.
    for lo, hi in spans:
        hit = grammar.phrases.get(tuple(seq[lo:hi]))
        if hit is not None:
            return Match(hit[0], hit[1], None, (lo, hi))
    if grammar.digits is not None:
        lo, hi = spans[1]
        core = seq[lo:hi]
        if len(core) == grammar.digits and all(w in DIGIT_WORDS for w in core):
            return Match(None, None, "".join(DIGIT_WORDS[w] for w in core), (lo, hi))
    return None


_NUMBER_WORDS: Final[Mapping[str, str]] = {**DIGIT_WORDS, "o": "0", "nought": "0", "nil": "0"}
_REPEATS: Final[Mapping[str, int]] = {"double": 2, "triple": 3}


def spoken_digits(text: str) -> str | None:
    """The digit string ``text`` says, or None when it says anything else as well.

    Digits written as numerals ("479201", "479-201", "4, 7, 9") or spoken ("four seven nine
    two oh one", "double seven") count; punctuation between them is ignored. Any other word
    (fillers aside) makes it None: "I have 3 kids" is not an account number. Nothing is
    truncated or padded: the caller's count of digits is the string's length.
    """
    out: list[str] = []
    repeat = 1
    words = [w for w in re.findall(r"[a-z]+|[0-9]+", text.lower()) if w not in EDGE_FILLERS]
    if not words:
        return None
    for word in words:
        if word.isdigit():
            out.append(word * repeat if repeat > 1 and len(word) == 1 else word)
            repeat = 1
        elif word in _REPEATS:
            repeat = _REPEATS[word]
        elif word in _NUMBER_WORDS:
            out.append(_NUMBER_WORDS[word] * repeat)
            repeat = 1
        else:
            return None
    return "".join(out) if repeat == 1 else None
