"""Two gateways behind a real round-robin load balancer, no stickiness: the shipped deployment.

Everything is real and on loopback: two ``gateway serve`` processes (tiny model on CPU, the
transfer line of tests/unit/twilio/test_rest.py, signatures checked, ``GATEWAY_MAX_CALLS=2`` each,
the fleet settings: ``GATEWAY_TWILIO_ACCOUNT_SID`` for live-call updates and
``GATEWAY_TWILIO_RESERVATION_S=0``), HAProxy (Debian's ``haproxy``) in front of them balancing
every request and WebSocket upgrade round-robin (it names the replica that answered in
``X-Served-By``), Twilio's REST API stood in for by :class:`fake_twilio_api.FakeTwilioApi`, and
the test as Twilio: it POSTs the voice webhook and after-stream through the proxy, signed over
the public (proxy) URL, and streams the call with :class:`twilio_client.FakeTwilioCall`.

Round-robin sends a call's webhook to one replica and its stream to the other, which is what
used to break: the transfer decided on the stream's replica was answered ``<Hangup/>`` by the
webhook's, and the webhook's replica held a phantom seat for 30 s (refusing callers, holding
its drain). Here the transfer reaches Twilio as a live-call update from the stream's replica,
after-stream on the replica that does not know the call asks again until the one that does
answers, each replica admits streams against its own budget only (a refused one still hears
the busy message), and a drained replica exits as soon as its own calls are over.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from twilio.request_validator import RequestValidator

from tests.support import local_http
from tests.support.fake_twilio_api import FakeTwilioApi
from tests.support.gateway_process import GatewayProcess
from tests.support.lines import write_transfer_line
from tests.support.metrics import metric
from tests.support.net import free_port
from tests.support.servers import AUTH_TOKEN
from tests.support.twilio_client import FakeTwilioCall
from tests.support.waiting import until_in_thread, wait_until

pytestmark = pytest.mark.slow

ACCOUNT_SID = "AC" + "b2" * 16


class HAProxy:
    """HAProxy in the foreground on 127.0.0.1: round-robin over ``backends``, HTTP and
    WebSocket, no stickiness (like the shipped ALB, infra/alb.tf)."""

    def __init__(self, workdir: Path, backends: dict[str, int], port: int) -> None:
        self.port = port
        self.config = workdir / "haproxy.cfg"
        servers = "".join(f"    server {name} 127.0.0.1:{port}\n"
                          for name, port in backends.items())
        # A request is balanced on its own whatever connection it came on (no
        # prefer-last-server, no cookie): what a fleet without stickiness does to Twilio's
        # webhooks and its stream.
        self.config.write_text(
            "global\n    maxconn 256\n"
            "defaults\n    mode http\n    timeout connect 2s\n    timeout client 60s\n"
            "    timeout server 60s\n    timeout tunnel 60s\n"
            f"frontend twilio\n    bind 127.0.0.1:{self.port}\n    default_backend gateways\n"
            "backend gateways\n    balance roundrobin\n"
            "    http-response set-header X-Served-By %[srv_name]\n" + servers)
        binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
        assert Path(binary).exists(), (
            "haproxy is not installed: apt-get install -y --no-install-recommends haproxy")
        self.command = [binary, "-db", "-f", str(self.config)]
        self.log_path = workdir / "haproxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HAProxy:
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

        def listening() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"haproxy exited: {self.log_path.read_text()}")
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", self.port)) == 0

        wait_until(listening, 10, "haproxy to listen")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._log.close()


@dataclass
class Fleet:
    proxy: HAProxy
    replicas: dict[str, GatewayProcess]
    api: FakeTwilioApi

    def other(self, name: str) -> str:
        return next(other for other in self.replicas if other != name)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("fleet")
    line = write_transfer_line(workdir)
    proxy_port = free_port(kind=socket.SOCK_STREAM)
    public = f"http://127.0.0.1:{proxy_port}"
    with FakeTwilioApi(ACCOUNT_SID, (ACCOUNT_SID, AUTH_TOKEN)) as api:
        env = {
            "GATEWAY_PUBLIC_URL": public,  # what Twilio requests: the balancer's address
            "GATEWAY_TWILIO_AUTH_TOKEN": AUTH_TOKEN,
            "GATEWAY_TWILIO_ACCOUNT_SID": ACCOUNT_SID,
            "GATEWAY_TWILIO_API_BASE": api.url,
            "GATEWAY_TWILIO_RESERVATION_S": "0",
            "GATEWAY_SCRIPT": str(line),
            "GATEWAY_CACHE_DIR": "",
            "GATEWAY_MAX_CALLS": "2",
            "GATEWAY_BARGE_IN_ON_SPEECH": "false",
            "GATEWAY_DRAIN_GRACE_S": "60",
            # Two calls each: a small batch and cache keep the two start-ups short.
            "GATEWAY_BATCH_ROWS": "2",
            "GATEWAY_MAX_SEQ_LEN": "512",
        }
        replicas = {name: GatewayProcess(tiny_model_dir, workdir, dict(env), name=name,
                                         insecure=False) for name in ("gw-a", "gw-b")}
        proxy = HAProxy(workdir, {name: r.port for name, r in replicas.items()}, proxy_port)
        try:
            for replica in replicas.values():
                replica.start()
            for replica in replicas.values():
                replica.wait_ready()
            with proxy:
                yield Fleet(proxy, replicas, api)
        finally:
            for replica in replicas.values():
                replica.stop()


# --- Twilio's side, through the proxy ---------------------------------------------------------


async def _post(fleet: Fleet, path: str, form: dict[str, str]) -> tuple[str, ET.Element]:
    """POST as Twilio does (signed over the public URL), on a new connection; which replica
    answered and its TwiML."""
    url = f"{fleet.proxy.url}{path}"
    signature = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(url, data=form, headers={"X-Twilio-Signature": signature})
    assert response.status_code == 200, response.text
    return response.headers["x-served-by"], ET.fromstring(response.text)


async def _through(fleet: Fleet) -> str:
    """Some other client's request through the balancer (it takes one turn of the rotation)."""
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(f"{fleet.proxy.url}/healthz")
    assert response.status_code == 200
    return response.headers["x-served-by"]


