"""Telephone text normalisation (gateway/text/): golden tables of every say-as type per
language, the free-text normaliser, templates, the lexicon and a line's reader."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from gateway.errors import TextError
from gateway.text import KINDS, Conventions, Lexicon, LexiconEntry, LexiconError, Reader, Reading
from gateway.text.languages import default_region, language, language_code
from gateway.text.lexicon import compile_entry
from gateway.text.sayas import say_as, unsupported
from gateway.text.template import MAX_VALUE_CHARS, Slot, TemplateError, parse
from tests.support.paths import GOLDEN as GOLDEN_ROOT
from tests.support.paths import REPO

GOLDEN = GOLDEN_ROOT / "text"
SAYAS = yaml.safe_load((GOLDEN / "sayas.yaml").read_text(encoding="utf-8"))
FREE_TEXT = yaml.safe_load((GOLDEN / "free_text.yaml").read_text(encoding="utf-8"))


def _tables() -> list[Any]:
    out = []
    for kind, tables in SAYAS.items():
        for i, table in enumerate(tables):
            kind_of = table.get("kind", kind)
            out.append(pytest.param(kind_of, table, id=f"{kind}-{table['language']}-{i}"))
    return out


def _read(kind: str, value: str, table: dict[str, Any]) -> str | None:
    conventions = Conventions(**table.get("conventions", {}))
    lang = language(table["language"], conventions.region)
    assert lang is not None
    try:
        return say_as(kind, value, lang, conventions)
    except TextError:
        return None


@pytest.mark.parametrize(("kind", "table"), _tables())
def test_golden_say_as_tables(kind: str, table: dict[str, Any]) -> None:
    """Every row: the value read in the table's language (None: not of its type)."""
    wrong = {value: (want, got) for value, want in table["rows"].items()
             if (got := _read(kind, str(value), table)) != want}
    assert not wrong, "\n".join(f"{kind} {v!r}: want {w!r}, got {g!r}"
                                for v, (w, g) in wrong.items())


def test_the_golden_tables_cover_every_type_in_english_and_spanish() -> None:
    for kind in KINDS:
        languages = {table["language"] for table in SAYAS[kind]}
        assert {"English", "Spanish"} <= languages, kind
    edge = SAYAS["currency"][0]["rows"]
    # The edge cases: negative and zero amounts, cents only.
    assert {"0", "-12.50", "0.05", "-0.75"} <= set(edge)
    assert "004512" in SAYAS["digits"][0]["rows"]
    assert any("ext" in value for value in SAYAS["telephone"][0]["rows"])
    times = SAYAS["time"][0]["rows"]
    assert "15:30" in times and "3:30 PM" in times
    assert len(SAYAS["date"][0]["rows"]) >= 10


@pytest.mark.parametrize("table", FREE_TEXT,
                         ids=[f"{t['language']}-{t['mode'] or 'off'}" for t in FREE_TEXT])
def test_golden_free_text_tables(table: dict[str, Any]) -> None:
    reader = Reader(table["language"], Reading(free_text=table["mode"]))
    wrong = {text: (want, got) for text, want in table["rows"].items()
             if (got := reader.free(text, table["language"])) != want}
    assert not wrong, "\n".join(f"{t!r}: want {w!r}, got {g!r}" for t, (w, g) in wrong.items())


# --- languages and what they can read -----------------------------------------------------------


def test_languages_come_from_cldr_names_and_regions_from_likely_subtags() -> None:
    assert language_code("Spanish") == "es" and language_code("spanish") == "es"
    assert language_code("Auto") is None and language_code("Klingon") is None
    assert default_region("English") == "US" and default_region("Spanish") == "ES"
    uk = language("English", "GB")
    assert uk is not None and str(uk.locale) == "en_GB"
    # CLDR has no Spanish for Japan: Spanish's own conventions, never another language's.
    odd = language("Spanish", "JP")
    assert odd is not None and str(odd.locale) == "es"


