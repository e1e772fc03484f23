"""tools/renames_35.py: issue 35's renames are applied everywhere, and the tool renames the
names it means and nothing else (a TwiML verb in a string, another module's class of the same
name, a deprecated alias kept on purpose)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.paths import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "tools"))

import renames_35 as tool  # noqa: E402


def test_no_old_name_is_left_in_the_repository() -> None:
    """Fails after a merge that brought old names back: run ``python tools/renames_35.py``."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "renames_35.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _step(name: str, path: str, text: str) -> str:
    step = next(s for s in tool.STEPS if s.name == name)
    edit = step.python if path.endswith(".py") else step.text
    assert edit is not None
    return tool.realign(text, edit(path, text)) if path.endswith(".py") else edit(path, text)


def test_events_rename_python_names_and_sphinx_references_but_not_twiml() -> None:
    source = '''"""Ends with :class:`~gateway.call.events.Hangup`, or ``<Hangup/>`` in TwiML."""
from gateway.call.events import HangUp, Hangup

__all__ = ["HangUp", "Hangup"]


def f(call, root):
    assert root.find("Hangup") is not None and [c.tag for c in root] == ["Say", "Hangup"]
    return isinstance(call.event, Hangup) and call.outcome == HangUp()
'''
    out = _step("events", "gateway/x.py", source)
    assert ":class:`~gateway.call.events.CallerHungUp`" in out and "``<Hangup/>``" in out
    assert "import EndCall, CallerHungUp" in out
    assert '__all__ = ["EndCall", "CallerHungUp"]' in out
    assert 'root.find("Hangup")' in out and '["Say", "Hangup"]' in out
    assert "isinstance(call.event, CallerHungUp) and call.outcome == EndCall()" in out
    assert _step("events", "gateway/x.py", out) == out  # idempotent


def test_voice_is_renamed_by_the_module_it_comes_from() -> None:
    speech = "from gateway.speech import Speaker, Voice\n\nv: Voice = Voice()\n"
    script = "from gateway.ivr.script import Voice as ScriptVoice\n\nv: ScriptVoice\n"
    other = "from somewhere import Voice\n\nv: Voice = Voice()\n"
    assert _step("voices", "gateway/a.py", speech) == (
        "from gateway.speech import Speaker, SpeechVoice\n\nv: SpeechVoice = SpeechVoice()\n")
    assert _step("voices", "gateway/b.py", script) == (
        "from gateway.ivr.script import ScriptVoice\n\nv: ScriptVoice\n")
    assert _step("voices", "gateway/c.py", other) == other


def test_a_local_session_is_renamed_only_where_it_holds_a_speech_listener() -> None:
    source = '''def collect(self, grammar):
    session = self.ctx.recognizer.session(grammar, encoding="pcmu",
                                          max_speech_s=5)
    self.call.listen(session)


def bot(self):
    session = BotSession(self.call)
    return session.run()
'''
    out = _step("speech-listener", "gateway/x.py", source)
    assert '''    listener = self.ctx.recognizer.listener(grammar, encoding="pcmu",
                                            max_speech_s=5)
    self.call.listen(listener)''' in out
    assert "    session = BotSession(self.call)\n    return session.run()" in out


def test_cli_uses_move_to_script_and_kept_lines_stay() -> None:
    source = '''main(["prompts", "validate", path])
main(["prompts", "validate", path])  # renames_35: keep
main(
    [
        "prompts",
        "render",
    ]
)
pos("prompts", prompt_name)
'''
    out = _step("script-cli", "tests/x.py", source)
    assert out.splitlines()[0] == 'main(["script", "validate", path])'
    assert out.splitlines()[1] == 'main(["prompts", "validate", path])  # renames_35: keep'
    assert '        "script",\n        "render",' in out
    assert 'pos("prompts", prompt_name)' in out  # a script's prompts: section, not the verb
    docs = "Run `gateway prompts validate x.yaml` or ./run.sh prompts test a b; prompts/ stays.\n"
    assert _step("script-cli", "README.md", docs) == (
        "Run `gateway script validate x.yaml` or ./run.sh script test a b; prompts/ stays.\n")