def _form(sid: str) -> dict[str, str]:
    return {"CallSid": sid, "AccountSid": ACCOUNT_SID, "From": "+15550001111",
            "To": "+15550002222", "Direction": "inbound", "CallStatus": "in-progress"}


@dataclass
class FleetCall:
    call: FakeTwilioCall
    webhook_by: str
    stream_by: str


async def _dial(fleet: Fleet, n: int) -> FleetCall:
    """Twilio placing call ``n``: the voice webhook, then the <Stream> it names; the call is up
    (or refused) on whichever replica the balancer picked for the stream."""
    sid = f"CA{n:032d}"
    webhook_by, twiml = await _post(fleet, "/twilio/voice", _form(sid))
    connect = twiml.find("Connect")
    assert connect is not None, f"{webhook_by} answered {ET.tostring(twiml)!r}"
    assert connect.get("action") == f"{fleet.proxy.url}/twilio/after-stream"
    stream = connect.find("Stream")
    assert stream is not None
    ws_url = stream.get("url") or ""
    assert ws_url == f"ws://127.0.0.1:{fleet.proxy.port}/twilio/media"
    params = {p.get("name") or "": p.get("value") or "" for p in stream.findall("Parameter")}
    call = FakeTwilioCall(ws_url, AUTH_TOKEN, call_sid=sid, stream_sid=f"MZ{n:032d}")
    await call.connect()
    await call.start(params)
    return FleetCall(call, webhook_by, call.response_headers["x-served-by"])


async def _twilio_ends_the_stream(call: FakeTwilioCall) -> None:
    """What Twilio does once a live-call update replaces <Connect><Stream>."""
    await call.send_stop()
    await call.close()


