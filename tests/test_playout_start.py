"""Gap-free playout: the start buffer of a live utterance and the underruns the playout counts,
on a virtual clock (no model, no sockets, no real waiting).

- The playout alone, under Twilio's policy and RTP's: a live utterance's first frame is held
  until its source's playback origin plus the start buffer; the hold ends at once when the
  utterance is complete, never lasts past its cap, never applies to a prompt played from memory
  and never fires mid-utterance; audio still playing from before counts towards it.
- Underruns: a gap in the middle of an utterance is counted with its length (Twilio: the far end
  played everything before the next frame went; RTP: a beat went out as silence), never the
  silence between utterances, of a hold or of the start buffer itself.
- The whole chain (speech stream -> the call's phone path -> playout -> transport) with an engine
  whose every chunk arrives with a little lead to spare: the caller's buffer, modelled as the
  load simulator models it, never runs dry; without the start hold it does, at every utterance
  start (the stutter), and the gateway's own underrun count says so too.
- The hold adapts: when the engine core says its next chunk comes well before the first one
  has played, the first frame goes at once (the start buffer covers an engine at real time,
  not one with lead to spare); an estimate of no lead keeps the whole hold.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
import numpy.typing as npt
import pytest
from clocks import VirtualClock

from gateway.audio.condition import Conditioning
from gateway.audio.g711 import ulaw_encode
from gateway.call import Call, CallOutcome, Playout, PlayoutPolicy
from gateway.call.playout import start_buffer_setting
from gateway.call.session import Utterance
from gateway.config import Settings
from gateway.loadsim.twilio_caller import Heard
from gateway.metrics import Metrics
from gateway.sip.endpoint import RTP_PLAYOUT
from gateway.twilio.session import TwilioConfig

SILENCE = b"\xff" * 160
AUDIO = b"\x10" * 160
TWILIO = TwilioConfig(max_lead_s=1.0, frames_per_message=50, start_buffer_s=0.02).playout()


class _Owner:
    def __init__(self) -> None:
        self.released = 0
        self.first: float | None = None

    def frames_released(self, count: int, at: float) -> None:
        self.first = at if self.first is None else self.first
        self.released += count


class _Sink:
    """What the far end is sent: (time, frames) per message, marks, clears."""

    codec = "pcmu"

    def __init__(self, clock: VirtualClock, policy: PlayoutPolicy) -> None:
        self.clock = clock
        self.playout = policy
        self.sent: list[tuple[float, list[bytes]]] = []
        self.marks: list[tuple[float, str]] = []

    async def send_frames(self, frames: list[bytes]) -> None:
        self.sent.append((self.clock.now(), list(frames)))

    async def send_mark(self, name: str) -> None:
        self.marks.append((self.clock.now(), name))

    async def clear(self) -> None:
        pass

    async def end(self, outcome: CallOutcome) -> None:
        pass

    def abort(self, reason: str) -> None:
        raise AssertionError(reason)

    def audio(self) -> list[tuple[float, int]]:
        """(time, frames) of every message carrying anything but silence."""
        return [(t, sum(f != SILENCE for f in frames)) for t, frames in self.sent
                if any(f != SILENCE for f in frames)]


@pytest.fixture
async def rig() -> AsyncIterator[tuple[VirtualClock, list[Playout]]]:
    clock = VirtualClock(start=100.0)
    playouts: list[Playout] = []
    yield clock, playouts
    for playout in playouts:
        await playout.close()


def _playout(rig: tuple[VirtualClock, list[Playout]], policy: PlayoutPolicy
             ) -> tuple[Playout, _Sink, list[tuple[object, float]]]:
    clock, playouts = rig
    sink = _Sink(clock, policy)
    underruns: list[tuple[object, float]] = []
    starved: list[bool] = []
    playout = Playout(sink, clock, policy, silence=SILENCE, on_played=lambda name: None,
                      on_underrun=lambda speaker, s, dry: (underruns.append((speaker, s)),
                                                           starved.append(dry)))
    playout.starved = starved  # type: ignore[attr-defined]
    playout.start()
    playouts.append(playout)
    return playout, sink, underruns


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# --- the start buffer -------------------------------------------------------------------------


async def test_a_live_utterance_starts_at_its_source_origin_plus_the_start_buffer(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _ = rig
    playout, sink, _ = _playout(rig, TWILIO)
    t0 = clock.now()
    playout.begin(_Owner(), live=True)
    # 40 ms of the first 80 ms chunk came through the phone path (say): the source's listener
    # is 40 ms ahead of these frames, so they may not play before t0 + 0.04 (+ 20 ms buffer).
    await playout.push([AUDIO] * 2, not_before=t0 + 0.04)
    await clock.advance(0.059)
    assert sink.sent == []
    await clock.advance(0.001)
    assert sink.audio() == [(pytest.approx(t0 + 0.06), 2)]


async def test_the_hold_ends_at_once_when_the_utterance_is_complete(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _ = rig
    playout, sink, _ = _playout(rig, TWILIO)
    t0 = clock.now()
    playout.begin(_Owner(), live=True)
    await playout.push([AUDIO] * 3, not_before=t0 + 0.04)
    await clock.advance(0.01)
    assert sink.sent == []
    playout.mark("short")  # a short sentence: all of it is here, nothing can come late
    await _settle()
    assert sink.audio() == [(t0 + 0.01, 3)]


async def test_a_prompt_from_memory_is_never_held(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _ = rig
    playout, sink, _ = _playout(rig, TWILIO)
    playout.begin(_Owner())  # a cached prompt: all in hand
    await playout.push([AUDIO] * 30)
    await _settle()
    assert sink.audio() == [(clock.now(), 30)]


async def test_the_hold_never_fires_mid_utterance(rig) -> None:  # type: ignore[no-untyped-def]
    """Once an utterance's first frame is out, its frames go as they come, whatever origin the
    producer reports (the hold the throwaway patch had fired here too)."""
    clock, _ = rig
    playout, sink, underruns = _playout(rig, TWILIO)
    t0 = clock.now()
    playout.begin(_Owner(), live=True)
    await playout.push([AUDIO] * 2, not_before=t0)
    await clock.advance(0.02)
    assert sink.audio() == [(t0 + 0.02, 2)]
    await clock.advance(0.1)  # the far end ran dry at t0 + 0.06: an underrun, 60 ms
    await playout.push([AUDIO] * 4, not_before=clock.now() + 0.5)
    await _settle()
    assert sink.audio()[-1] == (clock.now(), 4)
    assert [s for _, s in underruns] == [pytest.approx(0.06)]


async def test_the_hold_is_capped(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _ = rig
    policy = replace(TWILIO, max_start_hold_s=0.1)
    playout, sink, _ = _playout(rig, policy)
    t0 = clock.now()
    playout.begin(_Owner(), live=True)
    await playout.push([AUDIO] * 2, not_before=t0 + 0.5)  # seconds of trimmed silence
    await clock.advance(0.099)
    assert sink.sent == []
    await clock.advance(0.001)
    assert sink.audio() == [(pytest.approx(t0 + 0.1), 2)]


async def test_audio_still_playing_counts_towards_the_hold(rig) -> None:  # type: ignore[no-untyped-def]
    """The next sentence queued while the last one plays at Twilio: what Twilio still has to play
    comes first, so the new first frame needs no hold of its own."""
    clock, _ = rig
    playout, sink, _ = _playout(rig, TWILIO)
    playout.begin(_Owner())
    await playout.push([AUDIO] * 10)  # 200 ms at Twilio
    playout.mark("one")
    await clock.advance(0.05)
    t = clock.now()
    playout.begin(_Owner(), live=True)
    await playout.push([AUDIO] * 2, not_before=t + 0.04)
    await _settle()
    assert sink.audio()[-1] == (t, 2)  # 150 ms still to play at Twilio >= 60 ms of hold


async def test_no_start_buffer_means_no_hold(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _ = rig
    playout, sink, _ = _playout(rig, replace(TWILIO, start_buffer_s=None))
    playout.begin(_Owner(), live=True)
    await playout.push([AUDIO] * 2, not_before=clock.now() + 0.04)
    await _settle()
    assert sink.audio() == [(clock.now(), 2)]


async def test_rtp_holds_on_silent_beats_then_plays_on_the_beat(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _ = rig
    playout, sink, underruns = _playout(rig, RTP_PLAYOUT)
    await clock.advance(0)
    t0 = sink.sent[0][0]
    await clock.advance(0.03)  # beats at t0, +20, +40 ms: silence
    playout.begin(_Owner(), live=True)
    await playout.push([AUDIO] * 2, not_before=clock.now() + 0.04)  # due at t0 + 0.09
    await clock.advance(0.2)
    times = [t for t, frames in sink.sent if frames == [AUDIO]]
    # The first beat at or after t0 + 0.03 + 0.04 + 0.02 = t0 + 0.09 is t0 + 0.10.
    assert times == [pytest.approx(t0 + 0.10), pytest.approx(t0 + 0.12)]
    assert all(np.isclose(np.diff([t for t, _ in sink.sent]), 0.02))  # never off the beat
    assert underruns == []  # the held beats were before the utterance started


async def test_rtp_counts_silent_beats_mid_utterance_as_one_underrun(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _ = rig
    playout, _sink, underruns = _playout(rig, RTP_PLAYOUT)
    await clock.advance(0)
    owner = _Owner()
    playout.begin(owner, live=True)
    await playout.push([AUDIO] * 2, not_before=clock.now() - 1)
    await clock.advance(0.1)  # 2 frames, then 3 beats of silence while the utterance waits
    await playout.push([AUDIO] * 2)
    playout.mark("u")
    await clock.advance(0.2)  # then the end: silence after it is not an underrun
    assert [s for who, s in underruns] == [pytest.approx(0.06)]
    assert underruns[0][0] is owner and playout.starved == [True]  # type: ignore[attr-defined]
    assert playout.underruns == 1 and playout.underrun_s == pytest.approx(0.06)


def _phone_heard(sink: _Sink, start: float, end: float) -> tuple[int, float]:
    """What the load simulator's SIP phone (fixed 40 ms jitter buffer) hears of the beats sent
    in [start, end): (gaps, ms)."""
    from gateway.loadsim.sip_caller import RtpReceiveLog
    from gateway.sip.rtp import RtpPacket

    log = RtpReceiveLog()
    for n, (t, frames) in enumerate(sink.sent):
        log.record(RtpPacket(0, n % 65536, 160 * n, 5, frames[0]).serialize(), ("h", 1), t)
    stats = log.playout(start, end)
    return stats.gaps, stats.gap_ms


async def test_rtp_counts_a_late_beat_as_the_phone_hears_it(rig) -> None:  # type: ignore[no-untyped-def]
    """A stalled event loop sends a beat 50 ms late: a phone with a 40 ms jitter buffer hears
    10 ms of silence; the playout counts the same gap the load simulator's phone hears."""
    loud = ulaw_encode((8000 * np.sin(np.arange(160 * 30) / 3)).astype(np.int16))
    audio = [loud[i * 160:(i + 1) * 160] for i in range(30)]
    clock, _ = rig
    playout, sink, underruns = _playout(rig, RTP_PLAYOUT)
    await clock.advance(0)
    start = clock.now()
    playout.begin(_Owner())
    await playout.push(audio)
    playout.mark("u")
    await clock.advance(0.2)
    clock._now += 0.07  # the event loop stalls just after a beat: the next is 50 ms late
    await clock.advance(0)
    await clock.advance(1.0)
    assert [1000 * s for _, s in underruns] == [pytest.approx(10, abs=0.01)]
    assert playout.starved == [False]  # type: ignore[attr-defined]  # its audio was here
    assert _phone_heard(sink, start, clock.now()) == (1, pytest.approx(10, abs=0.01))


