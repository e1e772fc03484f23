"""Conditions in IVR scripts: a small expression language over the call's variables.

A ``branch`` case reads like this (``prompts/demo.yaml``)::

    branch:
      - if: account_status == "overdue"
        goto: overdue
      - if: balance >= 500 and not autopay
        goto: big_balance
      - if: account_status in ["closed", "suspended"]
        goto: closed
      - else: anything_else

Grammar (keywords are lower case; ``#`` is not a comment inside a condition)::

    condition  := or
    or         := and ("or" and)*
    and        := unary ("and" unary)*
    unary      := "not" unary | "(" condition ")" | comparison
    comparison := value [ ("==" | "!=" | "<" | "<=" | ">" | ">=") value
                        | ["not"] "in" "[" [value ("," value)*] "]" ]
    value      := NAME | "string" | 'string' | NUMBER

Meaning, chosen so a caller is never dropped by a surprise in the data:

- A bare ``NAME`` tests presence: the variable is set and not empty.
- Variables are text (a webhook's ``true`` arrives as ``"yes"``). ``==``/``!=`` compare text,
  unless one side is a number literal: then both are compared as decimal numbers
  (``balance == 42.1`` holds for ``"42.10"``), and a value that is not a number is unequal.
- ``<``, ``<=``, ``>``, ``>=`` compare decimal numbers; if either side is not a number the
  comparison is false (a missing balance never counts as "over 500").
- ``in`` is ``==`` against each item of the list.

The parser is hand-written (no ``eval``): a condition is parsed once when the script loads and
evaluated per call with no way to reach Python. Errors carry the character offset of the problem
so the script loader reports them as ``file:line:column``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

__all__ = ["Condition", "ConditionError", "compile_condition"]

#: Longest condition accepted (a script line, not a program).
MAX_CONDITION_CHARS = 1000
#: Deepest nesting of parentheses and ``not`` (the parser recurses once per level).
MAX_DEPTH = 32

_NUMBER_TEXT = re.compile(r"^\s*[-+]?[0-9]+(\.[0-9]+)?\s*$")
_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<number>-?[0-9]+(?:\.[0-9]+)?(?![A-Za-z_0-9]))
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<op>==|!=|<=|>=|<|>|\(|\)|\[|\]|,)
    """,
    re.VERBOSE,
)
_KEYWORDS = frozenset({"and", "or", "not", "in"})


