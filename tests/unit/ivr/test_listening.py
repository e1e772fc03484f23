"""The end of a spoken turn (gateway.ivr.listening): VoiceXML's complete and incomplete
timeouts over a real SpeechListener, with recognitions the test answers when it chooses."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gateway.asr.base import MatchStatus, RecognitionResult
from gateway.asr.grammar import SpeechGrammar
from gateway.asr.pool import SpeechListener
from gateway.errors import RecognizerError, RecognizerUnavailable
from gateway.ivr.listening import SpeechTurn

MENU = SpeechGrammar.build({"agent": ["agent"], "billing": ["billing"]})
FRAME = b"\x01" * 160
AGENT = RecognitionResult(MatchStatus.MATCH, branch="agent", phrase="agent")
NOTHING = RecognitionResult(MatchStatus.NO_MATCH, reason="heard 'hello'")


class Recognizer:
    """Each recognition waits until the test answers it."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, asyncio.Future[RecognitionResult]]] = []

    async def __call__(self, pcm: np.ndarray, grammar: SpeechGrammar) -> RecognitionResult:
        future: asyncio.Future[RecognitionResult] = asyncio.get_running_loop().create_future()
        self.asked.append((len(pcm), future))
        return await future

    async def answer(self, result: RecognitionResult | BaseException, index: int = -1) -> None:
        future = self.asked[index][1]
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
        for _ in range(3):
            await asyncio.sleep(0)


async def _poll(turn: SpeechTurn, now: float):  # type: ignore[no-untyped-def]
    """``turn.poll(now)``, then let a recognition it started reach the recogniser."""
    decision = turn.poll(now)
    for _ in range(3):
        await asyncio.sleep(0)
    return decision


def _turn(rec: Recognizer, *, max_speech_s: float = 10.0) -> tuple[SpeechTurn, SpeechListener]:
    listener = SpeechListener(rec, MENU)
    return SpeechTurn(listener, complete_s=0.2, incomplete_s=1.0,
                      max_speech_s=max_speech_s), listener


async def test_a_complete_phrase_ends_the_turn_after_the_complete_timeout() -> None:
    rec = Recognizer()
    turn, session = _turn(rec)
    assert await _poll(turn, 0.0) is None and turn.deadline(0.0) is None  # nobody spoke yet
    session.speech_started(1.0)
    session.feed(FRAME * 30)
    assert await _poll(turn, 1.2) is None
    assert turn.deadline(1.2) == 11.0  # speaking: only the cap
    session.speech_paused(1.6)
    assert await _poll(turn, 1.65) is None  # the pause is recognised as it begins...
    assert len(rec.asked) == 1 and rec.asked[0][0] == 30 * 160
    await rec.answer(AGENT)
    assert await _poll(turn, 1.7) is None
    assert turn.deadline(1.7) == pytest.approx(1.8)  # ...and ends the turn 0.2 s after it
    decision = await _poll(turn, 1.8)
    assert decision is not None and decision.result is AGENT
    assert (decision.ended_at, decision.decided_at, decision.recognitions) == (1.6, 1.8, 1)
    assert not decision.capped


async def test_what_is_not_an_answer_waits_for_the_incomplete_timeout() -> None:
    rec = Recognizer()
    turn, session = _turn(rec)
    session.speech_started(1.0)
    session.speech_paused(1.5)
    await _poll(turn, 1.5)
    await rec.answer(NOTHING)
    assert await _poll(turn, 2.0) is None and turn.deadline(2.0) == pytest.approx(2.5)
    decision = await _poll(turn, 2.5)
    assert decision is not None and decision.result is NOTHING and decision.ended_at == 1.5


async def test_speaking_on_makes_the_pause_stale_and_the_next_pause_decides() -> None:
    rec = Recognizer()
    turn, session = _turn(rec)
    session.speech_started(1.0)
    session.speech_paused(1.3)
    await _poll(turn, 1.3)
    session.speech_resumed(1.4)  # "four one seven ... oh two nine"
    session.feed(FRAME)
    await rec.answer(AGENT, 0)
    # The answer heard only the first half: it ends nothing while the caller speaks on.
    assert await _poll(turn, 1.6) is None and len(rec.asked) == 1
    session.speech_paused(2.0)
    assert await _poll(turn, 2.0) is None and len(rec.asked) == 2
    assert await _poll(turn, 2.3) is None  # 0.3 s after the second pause: its answer is not back
    await rec.answer(NOTHING, 1)
    assert await _poll(turn, 2.5) is None
    decision = await _poll(turn, 3.0)
    assert decision is not None and decision.result is NOTHING and decision.recognitions == 2


async def test_a_pause_during_a_running_recognition_is_recognised_when_it_is_back() -> None:
    rec = Recognizer()
    turn, session = _turn(rec)
    session.speech_started(1.0)
    session.speech_paused(1.3)
    await _poll(turn, 1.3)
    session.speech_resumed(1.35)
    session.speech_paused(1.5)
    assert await _poll(turn, 1.5) is None and len(rec.asked) == 1  # one recognition at a time
    await rec.answer(NOTHING, 0)
    assert await _poll(turn, 1.55) is None and len(rec.asked) == 2  # the newer pause, now
    await rec.answer(AGENT, 1)
    decision = await _poll(turn, 1.7)
    assert decision is not None and decision.result is AGENT and decision.ended_at == 1.5


async def test_a_turn_that_reaches_max_speech_is_recognised_whole_and_decided() -> None:
    rec = Recognizer()
    turn, session = _turn(rec, max_speech_s=3.0)
    session.speech_started(1.0)
    session.speech_paused(1.5)
    await _poll(turn, 1.5)
    session.speech_resumed(1.6)
    assert turn.deadline(3.0) == 4.0
    assert await _poll(turn, 4.0) is None  # still speaking at the cap: everything is recognised
    assert len(rec.asked) == 2 and rec.asked[0][1].cancelled()
    assert turn.deadline(4.0) is None  # only the recognition moves it on now
    await rec.answer(AGENT)
    decision = await _poll(turn, 4.01)
    assert decision is not None and decision.capped and decision.ended_at == 4.0


async def test_a_failed_recognition_comes_out_of_poll_and_close_cancels_what_runs() -> None:
    rec = Recognizer()
    turn, session = _turn(rec)
    session.speech_started(1.0)
    session.speech_paused(1.5)
    await _poll(turn, 1.5)
    await rec.answer(RecognizerUnavailable("the recogniser worker died"))
    with pytest.raises(RecognizerError, match="worker died"):
        await _poll(turn, 1.6)
    other, session = _turn(rec)
    session.speech_started(1.0)
    session.speech_paused(1.5)
    await _poll(other, 1.5)
    pending = other.pending
    assert pending is not None
    other.close()
    await asyncio.sleep(0)
    assert pending.cancelled() and other.pending is None
    assert session.feed(FRAME) is False  # a frame after the gather stopped is dropped