async def test_twilio_between_utterances_is_not_an_underrun(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _ = rig
    playout, _, underruns = _playout(rig, TWILIO)
    playout.begin(_Owner())
    await playout.push([AUDIO] * 5)
    playout.mark("one")
    await clock.advance(0.5)
    playout.begin(_Owner())
    await playout.push([AUDIO] * 5)
    playout.mark("two")
    await clock.advance(0.5)
    assert underruns == []


async def test_rtp_hold_silence_is_not_an_underrun(rig) -> None:  # type: ignore[no-untyped-def]
    clock, _ = rig
    playout, _, underruns = _playout(rig, RTP_PLAYOUT)
    await clock.advance(0)
    playout.begin(_Owner())
    await playout.push([AUDIO] * 3)
    await clock.advance(0.02)
    playout.paused = True
    await clock.advance(0.5)
    playout.paused = False
    await clock.advance(0.1)
    assert underruns == []


def test_the_policies_declare_their_start_buffers() -> None:
    assert TwilioConfig().playout().start_buffer_s == 0.02
    assert RTP_PLAYOUT.start_buffer_s == 0.02
    assert TwilioConfig(start_buffer_s=None).playout().start_buffer_s is None
    settings = Settings(twilio_start_buffer_ms=35, sip_start_buffer_ms=-1)
    assert TwilioConfig.from_settings(settings).playout().start_buffer_s == 0.035
    assert start_buffer_setting(settings.sip_start_buffer_ms) is None
    assert start_buffer_setting(Settings().sip_start_buffer_ms) == RTP_PLAYOUT.start_buffer_s
    with pytest.raises(ValueError):
        replace(RTP_PLAYOUT, start_buffer_s=-0.01)
    policy = replace(TWILIO, start_buffer_s=0.02, max_start_hold_s=0.25)
    assert policy.first_release_at(10.0, None, 0.0) == pytest.approx(10.02)
    assert policy.first_release_at(10.0, 10.04, 0.0) == pytest.approx(10.06)
    assert policy.first_release_at(10.0, 10.04, 0.05) == pytest.approx(10.01)
    assert policy.first_release_at(10.0, 11.0, 0.0) == pytest.approx(10.25)


# --- the whole chain: engine hand-off -> phone path -> playout -> the caller's buffer ----------

_RATE = 24_000
_CODEC_FRAME = 1920  # one 80 ms codec frame at 24 kHz


class _Engine:
    """A speech stream whose chunks come when an engine with ``lead_s`` to spare hands them on:
    the first at ``first_s``, each later one ``lead_s`` before a listener who started playing
    at the first would have run out (its ``gaps`` counted as ``SpeechStream`` counts them)."""

    def __init__(self, clock: VirtualClock, sizes: list[int], *, first_s: float,
                 lead_s: float | dict[int, float], leading_silence_s: float = 0.0,
                 seed: int = 0, eta_s: float | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.clock = clock
        self.chunks = [(0.1 * rng.standard_normal(n * _CODEC_FRAME)).astype(np.float32)
                       for n in sizes]
        silent = round(leading_silence_s * _RATE)
        self.chunks[0][:silent] = 0.0
        self.first_s = first_s
        self.lead_s = lead_s
        self.gaps = 0
        self._origin: float | None = None
        self._audio = 0.0
        self._index = 0
        self._started = clock.now()
        #: What the engine core says of its next chunk (``SpeechStream.next_chunk_eta_s``):
        #: None, like a stream from an engine that makes no estimate, until the first chunk.
        self.next_chunk_eta_s: float | None = None
        self._eta_s = eta_s

    def __aiter__(self) -> _Engine:
        return self

    async def __anext__(self) -> npt.NDArray[np.float32]:
        i = self._index
        if i >= len(self.chunks):
            raise StopAsyncIteration
        if self._origin is None:
            due = self._started + self.first_s
        else:
            lead = self.lead_s if isinstance(self.lead_s, float) else self.lead_s.get(i, 0.02)
            due = self._origin + self._audio - lead
        await self.clock.sleep(due - self.clock.now())
        now = self.clock.now()
        if self._origin is None:
            self._origin = now
        elif now > self._origin + self._audio + 1e-9:
            self.gaps += 1
            self._origin = now - self._audio
        self._audio += len(self.chunks[i]) / _RATE
        self._index += 1
        self.next_chunk_eta_s = self._eta_s
        return self.chunks[i]

    def cancel(self) -> None:
        self._index = len(self.chunks)

    async def aclose(self) -> None:
        self.cancel()


async def _say(policy: PlayoutPolicy, engine_args: dict[str, object], sentences: int = 3
               ) -> tuple[_Sink, list[Utterance], Metrics, list[_Engine]]:
    """``sentences`` live utterances through a real call's phone path (conditioning on)."""
    clock = VirtualClock(start=50.0)
    sink = _Sink(clock, policy)
    metrics = Metrics()
    call = Call("CAtest", sink, clock, transport_name="twilio" if policy.far_end_marks else "sip",
                conditioning=Conditioning(), metrics=metrics)
    call.start()
    engines: list[_Engine] = []
    utterances = []
    try:
        for n in range(sentences):
            engine = _Engine(clock, [1, 2, 4, 8, 8], seed=n, **engine_args)  # type: ignore[arg-type]
            engines.append(engine)
            utterance = call.speak(f"sentence {n}", lambda u, e=engine: e,
                                   turn_started_at=clock.now())
            utterances.append(utterance)
            while not utterance.generated.is_set():
                await clock.advance(0.005)
            await clock.advance(2.0)  # it plays out (Twilio: no mark echo here, time passes)
            utterance.played.set()
    finally:
        await call.close()
    return sink, utterances, metrics, engines


def _twilio_gaps(sink: _Sink, utterances: list[Utterance]) -> list[tuple[int, float]]:
    """Per utterance, the gaps a Twilio caller hears (the load simulator's model)."""
    heard = Heard()
    for t, count in sink.audio():
        heard.add_media(t, count * 0.02)
    out = []
    for u, nxt in zip(utterances, [*utterances[1:], None], strict=True):
        assert u.first_frame_at is not None
        end = nxt.first_frame_at if nxt is not None and nxt.first_frame_at else 1e9
        gaps, gap_ms, _ = heard.gaps_between(u.first_frame_at, end)
        out.append((gaps, gap_ms))
    return out


def _rtp_dropouts(sink: _Sink) -> list[float]:
    """Runs of silent beats between two beats of speech within one utterance (ms)."""
    beats = [frames[0] != SILENCE for _, frames in sink.sent]
    runs, run, talking = [], 0, False
    for speech in beats:
        if speech:
            if talking and 0 < run < 25:  # a run of 500 ms or more: between utterances
                runs.append(20.0 * run)
            talking, run = True, 0
        elif talking:
            run += 1
    return runs


def _counted(metrics: Metrics, transport: str, cause: str) -> float:
    return metrics.registry.get_sample_value(
        "gateway_playout_underruns_total", {"transport": transport, "cause": cause}) or 0.0


@pytest.mark.parametrize("lead_s", [0.005, 0.03])
async def test_twilio_chunks_with_lead_to_spare_never_run_the_caller_dry(lead_s: float) -> None:
    sink, utterances, metrics, engines = await _say(TWILIO, {"first_s": 0.05, "lead_s": lead_s})
    assert [e.gaps for e in engines] == [0, 0, 0]  # the engine kept up
    assert _twilio_gaps(sink, utterances) == [(0, 0.0)] * 3
    assert sum(u.underruns for u in utterances) == 0
    # What the start costs: the 20 ms the phone path holds of the first chunk (the limiter's
    # look-ahead, the resampler's delay, the framer's partial frame) plus the 20 ms buffer.
    for u in utterances:
        assert u.first_audio_s == pytest.approx(0.05 + 0.04, abs=0.006)
    held = metrics.registry.get_sample_value("gateway_playout_start_hold_seconds_sum",
                                             {"transport": "twilio"})
    assert held == pytest.approx(3 * 0.04, abs=0.006)


@pytest.mark.parametrize("lead_s", [0.005, 0.015])
async def test_without_the_start_hold_every_utterance_starts_with_a_stutter(lead_s: float) -> None:
    """The diagnosis this fixes: 60 ms of the first 80 ms chunk goes out (40 ms with the
    limiter's old two blocks of look-ahead), the next chunk comes more than 60 ms later though
    the engine had lead to spare; the gateway's own count agrees with the caller's."""
    sink, utterances, metrics, _ = await _say(replace(TWILIO, start_buffer_s=None),
                                              {"first_s": 0.05, "lead_s": lead_s})
    heard = _twilio_gaps(sink, utterances)
    assert [gaps for gaps, _ in heard] == [1, 1, 1]
    assert [u.underruns for u in utterances] == [1, 1, 1]
    for (_, gap_ms), u in zip(heard, utterances, strict=True):
        assert gap_ms == pytest.approx(1000 * u.underrun_s, abs=0.5)
        assert gap_ms == pytest.approx(20 - 1000 * lead_s, abs=2)
    assert _counted(metrics, "twilio", "playout") == 3
    assert _counted(metrics, "twilio", "engine") == 0


def _phone_gaps(sink: _Sink, utterances: list[Utterance]) -> list[tuple[int, float]]:
    """Per utterance, what the load simulator's SIP phone hears."""
    out = []
    for u, nxt in zip(utterances, [*utterances[1:], None], strict=True):
        assert u.first_frame_at is not None
        end = nxt.first_frame_at if nxt is not None and nxt.first_frame_at else 1e9
        out.append(_phone_heard(sink, u.first_frame_at - 1e-6, end - 1e-6))
    return out


async def test_rtp_chunks_with_lead_to_spare_never_run_dry() -> None:
    sink, utterances, _, _ = await _say(RTP_PLAYOUT, {"first_s": 0.05, "lead_s": 0.005})
    assert _rtp_dropouts(sink) == []
    assert _phone_gaps(sink, utterances) == [(0, 0.0)] * 3
    assert sum(u.underruns for u in utterances) == 0
    before, said, metrics, _ = await _say(replace(RTP_PLAYOUT, start_buffer_s=None),
                                          {"first_s": 0.05, "lead_s": 0.005})
    heard = _phone_gaps(before, said)
    assert sum(gaps for gaps, _ in heard) >= 2  # the stutter (a beat's phase can hide one)
    assert len(_rtp_dropouts(before)) == sum(gaps for gaps, _ in heard)
    # The gateway's own count is what the phone heard, utterance by utterance.
    assert [(u.underruns, pytest.approx(1000 * u.underrun_s, abs=0.01)) for u in said] == heard
    assert _counted(metrics, "sip", "playout") == sum(gaps for gaps, _ in heard)


async def test_trimmed_leading_silence_is_held_too() -> None:
    """Silence the phone path trims never reaches the caller, but the engine counted it: the
    caller would be that much further ahead of the engine's listener."""
    sink, utterances, _, _ = await _say(TWILIO, {"first_s": 0.05, "lead_s": 0.005,
                                                 "leading_silence_s": 0.03})
    assert _twilio_gaps(sink, utterances) == [(0, 0.0)] * 3


@pytest.mark.parametrize("transport", ["twilio", "sip"])
async def test_a_late_chunk_from_the_engine_is_the_engines_gap(transport: str) -> None:
    """A chunk that comes 50 ms after the engine's listener ran out: the start buffer absorbs
    20 ms, the caller hears 30 (over RTP whole beats of it), and the gateway counts it as the
    engine's, as long as what the caller heard."""
    policy = TWILIO if transport == "twilio" else RTP_PLAYOUT
    sink, utterances, metrics, engines = await _say(
        policy, {"first_s": 0.05, "lead_s": {3: -0.05}}, sentences=1)
    assert engines[0].gaps == 1
    (gaps, gap_ms), = (_twilio_gaps(sink, utterances) if transport == "twilio"
                       else _phone_gaps(sink, utterances))
    if transport == "twilio":
        assert gaps == 1 and gap_ms == pytest.approx(30, abs=1)
    else:  # whole beats of silence; the first frame waited for a beat, up to 20 ms more slack
        assert gaps == 1 and round(gap_ms) in (20, 40)
    assert utterances[0].underruns == 1
    assert 1000 * utterances[0].underrun_s == pytest.approx(gap_ms, abs=0.01)
    assert _counted(metrics, transport, "engine") == 1
    assert _counted(metrics, transport, "playout") == 0


async def test_an_engine_with_lead_to_spare_is_not_held() -> None:
    """The core says the next chunk comes 10 ms after the first (a device far faster than real
    time) and it does: the first frame goes as soon as the phone path has it, nothing held, and
    the caller still hears no gap; an estimate of the whole first chunk keeps the full hold."""
    eta = 0.01
    for policy in (TWILIO, RTP_PLAYOUT):
        sink, utterances, metrics, engines = await _say(
            policy, {"first_s": 0.05, "lead_s": 0.08 - eta, "eta_s": eta})
        assert [e.gaps for e in engines] == [0, 0, 0]
        heard = (_twilio_gaps(sink, utterances) if policy is TWILIO
                 else _phone_gaps(sink, utterances))
        assert heard == [(0, 0.0)] * 3
        assert sum(u.underruns for u in utterances) == 0
        transport = "twilio" if policy is TWILIO else "sip"
        held = metrics.registry.get_sample_value("gateway_playout_start_hold_seconds_sum",
                                                 {"transport": transport})
        if policy is TWILIO:
            for u in utterances:  # the first frame goes when the first chunk comes
                assert u.first_audio_s == pytest.approx(0.05, abs=0.006)
            assert held == pytest.approx(0.0, abs=0.006)
        else:  # RTP: at most the wait for the next beat
            assert held <= 3 * 0.02 + 1e-6
    # An estimate that leaves no lead: the full hold, as with no estimate at all; and so with
    # the adaptation off (GATEWAY_START_BUFFER_ADAPTIVE=false), whatever the engine says.
    for policy, args in ((TWILIO, {"first_s": 0.05, "lead_s": 0.005, "eta_s": 0.075}),
                         (replace(TWILIO, start_buffer_adapts=False),
                          {"first_s": 0.05, "lead_s": 0.08 - eta, "eta_s": eta})):
        _, utterances, _, _ = await _say(policy, args)
        for u in utterances:
            assert u.first_audio_s == pytest.approx(0.05 + 0.04, abs=0.006)
