"""Say-as types: a value put into the words a caller expects to hear, in a given language.

Each type parses the value as a company's backend writes it and reads it the way SSML's
``<say-as interpret-as="...">`` does (Twilio ``<Say>``, Amazon Connect):

============  =======================  ==================================================
type          value                    English
============  =======================  ==================================================
currency      ``456.10``, ``-$12.5``   four hundred and fifty-six dollars, ten cents
digits        ``004512``               zero zero four five one two
telephone     ``555-010-0199 x12``     five five five, zero one zero, zero one nine nine,
                                       extension one two
date          ``2026-12-15``           December fifteenth, twenty twenty-six
time          ``15:30``, ``3:30 PM``   three thirty PM
ordinal       ``21``, ``21st``         twenty-first
number        ``1,234.5``              one thousand, two hundred and thirty-four point five
characters    ``AB-12``                A B, one two
============  =======================  ==================================================

The words come from the libraries that know them: num2words (cardinals, ordinals, years,
currency amounts with their unit names), babel's CLDR data (month and day-period names, the
order a language writes a date in, 12- or 24-hour clocks, currency symbols and names) and
phonenumbers (how a country groups its numbers). What they do not provide (a language's word
for a phone extension, English's "oh" for a minute below ten) is a rule here, never a table of
numbers.

What the data means is the line's :class:`Conventions`: the currency of a bare amount, the
order of a numeric date, the region of a national phone number. A value that does not parse as
its type raises :class:`~gateway.errors.TextError`; the caller of :func:`say_as` reads it as
written instead.
"""

from __future__ import annotations

import functools
import inspect
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, time
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Literal, cast

import phonenumbers
from babel import Locale
from babel import dates as babel_dates
from babel import numbers as babel_numbers
from num2words import CONVERTER_CLASSES, num2words

from gateway.errors import TextError
from gateway.text.languages import Language

__all__ = [
    "KINDS",
    "Conventions",
    "DateOrder",
    "currency_code",
    "currency_words",
    "date_words",
    "minus_word",
    "month_names",
    "number_words",
    "parse_date",
    "parse_number",
    "parse_time",
    "say_as",
    "spell_digits",
    "time_words",
    "unsupported",
]

#: The say-as types, in the order docs/authors/say-as.md lists them.
KINDS = ("currency", "digits", "telephone", "date", "time", "ordinal", "number", "characters")

#: How a numeric date is written: 03/04/2026 is 4 March in ``dmy``, 3 April in ``mdy``.
DateOrder = Literal["mdy", "dmy", "ymd"]


@dataclass(frozen=True)
class Conventions:
    """How a line's data is written: what the say-as types parse."""

    #: ISO 4217 currency of an amount written without a symbol or code.
    currency: str = "USD"
    #: Order of the fields of a numeric date (ISO ``2026-12-15`` is always year first).
    date_order: DateOrder = "mdy"
    #: ISO 3166 region of a phone number written without its country code.
    region: str = "US"


def say_as(kind: str, value: str, language: Language, conventions: Conventions) -> str:
    """``value`` read as ``kind`` in ``language`` (raises :class:`TextError` when it is not
    one, or when the libraries cannot say it in this language)."""
    reader = _READERS.get(kind)
    if reader is None:
        raise TextError(f"'{kind}' is not a say-as type")
    text = value.strip()
    if not text:
        raise TextError("the value is empty")
    try:
        words = reader(text, language, conventions)
    except TextError:
        raise
    except (ArithmeticError, LookupError, NotImplementedError, TypeError, ValueError,
            AttributeError, OverflowError) as exc:
        # num2words and babel raise whatever their code meets on an odd value or a language
        # they only half cover (Num2Word_IT has no negword): the value is read as written.
        raise TextError(f"{type(exc).__name__} from the library: {exc}") from None
    if not words.strip():
        raise TextError(f"no words for it in {language.name}")
    return words


def unsupported(kind: str, language: Language | None) -> str | None:
    """Why ``kind`` cannot be read in ``language`` at all, or None when it can.

    Found by reading sample values, so it follows what the installed libraries cover rather
    than a list kept here."""
    if language is None:
        return "the sentence's language is not one the text libraries know"
    return _unsupported(kind, language)


