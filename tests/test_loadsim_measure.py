"""The load simulator's judgement, sans-I/O: known timelines in, exact figures out.

First audio after a key pressed mid-prompt (Twilio: clear and marks; SIP: the RTP talkspurt the
gateway starts), refusals apart from failures, back-off, the TwiML a Twilio call follows, the
call budget warning, the capacity SLO and the price of a million characters.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from clocks import VirtualClock

from gateway.audio.g711 import ulaw_encode
from gateway.loadsim.cli import capacity_clauses, cost_per_million
from gateway.loadsim.model import CallRecord, Level, Turn, evaluate
from gateway.loadsim.runner import budget_warning, redial_delay
from gateway.loadsim.sip_caller import RtpReceiveLog
from gateway.loadsim.twilio_caller import Heard, Ticker
from gateway.loadsim.twiml import (
    AfterStream,
    Busy,
    StreamAnswer,
    TwimlError,
    parse_after_stream,
    parse_voice_answer,
)
from gateway.sip.rtp import RtpPacket, RtpSender

# --- the simulated callers' 20 ms clock -------------------------------------------------------


class _Caller:
    """Stands in for a TwilioCaller on the ticker: stamps each send; one send may stall."""

    def __init__(self, clock: VirtualClock, stall_at: int = -1, stall_s: float = 0.0) -> None:
        self.clock, self.stall_at, self.stall_s = clock, stall_at, stall_s
        self.sent: list[float] = []

    async def send_media(self) -> None:
        self.sent.append(self.clock.now())
        if len(self.sent) == self.stall_at:
            await self.clock.sleep(self.stall_s)  # a socket applying backpressure


async def test_the_ticker_sends_on_a_20_ms_grid_and_reanchors_after_a_stall() -> None:
    clock = VirtualClock(start=50.0)
    ticker = Ticker(clock=clock)
    caller = _Caller(clock, stall_at=10, stall_s=0.3)
    ticker.callers.add(caller)  # type: ignore[arg-type]
    ticker.start()
    await asyncio.sleep(0)
    for _ in range(60):
        await clock.advance(0.01)
    await ticker.stop()
    sent = caller.sent
    # On the grid, drift-free (by multiplication from the anchor), until the stall ...
    assert sent[:10] == pytest.approx([50.0 + 0.02 * k for k in range(10)], abs=1e-9)
    # ... (the 10th send, at 50.18 s, held the loop 300 ms), which is not caught up in a burst
    # of 14 ticks: the next tick at once, then 20 ms again from there.
    assert sent[10] == pytest.approx(50.18 + 0.3, abs=1e-9)
    assert np.diff(sent[10:]) == pytest.approx(0.02, abs=1e-9)
    assert len(sent) >= 15  # ticks on to the end (50.6 s)
    assert ticker._pacer.reanchors == 1
    # Its own lateness is recorded: that tick ran 280 ms after its time (50.20 s), even though
    # it went out on the new anchor; every other tick on time.
    assert max(ticker.lateness_ms) == pytest.approx(280.0, abs=1e-6)
    assert sorted(ticker.lateness_ms)[-2] == pytest.approx(0.0, abs=1e-6)


# --- SIP: first audio of the new utterance ----------------------------------------------------

SPEECH = ulaw_encode((8000 * np.sin(np.arange(160) / 3)).astype(np.int16))
SILENCE = b"\xff" * 160


def _gateway_stream(timeline: list[tuple[float, bytes, bool]]) -> RtpReceiveLog:
    """Packets as the gateway's RtpSender sends them: one per 20 ms, continuous timestamps,
    ``start_talkspurt()`` (the marker bit) where the timeline says barge-in flushed the queue."""
    sender = RtpSender(0, rng=random.Random(5))
    log = RtpReceiveLog()
    for arrival, payload, talkspurt in timeline:
        if talkspurt:
            sender.start_talkspurt()
        log.record(sender.packet(payload), ("127.0.0.1", 20000), arrival)
    return log


def _prompt_then_barge_in(marker: bool) -> RtpReceiveLog:
    """A prompt playing from 0.00 s; the key at 1.00 s; the gateway's barge-in lands after
    three more prompt packets (1.00, 1.02, 1.04 still speech), the queue is flushed (marker on
    the next packet, silence), and the new utterance's first frame goes out at 1.32 s."""
    timeline: list[tuple[float, bytes, bool]] = []
    for n in range(100):  # 0.00 .. 1.98 s
        at = round(0.02 * n, 2)
        if at <= 1.04:
            timeline.append((at, SPEECH, False))
        elif at < 1.32:
            timeline.append((at, SILENCE, marker and at == 1.06))
        else:
            timeline.append((at, SPEECH, False))
    return _gateway_stream(timeline)


