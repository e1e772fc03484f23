"""IVR scripts: the demo is valid; every error kind has a golden message with its position."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.ivr.script import ScriptError, load_script, parse_script, render, template_variables
from tests.support.paths import GOLDEN as GOLDEN_ROOT
from tests.support.paths import REPO

ROOT = REPO
GOLDEN = GOLDEN_ROOT / "scripts"


def test_the_demo_script_is_valid() -> None:
    script = load_script(ROOT / "prompts" / "demo.yaml")
    assert script.start == "welcome" and script.voice.speaker == "ryan"
    statics = script.static_sentences()
    assert "Thank you for calling Acme Energy." in statics
    assert not any("{" in text for text in statics)  # the balance sentence is live
    assert script.languages_spoken() == ["English", "Spanish"]
    spanish = {text for text, voice in script.static_renders() if voice.language == "Spanish"}
    assert "Para español, oprima 8." in spanish
    assert script.sentence("main_menu", "Spanish").startswith("Para el saldo de su cuenta")


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
        "'next', 'gather', 'webhook', 'bot', 'transfer', 'branch', 'hours' or 'hangup: true'"
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
    assert main(["script", "validate", str(ROOT / "prompts" / "demo.yaml")]) == 0
    assert "ok (12 nodes, 20 cached sentences)" in capsys.readouterr().out
    assert main(["script", "validate", str(GOLDEN / "duplicates.yaml")]) == 1
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


def test_script_render_is_resumable(
    demo_cache_dir: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The session fixture rendered every static prompt once; a second run renders none."""
    code = main(
        [
            "script",
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
    # 10 English sentences, their 9 Spanish translations and the Spanish offer.
    assert "20 already cached, 0 rendered" in capsys.readouterr().out
    assert len(list(demo_cache_dir.rglob("*.wav"))) == 20


def test_a_branch_ends_with_else_and_else_comes_last() -> None:
    nodes = "nodes:\n  a:\n    branch:\n{cases}  b: {{hangup: true}}\n"
    no_else = ("t.yaml:6:5: node 'a' branches without '- else: NODE' as its last case (where "
               "the call goes when no test holds)")
    assert _errors(HEAD + nodes.format(cases="      - if: caller\n        goto: b\n")) == [no_else]
    errors = _errors(HEAD + nodes.format(cases="      - else: b\n      - if: caller\n"
                                               "        goto: b\n"))
    assert errors == [no_else, "t.yaml:7:15: node 'a' case 1: 'else' must be the last case (the "
                               "cases after it could never be chosen)"]
    errors = _errors(HEAD + nodes.format(cases="      - if: caller\n      - else: b\n"))
    assert errors == ["t.yaml:7:9: nodes.a.branch.0: a case is '- if: CONDITION' with "
                      "'goto: NODE' (or '- else: NODE')"]
    errors = _errors(HEAD + nodes.format(cases="      - {else: b, goto: b}\n"))
    assert errors == ["t.yaml:7:9: nodes.a.branch.0: 'else' stands alone: '- else: NODE'"]
    errors = _errors(HEAD + "nodes:\n  a:\n    branch: [{else: b}]\n    next: b\n"
                     "  b: {hangup: true}\n")
    assert errors == ["t.yaml:6:5: nodes.a: 'next' has no effect after 'branch'"]


def test_a_case_after_one_that_always_holds_is_unreachable_and_so_is_its_target() -> None:
    text = HEAD + (
        "nodes:\n  a:\n    branch:\n"
        "      - if: '\"x\" == \"x\"'\n        goto: b\n"
        "      - if: caller\n        goto: c\n"
        "      - else: c\n"
        "  b: {hangup: true}\n  c: {hangup: true}\n"
    )
    assert _errors(text) == [
        "t.yaml:9:13: node 'a' case 2 is unreachable: case 1 always holds, so nothing after "
        "it is chosen",
        "t.yaml:11:15: node 'a' case 3 is unreachable: case 1 always holds, so nothing after "
        "it is chosen",
        "t.yaml:13:3: node 'c' is unreachable: nothing leads to it from 'a'",
    ]


def test_conditions_may_test_what_the_call_a_gather_or_a_webhook_sets() -> None:
    script = parse_script(HEAD + (
        "variables: {tier: basic}\n"
        "nodes:\n"
        "  a:\n    gather: {prompt: 'Enter it.', digits: 4, store: pin, branch: {default: w},"
        " fallback: e}\n"
        "  w:\n    webhook: {url: 'http://backend/x', sets: [status], on_error: e}\n"
        "    next: r\n"
        "  r:\n    branch:\n"
        "      - if: caller == \"+15550001111\" and pin == 1234\n        goto: e\n"
        "      - if: status in [\"a\", \"b\"] or tier != \"basic\" or call_id\n"
        "        goto: e\n"
        "      - else: e\n"
        "  e: {hangup: true}\n"
    ), "t.yaml")
    assert script.successors("r") == ["e", "e", "e"]


def test_the_gateway_refuses_a_script_in_a_language_its_model_does_not_speak(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Scripts validate against the published languages; the loaded model's own list is
    checked before the gateway takes calls."""
    from gateway.app import default_engine_factory
    from tests.support.servers import serve

    def english_only(settings):  # type: ignore[no-untyped-def]
        engines = default_engine_factory(settings)
        for engine in engines:
            engine.shared.languages = ("English",)
        return engines

    settings = {"model": str(tiny_model_dir), "script": str(ROOT / "prompts" / "demo.yaml"),
                "cache_dir": str(tmp_path / "cache"), "render_lazily": True}
    with pytest.raises(RuntimeError) as info, serve(settings, english_only):
        pass
    assert "preparing the IVR script failed: the script speaks Spanish, which" in str(info.value)
    assert "does not (it speaks English)" in str(info.value)


# --- speech gathers -----------------------------------------------------------------------

SPEECH_HEAD = "name: t\nvoice: {speaker: ryan, language: English}\nstart: menu\nerror: bye\n"
SPEECH_TAIL = "  bye: {say: Bye., hangup: true}\n  agent: {say: Hold on., hangup: true}\n"


def test_speech_phrases_become_a_grammar_and_edges() -> None:
    text = SPEECH_HEAD + (
        "nodes:\n"
        "  menu:\n"
        "    gather:\n"
        "      prompt: Say agent or press 2.\n"
        "      digits: 1\n"
        "      branch: {'2': agent}\n"
        "      speech: {agent: [Agent, 'Customer-Service!'], bye: goodbye}\n"
    ) + SPEECH_TAIL
    script = parse_script(text, "t.yaml")
    grammar = script.speech_grammar("menu")
    assert grammar is not None and grammar.language == "en"
    assert dict(grammar.phrases) == {("agent",): ("agent", "Agent"),
                                     ("customer", "service"): ("agent", "Customer-Service!"),
                                     ("goodbye",): ("bye", "goodbye")}
    assert script.speech_grammar("menu") is grammar  # built once
    edges = [(e.target, e.kind, e.label) for e in script.nodes["menu"].edges()]
    assert ("agent", "speech", '"Agent" / "Customer-Service!"') in edges
    assert ("bye", "speech", '"goodbye"') in edges
    assert script.speech_gathers() == ["menu"]
    # A node reached only by speech is reachable.
    assert "bye" in script.successors("menu")


def test_speech_digits_fill_the_store_and_need_a_length() -> None:
    gather = ("nodes:\n  menu:\n    gather:\n      prompt: Say your number.\n"
              "      terminator: '#'\n      speech: digits\n      branch: {default: agent}\n")
    assert _errors(SPEECH_HEAD + gather + SPEECH_TAIL) == [
        "t.yaml:8:7: nodes.menu.gather: 'speech: digits' needs 'digits': how many digits the "
        "caller says"]
    fixed = gather.replace("terminator: '#'", "digits: 6")
    script = parse_script(SPEECH_HEAD + fixed + SPEECH_TAIL, "t.yaml")
    grammar = script.speech_grammar("menu")
    assert grammar is not None and grammar.digits == 6 and not grammar.phrases


def test_speech_shape_errors() -> None:
    base = SPEECH_HEAD + ("nodes:\n  menu:\n    gather:\n      prompt: Say it.\n"
                          "      digits: 1\n      branch: {'2': agent}\n")
    assert _errors(base + "      speech: [agent]\n" + SPEECH_TAIL) == [
        "t.yaml:11:15: nodes.menu.gather.speech: 'speech' is the phrases that choose each node "
        "({agent: [agent, representative]}) or 'digits' (the digit string said aloud)"]
    assert _errors(base + "      speech: {agent: []}\n" + SPEECH_TAIL) == [
        "t.yaml:11:15: nodes.menu.gather.speech: speech for 'agent' must be a phrase or a list "
        "of phrases"]
    assert _errors(base + "      speech_language: English\n" + SPEECH_TAIL) == [
        "t.yaml:8:7: nodes.menu.gather: 'speech_language' without 'speech' means nothing"]


def test_a_speech_gather_is_checked_against_the_configured_recognisers_vocabulary() -> None:
    from gateway.asr.base import UnknownWord

    class Klingon:
        languages = frozenset({"tlh"})

        def unknown_words(self, phrases: object) -> list[UnknownWord]:
            return [UnknownWord("qapla", "qapla", 0)]

    text = SPEECH_HEAD.replace("English", "Spanish") + (
        "nodes:\n  menu:\n    gather:\n      prompt: Diga agente.\n      digits: 1\n"
        "      speech: {agent: agente}\n"
    ) + SPEECH_TAIL
    # The built-in recogniser knows English only: a Spanish speech gather is an error...
    assert _errors(text) == [
        "t.yaml:10:7: node 'menu' listens for speech in Spanish, which the speech recogniser "
        "does not know (it knows English): a speech gather in Spanish needs a recogniser "
        "configured for it"]
    # ...unless the phrases are said in English (the Spanish menu then takes keys only)...
    english = text.replace("speech: {agent: agente}", "speech: {agent: agent}\n"
                           "      speech_language: English")
    assert parse_script(english, "t.yaml").speech_grammar("menu") is not None
    # ...and another recogniser's own languages and dictionary decide.
    errors = _errors(text.replace("Spanish", "Klingon").replace("language: Klingon",
                                                                 "language: English"),
                     vocabulary=Klingon())
    assert errors == ["t.yaml:10:7: node 'menu' listens for speech in English, which the speech "
                      "recogniser does not know (it knows tlh): a speech gather in English needs "
                      "a recogniser configured for it"]


@pytest.mark.parametrize(("old", "new"), [("    next: menu\n", "    next: men\n"),
                                          ("start: welcome\n", "start: welcom\n"),
                                          ("        goto: collections\n",
                                           "        goto: collection\n")])
def test_a_one_character_typo_in_a_node_name_is_one_error(old: str, new: str) -> None:
    """Not one per node behind it: those are unreachable only because of the typo (and their
    translations never said), and the fix of the one error removes them all."""
    text = (ROOT / "prompts" / "demo.yaml").read_text()
    assert old in text
    errors = _errors(text.replace(old, new, 1))
    assert len(errors) == 1, "\n".join(errors)
    assert "which is not a node" in errors[0]
