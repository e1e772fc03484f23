"""The SIP endpoint with real peers on loopback: baresip and SIPp against a real gateway.

The gateway (``conftest.demo_realtime``) runs the demo IVR with the tiny model on CPU; its SIP
endpoint listens on an ephemeral UDP port of 127.0.0.1 with an allow-list of 127.0.0.1/32, a
300 ms ring before answering (so a CANCEL can arrive first), and T1 = 100 ms (so the no-ACK case
ends in 6.4 s; the RFC 3261 default timings are tested in virtual time in test_sip_uas.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.call import EndCall, TransferTo
from gateway.sip.endpoint import RTP_PLAYOUT
from tests.support.clocks import LoopClock
from tests.support.servers import LiveServer, VirtualServer
from tests.support.sip_peers import Baresip, run_sipp
from tests.support.waiting import until
from tests.support.waiting import wait_until as _wait


@pytest.fixture(scope="module")
def sip_gateway(demo_realtime: tuple[LiveServer, Any]) -> tuple[LiveServer, Any]:
    return demo_realtime


def _target(live: LiveServer | VirtualServer) -> tuple[str, int]:
    endpoint = live.gateway.sip
    assert endpoint is not None and endpoint.local_addr is not None
    return endpoint.local_addr


def _idle(live: LiveServer) -> None:
    endpoint = live.gateway.sip
    _wait(
        lambda: not endpoint.media and not live.gateway.registry
        and endpoint.core.active_calls == 0,
        timeout=15,
    )


@pytest.mark.slow  # a real peer (baresip/SIPp) on real time
def test_baresip_hears_the_greeting_routes_by_dtmf_and_the_call_state_is_gone(
    sip_gateway: tuple[LiveServer, Any], tmp_path: Path
) -> None:
    live, seen = sip_gateway
    host, port = _target(live)
    with Baresip(tmp_path) as phone:
        phone.dial(f"sip:ivr@{host}:{port}")
        phone.wait_event("CALL_ESTABLISHED")
        call = _wait(lambda: next(iter(live.gateway.registry.values()), None))
        assert call.call_id.startswith("sip-")
        # The greeting, then the menu, come from the prompt cache.
        _wait(lambda: len(call.utterances) >= 2 and call.utterances[1].first_frame_at, 30)
        assert call.utterances[0].cached
        started = time.monotonic()
        phone.send_dtmf("1")
        ask = _wait(
            lambda: next(
                (u for u in call.utterances if "six digit account" in u.text and u.first_frame_at),
                None,
            )
        )
        print(
            f"\nSIP DTMF -> next prompt's first RTP frame: "
            f"{1000 * (ask.first_frame_at - started):.0f} ms (includes baresip's send)"
        )
        phone.send_dtmf("123456#")
        balance = _wait(
            lambda: next((u for u in call.utterances if "balance on account" in u.text), None), 30
        )
        assert balance.text.startswith("Thanks, Dana.")
        assert seen[-1]["variables"]["account_number"] == "123456"
        phone.hangup()
        phone.wait_event("CALL_CLOSED")
    _idle(live)
    heard = phone.recording().astype(np.float64)
    seconds = len(heard) / 8000
    rms = float(np.sqrt(np.mean(heard**2)))
    print(f"baresip recorded {seconds:.1f} s, RMS {rms:.0f}")
    assert seconds > 3 and rms > 100  # non-silent: the tiny model speaks noise


@pytest.mark.slow  # a real peer (baresip/SIPp) on real time
def test_dtmf_barge_in_stops_the_outgoing_stream(
    sip_gateway: tuple[LiveServer, Any], tmp_path: Path
) -> None:
    live, _ = sip_gateway
    host, port = _target(live)
    endpoint = live.gateway.sip
    with Baresip(tmp_path) as phone:
        phone.dial(f"sip:ivr@{host}:{port}")
        phone.wait_event("CALL_ESTABLISHED")
        call = _wait(lambda: next(iter(live.gateway.registry.values()), None))
        welcome = _wait(
            lambda: call.utterances and call.utterances[0].first_frame_at and call.utterances[0]
        )
        media = next(iter(endpoint.media.values()))
        # The greeting is queued for pacing, a second of it at most (fed in as it plays).
        assert 0 < call.playout.buffered <= RTP_PLAYOUT.buffer_frames
        pressed = time.monotonic()
        phone.send_dtmf("2", gap_s=0)
        _wait(lambda: welcome.interrupted, 5)
        stopped = time.monotonic()
        print(f"\nSIP barge-in: DTMF sent -> greeting stopped {1000 * (stopped - pressed):.0f} ms")
        assert "2" in media.stats.digits
        phone.wait_event("CALL_CLOSED", 30)  # "2" = agent: transfer by REFER, then BYE
    _idle(live)


@pytest.mark.slow  # a real peer (baresip/SIPp) on real time
@pytest.mark.parametrize(
    ("scenario", "local_ip"),
    [
        ("call_caller_bye.xml", "127.0.0.1"),
        ("cancel.xml", "127.0.0.1"),
        ("hold_resume.xml", "127.0.0.1"),
        ("options.xml", "127.0.0.1"),
        ("no_common_codec.xml", "127.0.0.1"),
        ("forbidden.xml", "127.0.0.5"),
        ("no_ack.xml", "127.0.0.1"),
    ],
)
def test_sipp_scenarios(
    sip_gateway: tuple[LiveServer, Any], tmp_path: Path, scenario: str, local_ip: str
) -> None:
    live, _ = sip_gateway
    result = run_sipp(scenario, _target(live), local_ip=local_ip, workdir=tmp_path, timeout_s=40)
    assert result.ok, result.stdout[-3000:]
    _idle(live)


@pytest.mark.slow  # a real peer (baresip/SIPp) on real time
def test_sipp_call_hung_up_by_the_gateway(
    sip_gateway: tuple[LiveServer, Any], tmp_path: Path
) -> None:
    live, _ = sip_gateway
    endpoint = live.gateway.sip
    import threading

    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome["result"] = run_sipp("call_gateway_bye.xml", _target(live), workdir=tmp_path)

    thread = threading.Thread(target=run)
    thread.start()
    call = _wait(lambda: next(iter(live.gateway.registry.values()), None))
    _wait(lambda: call.utterances and call.utterances[0].first_frame_at)
    asyncio.run_coroutine_threadsafe(call.end(EndCall()), endpoint.loop).result(5)
    thread.join(30)
    assert outcome["result"].ok, outcome["result"].stdout[-3000:]
    _idle(live)


@pytest.mark.slow  # a real peer (baresip/SIPp) on real time
def test_over_capacity_and_draining(sip_gateway: tuple[LiveServer, Any], tmp_path: Path) -> None:
    live, _ = sip_gateway
    endpoint = live.gateway.sip
    admission = live.gateway.admission
    admission.max_calls = 1  # the replica's call budget, both transports together
    try:
        import threading

        holder: dict[str, Any] = {}
        # The call that fills the budget stays up until the gateway hangs it up, once the
        # second caller has had its 486 (not for a fixed pause that a busy machine outlasts).
        thread = threading.Thread(
            target=lambda: holder.update(
                result=run_sipp("call_gateway_bye.xml", _target(live), workdir=tmp_path)
            )
        )
        thread.start()
        _wait(lambda: endpoint.core.active_calls == 1)
        held = _wait(lambda: next(iter(live.gateway.registry.values()), None))
        busy = run_sipp("busy.xml", _target(live), workdir=tmp_path)
        assert busy.ok, busy.stdout[-3000:]
        assert endpoint.core.active_calls == 1, "the budget's call must outlast the refusal"
        asyncio.run_coroutine_threadsafe(held.end(EndCall()), endpoint.loop).result(5)
        thread.join(30)
        assert holder["result"].ok, holder["result"].stdout[-3000:]
    finally:
        admission.max_calls = 32
    _idle(live)
    live.gateway.readiness.draining = True
    try:
        draining = run_sipp("draining.xml", _target(live), workdir=tmp_path)
        assert draining.ok, draining.stdout[-3000:]
    finally:
        live.gateway.readiness.draining = False


@pytest.mark.slow  # a real peer (baresip/SIPp) on real time
def test_fifty_calls_at_ten_per_second(sip_gateway: tuple[LiveServer, Any], tmp_path: Path) -> None:
    live, _ = sip_gateway
    result = run_sipp(
        "call_caller_bye.xml",
        _target(live),
        calls=50,
        rate=10,
        limit=30,
        workdir=tmp_path,
        timeout_s=60,
    )
    stats = result.stats
    print(
        f"\nSIPp 50 calls at 10/s: successful {stats.get('SuccessfulCall(C)')}, failed "
        f"{stats.get('FailedCall(C)')}, response time 1 (ms, mean) "
        f"{stats.get('ResponseTime1(C)')}, elapsed {stats.get('ElapsedTime(C)')}"
    )
    assert result.ok, result.stdout[-3000:]
    assert stats.get("SuccessfulCall(C)") == "50" and stats.get("FailedCall(C)") == "0"
    _idle(live)


# --- one IVR behaviour suite, every transport (STYLE rule 12) ----------------------------------

SCENARIOS = {
    "account lookup, then goodbye": [
        ("hear", "For your account balance"),
        ("press", "1"),
        ("hear", "six digit account"),
        ("press", "123456#"),
        ("hear", "Your balance on account one two three four five six is four hundred"),
        ("hear", "press 3"),
        ("press", "3"),
        ("hear", "Goodbye."),
        ("ended", "hangup"),
    ],
    "straight to an agent": [
        ("hear", "For your account balance"),
        ("press", "2"),
        ("hear", "transfer you"),
        ("ended", "transfer"),
    ],
    # 8 during the Spanish offer switches the call's language: the menu and the transfer
    # prompt come back in Spanish (their cached translations).
    "en español, to an agent": [
        ("hear", "Para español, oprima 8."),
        ("press", "8"),
        ("hear", "Para el saldo de su cuenta, oprima 1."),
        ("press", "2"),
        ("hear", "le comunico con un agente"),
        ("ended", "transfer"),
    ],
}


class TwilioCaller:
    """The scenario's caller over Twilio Media Streams (the test Twilio client)."""

    def __init__(self, live: LiveServer | VirtualServer, n: int) -> None:
        from tests.support.servers import AUTH_TOKEN
        from tests.support.twilio_client import FakeTwilioCall

        self.live = live
        self.fake = FakeTwilioCall(
            live.ws_url,
            AUTH_TOKEN,
            call_sid=f"CA{n:032d}",
            stream_sid=f"MZ{n:032d}",
            playback_speed=20,
        )

    async def start(self) -> None:
        await self.fake.connect()
        await self.fake.start({"From": "+15550001111"})

    async def press(self, keys: str) -> None:
        for key in keys:
            await self.fake.send_dtmf(key)
            await asyncio.sleep(0.05)  # the caller's finger, 50 ms a key

    async def ended(self) -> None:
        await self.fake.wait_for(lambda: self.fake.closed.is_set(), timeout=30)

    async def close(self) -> None:
        await self.fake.close()


