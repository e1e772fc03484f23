"""The free-text normaliser: numbers, amounts, dates, times and phone numbers found in text
nobody marked up (the greeter's sentences, a script's untyped values, later a bot's text).

Three modes, per line (``reading: {free_text: ...}``) or per gateway for the greeter
(``GATEWAY_FREE_TEXT``):

- ``off``: the text goes to the engine as written.
- ``numbers``: numbers in words. ``42`` and ``1,234.5`` as numbers, ``3rd`` (``3º`` in
  Spanish) as an ordinal, ``50%`` with the language's word for percent, and a digit string
  with a leading zero or more than six digits (an account or order number) digit by digit.
- ``full``: also what the say-as types read, where the text makes it unambiguous: amounts with
  a currency symbol or code (``$12.50``, ``12 EUR``), dates with a year (``2026-12-15``,
  ``12/15/2026`` in the line's date order) or a month's name (``December 15``), times with a
  colon or AM/PM (``3:30 PM``, ``15:45``), and phone numbers written as such (``+1 555 010
  0199``, ``(555) 010-0199 ext. 12``).

Anything else is left alone: a number glued to letters (``MP3``, ``4G``), one beside a slash
(``24/7``), a time without a colon. A span that looks like a type but does not parse (``13/45/
2026``) is read by the next rule that fits, or left as written. Sentences are at most a few
hundred characters; the patterns are compiled once per language.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

import phonenumbers
from babel import numbers as babel_numbers
from babel import units as babel_units

from gateway.errors import TextError
from gateway.text.languages import Language
from gateway.text.sayas import (
    Conventions,
    currency_code,
    currency_words,
    date_words,
    minus_word,
    month_names,
    number_words,
    parse_date,
    parse_number,
    parse_time,
    say_as,
    spell_digits,
    time_words,
)

__all__ = ["MODES", "FreeTextMode", "normalise"]

#: What the free-text normaliser reads.
FreeTextMode = Literal["off", "numbers", "full"]
MODES: tuple[FreeTextMode, ...] = ("off", "numbers", "full")

#: A digit string this long or longer without separators is an identifier, read digit by digit.
DIGIT_STRING = 7

#: Ordinal suffixes as each language writes them after a numeral (en "3rd", es "3º").
_ORDINAL_SUFFIXES = {
    "en": r"st|nd|rd|th",
    "es": r"\.?º|\.?ª",
    "pt": r"\.?º|\.?ª",
    "it": r"º|ª",
    "fr": r"er|re|e|ème",
}


#: Every currency sign Unicode has (category Sc), for patterns to keep away from amounts.
_CURRENCY_SIGNS = re.escape("".join(
    chr(c) for c in range(0x10000) if unicodedata.category(chr(c)) == "Sc"))
#: How a phone number is written in text (see :func:`_phone_spans`).
_PHONE_SHAPE = re.compile(r"(?:\+|\(\d)[\d\s().\-]*\d.*|\d+(?:[\s.\-]\d+)+.*")


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    #: Lower wins when two spans start at the same place.
    rank: int
    read: Callable[[str], str]


def normalise(text: str, mode: FreeTextMode, language: Language | None,
              conventions: Conventions) -> str:
    """``text`` with what ``mode`` reads put into words in ``language`` (unchanged when off, or
    when the language is not one the libraries know)."""
    if mode == "off" or language is None or language.words is None or not any(
            c.isdigit() for c in text):
        return text
    rules = _rules(language, conventions, mode)
    spans: list[_Span] = []
    for rank, (pattern, reader) in enumerate(rules.patterns):
        for match in pattern.finditer(text):
            spans.append(_Span(match.start(), match.end(), rank, _bind(reader, match)))
    if mode == "full":
        spans.extend(_phone_spans(text, language, conventions))
    spans.sort(key=lambda s: (s.start, s.rank, -s.end))
    out: list[str] = []
    at = 0
    for span in spans:
        if span.start < at:
            continue
        try:
            words = span.read(text[span.start:span.end])
        except TextError:
            continue  # not what it looked like: a later rule may read it, else it stays
        out.append(text[at:span.start])
        out.append(words)
        at = span.end
    out.append(text[at:])
    return "".join(out)


def _bind(reader: Callable[[re.Match[str]], str], match: re.Match[str]) -> Callable[[str], str]:
    return lambda _: reader(match)


@dataclass(frozen=True)
class _Rules:
    patterns: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...]


@functools.lru_cache(maxsize=64)
def _rules(language: Language, conventions: Conventions, mode: FreeTextMode) -> _Rules:
    """The patterns of ``mode`` in ``language``, most specific first."""
    locale = language.locale
    group = re.escape(babel_numbers.get_group_symbol(locale))
    decimal = re.escape(babel_numbers.get_decimal_symbol(locale))
    # Not part of a word, a path, a time, a fraction, a date or an amount (MP3, 24/7, 3:30,
    # v1.2, 2026-12-15, $5): those are the full mode's, or nobody's.
    before = rf"(?<![\w/:.,{_CURRENCY_SIGNS}])(?<!\d-)"
    after = r"(?![\w/:]|[.,-]\d)"
    number = rf"(?:\d{{1,3}}(?:{group}\d{{3}})+|\d+)(?:{decimal}\d+)?"
    patterns: list[tuple[re.Pattern[str], Callable[[re.Match[str]], str]]] = []

    def add(pattern: str, reader: Callable[[re.Match[str]], str], flags: int = 0) -> None:
        patterns.append((re.compile(pattern, flags), reader))

    if mode == "full":
        symbols = r"[^\w\s\d.,:;!?'\"()\[\]/\-+%&*#@]"  # a currency sign ($, €, £, ¥, ...)
        add(rf"(?<![\w.,])(?P<sign>-)?(?P<sym>{symbols}{{1,3}})\s?(?P<n>{number}){after}",
            lambda m: _amount(m, language, conventions))
        add(rf"{before}(?P<sign>-)?(?P<n>{number})\s?(?P<sym>[A-Z]{{3}}(?![\w])|{symbols})",
            lambda m: _amount(m, language, conventions))
        add(r"(?<![\w/.-])\d{4}-\d{1,2}-\d{1,2}(?![\w/-])|(?<![\w/.-])\d{1,2}[/.-]\d{1,2}"
            r"[/.-](?:\d{4}|\d{2})(?![\w/-]|\.\d)",
            lambda m: date_words(parse_date(m[0], language, conventions.date_order),
                                 language))
        months = "|".join(sorted((re.escape(n) for n in month_names(locale)), key=len,
                                 reverse=True))
        add(rf"\b(?P<month>{months})\.?\s+\d{{1,2}}(?:st|nd|rd|th)?(?:,?\s+\d{{4}})?(?!\w)"
            rf"|(?<![\w.,])\d{{1,2}}(?:st|nd|rd|th|º)?\s+(?:de\s+|of\s+)?(?P<month2>{months})"
            rf"\b(?:,?\s+(?:de\s+)?\d{{4}})?(?!\w)",
            lambda m: _named_date(m, language, conventions), re.IGNORECASE)
        meridiem = r"(?:[aApP]\.\s?[mM]\.|[aApP][mM])(?!\w)"
        add(rf"(?<![\w:.])\d{{1,2}}:\d{{2}}(?:\s?{meridiem})?(?![\w:]|\.\d)"
            rf"|(?<![\w:.])\d{{1,2}}\s?{meridiem}",
            lambda m: _time(m, language))
    suffixes = _ORDINAL_SUFFIXES.get(language.code)
    if suffixes:
        add(rf"{before}(?P<n>\d+)(?:{suffixes})(?!\w)",
            lambda m: number_words(int(m["n"]), language, "ordinal"))
    add(rf"{before}(?P<sign>-)?(?P<n>{number})\s?%",
        lambda m: _percent(m, language))
    add(rf"(?:(?<=\s)|(?<=^)|(?<=\())(?P<sign>-)(?P<n>{number}){after}"
        rf"|{before}(?P<n2>{number}){after}",
        lambda m: _number(m, language))
    return _Rules(tuple(patterns))


def _number(match: re.Match[str], language: Language) -> str:
    written = match["n"] or match["n2"]
    if written.isdigit() and (len(written) >= DIGIT_STRING or
                              (len(written) > 1 and written.startswith("0"))):
        # 004512, 1234567: an identifier, not a quantity.
        spoken = spell_digits(written, language)
    else:
        spoken = say_as("number", written, language, Conventions())
    return f"{minus_word(language)} {spoken}" if match["sign"] else spoken


def _percent(match: re.Match[str], language: Language) -> str:
    value = parse_number(match["n"], language.locale)
    # CLDR's "{0} percent" / "{0} por ciento", with the number in words in its place.
    pattern = babel_units.format_unit(1, "percent", length="long", locale=language.locale)
    words = say_as("number", str(value), language, Conventions())
    if match["sign"]:
        words = f"{minus_word(language)} {words}"
    spoken = re.sub(r"1", lambda _: words, str(pattern), count=1)
    if spoken == str(pattern):
        raise TextError("no word for percent")
    return spoken


def _amount(match: re.Match[str], language: Language, conventions: Conventions) -> str:
    code = currency_code(match["sym"], language, conventions)
    amount = parse_number(match["n"], language.locale)
    return currency_words(-amount if match["sign"] else Decimal(amount), code, language)


def _time(match: re.Match[str], language: Language) -> str:
    words = time_words(parse_time(match[0]), language)
    # "at 3 p.m." ending a sentence: its full stop was the abbreviation's.
    end = match.string[match.end():]
    if match[0].endswith(".") and (not end.strip() or end.lstrip()[:1].isupper()):
        words += "."
    return words


def _named_date(match: re.Match[str], language: Language, conventions: Conventions) -> str:
    month = match["month"] or match["month2"]
    if language.code == "en" and month[:1].islower():
        raise TextError("'may', 'march': English words first, months when capitalised")
    return date_words(parse_date(match[0], language, conventions.date_order), language)


def _phone_spans(text: str, language: Language, conventions: Conventions) -> list[_Span]:
    spans = []
    for found in phonenumbers.PhoneNumberMatcher(text, conventions.region,
                                                 leniency=phonenumbers.Leniency.POSSIBLE):
        raw = found.raw_string
        # Only what is written as a phone number: a '+', a parenthesised area code, or digit
        # groups joined by spaces, dashes or dots. A bare digit string is the number rule's
        # (an identifier), and phonenumbers would take a date's "13/45/2026" for one.
        if not _PHONE_SHAPE.fullmatch(raw):
            continue
        spans.append(_Span(found.start, found.end, -1, _phone_reader(language, conventions)))
    return spans


def _phone_reader(language: Language, conventions: Conventions) -> Callable[[str], str]:
    return lambda raw: say_as("telephone", raw, language, conventions)
