"""Sentence templates: literal text, ``{variables}`` and say-as slots.

::

    Your balance is {balance:currency}, due on {due_date:date}.
    Call us on {"+1 555 010 0199":telephone}.

- ``{name}``: the variable's value, read as the line's free-text setting says;
- ``{name:type}``: the value read as a say-as type (:data:`gateway.text.sayas.KINDS`);
- ``{"literal":type}`` (or single quotes): a fixed value read as a type;
- ``{{`` and ``}}``: literal braces.

The syntax is a strict subset of Python's format strings (no attribute or index access, no
conversions, no format specs), so nothing in a template or a value is ever interpreted: a
value is inserted as plain text. Parse errors carry the offset of the offending character, so
a script's diagnostic can point at it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["MAX_VALUE_CHARS", "Part", "Slot", "TemplateError", "parse", "slots", "variables"]

#: Longest variable value inserted into a sentence: a caller's ``From`` arrives from the
#: transport unchecked, and a sentence is generated live (an engine slot busy for its length).
MAX_VALUE_CHARS = 200


class TemplateError(ValueError):
    """A template that does not parse; ``offset`` is where in it."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset


@dataclass(frozen=True)
class Slot:
    """One ``{...}`` of a template."""

    #: The variable read here (None for a quoted literal).
    name: str | None
    #: The quoted value read here (None for a variable).
    literal: str | None
    #: The say-as type (None: plain text); checked by the script's validation, not here.
    kind: str | None
    #: Offset of the ``{`` in the template, and of the type's name (of the ``{`` if none).
    start: int
    kind_at: int
    #: The slot as written (``{balance:currency}``), for messages.
    source: str


#: A piece of a parsed template: literal text, or a slot.
Part = str | Slot

_SLOT = re.compile(
    r"""\{(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<quote>["'])(?P<literal>[^"'{}]*)(?P=quote))"""
    r"""(?::(?P<kind>[A-Za-z_]+))?\}"""
)


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> tuple[Part, ...]:
    """``text`` as literal pieces and slots (raises :class:`TemplateError`).

    Memoised: a call's sentences are a script's few templates, parsed on every turn.
    """
    parts: list[Part] = []
    literal: list[str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == "{":
            if text.startswith("{{", i):
                literal.append("{")
                i += 2
                continue
            match = _SLOT.match(text, i)
            if match is None:
                end = text.find("}", i)
                if end < 0:
                    # Python's own words for these, which authors may have met already.
                    raise TemplateError("Single '{' encountered in format string" if i == n - 1
                                        else "expected '}' before end of string", i)
                raise TemplateError(f"'{text[i:end + 1]}' is not a simple variable: write "
                                    "{name} with letters, digits and underscores only", i)
            if match["literal"] is not None and match["kind"] is None:
                raise TemplateError(f"'{match[0]}' quotes a value without saying how to read "
                                    "it: write {\"value\":type}", i)
            if literal:
                parts.append("".join(literal))
                literal = []
            kind_at = match.start("kind") if match["kind"] is not None else i
            parts.append(Slot(match["name"], match["literal"], match["kind"], i, kind_at,
                              match[0]))
            i = match.end()
        elif char == "}":
            if text.startswith("}}", i):
                literal.append("}")
                i += 2
                continue
            raise TemplateError("Single '}' encountered in format string", i)
        else:
            # Up to the next brace in one step: sentences are mostly literal text.
            nxt = min((j for j in (text.find("{", i), text.find("}", i)) if j >= 0), default=n)
            literal.append(text[i:nxt])
            i = nxt
    if literal:
        parts.append("".join(literal))
    return tuple(parts)


def variables(text: str) -> list[str]:
    """Names read as variables in ``text``, in order (raises :class:`TemplateError`)."""
    return [part.name for part in parse(text) if isinstance(part, Slot) and part.name]


def slots(text: str) -> list[Slot]:
    """Every slot of ``text`` (raises :class:`TemplateError`)."""
    return [part for part in parse(text) if isinstance(part, Slot)]
