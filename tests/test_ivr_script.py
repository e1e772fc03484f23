"""IVR scripts: the demo is valid; every error kind has a golden message with its position."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.ivr.script import ScriptError, load_script, parse_script, render, template_variables

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden" / "scripts"


def test_the_demo_script_is_valid() -> None:
    script = load_script(ROOT / "prompts" / "demo.yaml")
    assert script.start == "welcome" and script.voice.speaker == "ryan"
    statics = script.static_sentences()
    assert "Thank you for calling Acme Energy." in statics
    assert not any("{" in text for text in statics)  # the balance sentence is live


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.yaml")))
def test_golden_validation_messages(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    with pytest.raises(ScriptError) as info:
        load_script(Path("tests/golden/scripts") / f"{name}.yaml")
    expected = (GOLDEN / f"{name}.expected").read_text().strip()
    assert str(info.value) == expected


def _errors(text: str, **kwargs: object) -> list[str]:
    with pytest.raises(ScriptError) as info:
        parse_script(text, "t.yaml", **kwargs)  # type: ignore[arg-type]
    return [str(d) for d in info.value.diagnostics]


HEAD = "name: t\nvoice: {speaker: ryan}\nstart: a\n"


def test_unknown_cloned_voice_says_how_to_register_it() -> None:
    text = "name: t\nvoice: {clone: anna}\nstart: a\nnodes:\n  a: {say: 'Hi.', hangup: true}\n"
    errors = _errors(text, voice_exists=lambda name: False)
    assert errors == [
        "t.yaml:2:16: cloned voice 'anna' is not registered: add it with "
        "`gateway voices add anna REF.wav --text ...`"
    ]
    assert parse_script(text, "t.yaml", voice_exists=lambda name: True).voice.clone == "anna"


def test_missing_sound_file(tmp_path: Path) -> None:
    text = HEAD + "nodes:\n  a: {play: missing.wav, hangup: true}\n"
    assert _errors(text, base_dir=tmp_path) == [
        f"t.yaml:5:13: node 'a' plays 'missing.wav', which does not exist (looked in {tmp_path})"
    ]


def test_unset_environment_variable_in_a_webhook_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_BACKEND", raising=False)
    text = HEAD + (
        "nodes:\n  a:\n    webhook: {url: '${NO_SUCH_BACKEND}/x', on_error: a}\n    next: a\n"
    )
    assert _errors(text) == [
        "t.yaml:6:20: nodes.a.webhook.url: environment variable NO_SUCH_BACKEND is not set"
    ]
    monkeypatch.setenv("NO_SUCH_BACKEND", "https://api.example.com")
    script = parse_script(text, "t.yaml")
    assert script.nodes["a"].webhook is not None
    assert script.nodes["a"].webhook.url == "https://api.example.com/x"


def test_node_shape_errors_are_plain_english() -> None:
    errors = _errors(HEAD + "nodes:\n  a: {say: 'Hi.'}\n")
    assert errors == [
        "t.yaml:5:6: nodes.a: this node does not say where the call goes: add "
        "'next', 'gather', 'webhook', 'transfer' or 'hangup: true'"
    ]
    errors = _errors(HEAD + "nodes:\n  a: {transfer: '+15551234567', hangup: true}\n")
    assert "a node does one thing after speaking; this one has transfer and hangup" in errors[0]


def test_templates_insert_values_as_plain_text() -> None:
    assert template_variables("Hi {name}, you owe {amount}.") == ["name", "amount"]
    assert render("Hi {name}.", {"name": "{amount} {0.__class__}"}) == "Hi {amount} {0.__class__}."
    assert render("Hi {name}.", {}) == "Hi ."
    for bad in ("{a.b}", "{a[0]}", "{a!r}", "{a:>10}", "{0}"):
        with pytest.raises(ValueError):
            template_variables(bad)


def test_cli_validate_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prompts", "validate", str(ROOT / "prompts" / "demo.yaml")]) == 0
    assert "ok (9 nodes" in capsys.readouterr().out
    assert main(["prompts", "validate", str(GOLDEN / "duplicates.yaml")]) == 1
    err = capsys.readouterr().err
    assert "duplicates.yaml:6:3: error: 'hi' is defined twice" in err


def test_server_refuses_to_start_with_an_invalid_script(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["serve", "--insecure", "--port", "0", "--script", str(GOLDEN / "logic_errors.yaml")]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "logic_errors.yaml:3:12: error: speaker 'robot' is not a built-in voice" in err
    assert "refusing to start" in err


def test_prompts_render_is_resumable(
    demo_cache_dir: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The session fixture rendered every static prompt once; a second run renders none."""
    code = main(
        [
            "prompts",
            "render",
            str(ROOT / "prompts" / "demo.yaml"),
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--cache-dir",
            str(demo_cache_dir),
        ]
    )
    assert code == 0
    assert "9 already cached, 0 rendered" in capsys.readouterr().out
    assert len(list(demo_cache_dir.rglob("*.wav"))) == 9
