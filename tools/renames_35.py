"""Issue 35's renames of names that mislead, as a re-runnable script.

    python tools/renames_35.py              apply every step (idempotent: a renamed tree is left
                                            as it is, new uses of an old name are renamed)
    python tools/renames_35.py STEP...      apply only these steps (``--list`` names them)
    python tools/renames_35.py --check      change nothing; list what a run would change, exit 1
                                            if anything (tests/unit/test_renames_35.py runs this)

Why a script and not a one-off edit: other branches touch the same modules. Merge them, then
run this again: it renames what they added under the old names. It edits by Python token (a
``Hangup`` class name, never the TwiML ``<Hangup/>`` verb inside a string), by import (which of
two ``Voice`` classes a file means), by function scope (a local ``session`` that holds a speech
listener) and by literal text in documentation; it moves files with ``git mv``. A line holding
``renames_35: keep`` is never changed (the deprecated aliases and their tests). After a run it
sorts the imports and ``__all__`` of the files it changed with ruff, when ruff is installed.

The deprecated aliases themselves (``gateway prompts``, ``gateway_tts_slots_healthy``) are
ordinary code in gateway/cli.py and gateway/metrics.py, not made here.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEEP = "renames_35: keep"
#: Text files (besides Python) whose prose and commands name what is renamed.
TEXT_SUFFIXES = {".md", ".tf", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg"}
TEXT_NAMES = {"Dockerfile", "run.sh", "run"}
#: Never edited: this script, and the changelog that names the old names on purpose.
SKIP = re.compile(r"^(tools/renames_35\.py|CHANGELOG[^/]*\.md|tests/unit/test_renames_35\.py)$")


# --- edits ------------------------------------------------------------------------------------


def _offsets(text: str) -> list[int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, new in sorted(set(edits), reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _kept(line: str) -> bool:
    return KEEP in line


def _in_spans(text: str, names: dict[str, str], dotted: bool = True) -> str:
    """``names`` renamed inside backtick spans of a docstring or comment (Sphinx roles, code):
    a bare name or (``dotted``) a dotted one's last part, never an XML tag (``<Hangup/>``)."""
    if not names:
        return text
    before = r"(?<![<\w])" if dotted else r"(?<![<\w.])"
    pattern = re.compile(before + "(" + "|".join(map(re.escape, names)) + r")(?![\w/>])")

    def span(match: re.Match[str]) -> str:
        return pattern.sub(lambda m: names[m.group(1)], match.group(0))

    return "\n".join(line if _kept(line) else re.sub(r"`+[^`\n]+`+", span, line)
                     for line in text.split("\n"))


def rename_tokens(text: str, names: dict[str, str], *, spans: bool = True, dotted: bool = True,
                  strings: dict[str, str] | None = None) -> str:
    """NAME tokens in ``names`` renamed; in strings and comments, the same names inside
    backtick spans (``spans``; ``dotted``: also as the last part of a dotted name); whole
    string tokens equal to a key of ``strings`` replaced."""
    offsets = _offsets(text)
    edits: list[tuple[int, int, str]] = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return text
    exported = _all_spans(text, offsets)
    for tok in tokens:
        if _kept(tok.line):
            continue
        start = offsets[tok.start[0] - 1] + tok.start[1]
        end = offsets[tok.end[0] - 1] + tok.end[1]
        if tok.type == tokenize.NAME and tok.string in names:
            edits.append((start, end, names[tok.string]))
        elif tok.type == tokenize.STRING and strings and tok.string in strings:
            edits.append((start, end, strings[tok.string]))
        elif (tok.type == tokenize.STRING and tok.string[1:-1] in names
              and any(a <= start < b for a, b in exported)):
            # A name in ``__all__`` (only there: "Hangup" elsewhere is a TwiML verb).
            edits.append((start, end, tok.string[0] + names[tok.string[1:-1]] + tok.string[-1]))
        elif tok.type in (tokenize.STRING, tokenize.COMMENT) and spans:
            new = _in_spans(tok.string, names, dotted)
            if new != tok.string:
                edits.append((start, end, new))
    return _apply(text, edits)


def _all_spans(text: str, offsets: list[int]) -> list[tuple[int, int]]:
    """Where ``__all__``'s value is written (offsets)."""
    tree = _parse(text)
    spans = []
    for node in tree.body if tree is not None else []:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        value = getattr(node, "value", None)
        if value is not None and any(isinstance(t, ast.Name) and t.id == "__all__"
                                     for t in targets):
            spans.append((offsets[value.lineno - 1] + value.col_offset,
                          offsets[value.end_lineno - 1] + value.end_col_offset))
    return spans