@functools.lru_cache(maxsize=256)
def _unsupported(kind: str, language: Language) -> str | None:
    if kind == "characters":
        return None
    if language.words is None:
        return f"num2words cannot say numbers in {language.name}"
    conventions = Conventions()
    for sample in _SAMPLES.get(kind, ()):
        try:
            say_as(kind, sample, language, conventions)
        except TextError as exc:
            return f"the text libraries cannot read {sample!r} as {kind} in {language.name} ({exc})"
    return None


# Values every language that supports a type must read (small ordinals: Korean's num2words
# reads those and fails on larger ones, which then fall back one value at a time).
_SAMPLES: dict[str, tuple[str, ...]] = {
    "currency": ("456.10", "0.05", "-12", "1"),
    "digits": ("0123456789",),
    "telephone": ("+15550100199",),
    "date": ("2026-12-15", "2026-01-01"),
    "time": ("15:30", "09:05", "12:00"),
    "ordinal": ("1", "2", "3", "11", "21"),
    "number": ("1234", "-7", "0"),
}


# --- words from num2words -----------------------------------------------------------------------


def number_words(value: int | Decimal, language: Language, to: str = "cardinal") -> str:
    """``value`` in words (num2words), or :class:`TextError`."""
    if language.words is None:
        raise TextError(f"num2words cannot say numbers in {language.name}")
    if isinstance(value, Decimal) and value != value.to_integral_value() and \
            not _keeps_decimals(language):
        # Reading 12.5 as "twelve" would be worse than leaving it to the model.
        raise TextError(f"num2words drops the decimals of a number in {language.name}")
    # Keyed on the written form: Decimal("12.50") == Decimal("12.5"), but may read otherwise.
    words = _num2words(type(value).__name__, str(value), language.words, to)
    if not words:
        raise TextError(f"num2words has no {to} for {value} in {language.name}")
    return words


@functools.lru_cache(maxsize=8192)
def _num2words(kind: str, value: str, lang: str, to: str) -> str:
    """num2words, memoised: its English cardinal alone costs ~100 us (a walk over its table of
    powers of ten), and an IVR says the same few numbers all day."""
    number = int(value) if kind == "int" else Decimal(value)
    words = num2words(number, lang=lang, to=to)
    return words.strip() if isinstance(words, str) else ""


@functools.lru_cache(maxsize=64)
def _keeps_decimals(language: Language) -> bool:
    """Whether num2words says a number's decimals in ``language`` (its Italian reads 0.5 as
    "zero")."""
    assert language.words is not None
    return bool(num2words(Decimal("0.5"), lang=language.words) !=
                num2words(Decimal("0"), lang=language.words))


@functools.lru_cache(maxsize=64)
def _digit_words(language: Language) -> tuple[str, ...]:
    return tuple(number_words(d, language) for d in range(10))


@functools.lru_cache(maxsize=64)
def minus_word(language: Language) -> str:
    """The language's word for a negative sign, as num2words writes it (``minus``, ``menos``):
    what it puts before minus one beyond its words for one."""
    one, negative = number_words(1, language), number_words(-1, language)
    if negative.endswith(one) and len(negative) > len(one):
        return negative[: -len(one)].strip()
    raise TextError(f"num2words has no word for minus in {language.name}")


def spell_digits(digits: str, language: Language) -> str:
    words = _digit_words(language)
    return " ".join(words[int(d)] for d in digits)


# --- numbers ----------------------------------------------------------------------------------

_MACHINE_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def parse_number(text: str, locale: Locale) -> Decimal:
    """A number as a backend or a person writes it: ``1234.5`` (machine form first), then the
    locale's own form (``1,234.5`` in English, ``1.234,5`` in Spanish)."""
    value = text.strip().replace("\u2212", "-")
    if _MACHINE_NUMBER.fullmatch(value):
        number = Decimal(value)
    else:
        try:
            number = babel_numbers.parse_decimal(value, locale=locale, strict=True)
        except (babel_numbers.NumberFormatError, InvalidOperation, ValueError):
            raise TextError(f"{value!r} is not a number") from None
    if not number.is_finite():
        raise TextError(f"{value!r} is not a number")
    return number


