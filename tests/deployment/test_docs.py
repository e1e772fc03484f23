"""The documentation documents what the code does: every setting (the configuration reference
is generated from the settings object), the two-command quick start, a site that builds with
--strict, a README within its budget, and nothing that points outside the repository."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gateway.config import Settings
from tests.support.paths import REPO

ROOT = REPO
README = (ROOT / "README.md").read_text()
#: The front door's budget: what it is, the quick start, a short tour and links.
README_BUDGET_BYTES = 8 * 1024


def _hook() -> ModuleType:
    """docs/hooks/settings_reference.py, the MkDocs hook that writes the reference."""
    path = ROOT / "docs" / "hooks" / "settings_reference.py"
    spec = importlib.util.spec_from_file_location("settings_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_is_in_the_configuration_reference() -> None:
    hook = _hook()
    table = hook.settings_table()
    documented = set(re.findall(r"^\| `(GATEWAY_[A-Z0-9_]+)` \|", table, flags=re.M))
    expected = {f"GATEWAY_{name.upper()}" for name in Settings.model_fields}
    assert documented == expected
    # Each row says what its setting means, in the words of the settings object.
    for name, field in Settings.model_fields.items():
        assert field.description and field.description.strip(), name
        row = next(line for line in table.splitlines()
                   if line.startswith(f"| `GATEWAY_{name.upper()}` |"))
        assert " ".join(field.description.split()).replace("|", "\\|") in row, name
    page = (ROOT / "docs" / "operators" / "configuration.md").read_text()
    assert hook.MARKER in page and hook.END_MARKER in page
    generated = hook.on_page_markdown(page, None, None, None)
    assert hook.MARKER not in generated and table in generated


def test_a_setting_without_a_description_fails_the_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hook = _hook()
    field = Settings.model_fields["port"]
    monkeypatch.setattr(field, "description", None)
    with pytest.raises(hook.UndocumentedSetting, match="'port'"):
        hook.settings_table()


def test_quick_start_is_two_commands_and_ci_runs_the_readme_test_command() -> None:
    section = README.split("## Quick start", 1)[1].split("##", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert len(commands) == 2 and all(commands)
    test_command = commands[1]
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_the_readme_fits_its_budget_and_its_links_resolve() -> None:
    assert len(README.encode()) <= README_BUDGET_BYTES
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert links
    for link in links:
        if "://" in link:
            continue
        assert (ROOT / link).exists(), link


#: Files people read: nothing in them may point at a path outside the repository.
_READ = ("README.md", "CHANGELOG.md", "pyproject.toml", "mkdocs.yml", "run.sh", "Dockerfile",
         ".ci/run")
_OUTSIDE = re.compile(r"\.\./shared|shared/DESIGN|shared/notes|shared/tools|/work/")


def test_nothing_points_outside_the_repository() -> None:
    files = [ROOT / name for name in _READ]
    for folder in ("docs", "gateway", "bench", "infra", "prompts", "tests"):
        files += [p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and p.suffix in (".md", ".py", ".sh", ".yaml", ".yml", ".tf",
                                                  ".toml", ".cfg", ".txt")]
    offenders = []
    for path in files:
        if path.resolve() == Path(__file__).resolve():
            continue  # this test names the patterns it looks for
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in _OUTSIDE.finditer(text)]
    assert not offenders, offenders


def test_the_site_builds_with_strict(tmp_path: Path) -> None:
    """mkdocs build --strict: a broken link or anchor, a page missing from the nav, an include
    whose file is gone or a setting without a description fails it."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-d", str(tmp_path / "site")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    reference = (tmp_path / "site" / "operators" / "configuration" / "index.html").read_text()
    for name in Settings.model_fields:
        assert f"GATEWAY_{name.upper()}" in reference, name


def test_the_script_test_pages_case_passes(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The case shown on docs/authors/testing.md is a real one: it passes against the demo."""
    from gateway.cli import main

    page = (ROOT / "docs" / "authors" / "testing.md").read_text()
    block = page.split("```yaml", 1)[1].split("```", 1)[0]
    cases = tmp_path / "cases.yaml"
    cases.write_text(block)
    code = main(["script", "test", str(ROOT / "prompts" / "demo.yaml"), str(cases)])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