# --- each replica's own view ------------------------------------------------------------------


def _metric(replica: GatewayProcess, name: str, **labels: str) -> float:
    """``name``'s value summed over the samples carrying ``labels`` (others, such as a call
    metric's ``line``, whatever their value); 0 for a series not created yet."""
    return metric(replica.base_url, name, default=0.0, **labels)


def _calls(replica: GatewayProcess) -> float:
    return _metric(replica, "gateway_calls_active", transport="twilio")


def _twiml(form: dict[str, str]) -> list[tuple[str, str]]:
    return [(verb.tag, (verb.text or "").strip()) for verb in ET.fromstring(form["Twiml"])]


# --- the tests --------------------------------------------------------------------------------


async def test_a_transfer_decided_on_the_stream_replica_reaches_twilio(fleet: Fleet) -> None:
    placed = await _dial(fleet, 1)
    sid = placed.call.call_sid
    assert placed.stream_by == fleet.other(placed.webhook_by)  # round-robin, no stickiness
    streaming = fleet.replicas[placed.stream_by]
    await until_in_thread(lambda: _calls(streaming) == 1,
                          what="the call up on the stream's replica")
    await placed.call.send_dtmf("0")
    update = (await asyncio.to_thread(fleet.api.wait_for, lambda: fleet.api.for_call(sid)))[0]
    # The right call, the right account, Twilio's documented request, <Dial> the target.
    assert update.path == f"/2010-04-01/Accounts/{ACCOUNT_SID}/Calls/{sid}.json"
    assert update.auth == (ACCOUNT_SID, AUTH_TOKEN)
    assert _twiml(update.form) == [("Dial", "+15550100200")]
    await until_in_thread(lambda: _metric(streaming, "gateway_twilio_call_updates_total",
                                 result="delivered") == 1, what="the update delivered")
    assert not placed.call.closed.is_set()  # left for Twilio to end
    await _twilio_ends_the_stream(placed.call)
    await until_in_thread(lambda: _calls(streaming) == 0, what="the call over")
    webhook = fleet.replicas[placed.webhook_by]
    assert _metric(webhook, "gateway_seats", kind="reservation") == 0  # nothing held there


async def test_when_the_update_fails_after_stream_finds_the_replica_that_knows(
    fleet: Fleet,
) -> None:
    sid = f"CA{2:032d}"
    fleet.api.plans[sid] = [503, 503, 503]  # Twilio's API down for this call's update
    placed = await _dial(fleet, 2)
    streaming = fleet.replicas[placed.stream_by]
    await until_in_thread(lambda: _calls(streaming) == 1,
                          what="the call up on the stream's replica")
    await placed.call.send_dtmf("0")
    # Every attempt failed: the stream's replica closes the stream, and Twilio asks.
    await placed.call.wait_for(lambda: placed.call.closed.is_set(), timeout=30)
    assert [u.answer for u in fleet.api.for_call(sid)] == [503, 503, 503]
    assert _metric(streaming, "gateway_twilio_call_updates_total", result="failed") == 1
    assert re.search(rf"call {sid}: Twilio REST update with <Dial> failed after 3 attempt",
                     streaming.log())
    path, answers = "/twilio/after-stream", []
    for _ in range(3):
        by, twiml = await _post(fleet, path, _form(sid))
        answers.append((by, [verb.tag for verb in twiml]))
        redirect = twiml.find("Redirect")
        if redirect is None:
            dial = twiml.find("Dial")
            assert dial is not None and dial.text == "+15550100200"
            break
        path = (redirect.text or "").removeprefix(fleet.proxy.url)
    # The replica that did not run the stream said "wait, ask again" (never <Hangup/>); the
    # next request through the balancer reached the one that recorded the transfer.
    assert answers == [(placed.webhook_by, ["Pause", "Redirect"]),
                       (placed.stream_by, ["Dial"])]