def _number(text: str, language: Language, conventions: Conventions) -> str:
    number = parse_number(text, language.locale)
    if number == number.to_integral_value():
        number = number.quantize(Decimal(1))  # 12.0 is "twelve", not "twelve point zero"
    return number_words(number, language)


_ORDINAL = re.compile(r"(\d+)\s*(?:st|nd|rd|th|º|ª|°|\.|o|a|er|re|e|ème|-?й|-?я|-?е)?",
                      re.IGNORECASE)


def _ordinal(text: str, language: Language, conventions: Conventions) -> str:
    match = _ORDINAL.fullmatch(text)
    if match is None:
        raise TextError(f"{text!r} is not a whole number")
    return number_words(int(match[1]), language, "ordinal")


def _digits(text: str, language: Language, conventions: Conventions) -> str:
    groups = re.split(r"[\s\-./]+", text)
    if not all(group.isascii() and group.isdigit() for group in groups):
        raise TextError(f"{text!r} is not digits")
    # A separator the value is written with is a pause ("1234-5678": four, pause, four).
    return ", ".join(spell_digits(group, language) for group in groups)


def _characters(text: str, language: Language, conventions: Conventions) -> str:
    groups: list[list[str]] = [[]]
    for char in text:
        if char.isspace() or char in "-_":
            if groups[-1]:
                groups.append([])
        elif char.isascii() and char.isdigit():
            groups[-1].append(_digit_words(language)[int(char)] if language.words else char)
        elif char.isalpha():
            # One letter per word, upper case: a lone "a" is otherwise read as the article.
            groups[-1].append(char.upper())
        else:
            groups[-1].append(char)
    return ", ".join(" ".join(group) for group in groups if group)


# --- currency ---------------------------------------------------------------------------------

#: An amount with a currency symbol or ISO code before or after it, a sign anywhere in front.
_AMOUNT = re.compile(
    r"(?P<sign1>[-\u2212+]?)\s*(?P<pre>[^\d\s.,+\-\u2212]+)?\s*(?P<sign2>[-\u2212+]?)\s*"
    r"(?P<number>[\d.,\s\u00a0\u202f']*\d[\d.,\u00a0\u202f']*)\s*(?P<post>[^\d\s.,+\-\u2212]+)?"
)
_SENTINEL = "\x00"


def currency_code(token: str, language: Language, conventions: Conventions) -> str:
    """The ISO code a symbol or code stands for: the line's currency for its own symbols
    (``$`` is dollars in the US and pesos in Mexico), else the one CLDR gives it."""
    if babel_numbers.is_currency(token.upper()) and token.isalpha() and len(token) == 3:
        return token.upper()
    for locale in _symbol_locales(language, conventions):
        symbol = babel_numbers.get_currency_symbol(conventions.currency, locale=locale)
        if token in (symbol, _narrow(symbol)):
            return conventions.currency
    for locale in _symbol_locales(language, conventions):
        found = _symbols(locale).get(token)
        if found is not None:
            return found
    raise TextError(f"{token!r} is not a currency this line knows")


def _narrow(symbol: str) -> str:
    """``US$`` -> ``$``: the symbol without the letters that tell dollars apart."""
    return "".join(c for c in symbol if unicodedata.category(c) == "Sc") or symbol


def _symbol_locales(language: Language, conventions: Conventions) -> list[Locale]:
    locales = [language.locale, Locale.parse("en")]
    try:
        locales.append(Locale.parse(f"{language.code}_{conventions.region}"))
    except (ValueError, LookupError):
        pass
    return locales


@functools.lru_cache(maxsize=64)
def _symbols(locale: Locale) -> dict[str, str]:
    """Symbol -> ISO code, for the symbols CLDR gives one currency only in ``locale``."""
    seen: dict[str, set[str]] = {}
    for code, symbol in locale.currency_symbols.items():
        if symbol != code:
            seen.setdefault(symbol, set()).add(code)
    return {symbol: next(iter(codes)) for symbol, codes in seen.items() if len(codes) == 1}


