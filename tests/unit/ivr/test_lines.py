"""The lines file: numbers, routing, and errors located like a script's (no model, no sockets).

The gateway side (a Twilio stream and a SIP call each reaching their own line, reloads with
calls up) is tests/unit/ivr/test_reload.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import Settings
from gateway.ivr.lines import (
    DEFAULT_LABEL,
    FileStamp,
    dialled_key,
    is_lines_file,
    load_lines,
    load_plan,
    normalise_number,
    stamp,
)
from gateway.ivr.script import ScriptError
from tests.support.paths import GOLDEN as GOLDEN_ROOT
from tests.support.paths import REPO

ROOT = REPO
PROMPTS = ROOT / "prompts"
GOLDEN = GOLDEN_ROOT / "scripts"

SMALL = """\
name: {name}
voice: {{speaker: ryan, language: English}}
start: hello
nodes:
  hello:
    say: {text}
    hangup: true
"""


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def _errors(path: Path) -> list[str]:
    with pytest.raises(ScriptError) as info:
        load_lines(path)
    return [str(d) for d in info.value.diagnostics]


@pytest.mark.parametrize(("written", "number"), [
    ("+15550002222", "+15550002222"),
    ("+1 (555) 000-2222", "+15550002222"),
    ("+44 20 7946.0000", "+442079460000"),
    ("2000", "2000"),
    ("0100", "0100"),            # an extension keeps its leading zero
    ("support", "support"),      # a SIP user
    ("sales.emea", "sales.emea"),
])
def test_numbers_are_e164_or_extensions_in_one_form(written: str, number: str) -> None:
    assert normalise_number(written) == number


@pytest.mark.parametrize(("written", "why"), [
    ("(555) 000-2222", "national number"),
    ("555 000 2222", "national number"),
    ("+1 555 O00 2222", "digits only"),
    ("+0123456789", "never 0"),
    ("+1234", "7 to 15 digits"),
    ("+1234567890123456", "7 to 15 digits"),
    ("sip:2000@example.com", "neither an E.164 number"),
    ("", "neither an E.164 number"),
])
def test_a_bad_number_says_what_is_wrong(written: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        normalise_number(written)


@pytest.mark.parametrize(("dialled", "key"), [
    ("+15550002222", "+15550002222"),                       # Twilio's To
    ("sip:2000@gw.example.com", "2000"),                    # Twilio's To for a SIP call
    ("sip:%2B15550002222@gw.example.com;user=phone", "+15550002222"),
    ("+1-555-000-2222;npdi", "+15550002222"),
    ("tel:+1-555-000-2222;phone-context=example.com", "+15550002222"),
    ("sips:ivr@gw.example.com:5061", "ivr"),
    ("sip:gw.example.com", ""),
    ("client:alice", "client:alice"),
    ("", ""),
])
def test_what_a_call_dialled_is_read_leniently(dialled: str, key: str) -> None:
    assert dialled_key(dialled) == key


def test_the_example_lines_file_routes_each_number_to_its_script() -> None:
    plan = load_lines(PROMPTS / "lines.yaml")
    assert plan.default == "customer-service" and not plan.single
    assert set(plan.lines) == {"customer-service", "outages"}
    assert plan.lines["outages"].script.name == "Acme Energy outage line"
    assert plan.lines["outages"].numbers == ("+15550003333", "2000")
    cases = {
        "+15550003333": ("outages", "outages"),
        "2000": ("outages", "outages"),
        "15550003333": ("outages", "outages"),   # a trunk that dropped the '+'
        "+15550002222": ("customer-service", "customer-service"),
        "ivr": ("customer-service", "customer-service"),
        "+15559999999": ("customer-service", DEFAULT_LABEL),  # unlisted: default, so labelled
        "": ("customer-service", DEFAULT_LABEL),
    }
    for dialled, (line, label) in cases.items():
        route = plan.route(dialled)
        assert (route.line.name, route.label) == (line, label), dialled
        assert route.matched == (label != DEFAULT_LABEL)
    # Both scripts, each once; every file read is stamped for the reloader.
    assert set(plan.scripts()) == {PROMPTS / "demo.yaml", PROMPTS / "outages.yaml"}
    assert set(plan.stamps) == {PROMPTS / "lines.yaml", PROMPTS / "demo.yaml",
                                PROMPTS / "outages.yaml"}


def test_lines_file_errors_are_all_reported_at_their_line_and_column(tmp_path: Path) -> None:
    _write(tmp_path, "a.yaml", SMALL.format(name="A", text="Hello from A."))
    lines = _write(tmp_path, "lines.yaml", """\
