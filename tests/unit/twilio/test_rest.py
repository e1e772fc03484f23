"""Outcomes delivered as live-call updates through Twilio's REST API, over real sockets.

A real gateway (tiny model, a script whose menu transfers on 0 and 5) is configured with an
account SID and GATEWAY_TWILIO_API_BASE pointing at :class:`fake_twilio_api.FakeTwilioApi` on
loopback; a test Twilio (:class:`twilio_client.FakeTwilioCall`) streams the call. Each request
the gateway makes is checked against Twilio's documented form: ``POST
/2010-04-01/Accounts/{AccountSid}/Calls/{CallSid}.json``, HTTP basic auth, a form body whose
``Twiml`` is the outcome. The test Twilio ends the stream after an update, as Twilio does when
new TwiML replaces ``<Connect><Stream>``. Retries, the timeout, the after-stream fallback and
the "ask again" answer for a call this replica did not run are here; the same behaviour across
two gateway processes behind a real round-robin proxy is tests/e2e/test_fleet.py.
"""

from __future__ import annotations

import asyncio
import logging
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from twilio.request_validator import RequestValidator

from tests.support.fake_twilio_api import FakeTwilioApi
from tests.support.lines import write_transfer_line
from tests.support.servers import AUTH_TOKEN, LiveServer, serve
from tests.support.twilio_client import FakeTwilioCall

pytestmark = pytest.mark.slow

ACCOUNT_SID = "AC" + "a1" * 16

@pytest.fixture(scope="module")
def api() -> Iterator[FakeTwilioApi]:
    with FakeTwilioApi(ACCOUNT_SID, (ACCOUNT_SID, AUTH_TOKEN)) as fake:
        yield fake


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, api: FakeTwilioApi,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    line = write_transfer_line(tmp_path_factory.mktemp("line"))
    with serve({"model": str(tiny_model_dir), "script": str(line), "cache_dir": "",
                "max_calls": 2, "barge_in_on_speech": False,
                "twilio_account_sid": ACCOUNT_SID, "twilio_api_base": api.url,
                "twilio_api_timeout_s": 0.5}) as live:
        yield live


def _metric(live: LiveServer, name: str, **labels: str) -> float:
    return live.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


async def _post(live: LiveServer, path: str, form: dict[str, str]) -> ET.Element:
    url = f"{live.base_url}{path}"
    signature = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(url, data=form, headers={"X-Twilio-Signature": signature})
    assert response.status_code == 200, response.text
    return ET.fromstring(response.text)


def _form(call_sid: str) -> dict[str, str]:
    return {"CallSid": call_sid, "AccountSid": ACCOUNT_SID, "From": "+15550001111",
            "To": "+15550002222", "CallStatus": "in-progress"}


async def _connect(live: LiveServer, n: int) -> FakeTwilioCall:
    """A call through the voice webhook, its stream started and its call up on the gateway."""
    sid = f"CA{n:032d}"
    assert (await _post(live, "/twilio/voice", _form(sid))).find("Connect") is not None
    call = FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid=sid, stream_sid=f"MZ{n:032d}")
    await call.connect()
    await call.start({"CallSid": sid, "From": "+15550001111", "To": "+15550002222"})
    await call.wait_for(lambda: live.gateway.registry.get(sid) is not None, timeout=20)
    return call


async def _twilio_ends_the_stream(call: FakeTwilioCall) -> None:
    """What Twilio does once new TwiML replaces <Connect><Stream>: stop, then close."""
    await call.send_stop()
    await call.close()


