"""The language a sentence is read in, as the text libraries name it.

Scripts and the model name languages in English words (``Spanish``); num2words wants its own
code (``es``) and babel a CLDR locale (``es`` with a region when CLDR has that combination:
``en_GB`` writes dates and times differently from ``en_US``). :func:`language` makes that
mapping once, from babel's own list of language names, so no table of languages is kept here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from babel import Locale, UnknownLocaleError
from babel.core import get_global
from num2words import CONVERTER_CLASSES

__all__ = ["Language", "default_region", "language", "language_code"]


@dataclass(frozen=True, eq=False)
class Language:
    """One language as the text libraries know it (one instance per name and region, from
    :func:`language`: compared and hashed by identity, as the caches keyed on it need fast)."""

    #: The model's name for it (``Spanish``).
    name: str
    #: ISO 639-1 (``es``).
    code: str
    #: CLDR data for dates, times, day periods, currency symbols and names.
    locale: Locale
    #: num2words' language (None: num2words has none, so no number can be put in words).
    words: str | None


@functools.lru_cache(maxsize=64)
def language_code(name: str) -> str | None:
    """``Spanish`` -> ``es`` (by CLDR's English names of languages); None when unknown
    (``Auto``: the model guesses the language, so nothing here can)."""
    wanted = name.strip().lower()
    for code, english in Locale("en").languages.items():
        if len(code) == 2 and english.lower() == wanted:
            return str(code)
    return None


@functools.lru_cache(maxsize=64)
def default_region(name: str) -> str | None:
    """The region a language is most likely spoken in (CLDR likely subtags: ``en`` -> ``US``,
    ``es`` -> ``ES``), for settings a line leaves out."""
    code = language_code(name)
    if code is None:
        return None
    likely = get_global("likely_subtags").get(code)
    if not likely:
        return None
    return str(likely).split("_")[-1]


@functools.lru_cache(maxsize=256)
def language(name: str, region: str | None = None) -> Language | None:
    """The language called ``name`` as read in ``region`` (None: not one the libraries know)."""
    code = language_code(name)
    if code is None:
        return None
    locale = Locale.parse(code)
    if region:
        try:
            regional = Locale.parse(f"{code}_{region}")
        except (UnknownLocaleError, ValueError):
            regional = None
        # CLDR has data for many but not all pairs (there is no es_JP): the language's own
        # conventions then, never another language's.
        if regional is not None and regional.territory == region:
            locale = regional
    # num2words' regional variants (es_CO, pt_BR) change the currency API itself (their
    # to_currency reads one fixed currency), so the language's own converter is used.
    words = code if code in CONVERTER_CLASSES else None
    return Language(name=name, code=code, locale=locale, words=words)
