"""`gateway script test`: scripted callers through the real IVR runner, no model.

The demo's own cases (prompts/demo.cases.yaml) run here, so CI runs them with the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.ivr.cases import load_cases, run_case
from gateway.ivr.script import ScriptError, load_script, parse_script
from tests.support.paths import REPO

ROOT = REPO
DEMO = ROOT / "prompts" / "demo.yaml"
DEMO_CASES = ROOT / "prompts" / "demo.cases.yaml"


def test_the_demo_cases_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["script", "test", str(DEMO), str(DEMO_CASES)]) == 0
    out = capsys.readouterr().out
    assert "13 passed, 0 failed" in out
    assert "PASS en español, the same lookup with translated prompts" in out
    assert "demo.cases.yaml:65:5: PASS an overdue account goes to collections" in out


def test_the_outage_lines_cases_pass(capsys: pytest.CaptureFixture[str]) -> None:
    """The second line of prompts/lines.yaml has its own cases."""
    prompts = ROOT / "prompts"
    assert main(["script", "test", str(prompts / "outages.yaml"),
                 str(prompts / "outages.cases.yaml")]) == 0
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out
    assert "PASS a gas leak goes to the emergency team" in out


def _cases(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.cases.yaml"
    path.write_text(text)
    return path


def test_a_failing_case_says_where_the_path_diverged_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = _cases(tmp_path, """cases:
  - name: expects the balance, but the account is overdue
    webhooks:
      lookup: {first_name: Dana, balance: "80", due_date: May 1, status: overdue}
    steps: [{press: "1"}, {press: "123456#"}, {press: "3"}]
    path: [welcome, menu, account, lookup, route, balance, anything_else, goodbye]
    outcome: hangup
  - name: expects different words
    steps: [{press: "2"}]
    says: [welcome, "Para español, oprima 8.", main_menu, Hold on.]
  - name: expects more steps than the call takes
    steps: [{press: "2"}, {press: "5"}]
    outcome: {transfer: "+15555550199"}
""")
    assert main(["script", "test", str(DEMO), str(cases)]) == 1
    out = capsys.readouterr().out
    assert f"{cases}:2:5: FAIL expects the balance, but the account is overdue" in out
    assert ("path diverged at node 6 (after 'route': case 1: status == \"overdue\" and "
            "balance > 0): expected 'balance', the call went to 'collections'") in out
    assert "    actual:   welcome > menu > account > lookup > route > collections" in out
    assert "outcome: expected hang-up, got transfer to +15555550101" in out
    assert ("sentence 4 (at 'agent', English): expected \"Hold on.\", heard \"Please hold "
            "while I transfer you to an agent.\"") in out
    assert "the call ended at 'agent' with steps left (press 5)" in out
    assert "outcome: expected transfer to +15555550199, got transfer to +15555550100" in out
    assert "0 passed, 3 failed" in out


def test_case_file_mistakes_are_located(tmp_path: Path) -> None:
    cases = _cases(tmp_path, """cases:
  - name: one
    at: 2025-06-16T10:00:00
    webhooks: {lookpu: {a: 1}}
    steps: [{press: "1x"}, {wait: soon}, jump]
    path: [welcome, menuu]
    outcome: {transfer: "+1555"}
    colour: blue
""")
    with pytest.raises(ScriptError) as info:
        load_cases(cases, load_script(DEMO))
    messages = [str(d).replace(str(cases), "c") for d in info.value.diagnostics]
    assert "c:3:9: cases.0.at: give the time with its UTC offset: 2025-06-16T10:00:00-04:00" \
        in messages
    assert messages == [
        "c:3:9: cases.0.at: give the time with its UTC offset: 2025-06-16T10:00:00-04:00",
        "c:5:21: cases.0.steps.0.press: '1x' is not keypad keys (0-9, *, #, A-D)",
        "c:5:35: cases.0.steps.1.wait: 'soon' is not a duration: write 5s, 1.5s or 500ms",
        'c:5:42: cases.0.steps.2: a step is {press: "1"}, {say: "agent"}, {wait: 5s} or hangup',
        "c:8:5: unknown field 'colour' (cases.0.colour): check the spelling",
    ]
    cases.write_text("cases:\n  - name: two\n    webhooks: {lookpu: {a: 1}}\n"
                     "    path: [welcome, menuu]\n")
    with pytest.raises(ScriptError) as info:
        load_cases(cases, load_script(DEMO))
    assert [str(d).replace(str(cases), "c") for d in info.value.diagnostics] == [
        "c:3:16: case 'two': 'lookpu' is not a webhook node (webhook nodes: lookup)",
        "c:4:21: case 'two': 'menuu' is not a node of the script",
    ]


HOURS = """name: t
voice: {speaker: ryan}
start: office
nodes:
  office:
    hours:
      timezone: America/New_York
      weekly: {mon-fri: "08:00-18:00"}
      holidays: [2025-12-25]
      open: menu
      closed: shut
  menu:
    gather:
      prompt: Press 1 for sales.
      digits: 1
      retries: 1
      branch: {"1": sales}
      fallback: shut
  sales: {transfer: "+15555550100"}
  shut:
    say: We are closed.
    hangup: true
