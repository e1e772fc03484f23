"""Move the flat ``tests/test_*.py`` modules into a tree laid out like the code they test.

    python tools/relayout_tests.py            # move (git mv), then rewrite references
    python tools/relayout_tests.py --dry-run  # print the plan, change nothing

The tree:

- ``tests/unit/<package>/`` mirrors ``gateway/<package>/`` (``tests/unit/`` itself holds the
  tests of ``gateway/``'s top-level modules and the package-wide checks);
- ``tests/e2e/``: whole gateways over real sockets (virtual or real time), real peers, fleets;
- ``tests/adversarial/``: fuzzers, hostile peers, malformed input;
- ``tests/deployment/``: what ships around the code (Dockerfile, Terraform, CI, README, docs,
  changelog);
- ``tests/bench/``: the benchmarks' own tests (``bench/``).

Where a module goes is decided by rules, in order: the explicit :data:`TABLE`; the suite
patterns (:data:`SUITES`); then the package itself: ``test_<pkg>_<rest>.py`` goes to
``tests/unit/<pkg>/test_<rest>.py`` when ``gateway/<pkg>/`` is a package, ``test_<mod>.py`` to
``tests/unit/test_<mod>.py`` when ``gateway/<mod>.py`` is a module, and to
``tests/unit/<pkg>/test_<mod>.py`` when exactly one ``gateway/<pkg>/<mod>.py`` exists. A module
no rule places stops the run before anything moves, listed by name (exit status 2): add a rule.

Every folder gets an ``__init__.py`` (the tests are the ``tests`` package: module names stay
unique whatever their base names, and ``tests.support`` imports from anywhere); the fixtures
stay in ``tests/conftest.py``, which pytest applies to every folder below it.

After the moves, the imports of modules written for the flat tree (``from conftest import
...``, ``from clocks import ...``, ``import local_http``, ``from test_x import ...``) and the
paths they computed from ``__file__`` are rewritten for :mod:`tests.support` and the new tree
(sort them with ``ruff check --fix``), and references to a moved module are rewritten in the
tracked text files: its path (``tests/test_sip_uas.py``) and its dotted name
(``tests.test_sip_uas``).

Idempotent: on a tree already laid out there is nothing at ``tests/test_*.py`` and nothing to
rewrite; a second run changes nothing. Run it again after merging a branch that added flat test
modules.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
PACKAGE = REPO / "gateway"

#: Explicit places, by module name (without ``.py``): where the name alone would mislead.
TABLE: dict[str, str] = {
    # gateway/ top level and package-wide checks
    "test_architecture": "unit/test_architecture.py",
    "test_cancellation": "unit/test_aio.py",  # gateway/aio.py: stopping child tasks
    "test_settings": "unit/test_config.py",  # gateway/config.py
    "test_startup_io": "unit/test_app_startup.py",  # gateway/app.py's start-up
    "test_voices": "unit/ivr/test_voices.py",  # gateway/ivr/voices.py
    "test_playout_start": "unit/call/test_playout_start.py",  # gateway/call/playout.py
    "test_loadsim": "unit/loadsim/test_loadsim.py",
    "test_tts_simulated": "unit/tts/test_simulated.py",
    "test_twilio_rest": "unit/twilio/test_rest.py",
    # whole gateways, real peers, fleets
    "test_call_failures": "e2e/test_call_failures.py",
    "test_capacity": "e2e/test_capacity.py",
    "test_drain": "e2e/test_drain.py",
    "test_faults": "e2e/test_faults.py",
    "test_fleet": "e2e/test_fleet.py",
    "test_heap": "e2e/test_heap.py",  # a running gateway's frozen heap
    "test_sip_kamailio": "e2e/test_sip_kamailio.py",
    "test_soak": "e2e/test_soak.py",
    "test_softphone": "e2e/test_softphone.py",
    # malformed input
    "test_sip_malformed": "adversarial/test_sip_malformed.py",
    # the benchmarks' scripts
    "test_gpu_run": "bench/test_gpu_run.py",  # bench/gpu_batching.sh
}

#: Suite patterns, tried in order on the module name: (pattern, folder). The module keeps its
#: name in its suite's folder.
SUITES: list[tuple[str, str]] = [
    (r"^test_.*e2e", "e2e"),
    (r"^test_(fuzz|hostile)_", "adversarial"),
    (r"^test_.*malformed", "adversarial"),
    (r"^test_bench_", "bench"),
    (r"^test_(docker|dockerfile|infra|terraform|ci|readme|docs|mkdocs|changelog)(_|$)",
     "deployment"),
    # Package-wide naming checks (renames, deprecated aliases), beside test_architecture.
    (r"^test_(re)?names?(_|$)", "unit"),
]

#: After the package rules, for names they may not place (the module they test not written
#: yet, or named otherwise): (pattern, folder); the module keeps its name there.
FALLBACKS: list[tuple[str, str]] = [
    (r"^test_bot", "unit/ivr"),  # the bot node of a script
    (r"^test_(rtp|uac|uas|sdp|digest)", "unit/sip"),
    (r"^test_(playout|frames|admission|inbound)", "unit/call"),
]

#: The helpers that lived beside the flat test modules, now in tests/support/.
SUPPORT_MOVES = {
    f"tests/{name}.py": f"tests/support/{name}.py"
    for name in ("clocks", "virtual_time", "sip_peers", "local_http", "twilio_client",
                 "fake_twilio_api", "asr_fakes", "gateway_process", "gateway_zygote",
                 "readme_samples")
}

UNIT = "unit"
SUITE_FOLDERS = ("unit", "e2e", "adversarial", "deployment", "bench")
#: Files referring to test modules by path or dotted name, rewritten after the moves.
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".txt", ".sh", ""}


@dataclass(frozen=True)
class Move:
    source: Path
    target: Path
    rule: str


def _packages() -> set[str]:
    return {p.parent.name for p in PACKAGE.glob("*/__init__.py")}


def _top_modules() -> set[str]:
    return {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}


def _sub_modules() -> dict[str, list[str]]:
    """Module name -> the packages of gateway/ that hold a module by that name."""
    found: dict[str, list[str]] = {}
    for path in PACKAGE.glob("*/*.py"):
        if path.stem != "__init__":
            found.setdefault(path.stem, []).append(path.parent.name)
    return found

#: ``from conftest import NAME``: where NAME lives now, and its new name where it changed.
CONFTEST_NAMES: dict[str, tuple[str, str]] = {
    "_server": ("servers", "uvicorn_server"),
    "_free_socket": ("net", "free_socket"),
    "_settings": ("servers", "gateway_settings"),
    "_built_once": ("builds", "built_once"),
    "DEMO_SCRIPT": ("paths", "DEMO_SCRIPT"),
}
#: ``from MODULE import NAME`` of a helper module that moved, for names that went elsewhere.
MOVED_NAMES: dict[tuple[str, str], tuple[str, str]] = {
    ("clocks", "until"): ("waiting", "until"),
    ("sip_peers", "wait_until"): ("waiting", "wait_until"),
    ("sip_peers", "free_port"): ("net", "free_port"),
    ("test_sip_message", "assert_round_trips"): ("sip_messages", "assert_round_trips"),
    ("test_sip_message", "without_length"): ("sip_messages", "without_length"),
    ("test_twilio_rest", "write_line"): ("lines", "write_transfer_line"),
    ("test_twilio_rest", "LINE"): ("lines", "TRANSFER_LINE"),
    ("test_speech_e2e", "SipCaller"): ("speech_callers", "SipCaller"),
    ("test_speech_e2e", "TwilioCaller"): ("speech_callers", "TwilioCaller"),
    ("test_speech_e2e", "_recognizer"): ("speech_callers", "recognizer_swapped"),
    ("test_speech_e2e", "_trace"): ("speech_callers", "ivr_trace"),
}
HELPER_MODULES = ("clocks", "virtual_time", "sip_peers", "twilio_client", "fake_twilio_api",
                  "gateway_process", "readme_samples")
#: Paths a flat test module computed from its own place, and what stands for them now.
FILE_PATHS: list[tuple[str, str, str]] = [
    (r'Path\(__file__\)\.resolve\(\)\.parent\.parent / "prompts" / "demo\.yaml"', "DEMO_SCRIPT",
     "DEMO_SCRIPT"),
    (r"Path\(__file__\)\.resolve\(\)\.parent\.parent", "REPO", "REPO"),
    (r"Path\(__file__\)\.resolve\(\)\.parents\[1\]", "REPO", "REPO"),
    (r"Path\(__file__\)\.parent\.parent", "REPO", "REPO"),
    (r'Path\(__file__\)\.(?:resolve\(\)\.)?parent / "golden"', "GOLDEN", "GOLDEN"),
    (r'Path\(__file__\)\.(?:resolve\(\)\.)?parent / "sipp"', "SIPP_DIR", "SIPP_DIR"),
    (r"Path\(__file__\)\.(?:resolve\(\)\.)?parent(?![\w.\[])", "TESTS", "TESTS"),
]


def _rewrite_imports(path: Path) -> bool:
    """The imports of a test module written for the flat tree (``from conftest import ...``,
    ``from clocks import ...``, ``import local_http``, ``from test_x import ...``) and the paths
    it computed from ``__file__``, rewritten for tests.support and the new tree."""
    text = path.read_text(encoding="utf-8")
    renamed: dict[str, str] = {}

    def names_of(block: str) -> list[tuple[str, str | None]]:
        out = []
        for item in block.strip("()").replace("\n", " ").split(","):
            item = item.strip()
            if item:
                name, _, alias = item.partition(" as ")
                out.append((name.strip(), alias.strip() or None))
        return out

    def from_import(match: re.Match[str]) -> str:
        indent, module, block = match.group(1), match.group(2), match.group(3)
        targets: dict[str, list[str]] = {}
        for name, alias in names_of(block):
            if module == "conftest":
                where, new = CONFTEST_NAMES.get(name, ("servers", name))
                where = f"support.{where}"
            elif (module, name) in MOVED_NAMES:
                where, new = MOVED_NAMES[(module, name)]
                where = f"support.{where}"
            elif module in HELPER_MODULES:
                where, new = f"support.{module}", name
            else:  # another test module, wherever the rules put it
                placed = place(module)
                if placed is None:
                    return match.group(0)
                where, new = placed[0].removesuffix(".py").replace("/", "."), name
            if new != name and alias is None:
                renamed[name] = new
            targets.setdefault(where, []).append(new + (f" as {alias}" if alias else ""))
        return "\n".join(f"{indent}from tests.{where} import {', '.join(items)}"
                         for where, items in targets.items())

    modules = "|".join(("conftest", *HELPER_MODULES, r"test_\w+"))
    new = re.sub(rf"^([ \t]*)from ({modules}) import (\([^)]*\)|[^\n]+)", from_import, text,
                 flags=re.M)
    new = re.sub(r"^([ \t]*)import (local_http|asr_fakes)$", r"\1from tests.support import \2",
                 new, flags=re.M)
    for old, replacement in renamed.items():
        new = re.sub(rf"(?<![\w.]){re.escape(old)}\(", replacement + "(", new)
    needed = set()
    for pattern, replacement, name in FILE_PATHS:
        new, count = re.subn(pattern, replacement, new)
        if count:
            needed.add(name)
    if needed:
        new = re.sub(r"^(from __future__ import annotations\n)",
                     rf"\1\nfrom tests.support.paths import {', '.join(sorted(needed))}\n",
                     new, count=1, flags=re.M)
    if new == text:
        return False
    path.write_text(new, encoding="utf-8")
    return True


def place(name: str) -> tuple[str, str] | None:
    """(target relative to tests/, the rule that placed it) for module ``name``, or None."""
    if name in TABLE:
        return TABLE[name], "table"
    for pattern, folder in SUITES:
        if re.search(pattern, name):
            return f"{folder}/{name}.py", f"suite {pattern}"
    stem = name.removeprefix("test_")
    packages = _packages()
    # test_<pkg>_<rest> / test_<pkg>: the longest package name that prefixes it
    for package in sorted(packages, key=len, reverse=True):
        if stem == package:
            return f"{UNIT}/{package}/test_{package}.py", f"package {package}"
        if stem.startswith(package + "_"):
            return f"{UNIT}/{package}/test_{stem[len(package) + 1:]}.py", f"package {package}"
    # test_<module of gateway/>
    first = stem.split("_")[0]
    for candidate in (stem, first):
        if candidate in _top_modules():
            return f"{UNIT}/{name}.py", f"module gateway/{candidate}.py"
    # test_<module of exactly one gateway/<pkg>/>
    for candidate in (stem, first):
        holders = _sub_modules().get(candidate, [])
        if len(holders) == 1:
            return f"{UNIT}/{holders[0]}/{name}.py", f"module gateway/{holders[0]}/{candidate}.py"
    for pattern, folder in FALLBACKS:
        if re.search(pattern, name):
            return f"{folder}/{name}.py", f"fallback {pattern}"
    return None


def plan() -> tuple[list[Move], list[str]]:
    """The moves for every flat test module, and the names no rule places."""
    moves: list[Move] = []
    unplaced: list[str] = []
    for source in sorted(TESTS.glob("test_*.py")):
        placed = place(source.stem)
        if placed is None:
            unplaced.append(source.name)
            continue
        relative, rule = placed
        moves.append(Move(source, TESTS / relative, rule))
    targets: dict[Path, Move] = {}
    for move in moves:
        clash = targets.get(move.target)
        if clash is not None or move.target.exists():
            other = clash.source.name if clash else "a file already there"
            unplaced.append(f"{move.source.name} (its place {move.target.relative_to(REPO)} "
                            f"is taken by {other})")
        targets[move.target] = move
    return moves, unplaced


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout


def _ensure_packages() -> list[Path]:
    """An ``__init__.py`` in tests/ and every folder below it that holds Python modules."""
    made = []
    folders = {TESTS} | {p.parent for p in TESTS.rglob("*.py")}
    for folder in sorted(folders):
        if "__pycache__" in folder.parts or not folder.is_relative_to(TESTS):
            continue
        for parent in [folder, *folder.parents]:
            if parent == TESTS.parent:
                break
            init = parent / "__init__.py"
            if not init.exists():
                init.touch()
                made.append(init)
    return made


def _rewrite_references() -> list[Path]:
    """References to flat test modules and helpers, rewritten in the tracked text files to
    where they are now: ``tests/test_x.py`` and ``tests.test_x`` by the rules (where that file
    exists), ``tests/test_<pkg>_*.py`` globs to ``tests/unit/<pkg>/``, and the helpers' old
    paths (:data:`SUPPORT_MOVES`). Stateless: it reads the tree, so it also fixes references a
    merged branch brought in, and finds nothing to do the second time."""

    def by_path(match: re.Match[str]) -> str:
        placed = place(match.group(1))
        if placed is None or not (TESTS / placed[0]).exists():
            return match.group(0)
        return f"tests/{placed[0].removesuffix('.py')}{match.group(2)}.py"

    def by_name(match: re.Match[str]) -> str:
        placed = place(match.group(1))
        if placed is None or not (TESTS / placed[0]).exists():
            return match.group(0)
        return "tests." + placed[0].removesuffix(".py").replace("/", ".")

    def by_glob(match: re.Match[str]) -> str:
        package = match.group(1)
        return f"tests/unit/{package}/" if (TESTS / UNIT / package).is_dir() else match.group(0)

    # ``tests/test_x.py``, or ``tests/test_x\.py`` inside a regular expression
    path_ref = re.compile(r"(?<![\w/.])tests/(test_\w+)(\\?)\.py(?![\w])")
    name_ref = re.compile(r"(?<![\w.])tests\.(test_\w+)(?![\w])")
    glob_ref = re.compile(r"(?<![\w/.])tests/test_([a-z]+)_\*\.py")
    helper_ref = re.compile("|".join(rf"(?<![\w/.]){re.escape(old)}(?![\w])"
                                     for old in SUPPORT_MOVES))
    changed = []
    for name in _git("ls-files").splitlines():
        path = REPO / name
        if (path.suffix not in TEXT_SUFFIXES or not path.is_file()
                or path == Path(__file__).resolve()):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        new = path_ref.sub(by_path, text)
        new = name_ref.sub(by_name, new)
        new = glob_ref.sub(by_glob, new)
        new = helper_ref.sub(lambda m: SUPPORT_MOVES[m.group(0)], new)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def summary() -> dict[str, int]:
    """Test modules per folder of the tree, as it is now."""
    counts: dict[str, int] = {}
    for path in TESTS.rglob("test_*.py"):
        if "__pycache__" in path.parts:
            continue
        counts[path.parent.relative_to(TESTS).as_posix() or "."] = counts.get(
            path.parent.relative_to(TESTS).as_posix() or ".", 0) + 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    args = parser.parse_args(argv)
    moves, unplaced = plan()
    if unplaced:
        print("relayout_tests: no place for these test modules (add a rule to "
              "tools/relayout_tests.py's TABLE or SUITES); nothing was moved:", file=sys.stderr)
        for name in unplaced:
            print(f"  {name}", file=sys.stderr)
        return 2
    for move in moves:
        print(f"{move.source.relative_to(REPO)} -> {move.target.relative_to(REPO)}"
              f"  [{move.rule}]")
    if args.dry_run:
        return 0
    tracked = set(_git("ls-files", "tests").splitlines())
    for move in moves:
        move.target.parent.mkdir(parents=True, exist_ok=True)
        source = move.source.relative_to(REPO).as_posix()
        if source in tracked:
            _git("mv", source, move.target.relative_to(REPO).as_posix())
        else:  # not committed yet: moved all the same, left for its author to add
            move.source.rename(move.target)
    rewritten = [p for p in sorted(TESTS.rglob("*.py"))
                 if "__pycache__" not in p.parts and p.parent != TESTS / "support"
                 and _rewrite_imports(p)]
    for path in rewritten:
        print(f"rewrote imports in {path.relative_to(REPO)} (run `ruff check --fix` to sort them)")
    made = _ensure_packages()
    if made:
        _git("add", *[str(p.relative_to(REPO)) for p in made])
    changed = _rewrite_references()
    for path in changed:
        print(f"rewrote references in {path.relative_to(REPO)}")
    if not moves and not made and not changed and not rewritten:
        print("relayout_tests: the tree is already laid out; nothing to do")
    print("modules per folder: " + ", ".join(f"{k}: {v}" for k, v in summary().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
