"""One call budget per replica (GATEWAY_MAX_CALLS), enforced on both transports.

Twilio calls are admitted by the voice webhook, which holds a place until the Media Stream
connects; a caller beyond the budget hears the busy message and is hung up. A stream that
arrives without the webhook (TwiML served elsewhere) is admitted on its own, or closed with
1013. SIP asks the same admission: an INVITE beyond the budget gets 486.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import AUTH_TOKEN, LiveServer, serve
from sip_peers import run_sipp
from twilio.request_validator import RequestValidator
from twilio_client import FakeTwilioCall

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with serve({"model": str(tiny_model_dir), "max_calls": 2, "sip": "127.0.0.1:0",
                "sip_allow": "127.0.0.1/32", "sip_t1_ms": 100,
                "rtp_ports": "25000-25099"}) as live:
        yield live


def _voice(live: LiveServer, call_sid: str) -> ET.Element:
    url = f"{live.base_url}/twilio/voice"
    form = {"CallSid": call_sid, "From": "+15550001111", "To": "+15550002222"}
    signature = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
    response = httpx.post(url, data=form, headers={"X-Twilio-Signature": signature}, timeout=10)
    assert response.status_code == 200
    return ET.fromstring(response.text)


def _refused(live: LiveServer, reason: str) -> float:
    return live.gateway.metrics.calls_refused.labels("twilio", reason)._value.get()


def _call(live: LiveServer, n: int) -> FakeTwilioCall:
    return FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid=f"CA{n:032d}",
                          stream_sid=f"MZ{n:032d}", playback_speed=20)


async def test_the_budget_is_shared_by_webhook_reservations_streams_and_sip(
    small: LiveServer, tmp_path: Path
) -> None:
    gateway = small.gateway
    first, second, third = (f"CA{n:032d}" for n in (1, 2, 3))
    assert _voice(small, first).find("Connect") is not None
    assert _voice(small, second).find("Connect") is not None
    # Two places held: the third caller is told and hung up, with no stream.
    busy = _voice(small, third)
    assert [child.tag for child in busy] == ["Say", "Hangup"]
    assert busy[0].text == gateway.settings.busy_message
    assert _refused(small, "at_capacity") == 1
    # SIP sees the budget taken by the reservations: 486.
    assert gateway.sip is not None and gateway.sip.local_addr is not None
    sip_target = gateway.sip.local_addr
    result = run_sipp("busy.xml", sip_target, workdir=tmp_path)
    assert result.ok, result.stdout[-2000:]

    async with _call(small, 1) as a, _call(small, 2) as b:
        await a.start()
        await b.start()
        await a.wait_for(lambda: a.events("media"), timeout=60)
        await b.wait_for(lambda: b.events("media"), timeout=60)
        assert gateway.registry.count("twilio") == 2 and not gateway.admission.reservations()
        # A stream nobody's webhook admitted, with the replica full: closed, try again later.
        async with _call(small, 4) as stray:
            await stray.start(stream_media=False)
            await stray.wait_for(lambda: stray.closed.is_set(), timeout=10)
            assert stray.close_code == 1013
        assert gateway.registry.count() == 2
    # Both calls over: room again, for SIP too.
    await b.wait_for(lambda: gateway.registry.count() == 0, timeout=10)
    options = run_sipp("options.xml", sip_target, workdir=tmp_path)
    assert options.ok, options.stdout[-2000:]
    assert gateway.admission.free() == 2

    # What an operator scrapes: turns and first audio split by transport and source, refusals
    # by reason, the drain flag, GPU memory (0 here: no CUDA).
    metrics = httpx.get(f"{small.base_url}/metrics", timeout=5).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line and not line.startswith("#")}
    # (No lines configured: every call is the default line's.)
    assert samples['gateway_turns_total{line="default",source="live",transport="twilio"}'] == 2
    assert samples['gateway_first_audio_seconds_count{line="default",source="live",'
                   'transport="twilio"}'] == 2
    assert samples['gateway_calls_refused_total{reason="at_capacity",transport="twilio"}'] == 2
    assert samples["gateway_draining"] == 0
    assert samples['gateway_gpu_memory_bytes{kind="allocated"}'] == 0


# Reservations lapsing and the order of refusal reasons are tested on a virtual clock in
# tests/test_call_lifecycle.py (a 30 s reservation there costs no real time).