def test_a_line_without_settings_follows_its_language() -> None:
    assert Reader("English").conventions == Conventions("USD", "mdy", "US")
    assert Reader("Spanish").conventions == Conventions("EUR", "dmy", "ES")
    assert Reader("Japanese").conventions == Conventions("JPY", "ymd", "JP")
    assert Reader("English", Reading(region="GB")).conventions == Conventions("GBP", "dmy", "GB")
    assert Reader("Spanish", Reading(region="MX")).conventions.currency == "MXN"
    assert Reader("English", Reading(currency="cad")).conventions.currency == "CAD"
    assert Reader("English").free_text == "off"


def test_a_type_the_libraries_cannot_say_is_known_before_any_call() -> None:
    chinese, auto = language("Chinese"), language("Auto")
    assert auto is None
    for kind in KINDS:
        assert unsupported(kind, auto) is not None
        assert unsupported(kind, language("English")) is None
        assert unsupported(kind, language("Spanish")) is None
        # Spelling needs no number words; everything else does (num2words has no Chinese).
        assert (unsupported(kind, chinese) is None) == (kind == "characters"), kind
    assert unsupported("number", chinese) == "num2words cannot say numbers in Chinese"


def test_an_unknown_type_raises_the_documented_error() -> None:
    english = language("English")
    assert english is not None
    with pytest.raises(TextError, match="not a say-as type"):
        say_as("money", "12", english, Conventions())
    with pytest.raises(TextError, match="empty"):
        say_as("currency", "   ", english, Conventions())


# --- templates ------------------------------------------------------------------------------


def test_templates_parse_into_text_and_slots_with_their_offsets() -> None:
    parts = parse('Pay {balance:currency} to {"+1 555 010 0199":telephone}, {name}. {{x}}')
    assert parts[0] == "Pay "
    balance = parts[1]
    assert isinstance(balance, Slot)
    assert (balance.name, balance.kind, balance.start, balance.kind_at) == (
        "balance", "currency", 4, 13)
    phone = parts[3]
    assert isinstance(phone, Slot)
    assert (phone.name, phone.literal, phone.kind) == (None, "+1 555 010 0199", "telephone")
    assert phone.source == '{"+1 555 010 0199":telephone}'
    name = parts[5]
    assert isinstance(name, Slot) and (name.name, name.kind) == ("name", None)
    assert parts[-1] == ". {x}"
    assert parse("{'3:30 PM':time}")[0] == Slot(None, "3:30 PM", "time", 0, 11,
                                                 "{'3:30 PM':time}")


@pytest.mark.parametrize(("text", "message", "offset"), [
    ("Hi {a.b}", "'{a.b}' is not a simple variable", 3),
    ("{a:>10}", "'{a:>10}' is not a simple variable", 0),
    ("{0}", "'{0}' is not a simple variable", 0),
    ("Hello {", "Single '{' encountered", 6),
    ("Hello {name", "expected '}' before end of string", 6),
    ("Hello }", "Single '}' encountered", 6),
    ("x {'12'} y", "quotes a value without saying how to read it", 2),
])
def test_template_errors_say_where(text: str, message: str, offset: int) -> None:
    with pytest.raises(TemplateError) as info:
        parse(text)
    assert message in info.value.message and info.value.offset == offset


# --- the lexicon ----------------------------------------------------------------------------


def test_lexicon_entries_replace_whole_words_and_patterns_in_order() -> None:
    lexicon = Lexicon([
        LexiconEntry(text="Acme", say="Ack-mee"),
        LexiconEntry(text="kWh", say="kilowatt hours", ignore_case=True),
        LexiconEntry(pattern=r"\bSt\.(?= [A-Z])", say="Street"),
        LexiconEntry(pattern=r"\bRte (\d+)", say=r"Route \1"),
        LexiconEntry(text="Ave", say="Avenida", language="Spanish"),
        LexiconEntry(text="C:\\", say="drive \\1"),  # a text entry's 'say' is never re syntax
        # Each entry sees what the ones before it left: "Ack-mee" is there to be matched.
        LexiconEntry(text="Ack-mee", say="Acme Energy"),
    ])
    text = "Acme, Acmes, acme: 12 KWH on Main St. Springfield, Rte 66, 5th Ave, C:\\ ok."
    assert lexicon.apply(text, "English") == (
        "Acme Energy, Acmes, acme: 12 kilowatt hours on Main Street Springfield, Route 66, "
        "5th Ave, drive \\1 ok.")
    assert "Avenida" in lexicon.apply("5th Ave", "spanish")


