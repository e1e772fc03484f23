"""A pronunciation lexicon: how a line says its product names, street names and company name.

Listed in a script or per line in the lines file::

    lexicon:
      - {text: Acme, say: Ack-mee}                  # whole words, case as written
      - {text: kWh, say: kilowatt hours, ignore_case: true}
      - {pattern: '\\bSt\\.(?= [A-Z])', say: Street}  # a regular expression (Python's re)
      - {pattern: '\\bRte (\\d+)', say: 'Route \\1'}   # groups as in re.sub
      - {text: Ave, say: Avenida, language: Spanish} # only in sentences spoken in Spanish

Entries apply in order, each to the text the ones before it left, before the free-text
normaliser reads numbers (so an entry can say "24/7" its own way) and never inside a say-as
value (``{balance:currency}`` is read by its type). A pattern and its replacement are checked
when the file loads: a pattern that does not compile is a diagnostic at the character where
``re`` stopped, and a replacement naming a group the pattern does not have is one too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Lexicon", "LexiconEntry", "LexiconError", "compile_entry"]

#: Longest replacement an entry may give (a sentence is at most 400 characters).
MAX_SAY_CHARS = 200


class LexiconEntry(BaseModel):
    """One entry: ``text`` (whole words) or ``pattern`` (a regular expression), said as
    ``say``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    text: str | None = Field(None, min_length=1, max_length=200)
    pattern: str | None = Field(None, min_length=1, max_length=500)
    say: str = Field(max_length=MAX_SAY_CHARS)
    ignore_case: bool = False
    #: Only in sentences spoken in this language (default: every language).
    language: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> LexiconEntry:
        if (self.text is None) == (self.pattern is None):
            raise ValueError("give exactly one of 'text' (whole words, as written) or "
                             "'pattern' (a regular expression)")
        return self


class LexiconError(ValueError):
    """An entry that cannot be compiled; ``field`` and ``offset`` locate the problem in it."""

    def __init__(self, message: str, field: str, offset: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.offset = offset


@dataclass(frozen=True)
class _Compiled:
    regex: re.Pattern[str]
    #: A literal replacement (text entries) or an ``re`` template (patterns).
    say: str
    literal: bool
    #: Lower-cased language, or None for every language.
    language: str | None


def compile_entry(entry: LexiconEntry) -> _Compiled:
    """The entry as a compiled replacement (raises :class:`LexiconError`)."""
    flags = re.IGNORECASE if entry.ignore_case else 0
    language = entry.language.lower() if entry.language else None
    if entry.text is not None:
        # Whole words: not inside a longer word ("Acme" leaves "Acmes" alone), whatever
        # characters the entry itself starts and ends with.
        regex = re.compile(rf"(?<!\w){re.escape(entry.text)}(?!\w)", flags)
        return _Compiled(regex, entry.say, True, language)
    assert entry.pattern is not None
    try:
        regex = re.compile(entry.pattern, flags)
    except re.error as exc:
        raise LexiconError(f"pattern does not compile: {exc.msg}", "pattern",
                           exc.pos or 0) from None
    except (OverflowError, RecursionError):
        raise LexiconError("pattern does not compile: too large or nested too deeply",
                           "pattern") from None
    if regex.match(""):
        raise LexiconError("pattern matches the empty string, so it would insert its "
                           "replacement between every two characters", "pattern")
    _check_template(regex, entry.say)
    return _Compiled(regex, entry.say, False, language)


def _check_template(regex: re.Pattern[str], say: str) -> None:
    """Raise unless ``say`` is a replacement ``regex.sub`` accepts: a stand-in pattern with the
    same groups (numbered and named, in order) matches the empty string, and ``re`` itself
    expands the template against it, so bad escapes and unknown groups fail here as they
    would mid-call."""
    names = {number: name for name, number in regex.groupindex.items()}
    stand_in = "".join(f"(?P<{names[i]}>)" if i in names else "()"
                       for i in range(1, regex.groups + 1))
    try:
        re.sub(stand_in, say, "", count=1)
    except (re.error, IndexError) as exc:
        message = exc.msg if isinstance(exc, re.error) else str(exc)
        raise LexiconError(f"replacement: {message} (the pattern has "
                           f"{regex.groups} group{'s' if regex.groups != 1 else ''})",
                           "say", getattr(exc, "pos", None) or 0) from None


class Lexicon:
    """Entries compiled once, applied to every sentence of a line."""

    def __init__(self, entries: Sequence[LexiconEntry] = ()) -> None:
        """Raises :class:`LexiconError` for an entry that does not compile (a loaded script or
        lines file has checked each already)."""
        self.entries = tuple(entries)
        self._compiled = tuple(compile_entry(entry) for entry in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Lexicon) and other.entries == self.entries

    def __hash__(self) -> int:
        return hash(self.entries)

    def __repr__(self) -> str:
        return f"Lexicon({len(self.entries)} entries)"

    def apply(self, text: str, language: str) -> str:
        """``text`` with every entry for ``language`` applied, in order."""
        wanted = language.lower()
        for entry in self._compiled:
            if entry.language is not None and entry.language != wanted:
                continue
            if entry.literal:
                # A function, not a template: a text entry's replacement is never re syntax.
                text = entry.regex.sub(lambda _, say=entry.say: say, text)  # type: ignore[misc]
            else:
                text = entry.regex.sub(entry.say, text)
        return text