class SipCaller:
    """The same caller over SIP/RTP (baresip dialling the gateway's SIP endpoint)."""

    def __init__(self, live: LiveServer, workdir: Path) -> None:
        self.live = live
        self.phone = Baresip(workdir)

    async def start(self) -> None:
        self.phone.__enter__()
        host, port = _target(self.live)
        self.phone.dial(f"sip:ivr@{host}:{port}")
        await asyncio.to_thread(self.phone.wait_event, "CALL_ESTABLISHED")

    async def press(self, keys: str) -> None:
        await asyncio.to_thread(self.phone.send_dtmf, keys, 0.15)

    async def ended(self) -> None:
        await asyncio.to_thread(self.phone.wait_event, "CALL_CLOSED", 40)

    async def close(self) -> None:
        self.phone.__exit__()


class LoopSipCaller:
    """The same caller over SIP/RTP as a simulated phone in the gateway's own loop (the load
    simulator's SIP UAC and RTP endpoint, on real UDP sockets), so it shares virtual time."""

    def __init__(self, live: VirtualServer) -> None:
        from gateway.loadsim.sip_caller import SipCaller as Phone

        self.live = live
        loop = asyncio.get_running_loop()
        self.phone = Phone(caller_id="tester", clock=LoopClock(loop))

    async def start(self) -> None:
        await self.phone.call(_target(self.live), user="ivr")

    async def press(self, keys: str) -> None:
        for key in keys:
            await self.phone.send_dtmf(key)
            await asyncio.sleep(0.05)  # the caller's finger between keys

    async def ended(self) -> None:
        await until(lambda: self.phone.remote_hangup_at is not None, 40)

    async def close(self) -> None:
        await self.phone.aclose()