def _currency(text: str, language: Language, conventions: Conventions) -> str:
    match = _AMOUNT.fullmatch(text)
    if match is None:
        raise TextError(f"{text!r} is not an amount")
    tokens = [t for t in (match["pre"], match["post"]) if t]
    if len(tokens) > 1:
        raise TextError(f"{text!r} names two currencies")
    code = (currency_code(tokens[0], language, conventions) if tokens
            else conventions.currency)
    signs = (match["sign1"] + match["sign2"]).replace("\u2212", "-")
    if len(signs) > 1:
        raise TextError(f"{text!r} has two signs")
    amount = parse_number(match["number"], language.locale)
    if signs == "-":
        amount = -amount
    return currency_words(amount, code, language)


def currency_words(amount: Decimal, code: str, language: Language) -> str:
    """``amount`` of currency ``code`` in words: whole units and minor units as the currency
    has them (none for yen), rounded half up to them; a zero part is left out ("five cents",
    "twelve dollars") unless the amount is zero."""
    precision = babel_numbers.get_currency_precision(code)
    amount = amount.quantize(Decimal(1).scaleb(-precision), rounding=ROUND_HALF_UP)
    negative, amount = amount < 0, abs(amount)
    units = int(amount)
    minor = int((amount - units).scaleb(precision))
    converter = CONVERTER_CLASSES.get(language.words or "")
    words: str | None = None
    if converter is not None:
        try:
            # The separator between units and minor units is the library's to choose (", ",
            # " con ", " et "); a sentinel in its place shows where to cut a zero part off.
            split = converter.to_currency(amount, currency=code, separator=_SENTINEL)
        except (NotImplementedError, TypeError, KeyError):
            split = None
        if isinstance(split, str) and split.count(_SENTINEL) == 1:
            whole, cents = (part.strip() for part in split.split(_SENTINEL))
            if precision == 0 or minor == 0:
                words = whole
            elif units == 0:
                words = cents
            else:
                words = split.replace(_SENTINEL, _separator(language.words or ""))
    if words is None:
        # num2words has no name for this currency in this language: the amount in words, and
        # CLDR's name for the currency ("twelve point five Japanese yen").
        count = units if minor == 0 else 2
        name = babel_numbers.get_currency_name(code, count=count, locale=language.locale)
        number = amount if minor else Decimal(units)
        words = f"{number_words(number, language)} {name}"
    return f"{minus_word(language)} {words}" if negative and amount else words


@functools.lru_cache(maxsize=64)
def _separator(words: str) -> str:
    """The separator num2words puts between units and minor units by default in language
    ``words`` (its to_currency's own default: "," in English, " con" in Spanish)."""
    converter = CONVERTER_CLASSES[words]
    parameter = inspect.signature(converter.to_currency).parameters.get("separator")
    default = parameter.default if parameter is not None else ","
    return default if isinstance(default, str) else ","


# --- telephone --------------------------------------------------------------------------------

#: The words num2words and CLDR do not have: "+" and "extension" said aloud, per language.
_PHONE_WORDS: dict[str, tuple[str, str]] = {
    "en": ("plus", "extension"),
    "es": ("más", "extensión"),
    "fr": ("plus", "poste"),
    "de": ("plus", "Durchwahl"),
    "it": ("più", "interno"),
    "pt": ("mais", "ramal"),
    "ru": ("плюс", "добавочный"),
    "ja": ("プラス", "内線"),
    "ko": ("플러스", "내선"),
    "zh": ("加", "分机"),
}
_DIALABLE = re.compile(r"\+?[\d\s\-.()/]+")


def _telephone(text: str, language: Language, conventions: Conventions) -> str:
    plus, extension = _PHONE_WORDS.get(language.code, _PHONE_WORDS["en"])
    try:
        number = phonenumbers.parse(text, conventions.region)
    except phonenumbers.NumberParseException:
        number = None
    if number is None or not phonenumbers.is_possible_number(number):
        # A short code or an internal extension ("911", "2000"): its digits as written.
        if not _DIALABLE.fullmatch(text):
            raise TextError(f"{text!r} is not a phone number")
        groups = re.findall(r"\d+", text)
        spoken = ", ".join(spell_digits(g, language) for g in groups)
        return f"{plus} {spoken}" if text.lstrip().startswith("+") else spoken
    bare = phonenumbers.PhoneNumber()
    bare.merge_from(number)
    bare.extension = None
    home = number.country_code == phonenumbers.country_code_for_region(conventions.region)
    # The groups the number's own country writes it in: "(555) 010-0199", "020 7946 0958".
    written = phonenumbers.format_number(
        bare, phonenumbers.PhoneNumberFormat.NATIONAL if home
        else phonenumbers.PhoneNumberFormat.INTERNATIONAL)
    groups = re.findall(r"\d+", written)
    spoken = ", ".join(spell_digits(g, language) for g in groups)
    if not home:
        spoken = f"{plus} {spoken}"
    if number.extension:
        spoken += f", {extension} {spell_digits(re.sub(r'[^0-9]', '', number.extension), language)}"
    return spoken