def test_sip_first_audio_after_a_key_mid_prompt_is_the_new_utterance() -> None:
    log = _prompt_then_barge_in(marker=True)
    pressed = 0.999
    # What the old measurement took: the next packet of the interrupted prompt (1 ms).
    assert log.first_audio_after(pressed) == pytest.approx(1.00)
    assert log.speaking_at(pressed)
    assert log.cuts.count(1) == 2  # the stream's first packet, and the barge-in's
    assert log.utterance_after(pressed) == pytest.approx(1.32)
    assert 1000 * (log.utterance_after(pressed) - pressed) == pytest.approx(321, abs=1e-6)
    # Bounded by the next turn: nothing yet before 1.30 s.
    assert log.utterance_after(pressed, until=1.30) is None


def test_sip_first_audio_without_a_marker_waits_for_the_interrupted_speech_to_stop() -> None:
    log = _prompt_then_barge_in(marker=False)
    assert log.cuts.count(1) == 1  # only the stream's first packet
    # The prompt's speech stops at 1.06 (100 ms of silence follows): the answer is after it.
    assert log.stream_stopped_after(0.999) == pytest.approx(1.06)
    assert log.utterance_after(0.999) == pytest.approx(1.32)


def test_sip_timestamp_jump_is_a_cut_and_a_key_between_utterances_needs_none() -> None:
    log = RtpReceiveLog()
    for n in range(10):  # speech 0.00-0.18
        log.record(RtpPacket(0, 100 + n, 8000 + 160 * n, 9, SPEECH).serialize(), ("h", 1),
                   0.02 * n)
    # 100 ms not sent: the timestamp jumps by 6 frames for one packet; no marker bit. Packet
    # loss (the sequence jumping with the timestamp) would not be a cut.
    for n in range(10):
        log.record(RtpPacket(0, 110 + n, 8000 + 160 * (15 + n), 9, SPEECH).serialize(),
                   ("h", 1), 0.30 + 0.02 * n)
    assert log.cuts[10] == 1 and log.cuts.count(1) == 2
    assert log.utterance_after(0.15) == pytest.approx(0.30)
    lossy = RtpReceiveLog()
    for n in (0, 1, 2, 5, 6):
        lossy.record(RtpPacket(0, n, 160 * n, 9, SPEECH).serialize(), ("h", 1), 0.02 * n)
    assert lossy.cuts.count(1) == 1
    # A key pressed in silence (nothing in the 100 ms before it): the next speech answers it.
    quiet = _gateway_stream([(0.02 * n, SILENCE, False) for n in range(20)]
                            + [(0.40 + 0.02 * n, SPEECH, False) for n in range(5)])
    assert not quiet.speaking_at(0.2) and quiet.utterance_after(0.2) == pytest.approx(0.40)


# --- Twilio: first audio of the new utterance -------------------------------------------------


def _heard(events: list[tuple[float, str]]) -> Heard:
    heard = Heard()
    for at, kind in events:
        if kind == "media":
            heard.add_media(at, 0.02)
        elif kind == "clear":
            heard.add_clear(at)
        else:
            heard.add_mark(at, kind)
    return heard