class ConditionError(ValueError):
    """A condition that does not parse; ``offset`` is where (0-based, into the text)."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset


@dataclass(frozen=True)
class _Token:
    kind: str  # "name", "keyword", "number", "string", "op", "end"
    text: str
    offset: int
    value: str | Decimal | None = None


# --- the tree ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Var:
    name: str
    offset: int


@dataclass(frozen=True)
class _Lit:
    value: str | Decimal


_Value = _Var | _Lit


@dataclass(frozen=True)
class _Present:
    var: _Var


@dataclass(frozen=True)
class _Compare:
    left: _Value
    op: str
    right: _Value


@dataclass(frozen=True)
class _In:
    value: _Value
    items: tuple[_Value, ...]
    negated: bool


@dataclass(frozen=True)
class _Not:
    inner: _Node


@dataclass(frozen=True)
class _Bool:
    op: str  # "and" | "or"
    parts: tuple[_Node, ...]


_Node = _Present | _Compare | _In | _Not | _Bool


def _as_number(value: str | Decimal) -> Decimal | None:
    if isinstance(value, Decimal):
        return value
    if not _NUMBER_TEXT.match(value):
        return None
    try:
        return Decimal(value.strip())
    except InvalidOperation:  # pragma: no cover - the pattern admits only plain decimals
        return None


def _equal(left: str | Decimal, right: str | Decimal, numeric: bool) -> bool:
    if numeric:
        a, b = _as_number(left), _as_number(right)
        return a is not None and b is not None and a == b
    return str(left) == str(right)


class Condition:
    """A parsed condition: evaluate it against a call's variables."""

    __slots__ = ("_tree", "text", "variables")

    def __init__(self, text: str, tree: _Node) -> None:
        self.text = text
        self._tree = tree
        #: Every variable the condition reads, with the offset of its first use.
        self.variables: dict[str, int] = {}
        self._collect(tree)

    @classmethod
    def parse(cls, text: str) -> Condition:
        """Parse ``text``; raise :class:`ConditionError` (with an offset) if it is not valid."""
        if not isinstance(text, str):
            raise ConditionError("a condition is text, such as: status == \"open\"", 0)
        if len(text) > MAX_CONDITION_CHARS:
            raise ConditionError(f"condition longer than {MAX_CONDITION_CHARS} characters", 0)
        if not text.strip():
            raise ConditionError("empty condition", 0)
        return cls(text, _Parser(text).parse())

    def _collect(self, node: _Node | _Value) -> None:
        if isinstance(node, _Var):
            self.variables.setdefault(node.name, node.offset)
        elif isinstance(node, _Present):
            self._collect(node.var)
        elif isinstance(node, _Compare):
            self._collect(node.left)
            self._collect(node.right)
        elif isinstance(node, _In):
            self._collect(node.value)
            for item in node.items:
                self._collect(item)
        elif isinstance(node, _Not):
            self._collect(node.inner)
        elif isinstance(node, _Bool):
            for part in node.parts:
                self._collect(part)

    def evaluate(self, variables: Mapping[str, str]) -> bool:
        """True if the condition holds for ``variables`` (missing variables read as empty)."""
        return self._eval(self._tree, variables)

    @property
    def canonical(self) -> str:
        """The condition with spacing and quoting normalised (spots a case written twice)."""
        return _show(self._tree)

    def _value(self, value: _Value, variables: Mapping[str, str]) -> str | Decimal:
        if isinstance(value, _Lit):
            return value.value
        return str(variables.get(value.name, ""))

    def _eval(self, node: _Node, variables: Mapping[str, str]) -> bool:
        if isinstance(node, _Present):
            return bool(str(variables.get(node.var.name, "")).strip())
        if isinstance(node, _Not):
            return not self._eval(node.inner, variables)
        if isinstance(node, _Bool):
            if node.op == "and":
                return all(self._eval(part, variables) for part in node.parts)
            return any(self._eval(part, variables) for part in node.parts)
        if isinstance(node, _In):
            left = self._value(node.value, variables)
            found = any(
                _equal(left, self._value(item, variables),
                       _is_number_literal(node.value) or _is_number_literal(item))
                for item in node.items
            )
            return found != node.negated
        left = self._value(node.left, variables)
        right = self._value(node.right, variables)
        if node.op in ("==", "!="):
            numeric = _is_number_literal(node.left) or _is_number_literal(node.right)
            return _equal(left, right, numeric) == (node.op == "==")
        a, b = _as_number(left), _as_number(right)
        if a is None or b is None:
            return False
        if node.op == "<":
            return a < b
        if node.op == "<=":
            return a <= b
        if node.op == ">":
            return a > b
        return a >= b

    def __repr__(self) -> str:
        return f"Condition({self.text!r})"


def _is_number_literal(value: _Value) -> bool:
    return isinstance(value, _Lit) and isinstance(value.value, Decimal)


def _show(node: _Node | _Value) -> str:
    if isinstance(node, _Var):
        return node.name
    if isinstance(node, _Lit):
        return str(node.value) if isinstance(node.value, Decimal) else repr(node.value)
    if isinstance(node, _Present):
        return node.var.name
    if isinstance(node, _Compare):
        return f"{_show(node.left)} {node.op} {_show(node.right)}"
    if isinstance(node, _In):
        items = ", ".join(_show(item) for item in node.items)
        return f"{_show(node.value)} {'not in' if node.negated else 'in'} [{items}]"
    if isinstance(node, _Not):
        return f"not ({_show(node.inner)})"
    return "(" + f" {node.op} ".join(_show(part) for part in node.parts) + ")"


@functools.lru_cache(maxsize=4096)
def compile_condition(text: str) -> Condition:
    """:meth:`Condition.parse`, memoised (a script's conditions are parsed once per process)."""
    return Condition.parse(text)


# --- the parser -------------------------------------------------------------------------------


def _unescape(literal: str) -> str:
    body = literal[1:-1]
    return re.sub(r"\\(.)", lambda m: m.group(1), body)


