"""Callers who speak to the demo IVR over a real Twilio stream or a real SIP call, on the
gateway's virtual-time loop, and what the speech-menu tests read back (the recogniser swap, the
IVR trace). Used by the PocketSphinx and the Whisper end-to-end tests alike."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.call import Call, EndCall, TransferTo
from tests.support.builds import built_once
from tests.support.clocks import LoopClock
from tests.support.servers import AUTH_TOKEN, VirtualServer
from tests.support.waiting import until

__all__ = ["COMMON_SCENARIOS", "FAILURE", "SipCaller", "TwilioCaller", "broken_pool", "ivr_trace",
           "recognizer_swapped", "run_scenario", "said_once"]


class TwilioCaller:
    def __init__(self, live: VirtualServer, n: int) -> None:
        from tests.support.twilio_client import FakeTwilioCall

        self.fake = FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid=f"CA{n:032d}",
                                   stream_sid=f"MZ{n:032d}", playback_speed=20)

    async def start(self) -> None:
        await self.fake.connect()
        await self.fake.start({"From": "+15550001111"})

    def say(self, ulaw: bytes) -> None:
        self.fake.speak(ulaw)

    async def press(self, keys: str) -> None:
        for key in keys:
            await self.fake.send_dtmf(key)
            await asyncio.sleep(0.05)

    async def ended(self) -> None:
        await until(lambda: self.fake.closed.is_set(), 30)

    async def close(self) -> None:
        await self.fake.close()


class SipCaller:
    def __init__(self, live: VirtualServer, n: int) -> None:
        from gateway.loadsim.sip_caller import SipCaller as Phone

        self.live = live
        self.phone = Phone(caller_id=f"speaker{n}",
                           clock=LoopClock(asyncio.get_running_loop()))

    async def start(self) -> None:
        endpoint = self.live.gateway.sip
        assert endpoint is not None and endpoint.local_addr is not None
        await self.phone.call(endpoint.local_addr, user="ivr")

    def say(self, ulaw: bytes) -> None:
        self.phone.play(ulaw[i:i + 160] for i in range(0, len(ulaw) - 159, 160))

    async def press(self, keys: str) -> None:
        for key in keys:
            await self.phone.send_dtmf(key)
            await asyncio.sleep(0.05)

    async def ended(self) -> None:
        await until(lambda: self.phone.remote_hangup_at is not None, 30)

    async def close(self) -> None:
        await self.phone.aclose()


async def run_scenario(live: VirtualServer, said: dict[str, bytes],
                       steps: list[tuple[str, str]], n: int, transport: str) -> Call:
    """Call ``live`` over ``transport`` (caller number ``n``) and play ``steps``: ``say`` a
    synthesised utterance, ``press`` a key, wait until an utterance containing a text was
    ``hear``d / ``started`` / ``played`` / ``interrupted``, or the call ``ended`` (with a
    ``transfer`` or a hang-up). Returns the server's call once it has left the registry."""
    registry = live.gateway.registry
    before = {call_id for call_id, _ in registry.items()}
    caller = TwilioCaller(live, n) if transport == "twilio" else SipCaller(live, n)
    await caller.start()
    try:
        call: Call = await until(
            lambda: next((c for k, c in registry.items() if k not in before), None), 30)
        for step, arg in steps:
            if step == "say":
                caller.say(said[arg])
            elif step == "press":
                await caller.press(arg)
            elif step == "ended":
                await caller.ended()
                expected = TransferTo if arg == "transfer" else EndCall
                assert isinstance(call.outcome, expected), call.outcome
            else:
                def reached(step: str = step, arg: str = arg) -> bool:
                    return any(arg in u.text and {"hear": u.first_frame_at is not None,
                                                  "started": u.first_frame_at is not None,
                                                  "played": u.played.is_set(),
                                                  "interrupted": u.interrupted}[step]
                               for u in call.utterances)

                try:
                    await until(reached, 30)
                except AssertionError:
                    spoken = [(u.text[:50], u.interrupted) for u in call.utterances]
                    raise AssertionError(f"{step} {arg!r} never happened; said {spoken}") from None
    finally:
        await caller.close()
    await until(lambda: call.call_id not in registry, 30)
    await asyncio.sleep(0)
    return call



