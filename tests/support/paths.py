"""Where things are, for tests wherever they sit in the tree (tests/unit/<package>/, tests/e2e/,
...): the repository, the test data (golden captures, SIPp scenarios), the demo script."""

from __future__ import annotations

from pathlib import Path

#: The repository's root (pyproject.toml, README.md, gateway/, prompts/, infra/).
REPO = Path(__file__).resolve().parents[2]
#: The tests' root folder.
TESTS = REPO / "tests"
#: Recorded and hand-checked inputs: golden/{scripts,sip,text,twilio}.
GOLDEN = TESTS / "golden"
#: SIPp scenarios (NAME.xml) for :func:`tests.support.sip_peers.run_sipp`.
SIPP_DIR = TESTS / "sipp"
#: The demo IVR script (the README's quick start).
DEMO_SCRIPT = REPO / "prompts" / "demo.yaml"
