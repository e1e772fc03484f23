"""Text normalisation in the IVR: scripts and lines read their sentences through gateway/text,
the engine and the prompt cache get the words, a value that is not of its type is read as
written (logged once per call), and a lexicon edit re-renders exactly what it touches.

No model: speech is silence (the script tester's speaker) or a counting stand-in."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.call.events import CallerHungUp
from gateway.call.session import Call, Utterance
from gateway.cli import main
from gateway.clock import VirtualClock
from gateway.greeter import greeter
from gateway.ivr.cache import PromptCache
from gateway.ivr.cases import InstantTransport, SilentSpeaker, load_cases, run_case
from gateway.ivr.lines import load_lines
from gateway.ivr.prompts import ResolvedVoice, render_missing, renders
from gateway.ivr.runner import IvrRunner, RunnerContext
from gateway.ivr.script import Script, ScriptError, parse_script
from gateway.speech import Speaker, SpeechVoice
from gateway.text import LexiconEntry, Reader, Reading
from gateway.tts.engine import SpeechRequest
from tests.support.paths import REPO

ROOT = REPO

SCRIPT = """\
name: acme
voice: {speaker: ryan, language: English}
start: hello
reading: {currency: USD, date_order: mdy, region: US}
variables: {due_date: ""}        # what the backend answers (each test's call gives it)
prompts:
  hello: Thank you for calling Acme.
  street: Visit us at 12 Main St. Springfield.
  hours: We open at {'9:00':time} and close at {'17:30':time}.
  plain: Goodbye.
  due: Your balance of {balance:currency} is due on {due_date:date}.
nodes:
  hello:
    say: [hello, street, hours]
    next: lookup
  lookup:
    set: {balance: "456.10"}
    say: [due, due]
    next: bye
  bye:
    say: plain
    hangup: true