@pytest.mark.parametrize(("entry", "field", "offset", "message"), [
    ({"pattern": "St\\.(?= [A-Z]", "say": "Street"}, "pattern", 4, "missing ), unterminated"),
    ({"pattern": "a[b", "say": "x"}, "pattern", 1, "unterminated character set"),
    ({"pattern": "(\\d+) St", "say": "\\2 Street"}, "say", 1, "invalid group reference 2"),
    ({"pattern": "(?P<n>\\d+)", "say": "\\g<m>"}, "say", 0, "unknown group name 'm'"),
    ({"pattern": "x", "say": "\\q"}, "say", 0, "bad escape \\q"),
    ({"pattern": "a*", "say": "b"}, "pattern", 0, "matches the empty string"),
])
def test_a_lexicon_entry_that_cannot_compile_says_where(entry: dict[str, str], field: str,
                                                        offset: int, message: str) -> None:
    with pytest.raises(LexiconError) as info:
        compile_entry(LexiconEntry(**entry))
    assert info.value.field == field and info.value.offset == offset
    assert message in info.value.message


def test_a_lexicon_entry_is_text_or_pattern() -> None:
    with pytest.raises(ValidationError, match="exactly one of 'text'"):
        LexiconEntry(say="x")
    with pytest.raises(ValidationError, match="exactly one of 'text'"):
        LexiconEntry(text="a", pattern="b", say="x")
    # A named group and its reference compile; so does a group that may not take part.
    compile_entry(LexiconEntry(pattern=r"(?P<n>\d+)(x)?", say=r"\g<n>\2"))


# --- a line's reader --------------------------------------------------------------------------


def test_a_sentence_is_written_with_its_values_and_spoken_in_words() -> None:
    reader = Reader("English", Reading(free_text="numbers"),
                    [LexiconEntry(text="Acme", say="Ack-mee")])
    rendering = reader.sentence(
        "Acme account {account:digits}: {balance:currency}, {n} bills from {shop}.",
        {"account": "004512", "balance": "12.5", "n": "3", "shop": "Acme"}, "English")
    assert rendering.written == "Acme account 004512: 12.5, 3 bills from Acme."
    # Typed values are read by their type; untyped text and values go through the lexicon
    # and the free-text normaliser.
    assert rendering.spoken == ("Ack-mee account zero zero four five one two: twelve dollars, "
                                "fifty cents, three bills from Ack-mee.")
    assert rendering.fallbacks == ()


def test_the_lexicon_never_touches_a_typed_value() -> None:
    reader = Reader("English", lexicon=[LexiconEntry(text="dollars", say="bucks"),
                                        LexiconEntry(pattern=r"\d", say="#")])
    spoken = reader.sentence("{x:currency} in dollars, {y:digits}, 7", {"x": "2", "y": "12"},
                             "English").spoken
    assert spoken == "two dollars in bucks, one two, #"


def test_a_value_not_of_its_type_is_read_as_written_and_reported_without_its_content() -> None:
    reader = Reader("English", Reading(free_text="numbers"))
    rendering = reader.sentence("Due {when:date}, {amount:currency}, {gone:time}.",
                                {"when": "N/A", "amount": "12 or 13"}, "English")
    # As written, then through the free-text normaliser like any untyped text.
    assert rendering.spoken == "Due N/A, twelve or thirteen, ."
    assert [(f.slot, f.kind, f.shape) for f in rendering.fallbacks] == [
        ("{when:date}", "date", "A/A"), ("{amount:currency}", "currency", "99 aa 99"),
        ("{gone:time}", "time", "")]
    assert str(rendering.fallbacks[0]) == ("{when:date}: the value (written 'A/A') is not a "
                                           "date; read as written")
    assert str(rendering.fallbacks[2]) == "{gone:time}: the value is empty is not a time; " \
                                          "read as written"


