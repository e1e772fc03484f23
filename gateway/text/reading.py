"""How a line reads its sentences: say-as types, the free-text normaliser and the lexicon,
put together in front of the speech engine.

A script (and, overriding it field by field, a line of the lines file) says how its data is
written and what the automatic normaliser reads::

    reading:
      currency: USD        # an amount without a symbol or code is in this currency
      date_order: mdy      # 03/04/2026 is March 4 (mdy), 3 April (dmy); ISO dates are clear
      region: US           # a phone number without its country code is one of this region
      free_text: numbers   # off | numbers | full: what untyped text gets read as

Left out, they follow the script's language as CLDR knows it (English: US, dollars, month
first; Spanish: Spain, euros, day first) and ``free_text: off``: an author writes words, and
marks values with a type.

:class:`Reader` turns a template and the call's variables into a :class:`Rendering`: the
sentence as written (what ``says`` in a script test checks, and the call's trace shows) and
the words the engine receives (what ``hears`` checks, and the prompt cache keys on). Typed
slots are read by :func:`~gateway.text.sayas.say_as`; everything else (literal text and
untyped values) by the lexicon, then the free-text normaliser. A value that does not parse as
its type is read as written, and the rendering says so (:attr:`Rendering.fallbacks`).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import phonenumbers
from babel import dates as babel_dates
from babel import numbers as babel_numbers
from pydantic import BaseModel, BeforeValidator, ConfigDict, field_validator

from gateway.errors import TextError
from gateway.text.auto import FreeTextMode, normalise
from gateway.text.languages import Language, default_region, language
from gateway.text.lexicon import Lexicon, LexiconEntry
from gateway.text.sayas import KINDS, Conventions, DateOrder, say_as, unsupported
from gateway.text.template import MAX_VALUE_CHARS, Slot, parse

__all__ = ["Fallback", "Reader", "Reading", "Rendering", "slot_problems"]


def _mode(value: Any) -> Any:
    # YAML 1.1 reads a bare `off` as false.
    return "off" if value is False else value


class Reading(BaseModel):
    """The ``reading:`` block of a script or of a line: how its data is written, and what the
    free-text normaliser reads. Fields left out come from the script (for a line) or from the
    script's language."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    currency: str | None = None
    date_order: DateOrder | None = None
    region: str | None = None
    free_text: Annotated[FreeTextMode | None, BeforeValidator(_mode)] = None

    @field_validator("currency")
    @classmethod
    def _currency(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not (len(value) == 3 and value.isalpha() and babel_numbers.is_currency(value.upper())):
            raise ValueError(f"'{value}' is not an ISO 4217 currency code (USD, EUR, GBP, MXN)")
        return value.upper()

    @field_validator("region")
    @classmethod
    def _region(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.upper() not in phonenumbers.SUPPORTED_REGIONS:
            raise ValueError(f"'{value}' is not a region: an ISO 3166 country code (US, GB, "
                             "ES, MX)")
        return value.upper()

    def over(self, base: Reading | None) -> Reading:
        """These settings, with ``base``'s where these leave a field out."""
        if base is None:
            return self
        return Reading(**{name: getattr(self, name) if getattr(self, name) is not None
                          else getattr(base, name) for name in type(self).model_fields})


@dataclass(frozen=True)
class Fallback:
    """A typed value read as written because it is not of its type (the backend answered
    "N/A" for a date)."""

    #: The slot as the template writes it (``{due_date:date}``).
    slot: str
    kind: str
    #: How the value is written, not what it says (it may be a customer's data): letters as
    #: ``A``/``a``, digits as ``9``, the rest as is ("N/A" -> ``A/A``, "15/13/2026" ->
    #: ``99/99/9999``); ``""`` for a value that was empty or missing.
    shape: str

    def __str__(self) -> str:
        what = f"the value (written {self.shape!r})" if self.shape else "the value is empty"
        return f"{self.slot}: {what} is not a {self.kind}; read as written"


@dataclass(frozen=True)
class Rendering:
    """One sentence: as written (values filled in) and as the engine receives it."""

    written: str
    spoken: str
    fallbacks: tuple[Fallback, ...] = ()


class Reader:
    """How one line reads its sentences (compiled once per line and version)."""

    def __init__(self, language_name: str = "English", reading: Reading | None = None,
                 lexicon: Lexicon | Sequence[LexiconEntry] = ()) -> None:
        """``language_name``: the script's language, whose conventions fill what ``reading``
        leaves out. Raises :class:`~gateway.text.lexicon.LexiconError` for an entry that does
        not compile (a loaded script or lines file has checked them)."""
        reading = reading or Reading()
        region = reading.region or default_region(language_name) or "US"
        currency = reading.currency or _territory_currency(region) or "USD"
        order = reading.date_order or _date_order(language_name, region)
        self.conventions = Conventions(currency=currency, date_order=order, region=region)
        self.free_text: FreeTextMode = reading.free_text or "off"
        self.lexicon = lexicon if isinstance(lexicon, Lexicon) else Lexicon(lexicon)

    def _key(self) -> tuple[Any, ...]:
        return self.conventions, self.free_text, self.lexicon

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reader) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        c = self.conventions
        return (f"Reader({c.currency}, {c.date_order}, {c.region}, free_text={self.free_text},"
                f" {self.lexicon!r})")

    def warm(self, language_names: Sequence[str]) -> None:
        """Load what reading ``language_names`` needs (CLDR data, phonenumbers' metadata, the
        free-text patterns) now, at start-up, rather than on a first caller's turn (2-7 ms
        measured on this machine, once per process and language)."""
        for name in dict.fromkeys(language_names):
            lang = self.language(name)
            if lang is None:
                continue
            for kind in KINDS:
                unsupported(kind, lang)
            self.free("1 1st 1% $1 1/1/2026 1:00 PM +1 555 010 0199", name)

    def language(self, name: str) -> Language | None:
        """The language called ``name`` as this line's region reads it."""
        return language(name, self.conventions.region)

    def sentence(self, template: str, variables: Mapping[str, str],
                 language_name: str) -> Rendering:
        """``template`` with ``variables``, as written and as spoken in ``language_name``.

        Never raises for a value: one that is not of its slot's type is read as written (and
        listed in :attr:`Rendering.fallbacks`). The template itself has been validated."""
        lang = self.language(language_name)
        written: list[str] = []
        spoken: list[str] = []
        run: list[str] = []
        fallbacks: list[Fallback] = []
        for part in parse(template):
            if isinstance(part, str):
                written.append(part)
                run.append(part)
                continue
            value = _value(part, variables)
            written.append(value)
            if part.kind is None:
                run.append(value)
                continue
            try:
                if lang is None:
                    raise TextError(f"{language_name} is not a language the text libraries know")
                words = say_as(part.kind, value, lang, self.conventions)
            except TextError:
                fallbacks.append(Fallback(part.source, part.kind, _shape(value)))
                run.append(value)
                continue
            spoken.append(self.free("".join(run), language_name))
            run = []
            spoken.append(words)
        spoken.append(self.free("".join(run), language_name))
        return Rendering("".join(written), "".join(spoken), tuple(fallbacks))

    def free(self, text: str, language_name: str) -> str:
        """Untyped text as spoken: the lexicon's entries, then the free-text normaliser."""
        if not text:
            return text
        if self.lexicon:
            text = self.lexicon.apply(text, language_name)
        if self.free_text != "off":
            text = normalise(text, self.free_text, self.language(language_name),
                             self.conventions)
        return text


def _shape(value: str) -> str:
    """``value`` with its letters and digits masked (see :attr:`Fallback.shape`)."""
    masked = (("9" if c.isdigit() else "A" if c.isupper() else "a") if c.isalnum() else c
              for c in value.strip()[:40])
    return "".join(masked)


def _value(slot: Slot, variables: Mapping[str, str]) -> str:
    if slot.literal is not None:
        return slot.literal
    assert slot.name is not None
    # At most MAX_VALUE_CHARS of a value: a caller's From arrives unchecked, and every
    # character is engine time.
    return str(variables.get(slot.name, ""))[:MAX_VALUE_CHARS]


@functools.lru_cache(maxsize=64)
def _territory_currency(region: str) -> str | None:
    currencies = babel_numbers.get_territory_currencies(region)
    return str(currencies[0]) if currencies else None


@functools.lru_cache(maxsize=64)
def _date_order(language_name: str, region: str) -> DateOrder:
    """The order the region's short dates put day, month and year in (CLDR: ``M/d/yy`` in
    the US, ``d/M/yy`` in Spain, ``y/MM/dd`` in Japan)."""
    lang = language(language_name, region)
    if lang is None:
        return "mdy"
    pattern = str(babel_dates.get_date_format("short", locale=lang.locale).pattern)
    letters = "".join(dict.fromkeys(c for c in re.sub(r"'[^']*'", "", pattern) if c in "dMy"))
    order = letters.replace("M", "m")
    return order if order in ("mdy", "dmy", "ymd") else "mdy"  # type: ignore[return-value]


def slot_problems(slot: Slot, language_names: Sequence[str], reader: Reader) -> list[str]:
    """What is wrong with a typed slot spoken in ``language_names`` (empty: nothing): an
    unknown type, a type the libraries cannot say in one of the languages, or a quoted value
    that is not of its type."""
    kind = slot.kind
    if kind is None:
        return []
    if kind not in KINDS:
        close = difflib.get_close_matches(kind, KINDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return [f"'{slot.source}': unknown type '{kind}'{hint}; the types are "
                f"{', '.join(KINDS)}"]
    problems: list[str] = []
    for name in dict.fromkeys(language_names):
        lang = reader.language(name)
        if lang is None:
            problems.append(f"'{slot.source}' cannot be read as {kind}: the sentence is "
                            f"spoken in {name}, which is no language the text libraries know "
                            "(give the voice a language)")
            continue
        why = unsupported(kind, lang)
        if why is not None:
            problems.append(f"'{slot.source}' cannot be read as {kind} in {name}: {why}")
            continue
        if slot.literal is not None:
            try:
                say_as(kind, slot.literal, lang, reader.conventions)
            except TextError as exc:
                problems.append(f"'{slot.source}' cannot apply: {exc}")
    return problems