"""


@pytest.fixture(scope="module")
def script() -> Script:
    return parse_script(SCRIPT, "acme.yaml")


class _Counting(SilentSpeaker):
    """Silence, but remembers each sentence it was asked to speak live."""

    def __init__(self, voice: SpeechVoice | None = None, said: list[str] | None = None) -> None:
        super().__init__(voice)
        self.said: list[str] = said if said is not None else []

    def with_voice(self, voice: SpeechVoice) -> Speaker:
        return _Counting(voice, self.said)

    def say(self, call: Call, text: str, **kwargs: Any) -> Utterance:
        self.said.append(text)
        return super().say(call, text, **kwargs)


async def _call(script: Script, cache: PromptCache, reader: Reader | None = None,
                ) -> tuple[IvrRunner, list[str]]:
    """One call through ``script`` (it speaks and hangs up by itself); what was said live."""
    clock = VirtualClock()
    transport = InstantTransport()
    call = Call("CA" + "7" * 32, transport, clock, transport_name="test")
    transport.call = call
    call.start()
    speaker = _Counting()
    context = RunnerContext(script=script, cache=cache, model_fingerprint="fp",
                            voice_identity="speaker:ryan", speaker=speaker, audio="a",
                            clock=clock, reader=reader)
    # A backend that has no due date for this account.
    runner = IvrRunner(call, context, {"caller": "+15550001111", "called": "+15550002222",
                                       "call_id": call.call_id, "due_date": "N/A"})
    try:
        await asyncio.wait_for(runner.run(), 10)
    finally:
        await call.close()
    return runner, speaker.said


def _prerender(script: Script, cache: PromptCache, reader: Reader) -> list[str]:
    """Put every static prompt of ``script`` read by ``reader`` into ``cache``; its words."""
    texts = []
    for text, voice, resolved in renders(script, ResolvedVoice("speaker:ryan"), reader=reader):
        key = RunnerContext(script=script, cache=cache, model_fingerprint="fp",
                            voice_identity=resolved.identity, speaker=SilentSpeaker(),
                            audio="a").key(text, voice)
        cache.put(key, np.zeros(160, np.int16), to_disk=False)
        texts.append(text)
    return texts


# --- the runner -------------------------------------------------------------------------------


async def test_the_engine_gets_the_words_and_the_trace_has_both(script: Script) -> None:
    reader = Reader("English", Reading(free_text="numbers"),
                    [LexiconEntry(pattern=r"\bSt\.(?= [A-Z])", say="Street")])
    runner, said = await _call(script, PromptCache(None), reader)
    heard = runner.trace.heard
    assert [h.text for h in heard[:3]] == [
        "Thank you for calling Acme.", "Visit us at 12 Main St. Springfield.",
        "We open at 9:00 and close at 17:30."]
    assert [h.words for h in heard[:3]] == [
        "Thank you for calling Acme.", "Visit us at twelve Main Street Springfield.",
        "We open at nine AM and close at five thirty PM."]
    # Nothing was cached: every sentence went to the speaker, as words.
    assert said == [h.words for h in heard]
    record = runner.trace.to_record()["heard"][1]
    assert record["words"] == "Visit us at twelve Main Street Springfield."


async def test_a_value_not_of_its_type_is_read_as_written_and_logged_once_per_call(
    script: Script, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.ivr.runner")
    runner, _ = await _call(script, PromptCache(None))
    due = [h for h in runner.trace.heard if h.node == "lookup"]
    # Said twice, whole: the amount as money, the date the backend did not have as written.
    assert [h.words for h in due] == [
        "Your balance of four hundred and fifty-six dollars, ten cents is due on N/A."] * 2
    assert runner.trace.outcome == "hangup"
    warnings = [r.getMessage() for r in caplog.records if "read as written" in r.getMessage()]
    assert warnings == [f"call {runner.call.call_id}: {{due_date:date}}: the value (written "
                        "'A/A') is not a date; read as written"]
    # A second call logs its own.
    caplog.clear()
    await _call(script, PromptCache(None))
    assert sum("read as written" in r.getMessage() for r in caplog.records) == 1


# --- the prompt cache -------------------------------------------------------------------------


async def test_the_cache_keys_on_the_words_the_engine_receives(script: Script) -> None:
    reader = script.reader()
    cache = PromptCache(None)
    texts = _prerender(script, cache, reader)
    # The typed literals are fixed: their words are the key, not the template.
    assert "We open at nine AM and close at five thirty PM." in texts
    assert not any("{" in text for text in texts)
    _, said = await _call(script, cache, reader)
    # Only the sentence with variables was rendered live; every fixed one came from the cache.
    assert said == ["Your balance of four hundred and fifty-six dollars, ten cents is due on "
                    "N/A."] * 2


async def test_a_lexicon_edit_re_renders_exactly_the_prompts_it_touches(script: Script) -> None:
    cache = PromptCache(None)
    _prerender(script, cache, script.reader())
    touches_one = Reader("English", Reading(currency="USD", date_order="mdy", region="US"),
                         [LexiconEntry(pattern=r"\bSt\.(?= [A-Z])", say="Street")])
    _, said = await _call(script, cache, touches_one)
    assert said[:1] == ["Visit us at 12 Main Street Springfield."]
    assert len(said) == 3  # that prompt, and the live sentence twice
    touches_none = Reader("English", Reading(currency="USD", date_order="mdy", region="US"),
                          [LexiconEntry(text="Globex", say="Glow-bex")])
    _, said = await _call(script, cache, touches_none)
    assert len(said) == 2  # the live sentence only: no prompt's words changed


class _FakeEngine:
    render_settings = "fake"


class _FakeSpeech:
    """The part of the speech service render_missing uses; counts what it renders."""

    capacity = 2

    def __init__(self) -> None:
        self.engines = [_FakeEngine()]
        self.rendered: list[str] = []

    def clock(self) -> float:
        return 0.0

    async def stream(self, request: SpeechRequest,
                     turn_started_at: float | None = None) -> AsyncIterator[np.ndarray]:
        self.rendered.append(request.text)
        yield np.zeros(2400, np.float32)


async def test_start_up_and_reload_render_by_the_words(script: Script) -> None:
    cache = PromptCache(None)
    speech = _FakeSpeech()
    voice = ResolvedVoice("speaker:ryan")
    hits, rendered = await render_missing(script, cache, speech, "fp", voice)  # type: ignore[arg-type]
    assert (hits, rendered) == (0, 4)
    assert "We open at nine AM and close at five thirty PM." in speech.rendered
    speech.rendered.clear()
    edited = Reader("English", Reading(currency="USD", date_order="mdy", region="US"),
                    [LexiconEntry(text="Acme", say="Ack-mee")])
    hits, rendered = await render_missing(script, cache, speech, "fp", voice,  # type: ignore[arg-type]
                                          reader=edited)
    assert (hits, rendered) == (3, 1)
    assert speech.rendered == ["Thank you for calling Ack-mee."]


# --- lines ------------------------------------------------------------------------------------


def _lines(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "acme.yaml").write_text(SCRIPT)
    path = tmp_path / "lines.yaml"
    path.write_text("default: main\nlines:\n  main:\n    script: acme.yaml\n"
                    "    numbers: ['+15550002222']\n" + extra)
    return path


def test_a_line_reads_its_script_with_its_own_reading_and_lexicon_first(tmp_path: Path) -> None:
    path = _lines(tmp_path, "    reading: {free_text: numbers, currency: cad}\n"
                            "    lexicon:\n"
                            "      - {text: Acme, say: Ack-mee}\n"
                            "      - {pattern: 'Ack-(\\w+)', say: 'Ak-\\1', ignore_case: true}\n")
    line = load_lines(path).lines["main"]
    reader = line.reader()
    assert reader.conventions.currency == "CAD" and reader.conventions.date_order == "mdy"
    assert reader.free_text == "numbers"
    assert reader.free("Acme at 12 Main St.", "English") == "Ak-mee at twelve Main St."
    assert load_lines(path).lines["main"].reader() == reader


def test_a_lines_file_lexicon_error_is_located_in_the_lines_file(tmp_path: Path) -> None:
    path = _lines(tmp_path, "    reading: {region: ZZ}\n")
    with pytest.raises(ScriptError) as info:
        load_lines(path)
    assert [str(d) for d in info.value.diagnostics] == [
        f"{path}:6:23: lines.main.reading.region: 'ZZ' is not a region: an ISO 3166 country "
        "code (US, GB, ES, MX)"]
    path = _lines(tmp_path, "    lexicon:\n      - {pattern: 'a(b', say: x}\n"
                            "      - {text: x, say: y, language: Elvish}\n")
    with pytest.raises(ScriptError) as info:
        load_lines(path)
    assert [str(d) for d in info.value.diagnostics] == [
        f"{path}:7:21: lexicon: pattern does not compile: missing ), unterminated subpattern",
        f"{path}:8:37: language 'Elvish' is not supported (one of: Auto, Chinese, English, "
        "French, German, Italian, Japanese, Korean, Portuguese, Russian, Spanish)"]


def test_a_lines_reading_that_makes_a_fixed_value_unreadable_is_refused(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(
        "name: s\nvoice: {speaker: ryan}\nstart: a\nnodes:\n"
        "  a: {say: \"Due {'12/15/2026':date}.\", hangup: true}\n")
    path = tmp_path / "lines.yaml"
    path.write_text("default: m\nlines:\n  m:\n    script: s.yaml\n"
                    "    reading: {date_order: dmy}\n")
    with pytest.raises(ScriptError) as info:
        load_lines(path)
    assert [str(d) for d in info.value.diagnostics] == [
        f"{path}:5:14: line 'm': with this reading, {tmp_path / 's.yaml'} reads "
        "{'12/15/2026':date} as written: it is not a date (written '99/99/9999')"]
    path.write_text("default: m\nlines:\n  m:\n    script: s.yaml\n"
                    "    reading: {date_order: mdy}\n")
    assert load_lines(path).lines["m"].reader().conventions.date_order == "mdy"


# --- script tests -----------------------------------------------------------------------------


CASES = """\
cases:
  - name: hears the words
    hears: [hello, "Visit us at 12 Main St. Springfield.", hours, due, due, plain]
    says: [hello, street, "We open at 9:00 and close at 17:30.", due, due, Goodbye.]
  - name: a wrong expectation
    hears: [hello, street, "We open at 9:00 and close at 17:30."]
