"""Speech gathers in the IVR runner, on a virtual clock with a recogniser the test scripts.

No model, no audio: prompts play as 20 ms of silence (the script tester's speaker) and the
caller's turn is driven the way the call drives it (the listening session told of speech start
and pause, a SpeechPaused event). The recogniser answers what each test says, or fails. The
real recogniser over real sockets is in tests/test_speech_e2e.py; the flows on the demo script
in prompts/demo.cases.yaml.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import numpy as np
import pytest
from clocks import VirtualClock

from gateway.asr.base import Encoding, MatchStatus, RecognitionResult
from gateway.asr.grammar import SpeechGrammar
from gateway.asr.pool import SpeechSession
from gateway.call import Call, SpeechPaused, SpeechStarted
from gateway.errors import RecognizerError
from gateway.ivr.cache import PromptCache
from gateway.ivr.cases import InstantTransport, SilentSpeaker
from gateway.ivr.runner import IvrRunner, RunnerContext
from gateway.ivr.script import Script, parse_script
from gateway.metrics import Metrics

SCRIPT = """
name: speech test
voice: {speaker: ryan, language: English}
start: menu
error: agent
prompts:
  menu: Say billing or agent, or press 1 or 2.
  sorry: Sorry.
  pin: Say your PIN.
translations:
  Spanish: {menu: Diga o marque., sorry: Perdón., pin: Su PIN.}
nodes:
  menu:
    gather:
      prompt: menu
      digits: 1
      retries: 1
      retry_prompt: sorry
      branch: {"1": billing, "2": agent, "8": spanish}
      speech: {billing: [billing, pay my bill], agent: [agent, representative]}
      fallback: agent
  spanish:
    set: {language: Spanish}
    next: menu
  account:
    gather:
      prompt: pin
      digits: 4
      private: true
      speech: digits
      branch: {default: billing}
      fallback: agent
  billing:
    say: {text: Billing., language: English}
    next: account
  agent:
    say: {text: Hold on., language: English}
    transfer: "+15555550100"
"""
MENU = "Say billing or agent, or press 1 or 2."

class Transport(InstantTransport):
    """The script tester's transport; an abort is a test failure."""

    def abort(self, reason: str) -> None:
        raise AssertionError(reason)


class Recognizer:
    """Answers each turn with the next scripted result (or raises it)."""

    running = True

    def __init__(self) -> None:
        self.results: list[RecognitionResult | Exception] = []
        self.turns = 0

    def session(self, grammar: SpeechGrammar, *, encoding: Encoding = "pcmu",
                max_speech_s: float = 10.0) -> SpeechSession:
        return SpeechSession(self._recognize, grammar, encoding=encoding,
                             max_speech_s=max_speech_s)

    async def _recognize(self, pcm: np.ndarray, grammar: SpeechGrammar) -> RecognitionResult:
        self.turns += 1
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


def said(branch: str | None = None, digits: str | None = None) -> RecognitionResult:
    return RecognitionResult(MatchStatus.MATCH, branch=branch, phrase=branch, digits=digits,
                             transcript=branch or " ".join(digits or ""), confidence=1.0,
                             audio_s=1.2)