default: main
lines:
  main:
    script: a.yaml
    numbers: [+1 555 000 2222, "(555) 123-4567"]
  billing:
    script: missing.yaml
    numbers: ["+15550002222", 2000, 2000]
  default:
    script: a.yaml
    numbers: "+15550004444"
  quiet:
    script: a.yaml
  bad name:
    script: a.yaml
    numbers: [ext 1]
""")
    label = str(lines)
    assert _errors(lines) == [
        f"{label}:5:32: line 'main': '(555) 123-4567' looks like a national number, which "
        "means different lines in different countries: write it in E.164 with its country "
        "code (+1 555 000 2222); an extension is digits only (2000)",
        f"{label}:7:13: line 'billing': script 'missing.yaml' not found "
        f"({tmp_path / 'missing.yaml'})",
        f"{label}:8:15: line 'billing': +15550002222 is listed for line 'main' too (first at "
        "line 5): a number reaches one line",
        f"{label}:8:37: line 'billing': 2000 is listed twice (first at line 8): a number "
        "reaches one line",
        f"{label}:9:3: 'default' is the label of calls to numbers no line lists; name this "
        "line after what it is, and write 'default: <its name>'",
        f"{label}:12:3: line 'quiet' lists no numbers and is not the default: no call "
        "reaches it",
        f"{label}:14:3: line name 'bad name': letters, digits and '_ . -' (at most 48), "
        "starting with a letter or digit (it is a metric label)",
        f"{label}:16:15: line 'bad name': 'ext 1' is neither an E.164 number (+15550002222) "
        "nor an extension or SIP user (2000, support: letters, digits and . _ ~ -)",
    ]


def test_schema_errors_of_a_lines_file_are_located(tmp_path: Path) -> None:
    lines = _write(tmp_path, "lines.yaml", "default: main\nlines:\n  main:\n"
                                           "    scirpt: a.yaml\n    numbers: {a: 1}\n")
    errors = _errors(lines)
    assert f"{lines}:4:5: 'script' is required here (lines.main.script)" in errors
    assert f"{lines}:4:5: unknown field 'scirpt' (lines.main.scirpt): check the spelling" \
        in errors
    assert any(e.startswith(f"{lines}:5:14: lines.main.numbers:") for e in errors), errors
    missing_default = _write(tmp_path, "l2.yaml", "lines:\n  main: {script: a.yaml}\n")
    assert _errors(missing_default) == [
        f"{missing_default}:1:1: 'default' is required here (default)"]
    unknown_default = _write(tmp_path, "l3.yaml", "default: mian\nlines:\n"
                                                  "  main: {script: a.yaml, numbers: [1]}\n")
    _write(tmp_path, "a.yaml", SMALL.format(name="A", text="Hi."))
    assert _errors(unknown_default) == [
        f"{unknown_default}:1:10: default 'mian' is not a line (lines: main)"]
    syntax = _write(tmp_path, "l4.yaml", "default: main\nlines: {main: [\n")
    assert _errors(syntax)[0].startswith(f"{syntax}:3:1: YAML syntax:")


def test_a_scripts_own_errors_are_reported_in_the_script(tmp_path: Path) -> None:
    """The lines file names a broken script: its errors come located in that script, exactly
    as `script validate SCRIPT` reports them, alongside the lines file's own."""
    lines = _write(tmp_path, "lines.yaml",
                   f"default: main\nlines:\n  main:\n    script: {GOLDEN / 'logic_errors.yaml'}\n"
                   "    numbers: [+15550002222, +15550002222]\n")
    errors = _errors(lines)
    expected = (GOLDEN / "logic_errors.expected").read_text().splitlines()
    golden = [line.replace("tests/golden/scripts/", f"{GOLDEN}/") for line in expected]
    assert [e for e in errors if e.startswith(str(GOLDEN))] == golden
    assert [e for e in errors if e.startswith(str(lines))] == [
        f"{lines}:5:29: line 'main': +15550002222 is listed twice (first at line 5): a number "
        "reaches one line"]