def test_values_are_capped_and_never_interpreted() -> None:
    reader = Reader("English", Reading(free_text="full"))
    rendering = reader.sentence("Hi {name}, {code:characters}.",
                                {"name": "{balance:currency}" + "x" * 500, "code": "{0}"},
                                "English")
    assert rendering.written == "Hi {balance:currency}" + "x" * (MAX_VALUE_CHARS - 18) + ", {0}."
    assert rendering.spoken.startswith("Hi {balance:currency}xxx")
    assert rendering.spoken.endswith("x, { zero }.")


def test_a_sentence_in_a_language_the_libraries_do_not_know_is_read_as_written() -> None:
    rendering = Reader("English").sentence("{n:number} and {m}", {"n": "5", "m": "6"}, "Auto")
    assert rendering.spoken == "5 and 6" and rendering.fallbacks[0].slot == "{n:number}"


def test_reading_settings_are_validated_and_merge_field_by_field() -> None:
    with pytest.raises(ValidationError, match="not an ISO 4217 currency"):
        Reading(currency="DOLLARS")
    with pytest.raises(ValidationError, match="not a region"):
        Reading(region="XX")
    with pytest.raises(ValidationError):
        Reading(date_order="ydm")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        Reading(free_text="some")  # type: ignore[arg-type]
    assert Reading(free_text=False).free_text == "off"  # type: ignore[arg-type]  # YAML's off
    line = Reading(currency="cad", free_text="full")
    script = Reading(currency="USD", region="US", date_order="mdy")
    assert line.over(script) == Reading(currency="CAD", region="US", date_order="mdy",
                                        free_text="full")


def test_readers_compare_by_what_they_do() -> None:
    entries = [LexiconEntry(text="Acme", say="Ack-mee")]
    assert Reader("English", lexicon=entries) == Reader("English", lexicon=list(entries))
    assert Reader("English", lexicon=entries) != Reader("English")
    assert len({Reader("English"), Reader("English"), Reader("Spanish")}) == 2
    assert re.match(r"Reader\(USD, mdy, US, free_text=off, Lexicon\(1 entries\)\)",
                    repr(Reader("English", lexicon=entries)))


# --- the documentation's examples (docs/authors/say-as.md) -------------------------------------

SAY_AS_PAGE = (REPO / "docs" / "authors" / "say-as.md").read_text(
    encoding="utf-8")


def test_the_docs_table_of_types_reads_as_it_says() -> None:
    section = SAY_AS_PAGE.split("## How values are read (say-as types)", 1)[1].split(
        "## Free text", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)`[^|]* \| ([^|]+) \| ([^|]+) \|$", section,
                      flags=re.M)
    assert sorted(kind for kind, *_ in rows) == sorted(KINDS)
    for kind, value, english, spanish in rows:
        for name, words in (("English", english), ("Spanish", spanish)):
            first = words.split(";")[0].strip()
            if first.startswith("..."):
                continue  # an abbreviated example
            lang = language(name)
            assert lang is not None
            assert say_as(kind, value, lang, Conventions()) == first, (kind, name)


def test_the_docs_lexicon_example_compiles_and_reads_as_it_says() -> None:
    section = SAY_AS_PAGE.split("## Pronunciation lexicon", 1)[1]
    block = section.split("```yaml", 1)[1].split("```", 1)[0]
    entries = [LexiconEntry(**entry) for entry in yaml.safe_load(block)["lexicon"]]
    reader = Reader("English", lexicon=entries)
    assert reader.free("Acme: 12 KWH at 1 Main St. Springfield, Rte 66, 5 Ave.", "English") == (
        "Ack-mee: 12 kilowatt hours at 1 Main Street Springfield, Route 66, 5 Ave.")
    assert reader.free("5 Ave.", "Spanish") == "5 Avenida."