def _tokens(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            char = text[pos]
            if char == "=":
                raise ConditionError("write '==' to compare ('=' alone is not an operator)", pos)
            if char in "\"'":
                raise ConditionError("this quote is never closed", pos)
            if char == "!":
                raise ConditionError("write '!=' for 'not equal', or 'not' before a test", pos)
            raise ConditionError(f"unexpected character {char!r}", pos)
        kind = match.lastgroup
        assert kind is not None
        token_text = match.group()
        if kind == "name" and token_text in _KEYWORDS:
            tokens.append(_Token("keyword", token_text, pos))
        elif kind == "name":
            if token_text in ("true", "false", "True", "False", "null", "None"):
                raise ConditionError(
                    f"'{token_text}' is not a value here: variables are text, so compare with "
                    f"a quoted word (a webhook's true arrives as \"yes\")", pos)
            tokens.append(_Token("name", token_text, pos))
        elif kind == "number":
            tokens.append(_Token("number", token_text, pos, Decimal(token_text)))
        elif kind == "string":
            tokens.append(_Token("string", token_text, pos, _unescape(token_text)))
        elif kind == "op":
            tokens.append(_Token("op", token_text, pos))
        pos = match.end()
    tokens.append(_Token("end", "", len(text)))
    return tokens


_COMPARISONS = frozenset({"==", "!=", "<", "<=", ">", ">="})


class _Parser:
    """Recursive descent over the token list (depth bounded by :data:`MAX_DEPTH`)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokens(text)
        self.i = 0
        self.depth = 0

    @property
    def current(self) -> _Token:
        return self.tokens[self.i]

    def take(self) -> _Token:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def at(self, kind: str, text: str | None = None) -> bool:
        token = self.current
        return token.kind == kind and (text is None or token.text == text)

    def fail(self, message: str, token: _Token | None = None) -> ConditionError:
        token = token or self.current
        return ConditionError(message, token.offset)

    def parse(self) -> _Node:
        node = self.or_()
        if not self.at("end"):
            token = self.current
            hint = ("; join tests with 'and' or 'or'" if token.kind in ("name", "string",
                                                                         "number") else "")
            raise self.fail(f"unexpected {_describe(token)}{hint}")
        return node

    def or_(self) -> _Node:
        parts = [self.and_()]
        while self.at("keyword", "or"):
            self.take()
            parts.append(self.and_())
        return parts[0] if len(parts) == 1 else _Bool("or", tuple(parts))

    def and_(self) -> _Node:
        parts = [self.unary()]
        while self.at("keyword", "and"):
            self.take()
            parts.append(self.unary())
        return parts[0] if len(parts) == 1 else _Bool("and", tuple(parts))

    def unary(self) -> _Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(f"nested more than {MAX_DEPTH} levels deep")
        try:
            if self.at("keyword", "not"):
                self.take()
                return _Not(self.unary())
            if self.at("op", "("):
                opening = self.take()
                inner = self.or_()
                if not self.at("op", ")"):
                    raise self.fail(f"expected ')' to close the '(' at column "
                                    f"{opening.offset + 1} of the condition, found "
                                    f"{_describe(self.current)}")
                self.take()
                return inner
            return self.comparison()
        finally:
            self.depth -= 1

    def value(self) -> _Value:
        token = self.current
        if token.kind == "name":
            self.take()
            return _Var(token.text, token.offset)
        if token.kind in ("string", "number"):
            self.take()
            assert token.value is not None
            return _Lit(token.value)
        raise self.fail(f"expected a variable, a \"quoted text\" or a number, found "
                        f"{_describe(token)}")

    def comparison(self) -> _Node:
        start = self.current
        left = self.value()
        token = self.current
        if token.kind == "op" and token.text in _COMPARISONS:
            self.take()
            return _Compare(left, token.text, self.value())
        negated = False
        if self.at("keyword", "not") and self.tokens[self.i + 1].text == "in":
            self.take()
            negated = True
        if self.at("keyword", "in"):
            self.take()
            return _In(left, self.items(), negated)
        if isinstance(left, _Var):
            return _Present(left)
        raise self.fail(f"{start.text} alone is not a test: compare it with a variable "
                        "(status == \"open\")", start)

    def items(self) -> tuple[_Value, ...]:
        if not self.at("op", "["):
            raise self.fail(f"expected a list after 'in', such as [\"a\", \"b\"], found "
                            f"{_describe(self.current)}")
        self.take()
        items: list[_Value] = []
        if self.at("op", "]"):
            raise self.fail("an empty list matches nothing")
        while True:
            items.append(self.value())
            if self.at("op", "]"):
                self.take()
                return tuple(items)
            if not self.at("op", ","):
                raise self.fail(f"expected ',' or ']' in the list, found "
                                f"{_describe(self.current)}")
            self.take()


def _describe(token: _Token) -> str:
    if token.kind == "end":
        return "the end of the condition"
    return f"'{token.text}'"
