"""A call listening for a speech gather: inbound frames and the detector's turn, in step.

Real caller speech (flite through the G.711 path) goes frame by frame into a :class:`Call` with
the real Silero detector; a listener attached with :meth:`Call.listen` must get every frame
while attached (and none before or after), the speech start, and a pause that begins where the
caller stopped talking, told to the dialog as :class:`SpeechPaused`.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.asr.synth import SynthVoice, phone_line, synthesize
from gateway.audio.vad import SpeechStartDetector
from gateway.call import Call, PlayoutPolicy, SpeechPaused, SpeechStarted
from tests.support.clocks import VirtualClock
from tests.support.transports import MemoryTransport

FRAME = 160
LEAD_S = 0.6
TAIL_S = 1.0


def _transport() -> MemoryTransport:
    """A Twilio-like far end (marks come back from the caller) that never echoes one."""
    return MemoryTransport(PlayoutPolicy(lead_s=1.0, max_frames_per_send=50, far_end_marks=True),
                           echo_marks=False)


class _Listener:
    def __init__(self) -> None:
        self.bytes = 0
        self.log: list[tuple[str, float]] = []

    def feed(self, frame: bytes) -> bool:
        self.bytes += len(frame)
        return True

    def speech_started(self, at: float) -> None:
        self.log.append(("started", at))

    def speech_paused(self, at: float) -> None:
        self.log.append(("paused", at))

    def speech_resumed(self, at: float) -> None:
        self.log.append(("resumed", at))


@pytest.fixture(scope="module")
def caller() -> tuple[bytes, float]:
    """ "operator please" as a caller's mu-law, and where its speech ends (s)."""
    speech = synthesize("operator please", SynthVoice("flite", "slt"))
    return phone_line(speech, lead_s=LEAD_S, tail_s=TAIL_S), LEAD_S + len(speech) / 8000


