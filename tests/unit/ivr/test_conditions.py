"""Branch conditions: the grammar, what each test means on text variables, and the errors.

The parser is fuzzed (STYLE rule 11): any text either parses or raises ConditionError with an
offset inside the text, never another exception.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.ivr.conditions import MAX_DEPTH, Condition, ConditionError


def holds(text: str, **variables: str) -> bool:
    return Condition.parse(text).evaluate(variables)


def test_equality_compares_text_exactly() -> None:
    assert holds('status == "overdue"', status="overdue")
    assert not holds('status == "overdue"', status="Overdue")
    assert holds("status != 'overdue'", status="current")
    assert holds('status == other', status="x", other="x")
    assert holds('status == ""')  # a missing variable reads as empty


def test_a_number_literal_makes_the_comparison_numeric() -> None:
    assert holds("balance == 42.1", balance="42.10")
    assert not holds('balance == "42.1"', balance="42.10")  # quoted: text
    assert not holds("balance == 42", balance="forty-two")
    assert holds("balance != 42", balance="forty-two")


def test_ordering_is_numeric_and_false_for_anything_not_a_number() -> None:
    assert holds("balance > 500", balance="500.01")
    assert not holds("balance > 500", balance="500")
    assert holds("balance >= 500", balance="500")
    assert holds("balance < -1", balance="-2")
    assert holds("balance <= limit", balance="9", limit="10")
    assert not holds("balance > 500", balance="")  # unknown is never "over 500"
    assert not holds("balance < 500", balance="lots")
    assert not holds("balance < 500", balance="NaN")
    assert not holds("balance < 500", balance="1e3")


def test_membership() -> None:
    assert holds('status in ["closed", "suspended"]', status="closed")
    assert not holds('status in ["closed", "suspended"]', status="open")
    assert holds('status not in ["closed", "suspended"]', status="open")
    assert holds("tier in [1, 2]", tier="2.0")
    assert holds("code in [other, 'x']", code="y", other="y")


def test_presence_means_set_and_not_empty() -> None:
    assert holds("first_name", first_name="Dana")
    assert not holds("first_name", first_name="")
    assert not holds("first_name", first_name="   ")
    assert not holds("first_name")
    assert holds("not first_name")


def test_and_or_not_and_parentheses() -> None:
    variables = {"balance": "600", "autopay": "", "status": "current"}
    assert Condition.parse("balance > 500 and not autopay").evaluate(variables)
    assert Condition.parse('status == "x" or balance > 500').evaluate(variables)
    # 'and' binds tighter than 'or'
    assert Condition.parse('status == "x" and balance > 1 or autopay == ""').evaluate(variables)
    assert not Condition.parse('status == "x" and (balance > 1 or autopay == "")').evaluate(
        variables
    )
    assert Condition.parse("not not balance").evaluate(variables)


def test_strings_with_escapes_and_keywords_inside_quotes() -> None:
    assert holds(r'name == "Dana \"D\" O\'Neil"', name="Dana \"D\" O'Neil")
    assert holds('note == "and or not in"', note="and or not in")


def test_variables_read_with_the_offset_of_their_first_use() -> None:
    condition = Condition.parse('balance > 500 and status in ["a", other] or balance')
    assert condition.variables == {"balance": 0, "status": 18, "other": 34}


def test_canonical_form_ignores_spacing_and_quotes() -> None:
    assert Condition.parse('status=="a"').canonical == Condition.parse("status == 'a'").canonical
    assert Condition.parse("a > 1").canonical != Condition.parse("a >= 1").canonical


@pytest.mark.parametrize(
    ("text", "offset", "message"),
    [
        ('status = "x"', 7, "write '==' to compare"),
        ('status == "x', 10, "this quote is never closed"),
        ("status ==", 9, "expected a variable"),
        ('status == "x" "y"', 14, "unexpected '\"y\"'; join tests with 'and' or 'or'"),
        ("(a == 1", 7, "expected ')' to close the '(' at column 1"),
        ("a in []", 6, "an empty list matches nothing"),
        ("a in b", 5, "expected a list after 'in'"),
        ('"x"', 0, '"x" alone is not a test'),
        ("vip == true", 7, "'true' is not a value here"),
        ("a ! b", 2, "write '!=' for 'not equal'"),
        ("a == 1 and", 10, "expected a variable"),
        ("a @ b", 2, "unexpected character '@'"),
        ("   ", 0, "empty condition"),
    ],
)
def test_errors_say_what_is_wrong_and_where(text: str, offset: int, message: str) -> None:
    with pytest.raises(ConditionError) as info:
        Condition.parse(text)
    assert info.value.offset == offset
    assert message in info.value.message


def test_nesting_is_bounded() -> None:
    Condition.parse("(" * (MAX_DEPTH - 1) + "a" + ")" * (MAX_DEPTH - 1))
    with pytest.raises(ConditionError, match="nested more than"):
        Condition.parse("(" * 100 + "a" + ")" * 100)
    with pytest.raises(ConditionError, match="nested more than"):
        Condition.parse("not " * 100 + "a")


_ALPHABET = st.sampled_from(
    [*"ab_ 0123456789.-\"'\\()[],=!<>#@", "and ", "or ", "not ", "in ", "status", "=="]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_ALPHABET, max_size=40).map("".join))
def test_any_text_parses_or_fails_with_a_located_error(text: str) -> None:
    try:
        condition = Condition.parse(text)
    except ConditionError as exc:
        assert 0 <= exc.offset <= len(text)
        return
    condition.evaluate({"a": "1", "status": "x"})
    assert isinstance(condition.canonical, str)
