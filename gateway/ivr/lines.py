"""Lines: which IVR script answers which dialled number.

One gateway serves many phone lines. A lines file (YAML, ``GATEWAY_LINES``) names each line,
its script and the numbers that reach it, and the line that answers everything else::

    default: main                 # calls to a number no line lists
    lines:
      main:
        script: demo.yaml         # relative to this file
        numbers: ["+1 555 000 2222", ivr]
      billing:
        script: billing.yaml
        numbers: ["+15550003333", "2000"]
        reading: {currency: CAD}  # how this line reads (over its script's: gateway.text)
        lexicon:                  # and says its names (before its script's entries)
          - {text: Acme, say: Ack-mee}

A number is an E.164 number (``+`` and 7 to 15 digits, country code first; spaces, dashes,
dots and parentheses are read as visual separators, RFC 3966 5.1.1) or an extension / SIP user
(``2000``, ``ivr``: letters, digits and ``. _ ~ -``, compared exactly, as RFC 3261 19.1.4
compares the user part). What is dialled comes from Twilio's ``To`` or a SIP INVITE's
Request-URI user (the ``To`` user when the Request-URI has none); a SIP user of digits only also
matches the E.164 number with those digits, for trunks that drop the ``+``.

A line's name is the ``line`` label of the call metrics; calls to a number no line lists are
counted as ``default`` whichever line answers them, so the label set stays the configured lines
plus one however many numbers callers dial. ``GATEWAY_SCRIPT`` is the one-line case: every call
runs that script and counts as ``default``.

Loading a :class:`LinePlan` reads and validates the lines file and every script it names, and
reports every problem at once as ``file:line:column: message`` (:class:`ScriptError`), exactly
as a script's own errors are reported. Each file is stamped (:func:`stamp`) just before it is
read, so a change made while a plan loads is seen by the next check for changes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar
from urllib.parse import unquote

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from gateway.ivr.script import (
    LANGUAGES,
    Diagnostic,
    Script,
    ScriptError,
    _Loader,
    _Map,
    _schema_message,
    check_lexicon_entry,
    key_position,
    load_script,
    position,
    read_yaml,
    script_reader,
)
from gateway.text import LexiconEntry, Reader, Reading

__all__ = [
    "DEFAULT_LABEL",
    "FileStamp",
    "Line",
    "LinePlan",
    "Route",
    "dialled_key",
    "is_lines_file",
    "load_lines",
    "load_plan",
    "normalise_number",
    "script_sounds",
    "single_script",
    "stamp",
]

#: The metric label (and trace line) of calls to numbers no line lists.
DEFAULT_LABEL = "default"

#: A line's name: a metric label value and a word in logs.
_LINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")
#: RFC 3966 visual separators inside a global number (and the space people type).
_SEPARATORS = re.compile(r"[\s\-.()]")
#: An extension or SIP user part as a line lists it (RFC 3986 unreserved characters).
_EXTENSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._~-]{0,63}$")
#: E.164 (ITU-T E.164 section 6): a country code that never starts with 0, at most 15 digits.
_E164_MIN_DIGITS, _E164_MAX_DIGITS = 7, 15

#: (mtime_ns, size, inode) of a file, or None when it is missing: what a check for changes
#: compares. The inode catches an atomic rename (an editor's save, a Kubernetes ConfigMap's
#: symlink swap) that keeps the size and lands within the same timestamp tick.
FileStamp = tuple[int, int, int] | None


def stamp(path: Path) -> FileStamp:
    """``path``'s :data:`FileStamp` now (following symlinks)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def normalise_number(text: str) -> str:
    """A number as a lines file lists it, in the form calls are matched on.

    ``+1 (555) 000-2222`` -> ``+15550002222``; an extension or SIP user is kept as written.
    Raises :class:`ValueError` saying what is wrong (a national number, a stray character).
    """
    value = text.strip()
    if value.startswith("+"):
        digits = _SEPARATORS.sub("", value[1:])
        if not re.fullmatch(r"[0-9]+", digits):
            raise ValueError(f"'{text}' is not an E.164 number: after '+' come digits only "
                             "(spaces, dashes, dots and parentheses may separate them)")
        if digits[0] == "0" or not _E164_MIN_DIGITS <= len(digits) <= _E164_MAX_DIGITS:
            raise ValueError(f"'{text}' is not an E.164 number: a country code (never 0) "
                             f"and the number, {_E164_MIN_DIGITS} to {_E164_MAX_DIGITS} "
                             "digits in all, e.g. +15550002222")
        return "+" + digits
    if _EXTENSION.fullmatch(value):
        return value
    if re.fullmatch(r"[0-9\s\-.()]+", value):
        raise ValueError(f"'{text}' looks like a national number, which means different lines "
                         "in different countries: write it in E.164 with its country code "
                         "(+1 555 000 2222); an extension is digits only (2000)")
    raise ValueError(f"'{text}' is neither an E.164 number (+15550002222) nor an extension or "
                     "SIP user (2000, support: letters, digits and . _ ~ -)")