def said_once(tmp_path_factory: pytest.TempPathFactory, name: str,
              utterances: dict[str, tuple[str, str]]) -> dict[str, bytes]:
    """What callers say, as their mu-law line audio by name, synthesised once per test run
    (``built_once``): each utterance is ``(text, flite voice)``, or ``("noise:<kind>", "")``
    for a line carrying noise alone; 0.2 s of line before and after."""

    def synthesise(directory: Path) -> None:
        from gateway.asr.synth import SynthVoice, noise_only, phone_line, synthesize

        directory.mkdir(parents=True, exist_ok=True)
        for key, (text, voice) in utterances.items():
            audio = (noise_only(text.split(":")[1], 1.5, seed=5) if text.startswith("noise:")
                     else synthesize(text, SynthVoice("flite", voice)))
            (directory / f"{key}.ulaw").write_bytes(phone_line(audio, lead_s=0.2, tail_s=0.2))

    directory = built_once(tmp_path_factory, name, synthesise)
    return {key: (directory / f"{key}.ulaw").read_bytes() for key in utterances}

#: The scenario in which every recognition fails (the tests swap in :func:`broken_pool`).
FAILURE = "a recogniser failure falls back to keys with a logged reason"

#: What every recogniser must do with the demo's menu, as :func:`run_scenario` steps; each
#: recogniser's tests add their own.
COMMON_SCENARIOS: dict[str, list[tuple[str, str]]] = {
    # After the menu has played: "agent" goes to the agent node, which transfers.
    "a spoken choice routes the call": [
        ("played", "For your account balance"),
        ("say", "agent"),
        ("hear", "transfer you to an agent"),
        ("ended", "transfer"),
    ],
    "an out-of-menu sentence gets the retry prompt, then keys still work": [
        ("played", "For your account balance"),
        ("say", "cancel"),
        ("hear", "didn't catch that"),
        ("press", "2"),
        ("hear", "transfer you to an agent"),
        ("ended", "transfer"),
    ],
    FAILURE: [
        ("played", "For your account balance"),
        ("say", "agent"),
        ("hear", "didn't catch that"),
        ("press", "2"),
        ("hear", "transfer you to an agent"),
        ("ended", "transfer"),
    ],
}


@contextlib.contextmanager
def broken_pool(live: VirtualServer) -> Iterator[Any]:
    """A recogniser pool whose every turn fails (in its worker process), running on ``live``'s
    loop for the block."""
    from gateway.asr.pool import RecognizerPool
    from tests.support import asr_fakes

    pool = RecognizerPool(asr_fakes.Broken, workers=1, timeout_s=10)
    live.run(pool.start())
    try:
        yield pool
    finally:
        live.run(pool.close())


@contextlib.contextmanager
def recognizer_swapped(live: VirtualServer, pool: Any) -> Iterator[None]:
    """The demo's recogniser swapped for ``pool`` for the block."""
    switchboard = live.gateway.switchboard
    assert switchboard is not None
    contexts = list(switchboard.version.contexts.values())
    originals = [context.recognizer for context in contexts]
    for context in contexts:
        context.recognizer = pool
    try:
        yield
    finally:
        for context, original in zip(contexts, originals, strict=True):
            context.recognizer = original


def ivr_trace(caplog: pytest.LogCaptureFixture, call_id: str) -> dict[str, Any]:
    for record in caplog.records:
        data = getattr(record, "data", None)
        if record.getMessage() == "ivr trace" and data and data["trace"]["call_id"] == call_id:
            return data["trace"]  # type: ignore[no-any-return]
    raise AssertionError(f"no ivr trace for {call_id}")