def _twiml(update_form: dict[str, str]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """The verbs of an update's Twiml: (tag, text, children as (tag, text))."""
    root = ET.fromstring(update_form["Twiml"])
    assert root.tag == "Response"
    return [(verb.tag, (verb.text or "").strip(),
             [(child.tag, (child.text or "").strip()) for child in verb]) for verb in root]


@pytest.mark.parametrize(("key", "dial"), [
    ("0", ("Dial", "+15550100200", [])),
    ("5", ("Dial", "", [("Sip", "sip:agent@pbx.example.com")])),
])
async def test_a_transfer_is_a_live_call_update_and_twilio_ends_the_stream(
    gateway: LiveServer, api: FakeTwilioApi, key: str,
    dial: tuple[str, str, list[tuple[str, str]]],
) -> None:
    n = 10 + int(key)
    call = await _connect(gateway, n)
    sid = call.call_sid
    delivered = _metric(gateway, "gateway_twilio_call_updates_total", result="delivered")
    await call.send_dtmf(key)
    update = (await asyncio.to_thread(api.wait_for, lambda: api.for_call(sid)))[0]
    # Twilio's documented request: the call's own resource, basic auth, a form with Twiml.
    assert update.method == "POST"
    assert update.path == f"/2010-04-01/Accounts/{ACCOUNT_SID}/Calls/{sid}.json"
    assert update.auth == (ACCOUNT_SID, AUTH_TOKEN)
    assert update.content_type.startswith("application/x-www-form-urlencoded")
    assert _twiml(update.form) == [dial]
    # Delivered, and the stream left for Twilio to end (closing it from here would make Twilio
    # request after-stream, which another replica could answer while the update lands).
    server_call = gateway.gateway.registry.get(sid)
    assert server_call is not None
    transport = server_call.transport
    # The gateway runs on its own thread: the metric counts the delivery a moment before the
    # transport records the hand-off, so wait for both.
    await call.wait_for(lambda: _metric(gateway, "gateway_twilio_call_updates_total",
                                        result="delivered") == delivered + 1
                        and transport.handed_off, timeout=10)  # type: ignore[attr-defined]
    assert transport.connected  # type: ignore[attr-defined]
    assert not call.closed.is_set()
    await _twilio_ends_the_stream(call)
    await call.wait_for(lambda: sid not in gateway.gateway.registry, timeout=10)
    assert gateway.gateway.admission.seats() == 0
    assert len(api.for_call(sid)) == 1  # one update, no retry


async def test_a_transient_api_failure_is_retried_and_delivered(
    gateway: LiveServer, api: FakeTwilioApi,
) -> None:
    sid = f"CA{20:032d}"
    api.plans[sid] = [503, 429]
    retries = _metric(gateway, "gateway_twilio_call_update_retries_total")
    call = await _connect(gateway, 20)
    await call.send_dtmf("9")
    updates = await asyncio.to_thread(api.wait_for, lambda: len(api.for_call(sid)) >= 3 and
                                      api.for_call(sid))
    assert [u.answer for u in updates] == [503, 429, 200]
    assert all(_twiml(u.form) == [("Hangup", "", [])] for u in updates)
    assert _metric(gateway, "gateway_twilio_call_update_retries_total") == retries + 2
    assert updates[1].at - updates[0].at >= 0.5 and updates[2].at - updates[1].at >= 1.0
    await _twilio_ends_the_stream(call)
    await call.wait_for(lambda: sid not in gateway.gateway.registry, timeout=10)


async def test_when_every_attempt_fails_the_call_falls_back_on_after_stream(
    gateway: LiveServer, api: FakeTwilioApi, caplog: pytest.LogCaptureFixture,
) -> None:
    sid = f"CA{21:032d}"
    api.plans[sid] = [500, 500, 500]
    failed = _metric(gateway, "gateway_twilio_call_updates_total", result="failed")
    call = await _connect(gateway, 21)
    with caplog.at_level(logging.WARNING, logger="gateway.twilio.rest"):
        await call.send_dtmf("0")
        # The gateway closes the stream itself once it gives up: Twilio then asks after-stream.
        await call.wait_for(lambda: call.closed.is_set(), timeout=20)
    assert call.close_code == 1000
    assert [u.answer for u in api.for_call(sid)] == [500, 500, 500]
    assert _metric(gateway, "gateway_twilio_call_updates_total", result="failed") == failed + 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and sid in errors[0].getMessage()
    assert "HTTP 500" in errors[0].getMessage()
    after = await _post(gateway, "/twilio/after-stream", _form(sid))
    assert [(verb.tag, verb.text) for verb in after] == [("Dial", "+15550100200")]


async def test_a_call_twilio_says_is_over_is_not_retried(
    gateway: LiveServer, api: FakeTwilioApi,
) -> None:
    sid = f"CA{22:032d}"
    api.plans[sid] = [400]  # 21220: the call is not in progress (the caller hung up)
    call = await _connect(gateway, 22)
    await call.send_dtmf("0")
    await call.wait_for(lambda: call.closed.is_set(), timeout=20)
    assert [u.answer for u in api.for_call(sid)] == [400]


async def test_a_timed_out_update_is_not_repeated_once_twilio_has_ended_the_stream(
    gateway: LiveServer, api: FakeTwilioApi,
) -> None:
    """The answer to the first attempt is lost (no reply within the 0.5 s timeout) but Twilio
    took it and ends the stream: a second update would restart the <Dial> already ringing."""
    sid = f"CA{23:032d}"
    api.plans[sid] = ["hang"]
    moot = _metric(gateway, "gateway_twilio_call_updates_total", result="moot")
    call = await _connect(gateway, 23)
    await call.send_dtmf("0")
    await asyncio.to_thread(api.wait_for, lambda: api.for_call(sid))
    await _twilio_ends_the_stream(call)
    await call.wait_for(lambda: _metric(gateway, "gateway_twilio_call_updates_total",
                                        result="moot") == moot + 1, timeout=10)
    assert len(api.for_call(sid)) == 1


async def test_twilio_keeping_the_stream_after_an_update_gets_it_closed(
    gateway: LiveServer, api: FakeTwilioApi, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The update was taken but the stream stays up (it should not): the gateway closes it
    after HANDOFF_S, so the seat is not held for good; after-stream still has the outcome."""
    monkeypatch.setattr("gateway.twilio.stream.HANDOFF_S", 0.3)
    sid = f"CA{24:032d}"
    call = await _connect(gateway, 24)
    await call.send_dtmf("0")
    await call.wait_for(lambda: call.closed.is_set(), timeout=10)
    # One update; two when the first took longer than this fixture's 0.5 s API timeout on a
    # busy machine and was retried (a retry repeats the same TwiML, which Twilio takes again).
    updates = api.for_call(sid)
    assert call.close_code == 1000 and 1 <= len(updates) <= 3
    assert all(update.form == updates[0].form for update in updates)
    await call.wait_for(lambda: sid not in gateway.gateway.registry, timeout=10)
    after = await _post(gateway, "/twilio/after-stream", _form(sid))
    assert [(verb.tag, verb.text) for verb in after] == [("Dial", "+15550100200")]
    await call.close()


async def test_a_stream_refused_for_capacity_hears_the_busy_message_by_update(
    gateway: LiveServer, api: FakeTwilioApi,
) -> None:
    first, second = await _connect(gateway, 30), await _connect(gateway, 31)
    stray = FakeTwilioCall(gateway.ws_url, AUTH_TOKEN, call_sid=f"CA{32:032d}",
                           stream_sid=f"MZ{32:032d}")
    await stray.connect()
    await stray.start(stream_media=False)  # no webhook here (another replica answered it)
    update = (await asyncio.to_thread(api.wait_for, lambda: api.for_call(stray.call_sid)))[0]
    busy = gateway.gateway.settings.busy_message
    assert _twiml(update.form) == [("Say", busy, []), ("Hangup", "", [])]
    assert gateway.gateway.registry.count() == 2  # never over budget
    await _twilio_ends_the_stream(stray)
    for call in (first, second):
        await _twilio_ends_the_stream(call)
    await first.wait_for(lambda: not gateway.gateway.registry, timeout=10)


async def test_after_stream_for_a_call_this_replica_did_not_run_asks_again_then_hangs_up(
    gateway: LiveServer,
) -> None:
    """On a fleet the outcome may be on its way by REST, or recorded on the replica that ran
    the stream: wait a second and ask again through the balancer, twice, then hang up."""
    sid = "CA" + "f" * 32
    after_stream = path = "/twilio/after-stream"
    answers = []
    for _ in range(3):
        root = await _post(gateway, path, _form(sid))
        answers.append([verb.tag for verb in root])
        redirect = root.find("Redirect")
        if redirect is None:
            break
        assert root.find("Pause") is not None and root.find("Pause").get("length") == "1"  # type: ignore[union-attr]
        assert redirect.get("method") == "POST"
        url = urlsplit(redirect.text or "")
        assert f"{url.scheme}://{url.netloc}" == gateway.base_url and url.path == after_stream
        path = f"{url.path}?{url.query}"
        assert parse_qs(url.query) == {"hop": [str(len(answers))]}
    assert answers == [["Pause", "Redirect"], ["Pause", "Redirect"], ["Hangup"]]
