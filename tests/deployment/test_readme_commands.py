"""Every ``./run.sh`` command in the README and the documentation pages (docs/) exists with the
options it is shown with, the cheap ones run, and the load simulator's examples print what the
sizing page shows under them (their shape: tests/support/readme_samples.py), on the tiny model,
shortened where a flag allows. The quick start's ``./run.sh call`` sample is checked by
tests/e2e/test_softphone.py's end-to-end call."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from tests.support.readme_samples import ROOT, Documented, documented_commands, mismatch, shape
from tests.support.servers import AUTH_TOKEN, LiveServer

COMMANDS = documented_commands()


def _id(command: Documented) -> str:
    return f"{command.source}:{command.line}:{' '.join(command.argv[:3])}"


def test_the_docs_document_the_commands_this_test_knows() -> None:
    names = {tuple(c.argv[:2]) for c in COMMANDS}
    for expected in (("demo",), ("call",), ("loadsim", "run"), ("loadsim", "capacity"),
                     ("loadsim", "merge"), ("script", "validate"), ("say",)):
        assert any(name[:len(expected)] == expected for name in names), expected
    samples = [c for c in COMMANDS if c.sample is not None]
    assert {tuple(c.argv[:2]) for c in samples} >= {("call",), ("loadsim", "run"),
                                                    ("loadsim", "capacity")}


#: run.sh's own verbs, not gateway commands (tests/deployment/test_docs.py checks the test
#: command; the help verbs: tests/unit/test_cli.py).
RUN_SH_VERBS = ("test", "setup", "--help", "help")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.argv[0] not in RUN_SH_VERBS],
                         ids=_id)
def test_every_documented_command_exists_with_its_options(
    command: Documented, capsys: pytest.CaptureFixture[str]
) -> None:
    # --help is eager: it exits 0 once every option before it parsed, before anything runs;
    # an option or a command that does not exist is a usage error (exit 2).
    code = main([*command.argv, "--help"])
    err = capsys.readouterr().err
    assert code == 0, f"{command.source}:{command.line}: ./run.sh {' '.join(command.argv)}\n{err}"


# --- the cheap ones, run as written (a tiny model where the docs leave the default) ------------


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.argv[:2] in (
    ["script", "validate"], ["script", "graph"], ["script", "test"], ["say"],
    ["model", "tiny"], ["voices", "list"]) or c.argv[:1] in (["say"], ["model"])], ids=_id)
def test_cheap_documented_commands_run_as_written(
    command: Documented, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [str(ROOT / a) if a.startswith("prompts/") else a for a in command.argv]
    monkeypatch.chdir(tmp_path)  # outputs (flow.svg, p.wav, ./tiny-model) land here
    if argv[0] == "say":
        argv += ["--model", str(tiny_model_dir), "--device", "cpu"]
    if argv[:2] == ["script", "graph"] and not shutil.which("dot"):
        pytest.skip("graphviz is not installed")
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, f"./run.sh {' '.join(command.argv)}\n{captured.out}\n{captured.err}"


# --- the load simulator's examples ---------------------------------------------------------------


def _documented(*prefix: str, having: str | None = None) -> Documented:
    """The one documented command that starts with ``prefix`` (and has the option ``having``)."""
    (found,) = [c for c in COMMANDS if c.argv[:len(prefix)] == list(prefix)
                and (having is None or having in c.argv)]
    return found


def _shortened(argv: list[str], **flags: str) -> list[str]:
    """``argv`` with each ``--flag value`` of ``flags`` replaced (or added)."""
    out = list(argv)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def _on(url: str, argv: list[str], live: LiveServer) -> list[str]:
    """The documented http://127.0.0.1:808x targets pointed at the test's gateways."""
    return [a.replace("http://127.0.0.1:8080", live.base_url) for a in argv]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command in its own process, stdout and stderr interleaved as a terminal shows
    them, 80 columns."""
    env = {**os.environ, "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "gateway", *argv], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, check=False)


@contextlib.contextmanager
def _max_calls(live: LiveServer, max_calls: int) -> Iterator[None]:
    admission = live.gateway.admission
    saved = admission.max_calls
    admission.max_calls = max_calls
    try:
        yield
    finally:
        admission.max_calls = saved


def test_example_1_prints_what_the_readme_shows(
    demo_realtime: tuple[LiveServer, Any], tmp_path: Path
) -> None:
    """20 callers on 16 lines for 30 s, shortened: 3 callers on 2 lines for 3 s (refusals and
    the budget warning as in the sample), the same report files."""
    live, _ = demo_realtime
    command = _documented("loadsim", "run", "http://127.0.0.1:8080", having="--html")
    argv = _shortened(_on("", command.argv, live), concurrency="3", duration="3",
                      auth_token=AUTH_TOKEN)
    with _max_calls(live, 2):
        done = _run(argv, tmp_path)
    assert done.returncode == 0, done.stdout
    assert command.sample is not None
    problem = mismatch(command.sample, done.stdout)
    assert problem is None, problem
    document = json.loads((tmp_path / "run.json").read_text())
    assert document["levels"][0]["refused"] >= 1
    assert (tmp_path / "run.html").read_text().startswith("<!DOCTYPE html>")


def test_example_2_prints_what_the_readme_shows(
    demo_realtime: tuple[LiveServer, Any], live_gateway: LiveServer, tmp_path: Path
) -> None:
    """The capacity search, shortened: levels x1 and x2 of 2 s each, and an SLO every level
    of a busy test machine meets (the sample's shape, not its verdicts)."""
    cached, _ = demo_realtime
    command = _documented("loadsim", "capacity")
    argv = [a.replace("http://127.0.0.1:8080", cached.base_url)
            .replace("http://127.0.0.1:8082", live_gateway.base_url) for a in command.argv]
    argv = _shortened(argv, duration="2", max="2", slo="ttfa_p95<10s,errors=0",
                      auth_token=AUTH_TOKEN)
    done = _run(argv, tmp_path)
    assert done.returncode == 0, done.stdout
    assert command.sample is not None
    problem = mismatch(command.sample, done.stdout)
    assert problem is None, problem


def test_examples_3_and_4_run(demo_realtime: tuple[LiveServer, Any], tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SIP callers at a rate (shortened to 1 s), then merging two hosts' files."""
    live, _ = demo_realtime
    endpoint = live.gateway.sip
    assert endpoint is not None and endpoint.local_addr is not None
    host, port = endpoint.local_addr
    sip = _documented("loadsim", "run", "127.0.0.1:5060")
    argv = _shortened([a.replace("127.0.0.1:5060", f"{host}:{port}") for a in sip.argv],
                      duration="1", rate="2", http=live.base_url)
    monkeypatch.chdir(tmp_path)
    for name in ("host-a.json", "host-b.json"):
        assert main([*argv, "--json", name]) == 0
    merge = _documented("loadsim", "merge")
    assert main(merge.argv) == 0
    assert json.loads((tmp_path / "fleet.json").read_text())["levels"]
    assert (tmp_path / "fleet.html").exists()


# --- the comparison itself -----------------------------------------------------------------------


def test_the_shape_tolerates_figures_and_level_counts_but_not_words() -> None:
    sample = "level  calls  p95 ms  result\n  ×20    184     11  —\n  ×40    300     90  pass\n" \
             "...\nreport: run.html\n"
    assert mismatch(sample, "level  calls  p95 ms  result\n   ×1      3  1,204  withheld\n"
                            "progress\nreport: run.html\n") is None
    assert mismatch(sample, "level  calls  p95 ms  result\n   ×1  3  12  pass\n"
                            "report: out.html\n") is not None
    assert mismatch(sample, "level  calls  p95  result\n   ×1  3  12  pass\n"
                            "report: run.html\n") is not None
    assert shape("  0.84  key 1 sent") == shape(" 14.74  key 3 sent")