# --- dates ------------------------------------------------------------------------------------

_ISO_DATE = re.compile(r"(\d{4})[-/.](\d{1,2})[-/.](\d{1,2})(?:[T\s].*)?")
_COMPACT_DATE = re.compile(r"\d{8}")
_NUMERIC_DATE = re.compile(r"(\d{1,2})[-/.](\d{1,2})(?:[-/.](\d{2}|\d{4}))?")
_DATE_WORD = re.compile(r"\d+|[^\W\d_]+\.?", re.UNICODE)
#: Little words a written-out date may carry ("3 de marzo", "the 3rd of March").
_DATE_FILLERS = frozenset({"de", "del", "of", "the", "le", "el", "der", "den", "am"})
_ORDINAL_SUFFIX = re.compile(r"(?:st|nd|rd|th|º|ª|°|o|a|er|e)", re.IGNORECASE)


@dataclass(frozen=True)
class _Day:
    """A calendar day; ``year`` None when the value gives none ("March 3")."""

    year: int | None
    month: int
    day: int


def _valid(year: int | None, month: int, day: int) -> _Day:
    try:
        date(year if year is not None else 2000, month, day)  # 2000: February 29 exists
    except ValueError:
        raise TextError(f"there is no {year or ''}-{month:02d}-{day:02d}") from None
    return _Day(year, month, day)


def _two_digit_year(year: int) -> int:
    # POSIX strptime's %y pivot: 69-99 are 1969-1999, 00-68 are 2000-2068.
    return year + (1900 if year >= 69 else 2000)


def parse_date(text: str, language: Language, order: DateOrder) -> _Day:
    """A date as backends write it: ISO (``2026-12-15``, with or without a time after it),
    compact (``20261215``), numeric in the line's ``order`` (``12/15/2026``, ``15.12.26``,
    ``12/15``), or with the month's name in the sentence's language or English
    (``December 15, 2026``, ``15 Dec``, ``3 de marzo de 2026``)."""
    value = text.strip()
    if match := _ISO_DATE.fullmatch(value):
        return _valid(int(match[1]), int(match[2]), int(match[3]))
    if _COMPACT_DATE.fullmatch(value):
        iso_year = int(value[:4])
        if 1900 <= iso_year <= 2100:
            try:
                return _valid(iso_year, int(value[4:6]), int(value[6:]))
            except TextError:
                pass
        a, b, y = int(value[:2]), int(value[2:4]), int(value[4:])
        return _valid(y, a, b) if order == "mdy" else _valid(y, b, a) if order == "dmy" else \
            _valid(int(value[:4]), int(value[4:6]), int(value[6:]))
    if match := _NUMERIC_DATE.fullmatch(value):
        a, b = int(match[1]), int(match[2])
        year: int | None = None
        if match[3] is not None:
            year = int(match[3]) if len(match[3]) == 4 else _two_digit_year(int(match[3]))
        if order == "ymd":
            if year is None:
                return _valid(None, a, b)
            # yy/mm/dd: the two-digit year comes first.
            return _valid(_two_digit_year(a) if len(match[1]) <= 2 else a, b, int(match[3]))
        return _valid(year, a, b) if order == "mdy" else _valid(year, b, a)
    return _date_in_words(value, language)