def rename_imported(text: str, module: str, old: str, new: str, *, defines: bool) -> str:
    """``old`` renamed to ``new`` where this file means ``module``'s ``old``: in the module that
    defines it (``defines``), or in a file importing it (``from module import old [as x]``;
    the import is rewritten, an alias equal to ``new`` dropped). Dotted references
    (``module.old``) are renamed anywhere."""
    text = re.sub(rf"\b{re.escape(module)}\.{old}\b", f"{module}.{new}", text)
    imported = False
    tree = _parse(text)
    if tree is not None:
        offsets = _offsets(text)
        edits = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                segment = ast.get_source_segment(text, node) or ""
                if _kept(segment):
                    continue
                names = [(a.name, a.asname) for a in node.names]
                if not any(name == old for name, _ in names):
                    continue
                imported = imported or any(name == old and asname is None
                                           for name, asname in names)
                renamed = sorted(((new if name == old else name),
                                  None if (name == old and asname == new) else asname)
                                 for name, asname in names)
                parts = [name if asname is None else f"{name} as {asname}"
                         for name, asname in renamed]
                one = f"from {module} import {', '.join(parts)}"
                indent = " " * node.col_offset
                if len(indent) + len(one) > 100 or "\n" in segment:
                    body = "".join(f"{indent}    {part},\n" for part in parts)
                    one = f"from {module} import (\n{body}{indent})"
                start = offsets[node.lineno - 1] + node.col_offset
                end = offsets[node.end_lineno - 1] + node.end_col_offset  # type: ignore[operator]
                edits.append((start, end, one))
        text = _apply(text, edits)
    if defines or imported:
        # (Not a dotted name's last part in a docstring: that may be another module's.)
        text = rename_tokens(text, {old: new}, dotted=False)
    return text


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def _functions(tree: ast.AST) -> Iterable[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def rename_local(text: str, old: str, choose: Callable[[str, ast.AST], str | None]) -> str:
    """In every function ``choose`` picks a new name for (given the function's source and
    node), the local ``old`` (its assignments, uses and parameter) gets that name."""
    tree = _parse(text)
    if tree is None:
        return text
    offsets = _offsets(text)
    edits: dict[int, tuple[int, int, str]] = {}  # by position: a nested function is walked twice
    for func in _functions(tree):
        segment = ast.get_source_segment(text, func) or ""
        new = choose(segment, func)
        if new is None:
            continue
        for node in ast.walk(func):
            if (isinstance(node, ast.Name) and node.id == old) or (
                    isinstance(node, ast.arg) and node.arg == old):
                start = offsets[node.lineno - 1] + node.col_offset
                edits.setdefault(start, (start, start + len(old), new))
    return _apply(text, list(edits.values()))


def _names_in(func: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(func) if isinstance(n, ast.Name)} | {
        a.arg for a in ast.walk(func) if isinstance(a, ast.arg)}


def sub_lines(text: str, pattern: str, repl: str | Callable[[re.Match[str]], str]) -> str:
    """``re.sub`` line by line, leaving ``KEEP`` lines alone."""
    rx = re.compile(pattern)
    return "".join(line if _kept(line) else rx.sub(repl, line)
                   for line in text.splitlines(keepends=True))


def sub_text(text: str, pattern: str, repl: str) -> str:
    """``re.sub`` over the whole text (a match may span lines), except matches on a line that
    holds ``KEEP``."""

    def one(match: re.Match[str]) -> str:
        start = text.rfind("\n", 0, match.start()) + 1
        end = text.find("\n", match.end())
        return match.group(0) if _kept(text[start:end if end >= 0 else None]) else \
            match.expand(repl)

    return re.sub(pattern, one, text)


def realign(before: str, after: str) -> str:
    """Continuation lines that were aligned with an opening bracket moved with it, where a
    rename before the bracket changed its column (a rename leaves the tokens as they were)."""
    try:
        old_tokens = list(tokenize.generate_tokens(io.StringIO(before).readline))
        new_tokens = list(tokenize.generate_tokens(io.StringIO(after).readline))
    except (tokenize.TokenError, SyntaxError):
        return after
    if [t.type for t in old_tokens] != [t.type for t in new_tokens]:
        return after  # an import rewritten: ruff lays it out
    stack: list[tuple[tokenize.TokenInfo, tokenize.TokenInfo]] = []
    shifts: dict[int, int] = {}  # line (1-based) -> columns to add
    last_row = 0
    for old, new in zip(old_tokens, new_tokens, strict=True):
        if old.type in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            continue
        first_on_line = new.start[0] != last_row
        last_row = new.end[0]
        if first_on_line and stack:
            old_open, new_open = stack[-1]
            if (old.start[1] == old_open.start[1] + 1 and old.start[0] > old_open.start[0]
                    and new_open.start[1] != old_open.start[1]
                    and old.start[1] == new.start[1]):
                shifts[new.start[0]] = new_open.start[1] - old_open.start[1]
        if old.type == tokenize.OP and old.string in "([{":
            stack.append((old, new))
        elif old.type == tokenize.OP and old.string in ")]}" and stack:
            stack.pop()
    if not shifts:
        return after
    lines = after.splitlines(keepends=True)
    for row, delta in shifts.items():
        line = lines[row - 1]
        indent = len(line) - len(line.lstrip(" "))
        lines[row - 1] = " " * (indent + delta) + line[indent:]
    return "".join(lines)


# --- the steps --------------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    summary: str
    python: Callable[[str, str], str] | None = None  # (path, text) -> text, for .py files
    text: Callable[[str, str], str] | None = None  # for other text files (docs, Dockerfile...)
    moves: list[tuple[str, str]] = field(default_factory=list)
    #: A file without any of these is left alone unread by the edits (they are slow).
    triggers: tuple[str, ...] = ()


def api_members(text: str, modules: tuple[str, ...], names: dict[str, str]) -> str:
    """In documentation: ``module.Name`` references, and the ``- Name`` members listed under a
    mkdocstrings ``::: module`` block, renamed for the given modules only."""
    for module in modules:
        for old, new in names.items():
            text = sub_lines(text, rf"\b{re.escape(module)}\.{old}\b", f"{module}.{new}")
    lines = text.splitlines(keepends=True)
    current: str | None = None
    for i, line in enumerate(lines):
        block = re.match(r"\s*::: *([\w.]+)", line)
        if block:
            current = block.group(1)
        elif line.strip() and not line[0].isspace():
            current = None
        elif current in modules and not _kept(line):
            lines[i] = re.sub(r"^(\s*- +)(\w+)\s*$",
                              lambda m: m.group(1) + names.get(m.group(2), m.group(2)) + "\n"
                              if m.group(2) in names else m.group(0), line)
    return "".join(lines)


_EVENTS = {"Hangup": "CallerHungUp", "HangUp": "EndCall"}


def _events_py(path: str, text: str) -> str:
    return rename_tokens(text, _EVENTS)


def _events_doc(path: str, text: str) -> str:
    return api_members(text, ("gateway.call.events", "gateway.call"), _EVENTS)


def _playout_doc(path: str, text: str) -> str:
    return api_members(text, ("gateway.call.playout",), {"Speaker": "FrameOwner"})


def _voices_doc(path: str, text: str) -> str:
    text = api_members(text, ("gateway.speech",), {"Voice": "SpeechVoice"})
    return api_members(text, ("gateway.ivr.script",), {"Voice": "ScriptVoice"})


def _playout_py(path: str, text: str) -> str:
    text = rename_imported(text, "gateway.call.playout", "Speaker", "FrameOwner",
                           defines=path == "gateway/call/playout.py")
    if path == "gateway/call/playout.py":
        # Whose frames: an utterance, not a gateway.speech.Speaker.
        text = rename_tokens(text, {"speaker": "owner", "_speaker": "_owner"},
                             strings={'"speaker"': '"owner"'})
    if path == "gateway/call/session.py":
        text = rename_local(text, "speaker", lambda src, f: "utterance"
                            if getattr(f, "name", "") == "_underrun" else None)
    return text


def _voices_py(path: str, text: str) -> str:
    text = rename_imported(text, "gateway.speech", "Voice", "SpeechVoice",
                           defines=path == "gateway/speech.py")
    return rename_imported(text, "gateway.ivr.script", "Voice", "ScriptVoice",
                           defines=path == "gateway/ivr/script.py")


def _greeter_any(path: str, text: str) -> str:
    text = sub_lines(text, r"\bgateway\.demo\b", "gateway.greeter")
    return sub_lines(text, r"\bgateway/demo\.py\b", "gateway/greeter.py")


_VERBS = r"(validate|graph|test|render)"


def _script_cli_any(path: str, text: str) -> str:
    # (A command may be wrapped across lines in prose.)
    text = sub_text(text, rf"\b(gateway|run\.sh)(\s+)prompts(\s+){_VERBS}\b", r"\1\2script\3\4")
    text = sub_text(text, rf"(`+)prompts(\s+){_VERBS}\b", r"\1script\2\3")
    text = sub_lines(text, r"gateway\\s\+prompts\\s\+", r"gateway\\s+script\\s+")
    text = sub_lines(text, r"\(demo, call, say, prompts, loadsim",
                     "(demo, call, say, script, loadsim")
    return text


def _script_cli_py(path: str, text: str) -> str:
    text = _script_cli_any(path, text)
    text = rename_tokens(text, {"prompts_app": "script_app", "prompts_validate": "script_validate",
                                "prompts_graph": "script_graph", "prompts_test": "script_test",
                                "prompts_render": "script_render"}, spans=False)
    text = sub_lines(text, r'app\.add_typer\(script_app, name="prompts"\)',
                     'app.add_typer(script_app, name="script")')
    text = sub_lines(text, rf'(?<=[\[(])"prompts", "({_VERBS[1:-1]}|--help)"',
                     r'"script", "\1"')
    text = sub_lines(text, r'"prompts render": \["script"', '"script render": ["script"')
    # An argv written one item a line.
    text = sub_text(text, rf'(main\(\s*\[\s*)"prompts"(,\s*"(?:{_VERBS[1:-1]}|--help)")',
                    r'\1"script"\2')
    return sub_lines(text, r"\bdef test_prompts_", "def test_script_")


def _metric_any(path: str, text: str) -> str:
    return sub_lines(text, r"\bgateway_tts_slots_healthy\b", "gateway_tts_engines_healthy")


def _metric_py(path: str, text: str) -> str:
    text = _metric_any(path, text)
    return rename_tokens(text, {"tts_slots_healthy": "tts_engines_healthy",
                                "healthy_slots": "healthy_engines"})


def _twilio_any(path: str, text: str) -> str:
    # The architecture picture keeps its box edge where it was.
    text = sub_lines(text, r"twilio/session\.py ─┐", "twilio/stream.py  ─┐")
    text = sub_lines(text, r"\bgateway\.twilio\.session\b", "gateway.twilio.stream")
    text = sub_lines(text, r"\btwilio/session\.py\b", "twilio/stream.py")
    return sub_lines(text, r"\bTwilioSession\b", "TwilioStream")


def _twilio_py(path: str, text: str) -> str:
    text = _twilio_any(path, text)
    text = sub_lines(text, r'"twilio" / "session\.py"', '"twilio" / "stream.py"')
    if path.startswith("gateway/twilio/"):
        # Prose about the stream (not "the HTTP session" of the REST client).
        text = sub_lines(text, r"\b([Tt]he|WebSocket) session\b", r"\1 stream")
    return rename_tokens(text, {"TwilioSession": "TwilioStream"})


def _listener_any(path: str, text: str) -> str:
    text = sub_lines(text, r"\bSpeechSession\b", "SpeechListener")
    text = sub_lines(text, r"\bA listening session for one turn\b",
                     "A speech listener for one turn")
    text = sub_lines(text, r"\b(listening|speech) session\b", "speech listener")
    return sub_lines(text, r"\bthe session keeps listening\b", "the listener keeps listening")


def _holds_listener(src: str, func: ast.AST) -> str | None:
    """A function whose local ``session`` is a speech listener: its new name (``listener``,
    or ``speech`` where ``listener`` is taken)."""
    if not re.search(r"\bsession\b", src):
        return None
    args = getattr(func, "args", None)
    annotated = any(a.arg == "session" and a.annotation is not None
                    and re.search(r"Speech(Session|Listener)", ast.unparse(a.annotation))
                    for a in ([*args.posonlyargs, *args.args, *args.kwonlyargs] if args else []))
    assigned = re.search(r"\bsession = [^\n]*(\b(recognizer|pool)\.listener\(|"
                         r"isinstance\([^)]*Speech(Session|Listener)\)|"
                         r"\bSpeech(Session|Listener)\()", src)
    if not (annotated or assigned):
        return None
    return "speech" if "listener" in _names_in(func) else "listener"


def _listener_py(path: str, text: str) -> str:
    text = _listener_any(path, text)
    text = rename_tokens(text, {"SpeechSession": "SpeechListener"})
    # The factory of listeners: RecognizerPool.session(), SpeechInput.session() and fakes.
    text = sub_text(text, r"\bdef session(\(\s*self,\s*grammar\b)", r"def listener\1")
    text = sub_lines(text, r"\b(recognizer|pool)\.session\(", r"\1.listener(")
    text = rename_local(text, "session", _holds_listener)
    if path == "gateway/ivr/listening.py":
        # SpeechTurn's listener (the attribute and its parameter).
        text = rename_tokens(text, {"session": "listener"}, spans=False)
    return text


STEPS = [
    Step("events", "call events vs outcomes: Hangup -> CallerHungUp, HangUp -> EndCall",
         python=_events_py, text=_events_doc,
         triggers=("Hangup", "HangUp")),
    Step("playout-owner", "gateway.call.playout.Speaker -> FrameOwner (speaker -> owner there)",
         python=_playout_py, text=_playout_doc,
         triggers=("gateway.call.playout", "class Speaker(Protocol)")),
    Step("voices", "gateway.speech.Voice -> SpeechVoice, gateway.ivr.script.Voice -> ScriptVoice",
         python=_voices_py, text=_voices_doc,
         triggers=("gateway.speech", "gateway.ivr.script", "class Voice", "- Voice")),
    Step("greeter", "gateway/demo.py -> gateway/greeter.py", python=_greeter_any,
         text=_greeter_any, moves=[("gateway/demo.py", "gateway/greeter.py")],
         triggers=("gateway.demo", "gateway/demo.py")),
    Step("script-cli", "gateway prompts VERB -> gateway script VERB (uses, docs, tests)",
         python=_script_cli_py, text=_script_cli_any,
         triggers=("prompts",)),
    Step("engines-metric", "gateway_tts_slots_healthy -> gateway_tts_engines_healthy (uses)",
         python=_metric_py, text=_metric_any,
         triggers=("slots_healthy", "healthy_slots")),
    Step("twilio-stream", "gateway/twilio/session.py -> stream.py, TwilioSession -> TwilioStream",
         python=_twilio_py, text=_twilio_any,
         moves=[("gateway/twilio/session.py", "gateway/twilio/stream.py")],
         triggers=("twilio.session", "twilio/session", "TwilioSession", '"session.py"',
                   "the session", "The session", "WebSocket session")),
    Step("speech-listener", "gateway.asr.pool.SpeechSession -> SpeechListener, .session() -> "
         ".listener()", python=_listener_py, text=_listener_any,
         triggers=("SpeechSession", "session(", "listening session", "speech session",
                   "the session keeps")),
]


# --- running ----------------------------------------------------------------------------------


def _files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return sorted(p for p in set(out.splitlines())
                  if not SKIP.match(p) and (ROOT / p).is_file())


def run(steps: list[Step], *, check: bool) -> list[str]:
    """Apply ``steps`` (or, with ``check``, only report); returns what changed / would."""
    changes: list[str] = []
    for step in steps:
        first = len(changes)
        for old, new in step.moves:
            if (ROOT / old).exists() and not (ROOT / new).exists():
                changes.append(f"{step.name}: move {old} -> {new}")
                if not check:
                    subprocess.run(["git", "mv", old, new], cwd=ROOT, check=True)
            elif (ROOT / old).exists():
                changes.append(f"{step.name}: both {old} and {new} exist: merge them by hand")
        for path in _files():
            name = Path(path).name
            if path.endswith(".py"):
                edit = step.python
            elif Path(path).suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
                edit = step.text
            else:
                continue
            if edit is None:
                continue
            before = (ROOT / path).read_text(encoding="utf-8", errors="surrogateescape")
            if not any(t in before for t in step.triggers):
                continue
            after = edit(path, before)
            if path.endswith(".py") and after != before:
                after = realign(before, after)
            if after != before:
                changes.append(f"{step.name}: {path}")
                if not check:
                    (ROOT / path).write_text(after, encoding="utf-8", errors="surrogateescape")
        if not check:  # after each step: a later one may move a file this one changed
            _tidy(sorted({c.split(": ", 1)[1] for c in changes[first:]
                          if c.endswith(".py") and " -> " not in c}))
    return changes


def _tidy(paths: list[str]) -> None:
    """Imports and ``__all__`` sorted again where names changed (ruff, if installed)."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not paths or not Path(ruff).exists():
        return
    subprocess.run([ruff, "check", "--quiet", "--fix-only", "--select", "I001,RUF022,RUF023",
                    *paths], cwd=ROOT, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", nargs="*", help="steps to run (default: all)")
    parser.add_argument("--check", action="store_true", help="change nothing, report")
    parser.add_argument("--list", action="store_true", help="list the steps")
    args = parser.parse_args(argv)
    if args.list:
        for step in STEPS:
            print(f"{step.name:16} {step.summary}")
        return 0
    by_name = {step.name: step for step in STEPS}
    unknown = [s for s in args.steps if s not in by_name]
    if unknown:
        parser.error(f"unknown step(s): {', '.join(unknown)} (see --list)")
    changes = run([by_name[s] for s in args.steps] or STEPS, check=args.check)
    for change in changes:
        print(("would change " if args.check else "changed ") + change)
    return 1 if args.check and changes else 0


if __name__ == "__main__":
    sys.exit(main())
