"""Hostile Media Streams clients over a real socket, next to a healthy call whose audio is timed.

The gateway runs the demo IVR with every prompt in the pre-rendered cache, so the healthy call's
audio costs no generation and any gap it hears is the hostile traffic's doing. What
tests/e2e/test_twilio_e2e.py already covers (a binary frame, a 70 KB text message, bad base64, a
``start`` without fields) is not repeated; here:

- each bad stream (``media`` before ``start``, a second ``start``, an unknown ``streamSid``, a
  second stream for a live call's CallSid, a JSON lone surrogate, invalid UTF-8 and CESU-8
  surrogates in a text frame, a frame over the server's frame limit) is closed alone, with the
  documented close code and a log line naming the reason;
- while a flood of 5,000 media messages (as fast as the socket takes them) and a stream of those
  bad clients run (from another process), a healthy call's playback is simulated from its arrival
  times: no gap in a prompt may come near the 200 ms its buffer holds, and it is compared with
  the same call's baseline before the attack.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import json
import logging
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from starlette.websockets import WebSocketState

from tests.support.paths import GOLDEN, REPO
from tests.support.twilio_client import SILENCE_FRAME, FakeTwilioCall, Received

if TYPE_CHECKING:
    from tests.support.servers import LiveServer

# conftest (and torch with it) is imported lazily: the attacker process below runs this file
# as a script and needs none of it.


@pytest.fixture(scope="module")
def ivr_live(tiny_model_dir: Path, demo_cache_dir: Path) -> Iterator[LiveServer]:
    from tests.support.paths import DEMO_SCRIPT
    from tests.support.servers import serve

    with serve({"model": str(tiny_model_dir), "script": str(DEMO_SCRIPT),
                "cache_dir": str(demo_cache_dir), "max_calls": 64,
                # One 20 ms frame per message and at most 200 ms ahead of the caller's playback
                # (Twilio's own pacing): a stall of the gateway's loop longer than that is an
                # audible gap, so the measurement below is sensitive to one.
                "frames_per_message": 1, "twilio_max_lead_ms": 200}) as live:
        yield live


_counter = iter(range(10_000, 100_000))


def _call(live: LiveServer | tuple[str, str], **kwargs: Any) -> FakeTwilioCall:
    """A test Twilio stream to ``live`` (a server, or its ws URL and auth token)."""
    if isinstance(live, tuple):
        ws_url, token = live
    else:
        from tests.support.servers import AUTH_TOKEN

        ws_url, token = live.ws_url, AUTH_TOKEN
    n = next(_counter)
    values: dict[str, Any] = {"call_sid": f"CA{n:032d}", "stream_sid": f"MZ{n:032d}"}
    values.update(kwargs)
    return FakeTwilioCall(ws_url, token, **values)


def _media(stream_sid: str, payload: str = SILENCE_FRAME) -> str:
    return json.dumps({"event": "media", "streamSid": stream_sid,
                       "media": {"track": "inbound", "chunk": "1", "timestamp": "20",
                                 "payload": payload}})


def _start_message(call: FakeTwilioCall) -> dict[str, Any]:
    return {"event": "start", "sequenceNumber": "2", "streamSid": call.stream_sid,
            "start": {"accountSid": "AC" + "0" * 32, "streamSid": call.stream_sid,
                      "callSid": call.call_sid, "tracks": ["inbound"], "customParameters": {},
                      "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000,
                                      "channels": 1}}}


# Each case: what the hostile client does after connecting, the close code it must get, and
# words of the reason that must appear in the gateway's log.
CASES = {
    "media before start": (1008, "'media' before 'start'"),
    "second start": (1008, "second 'start'"),
    "unknown streamSid": (1008, "unknown streamSid"),
    "json lone surrogate": (1007, "not valid JSON"),
    "invalid utf-8 text frame": (1007, "code 1007"),
    "cesu-8 surrogate text frame": (1007, "code 1007"),
    "frame over ws_max_size": (1009, "code 1009"),
    "call sid of a live call": (1008, "already has a stream"),
}


async def _misbehave(call: FakeTwilioCall, case: str, live_call_sid: str | None) -> None:
    ws = call._ws
    assert ws is not None
    if case == "media before start":
        await call.send_raw(_media(call.stream_sid))
        return
    if case == "call sid of a live call":
        assert live_call_sid is not None
        call.call_sid = live_call_sid
    await call.start(stream_media=False)
    if case != "call sid of a live call":
        # Misbehave while the greeting streams: the gateway is writing to this socket when the
        # server closes it under the call.
        await call.wait_for(lambda: call.events("media"), timeout=30)
    if case == "second start":
        await call.send_json(_start_message(call))
    elif case == "unknown streamSid":
        await call.send_raw(_media("MZ" + "f" * 32))
    elif case == "json lone surrogate":
        # Valid UTF-8 on the wire; the JSON escape names a lone surrogate.
        escaped = json.dumps({"event": "dtmf", "streamSid": call.stream_sid,
                              "dtmf": {"digit": "SURROGATE"}})
        await call.send_raw(escaped.replace("SURROGATE", "\\ud800"))
    elif case == "invalid utf-8 text frame":
        await ws.send(b'{"event": "media", "x": "\xff\xfe"}', text=True)
    elif case == "cesu-8 surrogate text frame":
        # A lone surrogate as it would be encoded by a sloppy UTF-8 encoder (U+D800).
        await ws.send(b'{"event": "media", "x": "\xed\xa0\x80"}', text=True)
    elif case == "frame over ws_max_size":
        await ws.send("x" * (2 * 1024 * 1024))


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_bad_stream_is_closed_alone_with_its_code_and_a_logged_reason(
    ivr_live: LiveServer, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    code, reason = CASES[case]
    async with _call(ivr_live) as healthy:
        await healthy.start()
        registry = ivr_live.gateway.registry
        server_call = await healthy.wait_for(lambda: registry.get(healthy.call_sid))
        calls_before = len(ivr_live.gateway.registry)
        async with _call(ivr_live) as bad:
            await _misbehave(bad, case, healthy.call_sid)
            await bad.wait_for(lambda: bad.closed.is_set(), timeout=15)
        # The bad call's work is over once the server has forgotten it (its tasks are done).
        await healthy.wait_for(lambda: len(registry) <= calls_before, timeout=10)
        gc.collect()  # a task that died with an exception nobody awaited reports it when freed
        errors = [r.getMessage()[:300] for r in caplog.records if r.levelno >= logging.ERROR
                  and not r.name.startswith("uvicorn")]
        logged = [r.getMessage() for r in caplog.records if r.name.startswith("gateway.twilio")]
        print(f"\n{case}: close {bad.close_code} {bad.close_reason!r}; "
              f"log: {[m for m in logged if reason in m][:1]}")
        assert bad.close_code == code
        assert any(reason in m for m in logged), logged[-5:]
        assert not errors, errors
        # The healthy call is the same call, still up, and the call table did not grow.
        assert ivr_live.gateway.registry.get(healthy.call_sid) is server_call
        assert not healthy.closed.is_set()
        await healthy.wait_for(lambda: len(ivr_live.gateway.registry) <= calls_before, timeout=10)
        await healthy.send_stop()


async def test_a_flood_from_one_stream_is_dropped_and_counted_and_a_normal_one_never_is(
    ivr_live: LiveServer,
) -> None:
    """A stream sends 50 media messages a second: none is dropped. Another sends 3,000 at once
    (half of them in Twilio's compact form, dropped unread, half reformatted, read and then
    dropped): all but the cap's burst and rate are dropped and counted instead of being fed to
    its call, and that stream stays open."""
    from gateway.call.inbound import BURST, MAX_RATE

    def dropped() -> float:
        return ivr_live.gateway.metrics.registry.get_sample_value(
            "gateway_inbound_media_dropped_total", {"transport": "twilio"}) or 0.0

    before = dropped()
    async with _call(ivr_live) as healthy:
        await healthy.start()
        await healthy.wait_for(lambda: healthy.media_sent >= 150, timeout=30)  # 3 s at 50/s
        assert dropped() == before
        async with _call(ivr_live) as flooder:
            await flooder.start(stream_media=False)
            compact = json.dumps(json.loads(_media(flooder.stream_sid)), separators=(",", ":"))
            spaced = _media(flooder.stream_sid)
            assert compact.startswith('{"event":"media"') and not spaced.startswith(compact[:16])
            t0 = time.monotonic()
            for i in range(3000):
                await flooder.send_raw(compact if i % 2 else spaced)
            await flooder.wait_for(
                lambda: dropped() - before >= 3000 - BURST - MAX_RATE * (time.monotonic() - t0),
                timeout=20)
            print(f"\nflood of 3,000 media messages: {dropped() - before:.0f} dropped "
                  f"{time.monotonic() - t0:.2f} s after the first")
            assert not flooder.closed.is_set()
        assert not healthy.closed.is_set()
        await healthy.send_stop()


# --- the transport under a socket closed by the server --------------------------------------


class _ClosedUnderUs:
    """What a Starlette WebSocket looks like once uvicorn closed it itself (invalid UTF-8, an
    oversize frame): Starlette still says CONNECTED, uvicorn refuses every send."""

    application_state = WebSocketState.CONNECTED

    async def send_text(self, text: str) -> None:
        raise RuntimeError("Unexpected ASGI message 'websocket.send', after sending "
                           "'websocket.close'.")

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        raise RuntimeError("Unexpected ASGI message 'websocket.close', after sending "
                           "'websocket.close'.")


async def test_writes_to_a_socket_closed_under_the_call_are_dropped_not_raised() -> None:
    from gateway.call import EndCall
    from gateway.twilio.protocol import MediaStreamProtocol
    from gateway.twilio.stream import TwilioTransport

    protocol = MediaStreamProtocol()
    for name in ("connected", "start"):
        protocol.receive((GOLDEN / "twilio" / f"{name}.json")
                         .read_text())
    transport = TwilioTransport(_ClosedUnderUs(), protocol)  # type: ignore[arg-type]
    # An utterance task writing frames and a mark, then the runner hanging up: none may raise
    # (an exception here kills the utterance task, and nobody retrieves it).
    await transport.send_frames([b"\xff" * 160])
    await transport.send_mark("u1")
    await transport.end(EndCall())
    assert transport.messages_sent == 0


# --- a healthy call under fire ----------------------------------------------------------------


def playback_report(received: list[Received]) -> dict[str, float]:
    """Simulate the caller's jitter buffer from arrival times.

    Each media message adds its frames to the playout; a message arriving after the playout ran
    dry in the middle of a prompt is an underrun the caller hears. A ``mark`` (or ``clear``)
    ends a prompt: the silence before the next one is the IVR's turn-taking, not a gap, and
    inter-message gaps are only measured within a prompt.
    """
    playout_end = 0.0
    previous: float | None = None
    underruns: list[float] = []
    gaps: list[float] = []
    messages = 0
    for item in received:
        event = item.message.get("event")
        if event in ("mark", "clear"):
            previous = None
            continue
        if event != "media":
            continue
        messages += 1
        frames = len(base64.b64decode(item.message["media"]["payload"])) // 160
        if previous is not None:
            gaps.append(1000 * (item.at - previous))
            # More than one frame late: a frame the caller did not hear on time.
            if item.at > playout_end + 0.02:
                underruns.append(1000 * (item.at - playout_end))
        playout_end = max(playout_end, item.at) + 0.02 * frames
        previous = item.at
    return {
        "messages": messages,
        "underruns": len(underruns),
        "worst_underrun_ms": max(underruns, default=0.0),
        "max_gap_ms": max(gaps, default=0.0),
        "p99_gap_ms": statistics.quantiles(gaps, n=100)[-1] if len(gaps) > 1 else 0.0,
    }


def test_the_playback_model_sees_an_underrun() -> None:
    # The checker itself: a prompt whose second message comes 300 ms after the first one's
    # 100 ms of audio ran out is one underrun; the same after a mark is turn-taking.
    def media(at: float, frames: int) -> Received:
        payload = base64.b64encode(b"\xff" * 160 * frames).decode()
        return Received(at, {"event": "media", "media": {"payload": payload}})

    starved = [media(0.0, 5), media(0.4, 5)]
    assert playback_report(starved)["underruns"] == 1
    assert 290 < playback_report(starved)["worst_underrun_ms"] < 310
    assert playback_report(starved)["max_gap_ms"] > 390
    turn = [media(0.0, 5), Received(0.1, {"event": "mark"}), media(0.4, 5)]
    assert playback_report(turn)["underruns"] == 0 and playback_report(turn)["max_gap_ms"] == 0


# The attacker runs in its own process: in the test's process its work would hold the GIL the
# gateway's thread needs, and delay the healthy client's own arrival timestamps.


async def _flood(target: tuple[str, str], messages: int, stats: dict[str, Any]) -> None:
    """A started stream that sends ``messages`` media messages as fast as the socket takes."""
    async with _call(target) as flooder:
        await flooder.start(stream_media=False)
        text = _media(flooder.stream_sid)
        t0 = time.monotonic()
        for _ in range(messages):
            await flooder.send_raw(text)
        stats["flood_send_s"] = time.monotonic() - t0
        # A flood of well-formed media is not a reason to drop the stream: its close, if the
        # gateway sent one, arrives within a second of the last message (the parent asserts
        # none did); waited for as the event it would be, not slept through.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(flooder.closed.wait(), 1.0)
        stats["flood_closed"] = flooder.close_code
        stats["flood_close_reason"] = flooder.close_reason


async def _bad_clients(target: tuple[str, str], until: float, rate: float,
                       stats: dict[str, Any]) -> None:
    """Bad streams, ``rate`` a second, each running one case, until ``until``."""
    cases = sorted(set(CASES) - {"call sid of a live call"})

    async def one(case: str) -> None:
        async with _call(target) as bad:
            await _misbehave(bad, case, None)
            await bad.wait_for(lambda: bad.closed.is_set(), timeout=15)
            if bad.close_code != CASES[case][0]:
                stats["wrong"].append((case, bad.close_code))
        stats["bad"] += 1

    tasks = []
    deadline = time.monotonic()
    while time.monotonic() < until:
        tasks.append(asyncio.create_task(one(cases[len(tasks) % len(cases)])))
        deadline += 1 / rate
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    await asyncio.gather(*tasks, return_exceptions=True)


async def attack(ws_url: str, token: str, seconds: float, rate: float, flood: int,
                 ) -> dict[str, Any]:
    stats: dict[str, Any] = {"bad": 0, "wrong": [], "flood_send_s": None, "flood_closed": None}
    target = (ws_url, token)
    await asyncio.gather(_flood(target, flood, stats),
                         _bad_clients(target, time.monotonic() + seconds, rate, stats))
    return stats


async def test_a_healthy_call_keeps_its_audio_while_hostile_streams_run(
    ivr_live: LiveServer,
) -> None:
    from tests.support.servers import AUTH_TOKEN

    baseline_s, attack_s, rate, flood = 5.0, 8.0, 25.0, 5000
    async with _call(ivr_live) as healthy:
        await healthy.start()
        await healthy.wait_for(lambda: healthy.events("media"), timeout=30)
        t_base = time.monotonic()
        attacker = await asyncio.create_subprocess_exec(
            # By module name from the repository's root: this file imports tests.support.
            sys.executable, "-m", __name__, ivr_live.ws_url, AUTH_TOKEN, str(attack_s),
            str(rate), str(flood), stdout=asyncio.subprocess.PIPE, cwd=REPO)
        assert attacker.stdout is not None
        try:
            ready = await asyncio.wait_for(attacker.stdout.readline(), 60)
            assert ready.strip() == b"ready", ready
            # The baseline window runs while the attacker starts up (it waits for "go").
            await asyncio.sleep(max(0.0, baseline_s - (time.monotonic() - t_base)))
            t_attack = time.monotonic()
            assert attacker.stdin is None
            os.kill(attacker.pid, signal.SIGUSR1)
            out = await asyncio.wait_for(attacker.stdout.read(), attack_s + 60)
            await attacker.wait()
        finally:
            if attacker.returncode is None:
                attacker.kill()
                await attacker.wait()
        t_end = time.monotonic()
        stats = json.loads(out)
        before = playback_report([r for r in healthy.received if t_base <= r.at < t_attack])
        during = playback_report([r for r in healthy.received if t_attack <= r.at <= t_end])
        print(f"\nattack {t_end - t_attack:.1f} s: {stats['bad']} bad streams ({rate:g}/s) closed, "
              f"{flood} media messages flooded in {stats['flood_send_s']:.2f} s "
              f"({flood / stats['flood_send_s']:,.0f}/s)\nhealthy call before: {before}\n"
              f"healthy call during: {during}")
        assert not stats["wrong"], stats["wrong"]
        assert stats["bad"] >= attack_s * rate * 0.8
        assert stats["flood_closed"] is None, stats
        assert during["messages"] >= 100  # it was speaking during the attack
        # The buffer is 200 ms deep: a stall of the gateway's loop that long empties it. On a
        # shared 2-core box a frame may land a few ms late now and then (the baseline window
        # shows the same); before sessions yielded between queued messages, the 5,000-message
        # flood held the loop for ~0.7 s and the healthy caller lost that much audio.
        # Both bounds are relative to the same call's baseline window, measured moments before
        # on the same machine: the attack adds less than 200 ms to the longest gap and 100 ms
        # of silence to what the machine's own load already costs (a busy box underran ~100 ms
        # and gapped 229 ms with other jobs running).
        assert during["max_gap_ms"] < 200 + before["max_gap_ms"], (before, during)
        assert during["worst_underrun_ms"] < 100 + before["worst_underrun_ms"], (before, during)
        assert not healthy.closed.is_set()
        await healthy.send_stop()


def _attacker_main(argv: list[str]) -> None:
    global _counter
    ws_url, token, seconds, rate, flood = argv
    # SIDs of its own: a stream reusing the healthy call's CallSid is refused (tested above).
    _counter = iter(range(50_000, 100_000))
    go = asyncio.Event()

    async def main() -> dict[str, Any]:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, go.set)
        print("ready", flush=True)
        await asyncio.wait_for(go.wait(), 120)
        return await attack(ws_url, token, float(seconds), float(rate), int(flood))

    print(json.dumps(asyncio.run(main())), flush=True)


if __name__ == "__main__":
    _attacker_main(sys.argv[1:])