def _date_in_words(value: str, language: Language) -> _Day:
    months = month_names(language.locale)
    weekdays = _weekday_names(language.locale)
    month: int | None = None
    numbers: list[int] = []
    for token in _DATE_WORD.findall(value):
        folded = token.lower().rstrip(".")
        if token[0].isdigit():
            numbers.append(int(token))
        elif folded in months:
            if month is not None:
                raise TextError(f"{value!r} names two months")
            month = months[folded]
        elif folded in weekdays or folded in _DATE_FILLERS or (
                numbers and _ORDINAL_SUFFIX.fullmatch(folded)):
            continue
        else:
            raise TextError(f"{value!r} is not a date")
    if month is None or not 1 <= len(numbers) <= 2:
        raise TextError(f"{value!r} is not a date")
    if len(numbers) == 1:
        return _valid(None, month, numbers[0])
    first, second = numbers
    # The year is the number that cannot be a day ("March 3, 2026", "2026 March 3").
    if first > 31 and second <= 31:
        return _valid(first, month, second)
    if second > 31 and first <= 31:
        return _valid(second, month, first)
    raise TextError(f"{value!r}: which number is the day and which the year?")


@functools.lru_cache(maxsize=64)
def month_names(locale: Locale) -> dict[str, int]:
    """Every spelling of the months in ``locale`` and English (full and abbreviated, as part
    of a date and standing alone), folded to lower case."""
    names: dict[str, int] = {}
    for where in (Locale.parse("en"), locale):
        for width in ("wide", "abbreviated"):
            for context in ("format", "stand-alone"):
                for number, name in babel_dates.get_month_names(width, context, where).items():
                    names.setdefault(str(name).lower().rstrip("."), int(number))
    # English's "Sept" is CLDR's abbreviation in some locales only.
    names.setdefault("sept", 9)
    return names


@functools.lru_cache(maxsize=64)
def _weekday_names(locale: Locale) -> frozenset[str]:
    names: set[str] = set()
    for where in (Locale.parse("en"), locale):
        for width in ("wide", "abbreviated"):
            names.update(str(n).lower().rstrip(".")
                         for n in babel_dates.get_day_names(width, "format", where).values())
    return frozenset(names)


#: How a language reads the day of a date: as an ordinal ("March third", "der dritte
#: März"), or as a cardinal with the first of the month an ordinal ("primero de marzo",
#: "premier mars"). Languages not listed read cardinals.
_DAY_STYLE: dict[str, Literal["ordinal", "first"]] = {
    "en": "ordinal", "de": "ordinal", "es": "first", "fr": "first", "it": "first",
    "pt": "first",
}


def _date(text: str, language: Language, conventions: Conventions) -> str:
    return date_words(parse_date(text, language, conventions.date_order), language)


def date_words(day: _Day, language: Language) -> str:
    """A day in words, in the order and with the month names the language writes it (CLDR's
    long date, or month and day when the value has no year)."""
    locale = language.locale
    if day.year is not None:
        pattern = str(babel_dates.get_date_format("long", locale=locale).pattern)
    else:
        pattern = str(locale.datetime_skeletons["MMMMd"].pattern)
    style = _DAY_STYLE.get(language.code)
    ordinal_day = style == "ordinal" or (style == "first" and day.day == 1)
    fields: dict[str, str] = {}
    template = _pattern_format(pattern)
    for field in re.findall(r"%\((\w+)\)s", template):
        letter = field[0]
        if letter == "d":
            fields[field] = number_words(day.day, language,
                                         "ordinal" if ordinal_day else "cardinal")
        elif letter in "ML" and len(field) >= 3:
            fields[field] = str(babel_dates.get_month_names(
                "wide", "format" if letter == "M" else "stand-alone", locale)[day.month])
        elif letter in "ML":
            fields[field] = number_words(day.month, language)
        elif letter == "y" and day.year is not None:
            fields[field] = _year(day.year, language)
        elif letter == "E" and day.year is not None:
            fields[field] = str(babel_dates.format_date(
                date(day.year, day.month, day.day), "EEEE", locale=locale))
        else:
            fields[field] = ""
    text = template % fields
    if ordinal_day:
        # "15. Dezember": the full stop marks the ordinal, which is a word now.
        text = re.sub(re.escape(fields.get("d", fields.get("dd", "\x00"))) + r"\.", lambda m:
                      m[0][:-1], text, count=1)
    # A number CLDR writes inside a name (Korean "12월") is read as words too.
    text = re.sub(r"\d+", lambda m: number_words(int(m[0]), language), text)
    return re.sub(r"\s+", " ", text).strip(" ,")


