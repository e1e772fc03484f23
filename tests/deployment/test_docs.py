"""The README documents what the code does: every setting, the two-command quick start."""

from __future__ import annotations

import re

from gateway.config import Settings
from tests.support.paths import REPO

ROOT = REPO
README = (ROOT / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table() -> None:
    documented = set(re.findall(r"^\| `(GATEWAY_[A-Z0-9_]+)` \|", README, flags=re.M))
    expected = {f"GATEWAY_{name.upper()}" for name in Settings.model_fields}
    assert documented == expected


def test_quick_start_is_two_commands_and_ci_runs_the_readme_test_command() -> None:
    section = README.split("## Quick start", 1)[1].split("##", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert len(commands) == 2 and all(commands)
    test_command = commands[1]
    assert test_command in (ROOT / ".ci" / "run").read_text()