#: Each scenario on each transport; the SIP scenarios once more with baresip, a real phone in
#: another process (real time), for the transfer.
SUITE = [*((name, t) for name in sorted(SCENARIOS) for t in ("twilio", "sip")),
         ("straight to an agent", "sip-baresip")]


@pytest.mark.parametrize(("name", "transport"), SUITE)
def test_ivr_scenarios_behave_the_same_on_every_transport(
    request: pytest.FixtureRequest, tmp_path: Path, transport: str, name: str
) -> None:
    """The same demo script and steps over each transport. Twilio and SIP run on the demo
    gateway in virtual time (their callers share the gateway's loop); baresip on real time."""
    if transport == "sip-baresip":
        live, _ = request.getfixturevalue("sip_gateway")
        asyncio.run(_scenario(live, SipCaller(live, tmp_path), name))
        _idle(live)
        return
    virtual, _ = request.getfixturevalue("demo_virtual")

    async def run() -> None:
        caller = (TwilioCaller(virtual, 100 + len(name)) if transport == "twilio"
                  else LoopSipCaller(virtual))
        await _scenario(virtual, caller, name)

    virtual.run(run())


async def _scenario(live: LiveServer | VirtualServer,
                    caller: TwilioCaller | SipCaller | LoopSipCaller, name: str) -> None:
    registry = live.gateway.registry
    before = {call_id for call_id, _ in registry.items()}
    await caller.start()
    try:
        call = await until(
            lambda: next((c for k, c in registry.items() if k not in before), None)
        )
        for step, arg in SCENARIOS[name]:
            if step == "hear":
                # Heard = its first frame went out (SIP plays in real time; a key press while a
                # prompt plays barges in, exactly as a caller would).
                try:
                    await until(
                        lambda arg=arg: any(
                            arg in u.text and u.first_frame_at for u in call.utterances
                        ),
                        40,
                    )
                except AssertionError:
                    said = [(u.text[:70], u.interrupted) for u in call.utterances]
                    raise AssertionError(f"never heard {arg!r}; said {said}") from None
            elif step == "press":
                await caller.press(arg)
            else:
                await caller.ended()
                expected = TransferTo if arg == "transfer" else EndCall
                assert isinstance(call.outcome, expected), call.outcome
    finally:
        await caller.close()