async def test_each_replica_keeps_its_own_budget_and_drains_without_phantom_seats(
    fleet: Fleet,
) -> None:
    # Two calls whose webhooks one replica answers and whose streams the other takes.
    first, second = await _dial(fleet, 3), await _dial(fleet, 4)
    assert first.webhook_by == second.webhook_by and first.stream_by == second.stream_by
    webhooks, streams = (fleet.replicas[first.webhook_by], fleet.replicas[first.stream_by])
    await until_in_thread(lambda: _calls(streams) == 2,
                          what="both calls up on the streams' replica")
    # The webhooks' replica holds no phantom seats: its third webhook still gets <Connect>.
    assert _metric(webhooks, "gateway_seats", kind="reservation") == 0
    assert _metric(webhooks, "gateway_seats", kind="call") == 0
    third = await _dial(fleet, 5)
    assert third.stream_by == first.stream_by
    # ...but the streams' replica is full: it refuses the third stream against its own
    # budget, and the caller hears the busy message by a live-call update.
    sid = third.call.call_sid
    update = (await asyncio.to_thread(fleet.api.wait_for, lambda: fleet.api.for_call(sid)))[0]
    ready = local_http.get(f"{streams.base_url}/readyz", timeout=5).json()
    assert _twiml(update.form)[0][0] == "Say" and _twiml(update.form)[1] == ("Hangup", "")
    assert ready["calls"] == 2 and ready["max_calls"] == 2
    assert _metric(streams, "gateway_seats", kind="call") == 2  # never over budget
    assert _metric(streams, "gateway_calls_refused_total", transport="twilio",
                   reason="at_capacity") == 1
    await _twilio_ends_the_stream(third.call)
    # A stream that lands on the replica with room is taken there, whoever took the webhook.
    webhook_by, twiml = await _post(fleet, "/twilio/voice", _form(f"CA{6:032d}"))
    assert twiml.find("Connect") is not None and webhook_by == first.webhook_by
    assert await _through(fleet) == first.stream_by  # another client's turn
    local = FakeTwilioCall(f"ws://127.0.0.1:{fleet.proxy.port}/twilio/media", AUTH_TOKEN,
                           call_sid=f"CA{6:032d}", stream_sid=f"MZ{6:032d}")
    await local.connect()
    await local.start({"CallSid": local.call_sid})
    assert local.response_headers["x-served-by"] == first.webhook_by
    await until_in_thread(lambda: _calls(webhooks) == 1,
                          what="the call up on the webhooks' replica")

    # A rolling deploy drains the webhooks' replica: its three webhooks for streams that went
    # elsewhere hold nothing, so it exits as soon as its one call is over.
    webhooks.signal(signal.SIGTERM)
    await until_in_thread(
        lambda: local_http.get(f"{webhooks.base_url}/readyz", timeout=5).status_code == 503,
        what="the drain to begin")
    await local.send_dtmf("9")  # the caller picks "goodbye": a hang-up by live-call update
    hangup = (await asyncio.to_thread(fleet.api.wait_for,
                                      lambda: fleet.api.for_call(local.call_sid)))[0]
    assert _twiml(hangup.form) == [("Hangup", "")]
    await _twilio_ends_the_stream(local)
    ended = time.monotonic()
    code = await asyncio.to_thread(webhooks.wait_exit, 20)
    exited_after = time.monotonic() - ended
    assert code == 0, webhooks.log()
    assert exited_after < 10, f"exited {exited_after:.1f} s after its last call"
    # The other replica kept its calls through it all, and ends them the same way.
    assert _calls(streams) == 2
    for placed in (first, second):
        await placed.call.send_dtmf("9")
        await asyncio.to_thread(fleet.api.wait_for,
                                lambda p=placed: fleet.api.for_call(p.call.call_sid))
        await _twilio_ends_the_stream(placed.call)
    await until_in_thread(lambda: _metric(streams, "gateway_seats", kind="call") == 0,
                          what="seats free")