"""


async def test_cases_check_the_words_a_caller_hears(script: Script, tmp_path: Path) -> None:
    path = tmp_path / "acme.cases.yaml"
    path.write_text(CASES)
    cases = load_cases(path, script)
    good = await run_case(script, cases.cases[0])
    assert good.passed, good.failures
    bad = await run_case(script, cases.cases[1])
    assert bad.failures == [
        "the words of sentence 3 (at 'hello', English): expected \"We open at 9:00 and close at "
        "17:30.\", heard \"We open at nine AM and close at five thirty PM.\""]
    # With a line that has a lexicon, prompt names stand for that line's words.
    lexicon = Reader("English", lexicon=[LexiconEntry(text="Acme", say="Ack-mee")])
    moved = await run_case(script, cases.cases[0], reader=lexicon)
    assert moved.passed, moved.failures
    assert moved.trace.heard[0].words == "Thank you for calling Ack-mee."


def test_script_test_takes_a_line_of_a_lines_file(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = _lines(tmp_path, "    lexicon: [{text: Acme, say: Ack-mee}]\n")
    cases = tmp_path / "acme.cases.yaml"
    cases.write_text("cases:\n  - name: the line's words\n"
                     "    hears: [Thank you for calling Ack-mee.]\n    path: [hello, lookup, bye]"
                     "\n")
    assert main(["script", "test", str(path), str(cases), "--line", "main"]) == 1
    out = capsys.readouterr().out
    # The words matched; only the (deliberately short) list of sentences did not.
    assert "the words of sentence 2: said \"Visit us" in out
    assert "sentence 1" not in out
    assert main(["script", "test", str(path), str(cases), "--line", "nope"]) == 1
    assert "has no line 'nope'" in capsys.readouterr().err


def test_say_shows_the_words_it_speaks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["say", 'Your balance is {"456.10":currency}, due 12/15/2026.', "-o",
                 "unused.wav", "--text-only"]) == 0
    assert capsys.readouterr().out == (
        "says: Your balance is four hundred and fifty-six dollars, ten cents, due December "
        "fifteenth, twenty twenty-six.\n")
    assert main(["say", "Press 1 {not a slot}.", "-o", "x.wav", "--text-only", "--free-text",
                 "off"]) == 0
    assert capsys.readouterr().out == "says: Press 1 {not a slot}.\n"
    assert main(["say", "Oprima 8.", "-o", "x.wav", "--text-only", "--language",
                 "Spanish"]) == 0
    assert capsys.readouterr().out == "says: Oprima ocho.\n"


# --- the greeter ------------------------------------------------------------------------------


async def test_the_greeter_reads_its_free_text() -> None:
    clock = VirtualClock()
    transport = InstantTransport()
    call = Call("CA" + "8" * 32, transport, clock, transport_name="test")
    transport.call = call
    call.start()
    speaker = _Counting()
    task = asyncio.create_task(greeter(call, speaker, "Call us on (555) 010-0199.",
                                       Reader("English", Reading(free_text="full"))))
    for _ in range(5):
        await asyncio.sleep(0)
    call.dtmf("5")
    call.dtmf("#")
    for _ in range(20):
        await asyncio.sleep(0)
    call.deliver(CallerHungUp(at=clock.now()))
    await asyncio.wait_for(task, 5)
    await call.close()
    assert speaker.said == ["Call us on five five five, zero one zero, zero one nine nine.",
                            "You pressed five.", "You pressed pound, the # key."]
