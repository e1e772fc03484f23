"""The documented commands (README.md and the pages of docs/) and the sample output printed
under them, for tests that run them.

A sample is compared by *shape*, not by value: every token that holds a digit (a figure, a
time, a port, an id), ``none``, ``—`` and verdicts (``pass``, ``FAIL``, ``withheld``) become
``N``, ``calls``/``call`` one word, table rules one token, so a measured
figure may differ while the lines, their words and their order may not. Runs of a repeated
block of lines (a table's rows, a line per level) count once, so a shortened run with fewer
levels has the same shape. A sample line ``...`` stands for any lines. Every other sample line
must appear, in order, in what the command printed; the command may print more.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import REPO

ROOT = REPO
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def documented_files() -> list[Path]:
    """README.md and every Markdown page of the documentation site."""
    return [README, *sorted(DOCS.rglob("*.md"))]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_RULE = re.compile(r"^[─━═\-]{10,}$")


@dataclass(frozen=True)
class Documented:
    """One ``./run.sh`` command of a bash block, and the text block after it."""

    source: str  # the file, relative to the repository root
    line: int
    env: dict[str, str]
    argv: list[str]
    sample: str | None


def _blocks(text: str) -> list[tuple[int, str, str]]:
    """(line, language, body) of every fenced block."""
    blocks = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S):
        blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2)))
    return blocks


def documented_commands(text: str | None = None, source: str = "README.md") -> list[Documented]:
    """Every ``./run.sh`` command in the bash blocks of README.md and the documentation pages
    (or of ``text`` alone), continuation lines joined, comments dropped, with the ``text`` block
    that follows its bash block, if one does before the next bash block."""
    if text is None:
        return [command for path in documented_files()
                for command in documented_commands(path.read_text(encoding="utf-8"),
                                                   str(path.relative_to(ROOT)))]
    blocks = _blocks(text)
    found = []
    for index, (line, language, body) in enumerate(blocks):
        if language != "bash":
            continue
        sample = None
        for _, later_language, later_body in blocks[index + 1:]:
            if later_language == "bash":
                break
            if later_language == "text":
                sample = later_body
                break
        joined = re.sub(r"\\\n\s*", " ", body)
        for offset, raw in enumerate(joined.splitlines()):
            words = shlex.split(raw, comments=True)
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if words[:1] == ["./run.sh"] and len(words) > 1:
                found.append(Documented(source, line + 1 + offset, env, words[1:], sample))
    return found


def _token(token: str) -> str:
    word = token.strip(".,;:()[]")
    # A verdict is a value like the figures beside it: a busy machine may withhold a level
    # the sample shows as passed, and a level without an SLO shows "—".
    if any(c.isdigit() for c in token) or word in (
            "none", "—", "-", "pass", "FAIL", "withheld", "met", "MISSED", "missed"):
        return "N"
    if word in ("calls", "call", "call(s)"):
        return "call"
    return token


def shape(line: str) -> tuple[str, ...]:
    """A line's shape (module docstring)."""
    line = _ANSI.sub("", line).strip()
    if _RULE.match(line):
        return ("RULE",)
    return tuple(_token(t) for t in line.split())


def _collapse(shapes: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Runs of a repeated block of 1-3 lines, once."""
    out = list(shapes)
    changed = True
    while changed:
        changed = False
        for size in (1, 2, 3):
            i = 0
            while i + 2 * size <= len(out):
                if out[i:i + size] == out[i + size:i + 2 * size] and out[i] != ("...",):
                    del out[i + size:i + 2 * size]
                    changed = True
                else:
                    i += 1
    return out


def _logical_lines(text: str) -> list[str]:
    """Non-empty lines, a ``warning:`` paragraph joined into one (the terminal wraps it where
    its figures' widths put the breaks)."""
    lines: list[str] = []
    joining = False
    for line in _ANSI.sub("", text).replace("\r", "\n").splitlines():
        if not line.strip():
            joining = False
            continue
        if joining:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
        # A physical line that reached the wrap width continues on the next one.
        joining = lines[-1].strip().startswith("warning:") and len(line.rstrip()) >= 60
    return lines


def mismatch(sample: str, output: str) -> str | None:
    """None when ``output`` has the sample's shape, else what is missing and where."""
    wanted = _collapse([("...",) if line.strip() == "..." else shape(line)
                        for line in _logical_lines(sample)])
    got = _collapse([shape(line) for line in _logical_lines(output)])
    position = 0
    for want in wanted:
        if want == ("...",):
            continue
        while position < len(got) and got[position] != want:
            position += 1
        if position == len(got):
            return (f"the documented sample line shaped {' '.join(want)!r} is not in the output "
                    "(in order). Output:\n" + output)
        position += 1
    return None