"""


@pytest.mark.parametrize(
    ("at", "path"),
    [
        ("2025-06-16T10:00:00-04:00", ["office", "menu", "sales"]),
        ("2025-06-16T20:00:00-04:00", ["office", "shut"]),
        ("2025-12-25T10:00:00-05:00", ["office", "shut"]),
        ("2025-06-16T13:30:00+00:00", ["office", "menu", "sales"]),
    ],
)
async def test_a_case_sets_the_time_of_day_for_business_hours(
    tmp_path: Path, at: str, path: list[str]
) -> None:
    (tmp_path / "hours.yaml").write_text(HOURS)
    script = load_script(tmp_path / "hours.yaml")
    cases = load_cases(_cases(tmp_path, f"cases:\n  - name: n\n    at: {at}\n"
                                         "    steps: [{press: '1'}]\n"), script)
    result = await run_case(script, cases.cases[0])
    if path[-1] == "shut":
        assert result.failures == ["the call ended at 'shut' with steps left (press 1)"]
    else:
        assert result.passed, result.failures
    assert result.trace.path == path


async def test_hours_scripts_need_a_time_and_silence_runs_the_timeouts(tmp_path: Path) -> None:
    (tmp_path / "hours.yaml").write_text(HOURS)
    script = load_script(tmp_path / "hours.yaml")
    with pytest.raises(ScriptError, match="the script has business hours, so give the time"):
        load_cases(_cases(tmp_path, "cases:\n  - name: n\n"), script)
    cases = load_cases(_cases(tmp_path, "cases:\n  - name: silent\n"
                                        "    at: 2025-06-16T10:00:00-04:00\n"
                                        "    says: [Press 1 for sales., Press 1 for sales.,"
                                        " We are closed.]\n    outcome: hangup\n"), script)
    result = await run_case(script, cases.cases[0])
    assert result.passed, result.failures
    assert result.trace.path == ["office", "menu", "shut"]
    assert result.trace.ended_at is not None and result.trace.ended_at >= 10  # two 5 s waits


async def test_a_webhook_the_case_does_not_answer_fails_and_a_flow_that_never_ends_is_caught(
    tmp_path: Path,
) -> None:
    script = load_script(DEMO)
    cases = load_cases(_cases(tmp_path, "cases:\n  - name: n\n"
                                        "    steps: [{press: '1'}, {press: '123456#'}]\n"),
                       script)
    result = await run_case(script, cases.cases[0])
    assert result.failures[0].startswith("node 'lookup' called its webhook, but the case "
                                         "gives it no answer")
    assert result.trace.path[-1] == "sorry"
    loop = parse_script("name: t\nvoice: {speaker: ryan}\nstart: a\nnodes:\n"
                        "  a:\n    gather: {prompt: 'Press 1.', digits: 1, retries: 0,"
                        " branch: {'1': b}, fallback: a}\n  b: {hangup: true}\n")
    cases = load_cases(_cases(tmp_path, "cases:\n  - name: forever\n"), loop)
    result = await run_case(loop, cases.cases[0])
    assert len(result.failures) == 1
    assert result.failures[0].startswith("the call never ended (still waiting in 'a' after")


async def test_play_nodes_play_silence_in_a_case(tmp_path: Path) -> None:
    import numpy as np
    import soundfile as sf

    sf.write(str(tmp_path / "chime.wav"), np.zeros(800, np.float32), 8000)
    (tmp_path / "t.yaml").write_text("name: t\nvoice: {speaker: ryan}\nstart: a\nnodes:\n"
                                     "  a: {play: chime.wav, next: b}\n"
                                     "  b: {say: 'Bye.', hangup: true}\n")
    script = load_script(tmp_path / "t.yaml")
    cases = load_cases(_cases(tmp_path, "cases:\n  - name: n\n    path: [a, b]\n"
                                        "    says: [Bye.]\n    outcome: hangup\n"), script)
    result = await run_case(script, cases.cases[0])
    assert result.passed, result.failures