def test_twilio_first_audio_after_a_key_mid_prompt_is_after_the_clear() -> None:
    # The prompt streams; the key at 1.000; three frames already in flight still arrive; the
    # gateway's clear at 1.065; the new utterance's first frame at 1.330.
    events = [(round(0.02 * n, 3), "media") for n in range(53)]  # 0.00 .. 1.04
    events += [(1.060, "media"), (1.065, "clear"), (1.330, "media"), (1.350, "media")]
    heard = _heard(events)
    assert heard.utterance_after(1.0) == pytest.approx(1.330)
    assert heard.utterance_after(1.0, until=1.2) is None


def test_twilio_first_audio_after_a_key_the_gateway_does_not_barge_in_on() -> None:
    # No clear (a prompt that is not interruptible): the old utterance runs to its mark, then
    # the answer starts; media that arrive at the mark's own timestamp still count as after it.
    events = [(round(0.02 * n, 3), "media") for n in range(60)]  # .. 1.18
    events += [(1.18, "u1"), (1.18, "media"), (1.20, "media")]
    heard = _heard(events)
    assert heard.utterance_after(1.0) == pytest.approx(1.18)
    assert len(heard.media) == 62 and heard.boundaries == [(1.18, 60)]
    # A key after the utterance's mark arrived: whatever comes next answers it.
    later = _heard([(0.0, "media"), (0.02, "media"), (0.04, "u1"), (0.5, "media")])
    assert later.utterance_after(0.3) == pytest.approx(0.5)
    assert later.mark_after(0.0) == pytest.approx(0.04) and later.mark_after(0.1) is None


# --- refused is not failed ----------------------------------------------------------------------


def _call(n: int, *, refused: str | None = None, error: str | None = None,
          chars: int = 0) -> CallRecord:
    record = CallRecord(id=f"c{n}", level=0)
    if refused:
        record.refuse(refused)
    if error:
        record.fail(error)
    if not refused:
        record.turns = [Turn("answer", at_s=0.0, first_audio_ms=100.0 + n, chars=chars)]
    return record


def test_refusals_and_failures_are_counted_apart_and_grouped_by_cause() -> None:
    busy = "busy TwiML: Sorry, all our lines are busy right now."
    closed = "the gateway closed the stream: 1011 internal error"
    calls = ([_call(n) for n in range(5)] + [_call(10 + n, refused=busy) for n in range(3)]
             + [_call(20, refused="SIP 486 Busy Here")] + [_call(30 + n, error=closed)
                                                           for n in range(2)])
    summary = Level(4, calls, duration_s=4.0).summary()
    assert (summary["calls"], summary["completed"], summary["refused"], summary["errors"]) == (
        11, 5, 4, 2)
    assert summary["refused_by"] == {busy: 3, "SIP 486 Busy Here": 1}
    assert summary["failures_by"] == {closed: 2}
    assert summary["placed_per_s"] == pytest.approx(11 / 4.0)
    assert summary["refused_pct"] == pytest.approx(400 / 11)
    # The first cause wins; a refused call is never also a failure.
    record = _call(40, refused=busy)
    record.fail("no audio within 15 s after the answer")
    assert (record.outcome, record.error) == ("refused", None)
    # SLO: errors=0 holds (refusals are not errors); the capacity SLO adds refused=0.
    assert evaluate(capacity_clauses("errors=0,gaps=0")[:2], summary)[0] is False  # 2 failed
    summary["errors"] = 0
    assert evaluate(capacity_clauses("errors=0,gaps=0")[:2], summary)[0] is True
    passed, lines = evaluate(capacity_clauses("errors=0,gaps=0"), summary)
    assert not passed and "refused = 0: 4 MISSED" in lines
    assert evaluate(capacity_clauses("errors=0,refused_pct<50%"), summary)[0] is True


def test_characters_per_second_and_the_price_of_a_million() -> None:
    calls = [_call(n, chars=36) for n in range(10)]  # ten live sentences of 36 characters
    summary = Level(2, calls, duration_s=12.0).summary()
    assert summary["characters"] == 360 and summary["characters_per_s"] == pytest.approx(30.0)
    # $2.16/hour is $0.0006 a second; at 30 characters/s a million take 33,333 s: $20.
    assert cost_per_million(2.16, 30.0) == pytest.approx(20.0)
    assert cost_per_million(2.16, None) is None and cost_per_million(2.16, 0.0) is None


