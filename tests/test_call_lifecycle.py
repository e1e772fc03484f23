"""The call lifecycle both transports share, on a virtual clock (no model, no sockets).

- admission: one budget for webhook reservations, ringing SIP calls and calls in progress;
  reservations lapse; refusal reasons in order;
- the lifecycle: start registers a call and runs the dialog the factory chooses for it; finish
  tells the dialog, stops it, frees the seat; a dialog bug ends its call only; the drain waits
  out its grace period (110 s here, in no real time) and hangs up the rest;
- the RTP playout: one frame per 20 ms beat, silence when idle, a mark played once the frame
  before it has gone, re-anchoring after a stall, backpressure, nothing sent while on hold, and
  a barge-in that fades out instead of clicking (the click measured before and after);
- the inactivity watch of a call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from clocks import VirtualClock

from gateway.audio.g711 import ulaw_decode, ulaw_encode
from gateway.call import (
    Admission,
    Call,
    CallLifecycle,
    CallOutcome,
    CallRegistry,
    HangUp,
    Hangup,
    Playout,
    PromptFrames,
    SpeechStarted,
    TransferTo,
)
from gateway.metrics import Metrics
from gateway.readiness import Readiness
from gateway.sip.endpoint import RTP_PLAYOUT

SILENCE = b"\xff" * 160


def _ready(clock: VirtualClock, metrics: Metrics | None = None) -> Readiness:
    readiness = Readiness(metrics or Metrics(), clock)
    readiness.mark_ready("test")
    return readiness


def _refused(metrics: Metrics, transport: str, reason: str) -> float:
    return metrics.registry.get_sample_value(
        "gateway_calls_refused_total", {"transport": transport, "reason": reason}) or 0.0


# --- admission --------------------------------------------------------------------------------


def test_a_reservation_whose_stream_never_comes_gives_its_place_back() -> None:
    clock = VirtualClock()
    metrics = Metrics()
    admission = Admission(2, _ready(clock, metrics), clock, metrics)
    assert admission.reserve("CA" + "7" * 32, "twilio", 30.0) is None
    assert admission.reserve("CA" + "8" * 32, "twilio", 30.0) is None
    assert admission.reserve("CA" + "9" * 32, "twilio", 30.0) == "at_capacity"
    assert _refused(metrics, "twilio", "at_capacity") == 1
    clock._now += 29.9
    assert admission.refusal() == "at_capacity"
    clock._now += 0.2  # 30 s after the webhook: the streams never came
    assert admission.refusal() is None
    assert not admission.reservations()


def test_a_stream_claims_its_reservation_even_when_full_or_draining() -> None:
    clock = VirtualClock()
    readiness = _ready(clock)
    admission = Admission(1, readiness, clock)
    assert admission.reserve("CA1", "twilio", 30.0) is None
    assert admission.admit("CA2", "twilio") == "at_capacity"  # a stray stream, no seat
    readiness.begin_drain()
    assert admission.admit("CA1", "twilio") is None  # the webhook admitted it before the drain
    clock._now += 60
    assert admission.seats() == 1 and not admission.reservations()  # held, never lapses


def test_ringing_sip_calls_count_against_every_transport() -> None:
    clock = VirtualClock()
    admission = Admission(2, _ready(clock), clock)
    assert admission.admit("sip-dialog-1", "sip") is None  # an INVITE, still ringing
    assert admission.reserve("CA1", "twilio", 30.0) is None
    assert admission.refusal() == "at_capacity"
    admission.release("sip-dialog-1")  # cancelled while ringing
    assert admission.free() == 1 and admission.seats("twilio") == 1


def test_refusal_reasons_in_order() -> None:
    clock = VirtualClock()
    readiness = Readiness(Metrics(), clock)
    admission = Admission(1, readiness, clock)
    assert admission.refusal() == "not_ready"
    readiness.mark_ready("test")
    assert admission.refusal() is None
    readiness.begin_drain()
    assert admission.refusal() == "draining"  # draining wins: it will not come back
    readiness.ready = False
    assert admission.refusal() == "draining"


# --- the lifecycle ----------------------------------------------------------------------------


class FakeTransport:
    """An adapter that records what the lifecycle made it do."""

    codec = "pcmu"
    playout = RTP_PLAYOUT

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.frames: list[tuple[float, bytes]] = []
        self.cleared: list[float] = []
        self.outcome: CallOutcome | None = None
        self.aborted: str | None = None
        self.lifecycle: CallLifecycle | None = None
        self.call: Call | None = None

    async def send_frames(self, frames: list[bytes]) -> None:
        self.frames.extend((self.clock.now(), frame) for frame in frames)

    async def send_mark(self, name: str) -> None:
        raise AssertionError("RTP has no far-end marks")

    async def clear(self) -> None:
        self.cleared.append(self.clock.now())

    async def end(self, outcome: CallOutcome) -> None:
        self.outcome = outcome
        assert self.lifecycle is not None and self.call is not None
        asyncio.get_running_loop().call_soon(
            lambda: asyncio.ensure_future(self.lifecycle.finish(self.call, "local")))  # type: ignore[union-attr,arg-type]

    def abort(self, reason: str) -> None:
        self.aborted = reason


class Dialogs:
    def __init__(self) -> None:
        self.chosen: list[str] = []
        self.hangups: list[Hangup] = []
        #: Calls whose dialog has a bug.
        self.crash: set[str] = set()
        #: Dialled number -> the line the factory names for it.
        self.lines: dict[str, str] = {}

    def for_call(self, call: Call) -> Any:
        called = call.parameters.get("called", "")
        self.chosen.append(called)
        if called == "no-dialog":
            raise RuntimeError("no dialog for this call")
        call.line = self.lines.get(called, call.line)
        return self.run

    async def run(self, call: Call) -> None:
        if call.call_id in self.crash:
            raise RuntimeError("a dialog bug")
        while True:
            event = await call.events.get()
            if isinstance(event, Hangup):
                self.hangups.append(event)
                return


@pytest.fixture
async def rig() -> AsyncIterator[tuple[VirtualClock, CallLifecycle, Dialogs, Metrics]]:
    clock = VirtualClock()
    metrics = Metrics()
    readiness = _ready(clock, metrics)
    dialogs = Dialogs()
    lifecycle = CallLifecycle(admission=Admission(4, readiness, clock, metrics),
                              registry=CallRegistry(metrics), readiness=readiness,
                              dialogs=dialogs, clock=clock, metrics=metrics)
    yield clock, lifecycle, dialogs, metrics
    await lifecycle.close_all()


def _start(lifecycle: CallLifecycle, clock: VirtualClock, key: str = "k1",
           inactivity_s: float = 0.0, called: str = "+15550002222") -> tuple[Call, FakeTransport]:
    transport = FakeTransport(clock)
    transport.lifecycle = lifecycle
    assert lifecycle.admit(key, "sip") is None
    call = lifecycle.start(key, transport, transport_name="sip", call_id=f"call-{key}",
                           parameters={"caller": "100", "called": called},
                           inactivity_s=inactivity_s)
    transport.call = call
    return call, transport


async def test_start_runs_the_dialog_chosen_for_the_call_and_finish_frees_everything(rig) -> None:  # type: ignore[no-untyped-def]
    clock, lifecycle, dialogs, metrics = rig
    call, _ = _start(lifecycle, clock)
    await clock.advance(0)
    assert dialogs.chosen == ["+15550002222"]  # the factory saw the dialled number
    assert lifecycle.registry.get("call-k1") is call and lifecycle.admission.seats() == 1
    assert metrics.registry.get_sample_value("gateway_calls_active",
                                           {"transport": "sip", "line": "default"}) == 1
    await lifecycle.finish(call, "bye")
    assert [h.reason for h in dialogs.hangups] == ["bye"]
    assert "call-k1" not in lifecycle.registry and lifecycle.admission.seats() == 0
    assert metrics.registry.get_sample_value("gateway_calls_active",
                                           {"transport": "sip", "line": "default"}) == 0
    await lifecycle.finish(call, "bye")  # a second finish (BYE retransmitted) is harmless
    assert len(dialogs.hangups) == 1


async def test_prompt_frames_are_encoded_once_per_lifecycle_and_shared_by_nothing_else(rig) -> None:  # type: ignore[no-untyped-def]
    """A prompt two callers hear is encoded once, in the lifecycle's own cache (it once was a
    module-global cache that every app and test in the process shared)."""
    clock, lifecycle, _, _ = rig
    prompt = (3000 * np.sin(np.arange(4000) / 5)).astype(np.int16)
    first, first_wire = _start(lifecycle, clock, "p1")
    second, second_wire = _start(lifecycle, clock, "p2")
    await clock.advance(0)
    for call in (first, second):
        call.play(prompt, label="welcome")
    for _ in range(40):
        await clock.advance(0.02)
    assert len(lifecycle.prompt_frames) == 1
    assert lifecycle.prompt_frames.bytes == 25 * 160  # 500 ms: 25 frames, encoded once
    heard = [frame for _, frame in first_wire.frames if frame != b"\xff" * 160]
    assert heard == lifecycle.prompt_frames.frames(prompt, "pcmu")
    assert [f for _, f in second_wire.frames if f != b"\xff" * 160] == heard
    elsewhere = PromptFrames()  # another app's lifecycle: nothing of this one's
    assert len(elsewhere) == 0 and elsewhere.frames(prompt, "pcmu") == heard
    for call in (first, second):
        await lifecycle.finish(call, "bye")


def test_prompt_frames_evict_the_least_recently_played_within_their_byte_bound() -> None:
    cache = PromptFrames(max_bytes=10 * 160)
    a, b, c = (np.full(4 * 160, n, np.int16) for n in (1, 2, 3))  # 4 frames each
    frames_a = cache.frames(a, "pcmu")
    cache.frames(b, "pcmu")
    assert cache.frames(a, "pcmu") is frames_a  # a hit, and a is now the most recent
    cache.frames(c, "pcmu")  # 12 frames > 10: b, the least recently played, goes
    assert len(cache) == 2 and cache.bytes == 8 * 160
    assert cache.frames(a, "pcmu") is frames_a
    assert cache.frames(a, "pcma") is not frames_a  # per codec
    too_long = np.zeros(11 * 160, np.int16)
    assert len(cache.frames(too_long, "pcmu")) == 11 and cache.bytes <= 10 * 160


async def test_the_calls_line_named_by_the_dialog_factory_labels_its_metrics(rig) -> None:  # type: ignore[no-untyped-def]
    """The factory chooses before the call is counted: calls_active/total carry its line from
    the start and the same series goes down at the end."""
    clock, lifecycle, dialogs, metrics = rig
    dialogs.lines["2000"] = "billing"
    call, _ = _start(lifecycle, clock, "b", called="2000")
    await clock.advance(0)
    billing = {"transport": "sip", "line": "billing"}
    assert call.line == "billing"
    assert metrics.registry.get_sample_value("gateway_calls_active", billing) == 1
    assert metrics.registry.get_sample_value("gateway_calls_total", billing) == 1
    assert metrics.registry.get_sample_value("gateway_calls_active",
                                             {"transport": "sip", "line": "default"}) is None
    await lifecycle.finish(call, "bye")
    assert metrics.registry.get_sample_value("gateway_calls_active", billing) == 0


async def test_a_factory_that_cannot_choose_a_dialog_leaves_no_seat_behind(rig) -> None:  # type: ignore[no-untyped-def]
    clock, lifecycle, _, _ = rig
    with pytest.raises(RuntimeError):
        _start(lifecycle, clock, "x", called="no-dialog")
    assert "call-x" not in lifecycle.registry and lifecycle.admission.seats() == 0


async def test_a_finish_cancelled_midway_still_frees_the_seat_and_is_not_swallowed(rig) -> None:  # type: ignore[no-untyped-def]
    """A shutdown cancelling whoever is finishing a call (while it waits for the call's tasks
    to stop): the cancellation reaches it, and the call is still forgotten, its seat free."""
    clock, lifecycle, _, _ = rig
    call, _ = _start(lifecycle, clock)
    await clock.advance(0)
    after: list[str] = []

    async def finisher() -> None:
        await lifecycle.finish(call, "bye")
        after.append("carried on after its own cancellation")

    task = asyncio.create_task(finisher())
    await asyncio.sleep(0)  # it waits for the call's playout to stop
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not after
    assert "call-k1" not in lifecycle.registry and lifecycle.admission.seats() == 0


async def test_a_dialog_bug_hangs_up_its_own_call_only(rig) -> None:  # type: ignore[no-untyped-def]
    clock, lifecycle, dialogs, _ = rig
    dialogs.crash.add("call-bug")
    healthy, _ = _start(lifecycle, clock, "ok")
    _broken, transport = _start(lifecycle, clock, "bug")
    for _ in range(10):
        await clock.advance(0)
    assert transport.outcome == HangUp()
    assert "call-bug" not in lifecycle.registry and "call-ok" in lifecycle.registry
    assert not healthy.ended


async def test_the_drain_lets_calls_finish_within_the_grace_then_hangs_up(rig) -> None:  # type: ignore[no-untyped-def]
    clock, lifecycle, _, metrics = rig
    call, transport = _start(lifecycle, clock)
    assert lifecycle.reserve("CA1", "twilio", 30.0) is None
    drain = asyncio.create_task(lifecycle.drain(110.0))
    await clock.advance(0)
    assert lifecycle.readiness.draining and lifecycle.refusal() == "draining"
    assert metrics.registry.get_sample_value("gateway_draining") == 1
    await clock.advance(60)
    assert not drain.done() and not call.ended and transport.outcome is None
    await clock.advance(50)  # the grace is over: the call still up is hung up
    await asyncio.wait_for(drain, 5)
    assert transport.outcome == HangUp()


async def test_the_drain_ends_as_soon_as_the_last_call_does(rig) -> None:  # type: ignore[no-untyped-def]
    clock, lifecycle, _, _ = rig
    call, transport = _start(lifecycle, clock)
    drain = asyncio.create_task(lifecycle.drain(110.0))
    await clock.advance(5)
    await lifecycle.finish(call, "bye")
    await clock.advance(0)
    assert drain.done() and transport.outcome is None


async def test_an_unclaimed_reservation_does_not_hold_the_drain(rig) -> None:  # type: ignore[no-untyped-def]
    """A fleet: this replica's webhook reserved a seat whose stream the balancer sent to
    another replica. The drain used to wait for it to lapse (30 s) with no call left here."""
    clock, lifecycle, _, metrics = rig
    assert lifecycle.reserve("CA1", "twilio", 30.0) is None
    assert metrics.registry.get_sample_value("gateway_seats", {"kind": "reservation"}) == 1
    drain = asyncio.create_task(lifecycle.drain(110.0))
    await clock.advance(0)
    await clock.advance(0)
    assert drain.done() and clock.now() == 0.0
    # Should its stream come here after all, before the process is gone: it is taken.
    assert lifecycle.admit("CA1", "twilio") is None
    assert metrics.registry.get_sample_value("gateway_seats", {"kind": "call"}) == 1


async def test_a_reserved_stream_arriving_while_calls_drain_is_taken_and_waited_for(rig) -> None:  # type: ignore[no-untyped-def]
    clock, lifecycle, _, _ = rig
    first, _ = _start(lifecycle, clock, "k1")
    assert lifecycle.reserve("CA1", "twilio", 30.0) is None
    drain = asyncio.create_task(lifecycle.drain(110.0))
    await clock.advance(1)
    late, _ = _start(lifecycle, clock, "CA1")  # claims the reservation made before the drain
    await lifecycle.finish(first, "bye")
    await clock.advance(5)
    assert not drain.done()  # the claimed seat is a call: waited for
    await lifecycle.finish(late, "bye")
    await clock.advance(0)
    assert drain.done() and clock.now() == 6.0


def test_a_webhook_holding_no_seat_only_asks_whether_there_is_room() -> None:
    """GATEWAY_TWILIO_RESERVATION_S=0 (a fleet): the webhook refuses when full, holds nothing."""
    clock = VirtualClock()
    metrics = Metrics()
    admission = Admission(1, _ready(clock, metrics), clock, metrics)
    assert admission.reserve("CA1", "twilio", 0.0) is None
    assert admission.seats() == 0 and not admission.reservations()
    assert admission.admit("sip-dialog-1", "sip") is None
    assert admission.reserve("CA2", "twilio", 0.0) == "at_capacity"
    assert _refused(metrics, "twilio", "at_capacity") == 1


async def test_a_call_whose_media_stops_is_aborted_after_its_inactivity_timeout(rig) -> None:  # type: ignore[no-untyped-def]
    clock, lifecycle, _, metrics = rig
    call, transport = _start(lifecycle, clock, inactivity_s=60.0)
    for _ in range(100):
        call.inbound_audio(SILENCE)
        await clock.advance(0.02)
    call.hold(True)
    await clock.advance(120)  # on hold: no media is expected
    assert transport.aborted is None
    call.hold(False)
    await clock.advance(59.9)
    assert transport.aborted is None
    await clock.advance(0.2)
    assert transport.aborted == "inbound timeout" and call.timed_out
    assert metrics.registry.get_sample_value(
        "gateway_calls_inbound_timeouts_total", {"transport": "sip"}) == 1


# --- the speech-detector feed ------------------------------------------------------------------


class CountingDetector:
    """Counts the frames it hears; "detects" speech on the ``fire_at``-th."""

    def __init__(self, fire_at: int = 0) -> None:
        self.heard = 0
        self.resets = 0
        self.fire_at = fire_at

    def push(self, frame: bytes | bytearray | memoryview) -> bool:
        self.heard += 1
        return self.heard == self.fire_at

    def reset(self) -> None:
        self.resets += 1


async def _feed(call: Call, clock: VirtualClock, frames: int) -> None:
    for _ in range(frames):
        call.inbound_audio(SILENCE)
        await clock.advance(0.02)


async def test_the_speech_detector_hears_the_caller_only_while_their_speech_can_matter() -> None:
    """Not during a gather's wait for keys nor under a prompt that must play to its end (the
    detector costs 0.1 ms a frame when its model runs); while an interruptible prompt plays,
    and while the dialog asks for speech, every frame."""
    clock = VirtualClock(start=10.0)
    detector = CountingDetector(fire_at=15)
    call = Call("call-vad", FakeTransport(clock), clock, transport_name="sip",
                detector=detector)
    call.start()
    try:
        pcm = np.zeros(8000, dtype=np.int16)  # 1 s
        await _feed(call, clock, 25)  # nothing playing
        assert detector.heard == 0 and not call.listening
        firm = call.play(pcm, label="must be heard")  # not interruptible
        await _feed(call, clock, 25)
        assert detector.heard == 0 and not call.listening
        await call.barge_in()
        prompt = call.play(pcm, label="menu", interruptible=True)
        assert call.listening
        await _feed(call, clock, 20)
        assert detector.heard == 20 and not firm.played.is_set()
        started = [e for e in _drain(call) if isinstance(e, SpeechStarted)]
        assert len(started) == 1
        while not prompt.played.is_set():
            await _feed(call, clock, 1)
        heard = detector.heard
        await _feed(call, clock, 25)  # played: waiting for keys
        assert detector.heard == heard and not call.listening
        call.wants_speech = True  # a dialog waiting for a spoken answer
        await _feed(call, clock, 10)
        assert detector.heard == heard + 10
        # It had not heard the line for 0.5 s: it carried on. After a 3 s gap it starts afresh.
        assert detector.resets == 0
        call.wants_speech = False
        await _feed(call, clock, 150)
        call.wants_speech = True
        await _feed(call, clock, 1)
        assert detector.resets == 1
    finally:
        await call.close()


def _drain(call: Call) -> list[object]:
    events = []
    while not call.events.empty():
        events.append(call.events.get_nowait())
    return events


# --- what a call holds, however long it lasts ----------------------------------------------------


class _Chunks:
    """A speech stream of ``chunks`` chunks of 80 ms (24 kHz float)."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks

    def __aiter__(self) -> Any:
        return self._gen()

    async def _gen(self) -> Any:
        tone = (0.3 * np.sin(np.arange(1920) / 7.0)).astype(np.float32)
        for _ in range(self.chunks):
            yield tone
            await asyncio.sleep(0)

    def cancel(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def test_a_long_call_keeps_its_latest_utterances_and_lets_finished_ones_go() -> None:
    """A hundred sentences, each captured for the cache: the call used to keep every one, with
    its speech stream and its audio, until it ended."""
    from gateway.call.session import MAX_UTTERANCES

    clock = VirtualClock(start=10.0)
    call = Call("call-long", FakeTransport(clock), clock, transport_name="sip")
    call.start()
    try:
        for i in range(100):
            utterance = call.speak(f"sentence {i}", lambda u: _Chunks(2), capture=True)
            while not utterance.played.is_set():
                await clock.advance(0.02)
            assert utterance.captured_pcm() is not None  # what the IVR caches, until the next
        assert call.utterance_count == 100 and len(call.utterances) == MAX_UTTERANCES
        assert [u.seq for u in call.utterances] == list(range(100 - MAX_UTTERANCES + 1, 101))
        assert call.utterances[-1].text == "sentence 99"
        finished = call.utterances[:-1]
        assert all(u.stream is None and u.capture is None and u.task is None for u in finished)
        assert all(u.played.is_set() and u.first_frame_at is not None for u in finished)
    finally:
        await call.close()
    assert call.utterances[-1].stream is None and call.utterances[-1].capture is None


async def test_unread_events_are_bounded_and_a_hang_up_always_gets_through() -> None:
    """A dialog that does not read (it waits on a slow webhook) while the caller presses keys:
    the queue used to grow without end. Keys past the bound are dropped and counted; a hang-up
    takes the oldest event's place."""
    from gateway.call.session import MAX_EVENTS

    clock = VirtualClock(start=10.0)
    metrics = Metrics()
    call = Call("call-keys", FakeTransport(clock), clock, transport_name="sip", metrics=metrics)
    for _ in range(MAX_EVENTS + 500):
        call.dtmf("5")
    assert call.events.qsize() == MAX_EVENTS and call.events_dropped == 500
    assert metrics.registry.get_sample_value(
        "gateway_call_events_dropped_total", {"transport": "sip"}) == 500
    call.deliver(Hangup("bye", at=clock.now()))
    events = _drain(call)
    assert len(events) == MAX_EVENTS and isinstance(events[-1], Hangup)
    assert call.events_dropped == 501


async def test_a_cached_prompt_is_encoded_once_however_often_it_is_played(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Encoding a prompt cost 0.1 ms per second of audio on every play (the largest cost of a
    cached-prompt turn); the frames of a prompt are now encoded once per codec."""
    import gateway.call.frames as frames

    encoded: list[int] = []
    real = frames.ulaw_encode

    def counting(pcm: np.ndarray) -> bytes:
        encoded.append(len(pcm))
        return real(pcm)

    monkeypatch.setattr(frames, "ulaw_encode", counting)
    clock = VirtualClock(start=10.0)
    call = Call("call-menu", FakeTransport(clock), clock, transport_name="sip")
    call.start()
    try:
        menu = (3000 * np.sin(np.arange(8000) / 5.0)).astype(np.int16)
        for _ in range(5):
            prompt = call.play(menu, label="menu")
            await clock.advance(0.1)
            await call.barge_in()
            assert prompt.interrupted
        assert encoded == [8000]
        other = menu.copy()  # equal audio, another array: encoded for itself
        call.play(other, label="other")
        await clock.advance(0.02)
        assert encoded == [8000, 8000]
    finally:
        await call.close()


# --- the RTP playout --------------------------------------------------------------------------


def _frames(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    pcm = (8000 * rng.standard_normal(160 * n)).astype(np.int16)
    data = ulaw_encode(pcm)
    return [data[i * 160:(i + 1) * 160] for i in range(n)]


class _Owner:
    def __init__(self) -> None:
        self.released = 0
        self.first: float | None = None

    def frames_released(self, count: int, at: float) -> None:
        self.first = at if self.first is None else self.first
        self.released += count


@pytest.fixture
async def rtp() -> AsyncIterator[tuple[VirtualClock, FakeTransport, Playout, list[str]]]:
    clock = VirtualClock(start=10.0)
    sink = FakeTransport(clock)
    played: list[str] = []
    playout = Playout(sink, clock, RTP_PLAYOUT, silence=SILENCE, on_played=played.append)
    playout.start()
    await clock.advance(0)  # the first beat, at the start
    yield clock, sink, playout, played
    await playout.close()


async def test_rtp_goes_out_one_frame_per_20_ms_with_silence_between(rtp) -> None:  # type: ignore[no-untyped-def]
    clock, sink, playout, played = rtp
    await clock.advance(0.1)  # nothing to say: silence every beat
    assert [f for _, f in sink.frames] == [SILENCE] * 6
    owner = _Owner()
    playout.begin(owner)
    audio = _frames(10)
    await playout.push(audio)
    playout.mark("u1")
    await clock.advance(0.25)
    sent = [f for _, f in sink.frames]
    start = sent.index(audio[0])
    assert sent[start:start + 10] == audio and sent[start + 10] == SILENCE
    times = [t for t, _ in sink.frames]
    assert np.allclose(np.diff(times), 0.02)  # on the beat, no drift
    assert played == ["u1"] and owner.released == 10
    assert owner.first == pytest.approx(times[start])


async def test_a_stalled_stream_re_anchors_instead_of_bursting(rtp) -> None:  # type: ignore[no-untyped-def]
    clock, sink, _playout, _ = rtp
    await clock.advance(0.04)
    before = len(sink.frames)
    clock._now += 1.0  # the event loop stalled for a second
    await clock.advance(0.0)
    # Not 50 frames at once (a jitter buffer would drop them): one, then back on the beat.
    assert len(sink.frames) - before == 1
    await clock.advance(0.1)
    assert len(sink.frames) - before == 6


async def test_push_waits_while_the_buffer_is_full(rtp) -> None:  # type: ignore[no-untyped-def]
    clock, _, playout, _ = rtp
    playout.begin(_Owner())
    frames = _frames(150)
    pushing = asyncio.create_task(playout.push(frames))
    await clock.advance(0)
    # Never more than the bound is queued: a whole prompt goes in as it plays.
    bound = RTP_PLAYOUT.buffer_frames
    assert not pushing.done() and playout.buffered == bound
    most = bound
    while not pushing.done():
        await clock.advance(0.02)
        most = max(most, playout.buffered)
    assert most == bound and playout.buffered <= bound
    await clock.advance(bound * 0.02 + 0.1)
    sent = [f for _, f in _sink_frames(playout)]
    assert [f for f in sent if f != SILENCE] == frames  # all of it, in order


def _sink_frames(playout: Playout) -> list[tuple[float, bytes]]:
    return playout._sink.frames  # type: ignore[attr-defined,no-any-return]


async def test_nothing_is_sent_on_hold(rtp) -> None:  # type: ignore[no-untyped-def]
    clock, sink, playout, _ = rtp
    playout.paused = True
    before = len(sink.frames)
    await clock.advance(1.0)
    assert len(sink.frames) == before
    playout.paused = False
    await clock.advance(0.02)
    assert len(sink.frames) == before + 1


def click(stream: np.ndarray, cut: int) -> float:
    """The click at sample ``cut`` of what the caller hears: the largest sample-to-sample step
    from just before the cut to 20 ms after it, relative to the largest step of the signal's
    own waveform before the cut. 1.0 or less: no step the audio did not already have; a cut
    straight to silence steps by the whole sample value (up to 2.9x for a 440 Hz tone)."""
    x = stream.astype(np.float64)
    own = np.abs(np.diff(x[cut - 800:cut])).max()
    return float(np.abs(np.diff(x[cut - 1:cut + 161])).max() / own)


async def cut_tone(cut_after: int, *, fade: bool) -> tuple[float, int]:
    """A 440 Hz tone played over RTP, barged in on after ``cut_after`` frames: the click at the
    cut, and the fades the playout sent."""
    from dataclasses import replace

    clock = VirtualClock(start=10.0)
    sink = FakeTransport(clock)
    policy = replace(RTP_PLAYOUT, fade_on_interrupt=fade)
    playout = Playout(sink, clock, policy, silence=SILENCE, on_played=lambda name: None)
    playout.start()
    await clock.advance(0)
    t = np.arange(160 * 50) / 8000
    data = ulaw_encode((12000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16))
    frames = [data[i * 160:(i + 1) * 160] for i in range(50)]
    playout.begin(_Owner())
    await playout.push(frames)
    while sum(1 for _, f in sink.frames if f in frames) < cut_after:
        await clock.advance(0.02)
    await playout.interrupt()
    await clock.advance(0.2)
    await playout.close()
    sent = [f for _, f in sink.frames]
    last = max(i for i, f in enumerate(sent) if f in frames)
    stream = ulaw_decode(b"".join(sent))
    return click(stream, (last + 1) * 160), playout.fades


async def test_a_barge_in_fades_the_prompt_out_instead_of_clicking() -> None:
    """The click at the cut, before (a cut straight to silence) and after (the next 20 ms faded
    out), at cuts spread over the tone's phase. bench/bargein_click.py measures it on speech."""
    cuts = [5, 8, 11, 14, 17, 20, 23]
    abrupt = [(await cut_tone(n, fade=False))[0] for n in cuts]
    faded = [await cut_tone(n, fade=True) for n in cuts]
    print(f"\nbarge-in click (440 Hz tone, {len(cuts)} cuts): step at the cut / the tone's own "
          f"largest step: without the fade mean {np.mean(abrupt):.2f}, max {max(abrupt):.2f}; "
          f"with it mean {np.mean([c for c, _ in faded]):.2f}, max {max(c for c, _ in faded):.2f}")
    assert all(fades == 1 for _, fades in faded)
    assert max(c for c, _ in faded) <= 1.05  # no step the waveform did not already have
    assert np.mean(abrupt) > 1.5


async def test_transfer_and_hangup_outcomes_reach_the_transport(rig) -> None:  # type: ignore[no-untyped-def]
    clock, lifecycle, _, _ = rig
    call, transport = _start(lifecycle, clock)
    await call.end(TransferTo("+15555550100"))
    await clock.advance(0)
    assert transport.outcome == TransferTo("+15555550100")
    assert "call-k1" not in lifecycle.registry


async def test_a_dialog_that_speaks_after_the_hang_up_starts_nothing(rig) -> None:  # type: ignore[no-untyped-def]
    """A stream that closes right after its ``start`` can end the call before its dialog ran
    its first step: the greeting it then starts must not go on generating for nobody (it held
    the only engine slot for minutes of virtual time in test_twilio_e2e)."""
    clock, lifecycle, _, _ = rig
    call, _transport = _start(lifecycle, clock)
    await lifecycle.finish(call, "stream ended")
    opened: list[object] = []
    late = call.speak("Hello.", lambda utterance: opened.append(utterance))  # type: ignore[arg-type,return-value]
    assert late.done and late.task is None and not opened
    assert late.generated.is_set() and not call.speaking


def test_utterance_ids_carry_the_calls_own_id_not_a_sip_hosts_tail() -> None:
    from gateway.call.session import short_call_id

    assert short_call_id("CA0123456789abcdef0123456789abcdef") == "89abcdef"
    # SIP: "sip-<Call-ID>", the Call-ID "<random>@<host>": the random part, never "27.0.0.1".
    assert short_call_id("sip-5f2a9c1e0b7d4e88a1c2@127.0.0.1") == "0b7d4e88a1c2"[-8:]
    assert short_call_id("sip-abc") == "abc"