def dialled_key(text: str) -> str:
    """What a call dialled, in the form lines are matched on (never raises).

    Accepts Twilio's ``To`` (``+15550002222``, ``sip:2000@example.com``, ``client:alice``) and
    a SIP user part: a ``sip:``/``sips:``/``tel:`` scheme, the host and user parameters
    (``;phone-context=...``, RFC 3966 / RFC 3261 19.1.6) are dropped, escapes decoded, and a
    global number loses its visual separators.
    """
    value = text.strip()
    match = re.match(r"^(sips?|tel):", value, re.IGNORECASE)
    if match is not None:
        value = value[match.end():]
        if match.group(1).lower() != "tel":
            value = value.split("@", 1)[0] if "@" in value else ""
    value = unquote(value.split(";", 1)[0])
    if value.startswith("+"):
        value = "+" + _SEPARATORS.sub("", value[1:])
    return value


# --- the file ---------------------------------------------------------------------------------


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class _LineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    script: str = Field(min_length=1)
    numbers: Annotated[list[str], BeforeValidator(_as_list)] = Field(default_factory=list)
    #: This line's reading settings, over its script's (:class:`gateway.text.Reading`).
    reading: Reading | None = None
    #: This line's lexicon, applied before its script's.
    lexicon: list[LexiconEntry] = Field(default_factory=list)


class _LinesSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    default: str
    lines: dict[str, _LineSpec] = Field(min_length=1)


class _PlainLoader(_Loader):
    """Every plain scalar is a string: ``+15550002222`` unquoted would otherwise be the integer
    15550002222 (its ``+`` gone) and ``0100`` the octal 64."""

    yaml_implicit_resolvers: ClassVar[dict[Any, Any]] = {}


@dataclass(frozen=True)
class Line:
    """One line: its name (the metric label), its script and the numbers that reach it."""

    name: str
    script: Script
    path: Path
    numbers: tuple[str, ...] = ()
    #: The line's own ``reading`` and ``lexicon`` (the script's apply where these say nothing).
    reading: Reading | None = None
    lexicon: tuple[LexiconEntry, ...] = ()

    def reader(self) -> Reader:
        """How this line reads its sentences: its reading over its script's, its lexicon
        entries before its script's."""
        return script_reader(self.script, self.reading, self.lexicon)


@dataclass(frozen=True)
class Route:
    """Where a call goes: its line, and the label its metrics carry."""

    line: Line
    #: The line's name, or :data:`DEFAULT_LABEL` for a number no line lists.
    label: str
    #: What was dialled, as matched (:func:`dialled_key`).
    dialled: str
    matched: bool


@dataclass(frozen=True)
class LinePlan:
    """One version of the lines file and its scripts, validated: the routing table."""

    #: The lines file, or the one script of ``GATEWAY_SCRIPT``.
    source: Path
    lines: Mapping[str, Line]
    default: str
    #: Dialled number -> line name.
    numbers: Mapping[str, str] = field(default_factory=dict)
    #: Every file this plan was read from (lines file, scripts, sounds) and its stamp when read.
    stamps: Mapping[Path, FileStamp] = field(default_factory=dict)
    #: Built from ``GATEWAY_SCRIPT``: every call is the default line's.
    single: bool = False

    def route(self, dialled: str) -> Route:
        """The line of a call that dialled ``dialled`` (the default one when none lists it)."""
        key = dialled_key(dialled)
        name = self.numbers.get(key)
        if name is None and key.isascii() and key.isdigit():
            name = self.numbers.get("+" + key)  # a trunk that dropped the '+'
        if name is None:
            return Route(self.lines[self.default], DEFAULT_LABEL, key, matched=False)
        return Route(self.lines[name], name, key, matched=True)

    def scripts(self) -> dict[Path, Script]:
        """Each distinct script once (two lines may share one)."""
        return {line.path: line.script for line in self.lines.values()}

    def describe(self) -> str:
        if self.single:
            return f"{self.source} (every call)"
        return (f"{self.source}: {len(self.lines)} line(s), {len(self.numbers)} number(s), "
                f"default {self.default!r}")


