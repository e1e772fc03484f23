"""Bot nodes in scripts (gateway.ivr.script.Bot): ConversationRelay's option names and values
accepted, the greeting rendered ahead like any prompt, and every mistake a located message."""

from __future__ import annotations

import pytest

from gateway.ivr.script import ScriptError, parse_script

HEAD = """name: Bot
voice: {speaker: ryan, language: English}
start: agent
nodes:
  agent:
    bot:
"""
TAIL = """    next: done
  done:
    say: Goodbye.
    hangup: true
  sorry:
    say: Sorry.
    hangup: true
"""


def _script(bot: str, *, error: bool = True, tail: str = TAIL, extra: str = "") -> str:
    text = HEAD + "".join(f"      {line}\n" for line in bot.strip().splitlines()) + tail
    text = text.replace("start: agent\n", "start: agent\n" + extra)
    return text.replace("start: agent\n", "start: agent\nerror: sorry\n") if error else text


def _errors(text: str) -> list[str]:
    with pytest.raises(ScriptError) as info:
        parse_script(text, "t.yaml")
    return [str(d) for d in info.value.diagnostics]


def test_conversation_relays_names_and_values_are_accepted() -> None:
    script = parse_script(_script("""
url: wss://bot.example.com/relay
welcomeGreeting: Hi, how can I help?
welcomeGreetingInterruptible: dtmf
interruptible: false
preemptible: true
dtmfDetection: true
hints: "billing, Acme Gold , agent"
language: es-MX
prompts: [hold]
sets: [reasonCode]
parameters: {caller: "{caller}"}
""", extra="prompts:\n  hold: Please hold.\ntranslations:\n  Spanish:\n    hold: Espere.\n"),
                          "t.yaml")
    bot = script.nodes["agent"].bot
    assert bot is not None
    assert (bot.welcome_greeting, bot.welcome_greeting_interruptible) == (
        "Hi, how can I help?", "dtmf")
    assert bot.interruptible == "none" and bot.preemptible and bot.dtmf_detection
    assert bot.hints == ["billing", "Acme Gold", "agent"]
    # The bot's language is the call's from this node on: its greeting is rendered in it.
    assert script.voice_states()["agent"][0].language == "Spanish"
    assert ("Hi, how can I help?", script.voice_states()["agent"][0]) in script.static_renders()
    assert ("Espere.", script.voice_states()["agent"][0]) in script.static_renders()
    assert script.bot_nodes() == ["agent"]


def test_the_url_is_wss_or_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOT_HOST", "bot.internal")
    assert parse_script(_script("url: wss://${BOT_HOST}/r"), "t.yaml").nodes["agent"].bot
    for local in ("ws://localhost:8080/r", "ws://127.0.0.1/r", "ws://[::1]:9/r"):
        assert parse_script(_script(f"url: {local}"), "t.yaml").nodes["agent"].bot
    [error] = _errors(_script("url: ws://bot.example.com/relay"))
    assert error == ("t.yaml:8:12: nodes.agent.bot.url: 'ws://bot.example.com/relay': ws:// "
                     "carries the caller's words in clear text; use wss:// (ws:// is for a bot "
                     "on this machine: localhost, 127.0.0.1)")
    [error] = _errors(_script("url: https://bot.example.com/relay"))
    assert "is not a wss:// URL" in error


def test_mistakes_are_located_and_explained() -> None:
    errors = _errors(_script("""
url: wss://bot.example.com/r
interruptible: sometimes
language: tlh
prompts: [music]
sets: [caller]
parameters: {who: "{nobody}"}
ttsProvider: ElevenLabs
""", error=False))
    text = "\n".join(errors)
    assert "nodes.agent.bot.interruptible: Input should be 'none', 'dtmf', 'speech' or 'any'" \
        in text
    assert "unknown field 'ttsProvider'" in text
    # (Schema errors stop the load before the logic is checked; those come next.)
    errors = _errors(_script("""
url: wss://bot.example.com/r
language: tlh
prompts: [music]
sets: [caller]
parameters: {who: "{nobody}"}
""", error=False))
    assert errors == [
        "t.yaml:7:7: node 'agent' hands the call to a bot with nowhere to go if it fails "
        "(unreachable, silent, gone): add 'on_error: <node>'",
        "t.yaml:8:17: language 'tlh' is not one the voice speaks (a BCP 47 tag such as en-US, "
        "or one of: Auto, Chinese, English, French, German, Italian, Japanese, Korean, "
        "Portuguese, Russian, Spanish)",
        "t.yaml:9:17: node 'agent' lets its bot play 'music', which is not a prompt "
        "(prompts: none)",
        "t.yaml:10:13: node 'agent' lets its bot set 'caller', which comes from the call",
        "t.yaml:11:25: variable '{nobody}' is used but nothing sets it (a gather's 'store', "
        "a webhook's 'sets', a node's 'set', or 'variables')",
        "t.yaml:16:3: node 'sorry' is unreachable: nothing leads to it from 'agent'",
    ]


def test_a_bot_node_needs_somewhere_to_go_when_the_bot_ends() -> None:
    [error] = _errors(_script("url: wss://bot.example.com/r", tail="""  done:
    say: Goodbye.
    hangup: true
  sorry:
    say: Sorry.
    hangup: true
"""))
    assert "a bot node needs 'next' (where the call goes when the bot ends)" in error