def test_loadsim_drives_sip_callers(sip_gateway: tuple[LiveServer, Any]) -> None:
    """The load simulator's own SIP callers against the endpoint: the same measurements."""
    from gateway.loadsim.runner import LoadConfig, run_level

    live, _ = sip_gateway
    host, port = _target(live)
    config = LoadConfig(target=f"{host}:{port}", transport="sip", digits=["9"], think_s=0.8,
                        listen_s=0.5, duration_s=2.0, turn_timeout_s=10.0)
    level = run_level(config, 4, 0)
    summary = level.summary()
    print(f"\nloadsim over SIP, 4 callers: {summary['calls']} calls, first audio p50 "
          f"{summary['ttfa_ms']['p50']:.0f} ms, setup p50 {summary['setup_ms']['p50']:.0f} ms, "
          f"jitter p50 {summary['jitter_ms']['p50']:.2f} ms, MOS {summary['mos']:.2f}")
    assert summary["errors"] == 0 and summary["calls"] >= 4, [c.error for c in level.calls]
    assert summary["ttfa_ms"]["p50"] is not None and summary["gaps"] == 0
    answers = [t for c in level.calls for t in c.turns if t.kind == "answer"]
    assert all(t.first_audio_ms is not None for t in answers)
    _idle(live)


# --- RTP inactivity: a caller whose media stops is gone, BYE or not ---------------------------