def is_lines_file(path: Path) -> bool:
    """True when ``path`` reads as a lines file (a mapping with ``lines`` and no ``nodes``),
    so ``script validate`` and ``script render`` take either kind of file."""
    try:
        tree, _ = read_yaml(path.read_text(encoding="utf-8"), str(path), loader=_PlainLoader)
    except (OSError, UnicodeDecodeError, ScriptError):
        return False
    return isinstance(tree, dict) and "lines" in tree and "nodes" not in tree


def load_plan(path: Path, *, voice_exists: Callable[[str], bool] | None = None) -> LinePlan:
    """A lines file or a single script, whichever ``path`` is (see :func:`is_lines_file`)."""
    if is_lines_file(path):
        return load_lines(path, voice_exists=voice_exists)
    return single_script(path, voice_exists=voice_exists)


def single_script(path: Path, *, voice_exists: Callable[[str], bool] | None = None,
                  stamps: dict[Path, FileStamp] | None = None) -> LinePlan:
    """The plan of ``GATEWAY_SCRIPT``: one line, every call.

    ``stamps`` (see :func:`load_lines`) is filled with the files read, also when it fails.
    """
    path = Path(path)
    stamps = stamps if stamps is not None else {}
    stamps[path] = stamp(path)
    script = load_script(path, voice_exists=voice_exists)
    _stamp_sounds(script, path, stamps)
    line = Line(DEFAULT_LABEL, script, path)
    return LinePlan(path, {DEFAULT_LABEL: line}, DEFAULT_LABEL, {}, dict(stamps), single=True)


