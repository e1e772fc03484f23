"""Reservations and the drain end to end, on virtual time: the real app over a real socket.

The gateway (the greeter, tiny model) and its test Twilio share one virtual-time loop, so a
voice webhook's 5 s reservation lapsing and the default 110 s drain grace run in no real time
(test_drain.py sends a real SIGTERM to a real process; test_call_lifecycle.py checks the same
rules on the lifecycle alone).
"""

from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from twilio.request_validator import RequestValidator

from tests.support.servers import AUTH_TOKEN, VirtualServer, on_virtual_time, serve_virtual
from tests.support.twilio_client import FakeTwilioCall


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path) -> Iterator[VirtualServer]:
    with serve_virtual({"model": str(tiny_model_dir), "max_calls": 2,
                        "greeting": "Hello."}) as live:
        yield live


async def _voice(live: VirtualServer, call_sid: str) -> ET.Element:
    url = f"{live.base_url}/twilio/voice"
    form = {"CallSid": call_sid, "From": "+15550001111", "To": "+15550002222"}
    signature = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(url, data=form, headers={"X-Twilio-Signature": signature})
    assert response.status_code == 200
    return ET.fromstring(response.text)


def _call(live: VirtualServer, n: int) -> FakeTwilioCall:
    return FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid=f"CA{n:032d}",
                          stream_sid=f"MZ{n:032d}", playback_speed=20)


@on_virtual_time("small")
async def test_webhook_reservations_whose_streams_never_come_lapse_after_5_s(
    small: VirtualServer,
) -> None:
    admission = small.gateway.admission
    assert small.gateway.twilio.reservation_s == 5  # the default GATEWAY_TWILIO_RESERVATION_S
    assert (await _voice(small, "CA" + "7" * 32)).find("Connect") is not None
    assert (await _voice(small, "CA" + "8" * 32)).find("Connect") is not None
    busy = await _voice(small, "CA" + "9" * 32)
    assert [child.tag for child in busy] == ["Say", "Hangup"]
    t0 = asyncio.get_running_loop().time()
    await asyncio.sleep(4.5)
    assert admission.refusal() == "at_capacity"
    await asyncio.sleep(1)
    assert admission.refusal() is None and not admission.reservations()
    assert asyncio.get_running_loop().time() - t0 >= 5  # virtual seconds, no real ones


@on_virtual_time("small")
async def test_a_drain_keeps_calls_up_for_the_grace_period_then_hangs_up(
    small: VirtualServer,
) -> None:
    gateway = small.gateway
    assert gateway.settings.drain_grace_s == 110  # the default: ECS's stopTimeout less 10 s
    async with _call(small, 1) as call:
        await call.start()
        await call.wait_for(lambda: call.events("media"), timeout=60)
        drain = asyncio.create_task(gateway.drain())
        await call.wait_for(lambda: gateway.readiness.draining, timeout=10)
        async with httpx.AsyncClient(base_url=small.base_url, timeout=10) as client:
            ready = await client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        busy = await _voice(small, "CA" + "5" * 32)
        assert [child.tag for child in busy] == ["Say", "Hangup"]
        # The call in flight carries on: a key still gets its spoken answer, 100 s in.
        await asyncio.sleep(100)
        assert not call.closed.is_set() and not drain.done()
        server_call = gateway.registry.get(call.call_sid)
        assert server_call is not None
        said = len(server_call.utterances)
        await call.send_dtmf("7")
        reply = await call.wait_for(
            lambda: len(server_call.utterances) > said and server_call.utterances[-1], timeout=30)
        assert reply.text == "You pressed seven."  # the key, read by GATEWAY_FREE_TEXT=full
        # The grace is over: hung up (a clean close), and the drain returns.
        await asyncio.wait_for(drain, 60)
        await call.wait_for(lambda: call.closed.is_set(), timeout=30)
        assert call.close_code == 1000
        started_at = gateway.clock.now()
    assert not gateway.registry and started_at - server_call.answered_at >= 110
    gateway.readiness.draining = False  # the module's gateway serves the next test
    gateway.metrics.draining.set(0)