class Harness:
    def __init__(self, script: Script) -> None:
        self.clock = VirtualClock()
        self.transport = Transport()
        self.call = Call("CA" + "5" * 32, self.transport, self.clock, transport_name="twilio")
        self.transport.call = self.call
        self.call.start()
        self.recognizer = Recognizer()
        self.metrics = Metrics()
        self.context = RunnerContext(
            script=script, cache=PromptCache(None), model_fingerprint="test",
            voice_identity="test", speaker=SilentSpeaker(), audio="silence", clock=self.clock,
            recognizer=self.recognizer, metrics=self.metrics)
        self.runner = IvrRunner(self.call, self.context, {"call_id": self.call.call_id})
        self.task = asyncio.create_task(self.runner.run())
        self._waits = 0

    async def waiting(self) -> None:
        """Until the runner waits on the clock again (a gather's timeout, or its turn)."""
        waiter = asyncio.ensure_future(self.clock.next_wait(self._waits))
        done, _ = await asyncio.wait({waiter, self.task}, timeout=10,
                                     return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        assert waiter in done, f"not waiting; path {self.runner.path}"
        self._waits = self.clock.waits

    @property
    def session(self) -> SpeechSession:
        listener = self.call.listener
        assert isinstance(listener, SpeechSession), "nobody listens"
        return listener

    async def say(self, seconds: float = 0.8) -> float:
        """The caller speaks for ``seconds``, then pauses; returns when the pause began."""
        session = self.session
        session.speech_started(self.clock.now())
        self.call.deliver(SpeechStarted(at=self.clock.now()))
        await self.clock.advance(seconds)
        session.feed(b"\xff" * 160)
        end = self.clock.now()
        session.speech_paused(end)
        self.call.deliver(SpeechPaused(end, at=end))
        for _ in range(10):
            await asyncio.sleep(0)
        return end

    async def settle(self, seconds: float) -> None:
        await self.clock.advance(seconds)
        for _ in range(10):
            await asyncio.sleep(0)

    def spoken(self) -> list[str]:
        return [u.text for u in self.call.utterances]

    def counted(self, result: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "gateway_speech_turns_total", {"transport": "twilio", "result": result})
        return value or 0.0


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness(parse_script(SCRIPT, "speech.yaml"))
    yield harness
    if not harness.task.done():
        harness.task.cancel()
    await asyncio.gather(harness.task, return_exceptions=True)
    await harness.call.close()


async def test_a_spoken_phrase_routes_and_the_turn_counts_from_the_end_of_speech(
    h: Harness,
) -> None:
    await h.waiting()
    assert h.runner.path == ["menu"] and h.call.listener is not None
    h.recognizer.results = [said("billing")]
    ended = await h.say()
    await h.settle(0.2)  # the complete timeout: the branch's prompt starts now
    assert h.runner.path[:2] == ["menu", "billing"]
    billing = next(u for u in h.call.utterances if u.text == "Billing.")
    assert billing.turn_started_at == ended  # first audio measured from the end of speech
    (heard,) = h.runner.trace.speech
    assert (heard.node, heard.result, heard.branch, heard.said) == (
        "menu", "match", "billing", "billing")
    assert heard.at == ended and heard.decision_ms == pytest.approx(200.0)
    assert heard.recognitions == 1
    assert ("menu", "said: billing") in h.runner.trace.choices
    assert h.counted("match") == 1


async def test_spoken_digits_fill_the_store_and_stay_out_of_the_trace_when_private(
    h: Harness,
) -> None:
    await h.waiting()
    h.recognizer.results = [said("billing"), said(digits="4170")]
    await h.say()
    await h.settle(0.2)
    await h.waiting()  # the account gather listens
    assert h.runner.path[-1] == "account"
    await h.say(2.0)
    await h.settle(0.2)
    assert h.runner.variables["digits"] == "4170"
    pin = h.runner.trace.speech[-1]
    assert pin.said == "****" and pin.heard == "*"
    assert "4170" not in str(h.runner.trace.to_record())


async def test_out_of_menu_speech_waits_the_incomplete_timeout_then_gets_the_retry_prompt(
    h: Harness,
) -> None:
    await h.waiting()
    h.recognizer.results = [RecognitionResult(MatchStatus.NO_MATCH, transcript="cancel it",
                                              reason="heard 'cancel it', not in the menu")]
    await h.say()
    await h.settle(0.5)
    assert h.runner.path == ["menu"] and "Sorry." not in h.spoken()  # still the caller's turn
    await h.settle(0.5)  # 1 s of silence: the retry prompt
    await h.waiting()
    assert h.spoken()[-2:] == ["Sorry.", MENU]
    assert h.runner.trace.speech[-1].result == "no match"
    assert h.counted("no_match") == 1
    h.call.dtmf("2")  # keys still work in a speech gather
    await h.settle(0.1)
    assert h.runner.path[-1] == "agent"


async def test_a_key_while_the_caller_speaks_wins_and_stops_the_listening(h: Harness) -> None:
    await h.waiting()
    session = h.session
    session.speech_started(h.clock.now())
    h.call.deliver(SpeechStarted(at=h.clock.now()))
    await h.settle(0.3)
    h.call.dtmf("1")
    await h.settle(0.1)
    assert h.runner.path[:2] == ["menu", "billing"] and h.recognizer.turns == 0
    assert session.feed(b"\xff" * 160) is False  # closed: no recognition, no buffering


async def test_a_recogniser_failure_falls_back_to_keys_with_a_logged_reason(
    h: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    await h.waiting()
    h.recognizer.results = [RecognizerError("the recogniser worker died: killed")]
    with caplog.at_level(logging.WARNING, logger="gateway.ivr.runner"):
        await h.say()
        await h.waiting()
    assert any("speech recognition failed at menu (the recogniser worker died: killed); "
               "taking keys only" in r.getMessage() for r in caplog.records)
    # Prompted again (not a retry used up), listening no more: keys only.
    assert h.spoken()[-2:] == ["Sorry.", MENU]
    assert h.call.listener is None
    assert h.runner.trace.speech[-1].result == "failed"
    assert h.counted("failed") == 1
    await h.settle(5.0)  # no input: the one retry this gather has...
    await h.waiting()
    assert h.spoken()[-2:] == ["Sorry.", MENU]
    h.call.dtmf("1")  # ...and keys route the call
    await h.settle(0.1)
    assert h.runner.path[:2] == ["menu", "billing"]


async def test_a_call_in_another_language_than_the_phrases_takes_keys_only(h: Harness) -> None:
    await h.waiting()
    h.call.dtmf("8")
    await h.settle(0.1)
    await h.waiting()
    assert h.runner.path[-1] == "menu" and h.runner.voice.language == "Spanish"
    assert h.call.listener is None
    h.call.dtmf("2")
    await h.settle(0.1)
    assert h.runner.path[-1] == "agent"


async def test_no_speech_and_no_keys_is_no_input(h: Harness) -> None:
    await h.waiting()
    await h.settle(5.0)
    await h.waiting()
    assert h.spoken()[-2:] == ["Sorry.", MENU]
    assert h.recognizer.turns == 0 and h.runner.trace.speech == []


async def test_a_hold_stops_the_no_input_clock_of_a_listening_gather(h: Harness) -> None:
    """As for keys (tests/test_ivr_runner.py): a caller on hold is away, so the listening
    menu's 5 s no-input timeout waits for them and restarts in full; their speech after the
    hold is still the answer."""
    await h.waiting()
    h.call.hold(True)
    await h.settle(20.0)
    assert h.spoken() == [MENU] and h.runner.path == ["menu"]
    h.call.hold(False)
    await h.waiting()
    await h.settle(4.5)
    assert h.spoken() == [MENU]
    h.recognizer.results.append(said("agent"))
    await h.say()
    await h.settle(0.5)
    await h.task
    assert h.runner.path[-1] == "agent" and h.spoken()[-1] == "Hold on."


ACCOUNT = """
name: read-back test
voice: {speaker: ryan, language: English}
start: account
error: agent
prompts:
  account: Say your account number.
  sorry: Sorry.
nodes:
  account:
    gather:
      prompt: account
      digits: 6
      retries: 1
      retry_prompt: sorry
      speech: digits
      store: account_number
      branch: {default: done}
      fallback: agent
  done:
    say: {text: Thanks., language: English}
    hangup: true
  agent:
    say: {text: Hold on., language: English}
    transfer: "+15555550100"
"""


def unsure(digits: str) -> RecognitionResult:
    """Spoken digits the recogniser is not sure of (Whisper's read-back band)."""
    return RecognitionResult(MatchStatus.MATCH, digits=digits, transcript=digits,
                             confidence=0.3, audio_s=2.5, confirm=True)


@pytest.fixture
async def account() -> AsyncIterator[Harness]:
    harness = Harness(parse_script(ACCOUNT, "account.yaml"))
    yield harness
    if not harness.task.done():
        harness.task.cancel()
    await asyncio.gather(harness.task, return_exceptions=True)
    await harness.call.close()


@pytest.mark.parametrize("answer", ["yes", "1"])
async def test_unsure_spoken_digits_are_read_back_and_taken_once_the_caller_confirms(
    account: Harness, answer: str,
) -> None:
    h = account
    await h.waiting()
    h.recognizer.results = [unsure("479201"), *([said("yes")] if answer == "yes" else [])]
    await h.say(2.5)
    await h.settle(0.2)
    await h.waiting()  # the read-back asks and listens
    assert h.spoken()[-1] == ("I heard 4 7 9 2 0 1. Is that right? Say yes or no, or press 1 "
                              "for yes, 2 for no.")
    assert "account_number" not in h.runner.variables  # not taken yet
    if answer == "yes":
        await h.say(0.5)
        await h.settle(0.2)
    else:
        h.call.dtmf("1")
        await h.settle(0.1)
    await h.task
    assert h.runner.variables["account_number"] == "479201"
    assert "_read_back" not in h.runner.variables  # never sent to a webhook
    assert h.runner.path[-1] == "done"


@pytest.mark.parametrize("answer", ["no", "2"])
async def test_a_read_back_the_caller_refuses_is_asked_again_and_never_stored(
    account: Harness, answer: str,
) -> None:
    h = account
    await h.waiting()
    h.recognizer.results = [unsure("479201"), *([said("no")] if answer == "no" else []),
                            said(digits="479207")]
    await h.say(2.5)
    await h.settle(0.2)
    await h.waiting()
    if answer == "no":
        await h.say(0.5)
        await h.settle(0.2)
    else:
        h.call.dtmf("2")
        await h.settle(0.1)
    await h.waiting()
    assert h.spoken()[-2:] == ["Sorry.", "Say your account number."]
    assert "account_number" not in h.runner.variables
    await h.say(2.5)  # said again, heard for sure this time: no read-back
    await h.settle(0.2)
    await h.task
    assert h.runner.variables["account_number"] == "479207"
    assert sum("I heard" in t for t in h.spoken()) == 1


async def test_unsure_digits_of_a_private_gather_are_never_said_aloud(h: Harness) -> None:
    await h.waiting()
    h.recognizer.results = [said("billing"), unsure("4170")]
    await h.say()
    await h.settle(0.2)
    await h.waiting()
    assert h.runner.path[-1] == "account"
    await h.say(2.0)
    await h.settle(0.2)
    await h.waiting()
    assert "digits" not in h.runner.variables
    assert not any("I heard" in t or "4 1 7 0" in t for t in h.spoken())
    assert h.runner.path[-1] == "account"  # asked again (its retry prompt is its prompt)