def _pattern_format(pattern: str) -> str:
    """A CLDR pattern as a %-format over its fields (``MMMM d, y`` -> ``%(MMMM)s %(d)s,
    %(y)s``): babel's own parse, whose ``format`` attribute shadows a method of that name."""
    return cast(str, babel_dates.parse_pattern(pattern).format)


def _year(year: int, language: Language) -> str:
    if language.code == "en":
        # English says years in pairs ("twenty twenty-six"); num2words knows how.
        return number_words(year, language, "year")
    return number_words(year, language)


# --- times ------------------------------------------------------------------------------------

_TIME = re.compile(
    r"(\d{1,2})(?:[:.h](\d{2}))?(?::(\d{2}))?\s*(?:([ap])\.?\s?m\.?)?", re.IGNORECASE)
_ISO_DATETIME_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[T\s](\d{2}):(\d{2})(?::\d{2}(?:\.\d+)?)?"
                                r"(?:Z|[+-]\d{2}:?\d{2})?")


def parse_time(text: str) -> time:
    """A time of day: 24-hour (``15:30``, ``09:05``, ``15.30``, ``15h30``), 12-hour (``3:30
    PM``, ``3pm``, ``3:30 p. m.``), or the time of an ISO date-time (``2026-12-15T15:30:00``)."""
    value = text.strip()
    if match := _ISO_DATETIME_TIME.fullmatch(value):
        hour, minute = int(match[1]), int(match[2])
    elif match := _TIME.fullmatch(value):
        hour, minute = int(match[1]), int(match[2] or 0)
        marker = (match[4] or "").lower()
        if not marker and match[2] is None:
            raise TextError(f"{value!r} is a number, not a time (write 15:00 or 3 PM)")
        if marker:
            if not 1 <= hour <= 12:
                raise TextError(f"{value!r}: a 12-hour time's hour is 1 to 12")
            hour = hour % 12 + (12 if marker == "p" else 0)
    else:
        raise TextError(f"{value!r} is not a time")
    if not (0 <= hour <= 23 and 0 <= minute <= 59):
        raise TextError(f"{value!r} is not a time")
    return time(hour, minute)


def _time(text: str, language: Language, conventions: Conventions) -> str:
    return time_words(parse_time(text), language)


def time_words(moment: time, language: Language) -> str:
    """A time of day as a caller hears it: English on the 12-hour clock ("three thirty PM",
    "nine oh five AM"), Spanish with CLDR's period of the day ("tres y treinta de la tarde"),
    other languages on the clock their locale uses, hours and minutes in words."""
    hour12 = moment.hour % 12 or 12
    minute = moment.minute
    if language.code == "en":
        period = str(babel_dates.get_period_names("abbreviated", locale=Locale.parse("en"))[
            "am" if moment.hour < 12 else "pm"])
        if minute == 0:
            return f"{number_words(hour12, language)} {period}"
        # Minutes below ten are said "oh five" in English.
        minutes = number_words(minute, language) if minute >= 10 else \
            f"oh {number_words(minute, language)}"
        return f"{number_words(hour12, language)} {minutes} {period}"
    if language.code == "es":
        period = str(babel_dates.format_time(moment, "B", locale=language.locale))
        # "la una": hours are feminine (la hora), and num2words counts in the masculine; its
        # own Spanish currency code makes the same change for feminine currencies.
        hours = "una" if hour12 == 1 else number_words(hour12, language)
        if minute == 0:
            return f"{hours} {period}"
        return f"{hours} y {number_words(minute, language)} {period}"
    pattern = str(babel_dates.get_time_format("short", locale=language.locale).pattern)
    if minute == 0:
        pattern = re.sub(r"[:.]mm", "", pattern)
    written = str(babel_dates.format_time(moment, pattern, locale=language.locale))
    spoken = re.sub(r"\d+", lambda m: number_words(int(m[0]), language), written)
    return re.sub(r"\s+", " ", spoken.replace(":", " ")).strip()


_READERS: dict[str, Callable[[str, Language, Conventions], str]] = {
    "currency": _currency,
    "digits": _digits,
    "telephone": _telephone,
    "date": _date,
    "time": _time,
    "ordinal": _ordinal,
    "number": _number,
    "characters": _characters,
}

