"""The shape of gateway/ (docs/architecture/index.md, "Rules of the road"), checked from its source.

- The import graph has no cycle, counting every import: module level, inside functions, and
  under ``if TYPE_CHECKING:`` (a type-only cycle is still two modules that cannot be understood
  apart).
- No transport imports the app: the composition root reaches down, nothing reaches back up.
- Both transports start and finish calls through the one lifecycle module.
- The pure protocol modules (SIP, SDP, RTP, digest, the SIP server and client cores, the Twilio
  messages, G.711, the decimator)
  and their tests run without torch: a subprocess in which ``import torch`` fails collects
  every one of those test modules and runs their example-based tests (the property tests add
  no import and run in the default run).
"""

from __future__ import annotations

import ast
import functools
import graphlib
import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

ROOT = REPO
PACKAGE = ROOT / "gateway"

#: Tests of the protocol cores that must run on an install without torch.
PROTOCOL_TESTS = [
    "tests/unit/sip/test_message.py", "tests/unit/sip/test_sdp.py", "tests/unit/sip/test_rtp.py",
    "tests/unit/sip/test_uas.py", "tests/unit/sip/test_uac.py", "tests/unit/sip/test_digest.py",
    "tests/unit/twilio/test_protocol.py", "tests/unit/audio/test_g711.py",
    "tests/unit/audio/test_resample.py",
]
PROTOCOL_MODULES = [
    "gateway.sip.message", "gateway.sip.sdp", "gateway.sip.rtp", "gateway.sip.uas",
    "gateway.sip.uac", "gateway.sip.digest", "gateway.twilio.protocol", "gateway.audio.g711",
    "gateway.audio.resample", "gateway.errors",
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the gateway modules it imports (every import statement in the file)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the
                # module.
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


@functools.cache
def parsed_import_graph() -> dict[str, set[str]]:
    """:func:`import_graph`, built in a fresh interpreter (once per test process).

    CPython 3.11's AST constructor keeps its recursion depth per interpreter, not per thread
    (gh-106905): an ``ast.parse`` here while a thread a gateway test left behind compiles a
    module it imports lazily raised "AST constructor recursion depth mismatch" in a fresh
    clone. This module imports nothing but the standard library, so the child is cheap."""
    # Imported by its module name from the repository's root (``-c`` puts the working directory
    # first on the path), wherever the tests' tree keeps this module.
    code = (f"import json; import {__name__} as t; "
            "print(json.dumps({k: sorted(v) for k, v in t.import_graph().items()}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return {name: set(deps) for name, deps in json.loads(out).items()}


def test_the_import_graph_has_no_cycle_even_counting_type_only_imports() -> None:
    graph = parsed_import_graph()
    assert "gateway.app" in graph and "gateway.call.lifecycle" in graph  # the walk found them
    assert "gateway.call.session" in graph["gateway.call.lifecycle"]
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
    assert len(order) == len(graph)


def test_no_module_but_the_process_shell_imports_the_app() -> None:
    graph = parsed_import_graph()
    importers = sorted(name for name, deps in graph.items() if "gateway.app" in deps)
    # The CLI builds the app; nothing the app builds reaches back into it.
    assert importers == ["gateway.cli"], importers


def test_both_transports_go_through_the_one_lifecycle() -> None:
    graph = parsed_import_graph()
    for adapter in ("gateway.twilio.stream", "gateway.sip.endpoint"):
        assert "gateway.call.lifecycle" in graph[adapter], adapter
    # and neither does the lifecycle's work itself: no transport builds a Call or paces frames.
    for path in (PACKAGE / "twilio" / "stream.py", PACKAGE / "sip" / "endpoint.py"):
        source = path.read_text()
        assert "Call(" not in source and "Pacer" not in source, path
        assert "SpeechStartDetector" not in source and "ulaw_encode" not in source, path


_BLOCK_TORCH = """
import importlib.abc, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked: {name}")
        return None

sys.meta_path.insert(0, _NoTorch())
"""


def test_the_protocol_cores_and_their_tests_run_without_torch(tmp_path: Path) -> None:
    script = _BLOCK_TORCH + f"""
import importlib, pytest
for name in {PROTOCOL_MODULES!r}:
    importlib.import_module(name)
assert "torch" not in sys.modules
tests = [str(p) for p in {[str(ROOT / t) for t in PROTOCOL_TESTS]!r}]
# Every test module is collected (all their imports happen); the example-based tests run. The
# property tests (hypothesis) import nothing more and run in the default run.
code = pytest.main([*tests, "-q", "-p", "no:cacheprovider", "-x", "-W", "ignore",
                    "-m", "not hypothesis"])
assert "torch" not in sys.modules, "a protocol test imported torch"
sys.exit(int(code))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "tests", text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