def test_a_refused_or_failed_caller_backs_off_a_completed_one_redials_at_once() -> None:
    rng = random.Random(3)
    assert redial_delay("completed", 5.0, rng) == 0.0
    waits = [redial_delay(outcome, 5.0, rng) for outcome in ("refused", "failed") * 500]
    assert min(waits) >= 2.5 and max(waits) <= 7.5
    assert sum(waits) / len(waits) == pytest.approx(5.0, rel=0.05)
    assert len({round(w, 3) for w in waits}) > 900  # spread: no redial in lockstep
    assert redial_delay("refused", 0.0, rng) == 0.0


def test_the_call_budget_warning_reads_max_calls_from_readyz() -> None:
    ready = {"status": "ready", "calls": 3, "max_calls": 16, "http_status": 200}
    assert budget_warning(ready, 16) is None
    warning = budget_warning(ready, 20)
    assert warning is not None and "max_calls 16 in /readyz" in warning
    assert "about 4 caller(s) at a time will be refused" in warning
    assert budget_warning({"status": "ready", "http_status": 200}, 500) is None  # no budget
    assert budget_warning(None, 20) is None  # /readyz unreachable: nothing to say
    loading = budget_warning({"status": "loading", "http_status": 503}, 1)
    assert loading is not None and "not ready (/readyz: loading)" in loading


# --- TwiML ------------------------------------------------------------------------------------

CONNECT = ('<?xml version="1.0" encoding="UTF-8"?><Response><Connect action="http://gw/twilio/'
           'after-stream"><Stream url="wss://gw/twilio/media"><Parameter name="CallSid" '
           'value="CA1" /><Parameter name="From" value="+15550000000" /></Stream></Connect>'
           '</Response>')


def test_twiml_the_stream_its_parameters_and_the_busy_answer() -> None:
    answer = parse_voice_answer(CONNECT)
    assert answer == StreamAnswer("wss://gw/twilio/media",
                                  {"CallSid": "CA1", "From": "+15550000000"},
                                  "http://gw/twilio/after-stream", "POST")
    busy = ('<?xml version="1.0" encoding="UTF-8"?><Response><Say>Sorry, all our lines are '
            'busy.</Say><Hangup /></Response>')
    assert parse_voice_answer(busy) == Busy("Sorry, all our lines are busy.")
    assert parse_voice_answer('<Response><Reject reason="busy"/></Response>') == \
        Busy("<Reject reason='busy'>")
    assert parse_after_stream('<Response><Dial>+15555550100</Dial></Response>') == \
        AfterStream("+15555550100")
    assert parse_after_stream('<Response><Dial><Sip>sip:a@b</Sip></Dial></Response>') == \
        AfterStream("sip:a@b")
    assert parse_after_stream("<Response><Hangup/></Response>") == AfterStream(None)


@pytest.mark.parametrize(("text", "message"), [
    ("<Response><Connect>", "malformed TwiML"),
    ("<Html/>", "root element is <Html>"),
    ("<Response><Say>Hi</Say></Response>", "no <Connect><Stream> and no busy answer"),
    ('<Response><Start><Stream url="wss://x"/></Start></Response>', "one way"),
    ('<Response><Connect><Stream url="http://x"/></Connect></Response>', "not a ws://"),
    ("<Response><Connect/></Response>", "<Connect> without <Stream>"),
    ('<!DOCTYPE r [<!ENTITY a "aaaa">]><Response>&a;' + "x" * 70000 + "</Response>",
     "over 65536 bytes"),
])
def test_twiml_a_call_cannot_follow_is_an_error_that_says_why(text: str, message: str) -> None:
    with pytest.raises(TwimlError, match=message):
        parse_voice_answer(text)