def load_lines(path: Path, *, voice_exists: Callable[[str], bool] | None = None,
               stamps: dict[Path, FileStamp] | None = None) -> LinePlan:
    """Load and validate the lines file ``path`` and every script it names.

    Raises :class:`ScriptError` with every problem of the lines file and of its scripts, each
    located in the file it is in. ``stamps`` is filled with every file read and its stamp from
    just before it was read, also when loading fails: the files to watch for the next edit.
    """
    path = Path(path)
    label = str(path)
    problems: list[Diagnostic] = []

    def report(where: tuple[int, int], message: str) -> None:
        problems.append(Diagnostic(label, where[0], where[1], message))

    stamps = stamps if stamps is not None else {}
    stamps[path] = stamp(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScriptError([Diagnostic(label, 1, 1, "cannot read the lines file: "
                                                   f"{exc.strerror}")]) from None
    except UnicodeDecodeError:
        raise ScriptError([Diagnostic(label, 1, 1, "the lines file is not UTF-8 text")]) from None
    tree, duplicates = read_yaml(text, label, what="a lines file", loader=_PlainLoader)
    problems.extend(duplicates)
    if not isinstance(tree, _Map):
        report((1, 1), "a lines file is a mapping with 'default' and 'lines' (each line a "
                       "script and its numbers)")
        raise ScriptError(problems)
    try:
        spec = _LinesSpec.model_validate(tree)
    except ValidationError as exc:
        for error in exc.errors(include_url=False, include_input=False):
            loc = list(error["loc"])
            where = (key_position(tree, loc) if error.get("type") == "extra_forbidden"
                     else position(tree, loc))
            report(where, _schema_message(loc, error).replace("the script", "the lines file"))
        raise ScriptError(problems) from None

    numbers: dict[str, str] = {}
    first_at: dict[str, int] = {}
    for name, line in spec.lines.items():
        if not _LINE_NAME.fullmatch(name):
            report(key_position(tree, ("lines", name)),
                   f"line name '{name}': letters, digits and '_ . -' (at most 48), starting "
                   "with a letter or digit (it is a metric label)")
        elif name == DEFAULT_LABEL:
            report(key_position(tree, ("lines", name)),
                   f"'{DEFAULT_LABEL}' is the label of calls to numbers no line lists; name "
                   f"this line after what it is, and write 'default: <its name>'")
        for i, raw in enumerate(line.numbers):
            where = position(tree, ("lines", name, "numbers", i))
            try:
                number = normalise_number(raw)
            except ValueError as exc:
                report(where, f"line '{name}': {exc}")
                continue
            if number in numbers:
                again = "twice" if numbers[number] == name else f"for line '{numbers[number]}' too"
                report(where, f"line '{name}': {number} is listed {again} (first at line "
                              f"{first_at[number]}): a number reaches one line")
                continue
            numbers[number] = name
            first_at[number] = where[0]
        for i, entry in enumerate(line.lexicon):
            check_lexicon_entry(entry, ("lines", name, "lexicon", i), tree, report, LANGUAGES)
        if not line.numbers and name != spec.default:
            report(key_position(tree, ("lines", name)),
                   f"line '{name}' lists no numbers and is not the default: no call reaches it")
    if spec.default not in spec.lines:
        report(position(tree, ("default",)),
               f"default '{spec.default}' is not a line (lines: {', '.join(spec.lines)})")

    loaded: dict[Path, Script | None] = {}
    lines: dict[str, Line] = {}
    for name, line in spec.lines.items():
        script_path = (path.parent / line.script)
        where = position(tree, ("lines", name, "script"))
        if script_path not in loaded:
            loaded[script_path] = _load_script(script_path, line.script, name, where, label,
                                               problems, stamps, voice_exists)
        script = loaded[script_path]
        if script is not None:
            lines[name] = Line(name, script, script_path,
                               tuple(n for n, owner in numbers.items() if owner == name),
                               line.reading, tuple(line.lexicon))
            if line.reading is not None:
                _check_reading(lines[name], position(tree, ("lines", name, "reading")), report)
    if problems:
        raise ScriptError(problems)
    return LinePlan(path, lines, spec.default, numbers, dict(stamps))


def _check_reading(line: Line, where: tuple[int, int],
                   report: Callable[[tuple[int, int], str], None]) -> None:
    """A line's reading must still read its script's fixed values: a quoted phone number of
    another region, or a date in another order, is found here rather than read as written on
    every call."""
    try:
        reader = line.reader()
    except ValueError:
        return  # a lexicon entry that does not compile, reported where it is
    seen: set[str] = set()
    for template, voice in line.script.static_renders():
        for fallback in reader.sentence(template, {}, voice.language).fallbacks:
            if fallback.slot not in seen:
                seen.add(fallback.slot)
                report(where, f"line '{line.name}': with this reading, {line.script.path or ''}"
                              f" reads {fallback.slot} as written: it is not a "
                              f"{fallback.kind} (written {fallback.shape!r})")


def _load_script(path: Path, written: str, line: str, where: tuple[int, int], label: str,
                 problems: list[Diagnostic], stamps: dict[Path, FileStamp],
                 voice_exists: Callable[[str], bool] | None) -> Script | None:
    stamps[path] = stamp(path)
    if not path.is_file():
        # Located where the author wrote the name, not at 1:1 of a file that is not there.
        problems.append(Diagnostic(label, where[0], where[1],
                                   f"line '{line}': script '{written}' not found ({path})"))
        return None
    try:
        script = load_script(path, voice_exists=voice_exists)
    except ScriptError as exc:
        problems.extend(exc.diagnostics)
        return None
    _stamp_sounds(script, path, stamps)
    return script


def _stamp_sounds(script: Script, path: Path, stamps: dict[Path, FileStamp]) -> None:
    for sound in script_sounds(script):
        sound_path = path.parent / sound
        stamps[sound_path] = stamp(sound_path)


def script_sounds(script: Script) -> list[str]:
    """The WAV files a script's ``play`` nodes name (relative to the script)."""
    return sorted({node.play for node in script.nodes.values() if node.play is not None})