def test_unquoted_numbers_keep_their_plus_and_leading_zeros(tmp_path: Path) -> None:
    """YAML would read +15550002222 as the integer 15550002222 and 0100 as octal 64."""
    _write(tmp_path, "a.yaml", SMALL.format(name="A", text="Hi."))
    lines = _write(tmp_path, "lines.yaml", "default: main\nlines:\n  main:\n    script: a.yaml\n"
                                           "    numbers: [+15550002222, 0100, 1e3]\n")
    assert load_lines(lines).numbers == {"+15550002222": "main", "0100": "main", "1e3": "main"}


def test_stamps_name_every_file_read_even_when_loading_fails(tmp_path: Path) -> None:
    """The reloader watches what a refused attempt read, so fixing any of them is seen."""
    a = _write(tmp_path, "a.yaml", "name: A\nnodes: {}\n")
    lines = _write(tmp_path, "lines.yaml", "default: main\nlines:\n  main: {script: a.yaml}\n")
    stamps: dict[Path, FileStamp] = {}
    with pytest.raises(ScriptError):
        load_lines(lines, stamps=stamps)
    assert stamps == {lines: stamp(lines), a: stamp(a)}
    assert stamp(tmp_path / "gone.yaml") is None


def test_a_lines_file_and_a_script_are_told_apart() -> None:
    assert is_lines_file(PROMPTS / "lines.yaml")
    assert not is_lines_file(PROMPTS / "demo.yaml")
    single = load_plan(PROMPTS / "demo.yaml")
    assert single.single and single.route("+15550003333").label == DEFAULT_LABEL
    assert not load_plan(PROMPTS / "lines.yaml").single


def test_a_lines_file_supersedes_the_script_setting(caplog: pytest.LogCaptureFixture) -> None:
    """The image bakes in GATEWAY_SCRIPT: setting GATEWAY_LINES on top is enough, and said."""
    from gateway.app import create_app

    settings = Settings(lines=PROMPTS / "lines.yaml", script=PROMPTS / "demo.yaml",
                        insecure=True, device="cpu")
    assert settings.superseded_script == PROMPTS / "demo.yaml"
    assert Settings(script=PROMPTS / "demo.yaml").superseded_script is None
    assert Settings(lines="", script="x.yaml").lines is None  # type: ignore[arg-type]
    caplog.set_level("WARNING", logger="gateway.app")
    gateway = create_app(settings, lambda s: []).state.gateway
    assert gateway.plan is not None and not gateway.plan.single
    assert f"GATEWAY_LINES ({PROMPTS / 'lines.yaml'}) supersedes GATEWAY_SCRIPT " \
        f"({PROMPTS / 'demo.yaml'})" in caplog.text


def test_script_validate_checks_a_lines_file_and_every_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["script", "validate", str(PROMPTS / "lines.yaml")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{PROMPTS / 'lines.yaml'}: ok (2 lines, 5 numbers, default 'customer-service')",
        f"{PROMPTS / 'demo.yaml'}: ok (12 nodes, 20 cached sentences)",
        f"{PROMPTS / 'outages.yaml'}: ok (4 nodes, 4 cached sentences)",
    ]
    bad = _write(tmp_path, "lines.yaml", "default: main\nlines:\n  main:\n"
                                         f"    script: {GOLDEN / 'duplicates.yaml'}\n")
    assert main(["script", "validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{GOLDEN / 'duplicates.yaml'}:6:3: error: 'hi' is defined twice" in err
    assert "1 of 1 file(s) have errors" in err


def test_serve_refuses_to_start_with_an_invalid_lines_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _write(tmp_path, "lines.yaml", "default: main\nlines:\n  main:\n    script: nope.yaml\n")
    assert main(["serve", "--insecure", "--port", "0", "--lines", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:4:13: error: line 'main': script 'nope.yaml' not found" in err
    assert f"refusing to start: {bad} has errors" in err