async def _play(call: Call, clock: VirtualClock, audio: bytes,
                during: Any = None) -> None:
    for i in range(0, len(audio) - FRAME + 1, FRAME):
        await clock.advance(0.02)
        call.inbound_audio(audio[i:i + FRAME])
        if during is not None:
            during(i // FRAME)


def _events(call: Call) -> list[Any]:
    out = []
    while not call.events.empty():
        out.append(call.events.get_nowait())
    return out


async def test_a_listener_gets_the_frames_the_start_and_a_pause_where_the_speech_ended(
    caller: tuple[bytes, float],
) -> None:
    audio, speech_end = caller
    clock = VirtualClock()
    call = Call("CA1", _transport(), clock, transport_name="twilio",
                detector=SpeechStartDetector())
    listener = _Listener()
    call.listen(listener)
    assert call.listener is listener
    await _play(call, clock, audio)
    assert listener.bytes == len(audio) // FRAME * FRAME
    kinds = [kind for kind, _ in listener.log]
    assert kinds[0] == "started" and kinds[-1] == "paused"
    # Dips inside the words pause and resume; the last pause is where the caller stopped.
    assert kinds.count("paused") == kinds.count("resumed") + 1
    started, paused = listener.log[0][1], listener.log[-1][1]
    assert LEAD_S < started < LEAD_S + 0.45  # the detector needs 250 ms of speech
    assert speech_end - 0.05 <= paused <= speech_end + 0.05, (paused, speech_end)
    events = _events(call)
    assert [type(e) for e in events if not isinstance(e, SpeechPaused)] == [SpeechStarted]
    last = [e for e in events if isinstance(e, SpeechPaused)][-1]
    assert last.since == paused and last.since < last.at <= last.since + 0.1
    await call.close()
    assert call.listener is None


async def test_nothing_is_heard_before_or_after_listening_and_barge_in_still_works(
    caller: tuple[bytes, float],
) -> None:
    audio, _ = caller
    clock = VirtualClock()
    call = Call("CA2", _transport(), clock, transport_name="sip",
                detector=SpeechStartDetector())
    call.wants_speech = True  # as while an interruptible prompt plays: the detector hears
    listener = _Listener()
    quarter = len(audio) // FRAME // 4 * FRAME
    await _play(call, clock, audio[:quarter])
    call.listen(listener)
    call.listen(None)
    await _play(call, clock, audio[quarter:])
    assert listener.bytes == 0 and listener.log == []
    # Without a listener the detector still reports the start (barge-in), and no pause.
    assert [type(e) for e in _events(call)] == [SpeechStarted]
    await call.close()


async def test_listening_that_starts_while_the_caller_speaks_starts_their_turn_at_once(
    caller: tuple[bytes, float],
) -> None:
    audio, _ = caller
    clock = VirtualClock()
    detector = SpeechStartDetector()
    call = Call("CA3", _transport(), clock, transport_name="twilio", detector=detector)
    call.wants_speech = True  # talking over an interruptible prompt: the detector hears them
    listener = _Listener()
    attached: list[float] = []

    def attach(frame: int) -> None:
        if detector.speaking and not attached and detector.pause_start is None:
            call.listen(listener)
            attached.append(clock.now())

    await _play(call, clock, audio, during=attach)
    assert attached
    assert listener.log[0] == ("started", attached[0])
    assert listener.log[-1][0] == "paused"
    # It heard the speech from where it began (the detector fired ~250 ms into it, plus the
    # pre-roll), not only what came after listening started.
    heard_s = listener.bytes / 8000
    assert heard_s >= len(audio) / 8000 - LEAD_S - 0.05, (heard_s, len(audio) / 8000)
    await call.close()


def test_the_recent_audio_ring_keeps_the_last_bytes_in_order() -> None:
    from gateway.call.session import _Recent

    ring = _Recent(10)
    ring.push(b"abc")
    assert ring.last(5) == b"abc"
    ring.push(b"defghij")
    assert ring.last(10) == b"abcdefghij"
    ring.push(b"klm")
    assert ring.last(10) == b"defghijklm" and ring.last(4) == b"jklm"
    ring.push(b"0123456789abc")
    assert ring.last(10) == b"3456789abc"


async def test_speech_a_listener_heard_is_not_heard_again_by_the_next(
    caller: tuple[bytes, float],
) -> None:
    """A gather decides 200 ms into the caller's pause, while the detector still calls them
    speaking; the next gather (the node the answer chose) must not hear the same words."""
    audio, speech_end = caller
    clock = VirtualClock()
    detector = SpeechStartDetector()
    call = Call("CA4", _transport(), clock, transport_name="twilio", detector=detector)
    first, second = _Listener(), _Listener()
    call.listen(first)
    switched: list[float] = []

    def decide(frame: int) -> None:
        # 200 ms after the pause began: the first gather decides and the next one listens.
        if not switched and detector.pause_start is not None and detector.speaking and \
                clock.now() >= speech_end + 0.2:
            call.listen(None)
            call.listen(second)
            switched.append(clock.now())

    await _play(call, clock, audio, during=decide)
    assert switched and detector.events == 1
    assert first.log[0][0] == "started"
    assert second.log == [] and second.bytes == len(audio) // FRAME * FRAME - (
        round(switched[0] / 0.02) * FRAME)
    await call.close()



async def test_a_turn_the_detector_stopped_hearing_long_ago_is_not_started_again(
    caller: tuple[bytes, float],
) -> None:
    """The detector heard the caller start speaking over an interruptible prompt, then stopped
    hearing them (nothing interruptible plays). A gather listening seconds later must not take
    that stale turn for one in progress; the next speech it hears is the caller's turn."""
    audio, _ = caller
    clock = VirtualClock()
    detector = SpeechStartDetector()
    call = Call("CA5", _transport(), clock, transport_name="twilio", detector=detector)
    call.wants_speech = True
    half = len(audio) // FRAME // 2 * FRAME
    await _play(call, clock, audio[:half])
    assert detector.speaking  # mid-phrase when the prompt ends
    call.wants_speech = False
    await clock.advance(2.0)
    listener = _Listener()
    call.listen(listener)
    listening_at = clock.now()
    assert listener.log == [] and listener.bytes == 0
    await _play(call, clock, audio)
    kinds = [kind for kind, _ in listener.log]
    assert kinds[0] == "started" and kinds[-1] == "paused"
    # The turn it heard is the new phrase's (after its lead-in silence), not the stale one.
    assert listener.log[0][1] > listening_at + LEAD_S
    await call.close()