RTP_TIMEOUT_S = 1.5


def _rtp_timeouts(live: LiveServer) -> float:
    value = live.gateway.metrics.registry.get_sample_value(
        "gateway_calls_inbound_timeouts_total", {"transport": "sip"}
    )
    return value or 0.0


@pytest.mark.slow  # a real peer (baresip/SIPp) on real time
def test_a_call_whose_rtp_never_comes_is_hung_up_after_the_rtp_timeout(
    sip_gateway: tuple[LiveServer, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIPp sends no RTP at all (a phone that died after the ACK, a BYE lost on the way): the
    gateway sends BYE once the timeout passes, and the call's slot is free again."""
    live, _ = sip_gateway
    endpoint = live.gateway.sip
    monkeypatch.setattr(endpoint, "rtp_timeout_s", RTP_TIMEOUT_S)
    before = _rtp_timeouts(live)
    started = time.monotonic()
    result = run_sipp("call_gateway_bye.xml", _target(live), workdir=tmp_path, timeout_s=30)
    took = time.monotonic() - started
    assert result.ok, result.stdout[-3000:]
    print(f"\nno RTP: gateway BYE {took:.2f} s after the INVITE (timeout {RTP_TIMEOUT_S} s)")
    assert RTP_TIMEOUT_S <= took < RTP_TIMEOUT_S + 8
    assert _rtp_timeouts(live) == before + 1
    _idle(live)


@pytest.mark.slow  # a real peer (baresip/SIPp) on real time
def test_a_hold_longer_than_the_rtp_timeout_does_not_end_the_call(
    sip_gateway: tuple[LiveServer, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On hold (a=sendonly) for 3 s with no RTP, twice the timeout: the call survives, resumes
    with a fresh timer, and ends with the caller's own BYE (SIPp fails on a BYE from us)."""
    live, _ = sip_gateway
    monkeypatch.setattr(live.gateway.sip, "rtp_timeout_s", RTP_TIMEOUT_S)
    before = _rtp_timeouts(live)
    result = run_sipp("hold_long.xml", _target(live), workdir=tmp_path, timeout_s=30)
    assert result.ok, result.stdout[-3000:]
    assert _rtp_timeouts(live) == before
    _idle(live)


@pytest.mark.slow  # a real peer (baresip/SIPp) on real time
def test_a_caller_that_keeps_sending_rtp_outlives_the_rtp_timeout(
    sip_gateway: tuple[LiveServer, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """baresip streams RTP every 20 ms: three timeouts later its call is still up."""
    live, _ = sip_gateway
    endpoint = live.gateway.sip
    monkeypatch.setattr(endpoint, "rtp_timeout_s", RTP_TIMEOUT_S)
    before = _rtp_timeouts(live)
    host, port = _target(live)
    with Baresip(tmp_path) as phone:
        phone.dial(f"sip:ivr@{host}:{port}")
        phone.wait_event("CALL_ESTABLISHED")
        media = _wait(lambda: next(iter(endpoint.media.values()), None))
        start = _wait(lambda: media.stats.received, 10)
        # Three timeouts' worth of baresip's 20 ms packets arriving (not a sleep): the call is
        # held that long by packets alone; a timeout on the way ends the wait at once.
        _wait(lambda: media.stats.received >= start + 3 * RTP_TIMEOUT_S / 0.020
              or media.timed_out, 30, "three RTP timeouts of packets")
        assert endpoint.media.get(media.key) is media and not media.timed_out
        assert media.stats.received > 100
        phone.hangup()
        phone.wait_event("CALL_CLOSED", 15)
    assert _rtp_timeouts(live) == before
    _idle(live)
