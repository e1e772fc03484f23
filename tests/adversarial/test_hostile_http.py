"""Hostile HTTP against the production server: ``gateway serve``'s uvicorn settings
(:func:`gateway.http_limits.server_limits`) around the real app, on an ephemeral port.

What tests/e2e/test_twilio_e2e.py already covers (a missing, wrong-token, tampered or wrong-URL
signature gets 403) is not repeated. Here:

- forged and malformed webhooks (duplicated parameters and headers, oversized or binary
  signatures, bodies that are not forms): 403 or 400, never 5xx, and no state (no call
  reservation, no outcome read or consumed);
- bodies over ``GATEWAY_MAX_REQUEST_BYTES``: 413 without being read, by Content-Length or once
  a chunked body passes the limit, while a body just under it is served;
- slow clients: idle connections, header sections sent a byte at a time (slowloris), endless
  header sections, bodies that trickle. Each is measured: how long it held its socket, and how
  fast healthy requests were answered meanwhile. A Twilio WebSocket outlives the header deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest
import uvicorn
from twilio.request_validator import RequestValidator

from gateway.app import create_app
from gateway.call import TransferTo
from gateway.config import Settings
from gateway.http_limits import MAX_HEADER_BYTES, server_limits
from tests.support import local_http
from tests.support.net import free_socket
from tests.support.servers import AUTH_TOKEN, LiveServer, uvicorn_server
from tests.support.twilio_client import FakeTwilioCall

TIMEOUT_S = 2.0
MAX_BODY = 64 * 1024
FORM = {"CallSid": "CA" + "1" * 32, "From": "+15550001111", "To": "+15550002222",
        "AccountSid": "AC" + "0" * 32, "Direction": "inbound"}


@contextlib.contextmanager
def production_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """The app behind the uvicorn settings ``gateway serve`` uses, with a 2 s request timeout."""
    sock = free_socket()
    port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    settings = Settings(twilio_auth_token=AUTH_TOKEN, public_url=base_url,  # type: ignore[arg-type]
                        device="cpu", model=str(tiny_model_dir), barge_in_on_speech=False,
                        http_request_timeout_s=TIMEOUT_S, max_request_bytes=MAX_BODY)
    app = create_app(settings)
    config = uvicorn.Config(app, log_level="warning", ws_max_size=settings.ws_max_size,
                            lifespan="on", **server_limits(settings))
    listening = threading.Event()
    server = uvicorn_server(config, listening.set)
    gateway = app.state.gateway
    settled = threading.Event()
    gateway.readiness.when_settled(settled.set)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        if not (settled.wait(120) and gateway.readiness.ready and listening.wait(30)):
            raise RuntimeError(f"gateway did not become ready: {gateway.readiness.load_error}")
        yield LiveServer(base_url, f"ws://127.0.0.1:{port}/twilio/media", gateway, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _clear_reservations(live: LiveServer) -> None:
    admission = live.gateway.admission
    for key in admission.reservations():
        admission.release(key)


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with production_server(tiny_model_dir) as server:
        yield server


class _Multi(dict[str, list[str]]):
    """Repeated form keys, as the twilio library reads them (``getlist``)."""

    def getlist(self, key: str) -> list[str]:
        return self[key]


def _sign(url: str, form: dict[str, str] | list[tuple[str, str]]) -> str:
    params = _Multi()
    for key, value in (form.items() if isinstance(form, dict) else form):
        params.setdefault(key, []).append(value)
    return RequestValidator(AUTH_TOKEN).compute_signature(url, params)


def _rejections(live: LiveServer) -> float:
    counter = live.gateway.metrics.signature_rejections
    return sum(sample.value for metric in counter.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


# --- forged and malformed webhooks ------------------------------------------------------------


def _forgeries(url: str) -> dict[str, tuple[dict[str, str | bytes], bytes]]:
    """name -> (headers, body) of requests that must get 403 or 400."""
    good = _sign(url, FORM)
    body = urlencode(FORM).encode()
    other = (url.replace("/voice", "/after-stream") if url.endswith("/voice")
             else url.replace("/after-stream", "/voice"))
    form_type = {"content-type": "application/x-www-form-urlencoded"}
    return {
        # The signature covers the form once; the body carries CallSid twice.
        "duplicated parameter": ({**form_type, "x-twilio-signature": good},
                                 body + b"&CallSid=CA" + b"2" * 32),
        "parameter renamed by case": ({**form_type, "x-twilio-signature": good},
                                      body.replace(b"CallSid", b"callsid")),
        "signature of the other webhook": ({**form_type, "x-twilio-signature": _sign(
            other, FORM)}, body),
        "signature twice, the good one second": (
            {**form_type, "x-twilio-signature": "AAAA", "X-Twilio-Signature": good}, body),
        "huge signature": ({**form_type, "x-twilio-signature": "A" * 16_000}, body),
        "binary signature": ({**form_type, "x-twilio-signature": b"\xff\xfe\x80"}, body),
        # The account signs with HMAC-SHA256: a SHA-1 signature (a downgrade) does not do.
        "sha256 settings, sha1 signature": (
            {**form_type, "x-twilio-signature": good,
             "x-twilio-webhooks-signature-settings": "algorithm=HMAC_SHA256"}, body),
        "unknown algorithm": (
            {**form_type, "x-twilio-signature": good,
             "x-twilio-webhooks-signature-settings": "algorithm=NONE"}, body),
        "bad percent-encoding": ({**form_type, "x-twilio-signature": good},
                                 body + b"&From=%zz%%"),
        "non-utf-8 form": ({**form_type, "x-twilio-signature": good}, body + b"&From=\xff\xfe"),
        "json instead of a form": ({"content-type": "application/json",
                                    "x-twilio-signature": good}, b'{"CallSid": "CA1"}'),
        "multipart with 1,200 fields, under the size limit": (
            {"content-type": "multipart/form-data; boundary=b", "x-twilio-signature": good},
            b"".join(b'--b\r\nContent-Disposition: form-data; name="%d"\r\n\r\n\r\n' % i
                     for i in range(1200)) + b"--b--\r\n"),
        "multipart with 5,000 fields": (
            {"content-type": "multipart/form-data; boundary=b", "x-twilio-signature": good},
            b"".join(b'--b\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % i
                     for i in range(5000)) + b"--b--\r\n"),
    }


@pytest.mark.parametrize("path", ["/twilio/voice", "/twilio/after-stream"])
async def test_forged_or_malformed_webhooks_get_403_or_400_and_leave_no_state(
    live: LiveServer, path: str
) -> None:
    url = f"{live.base_url}{path}"
    gateway = live.gateway
    # A transfer the attacker would like to read or erase: only Twilio's request may consume it.
    gateway.outcomes.record(FORM["CallSid"], TransferTo("+15555550100"))
    reservations = gateway.admission.reservations()
    rejections = _rejections(live)
    seen: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=10) as client:
        for name, (headers, body) in _forgeries(url).items():
            response = await client.post(url, content=body, headers=headers)
            seen[name] = response.status_code
            assert "<Response>" not in response.text, name
    print(f"\n{path}: {seen}")
    assert all(status in (400, 403, 413) for status in seen.values()), seen
    assert gateway.admission.reservations() == reservations
    assert gateway.outcomes.get(FORM["CallSid"]) == TransferTo("+15555550100")
    assert _rejections(live) > rejections
    gateway.outcomes.take(FORM["CallSid"])


def test_a_signed_webhook_without_call_parameters_reserves_nothing(live: LiveServer) -> None:
    url = f"{live.base_url}/twilio/voice"
    reservations = live.gateway.admission.reservations()
    response = local_http.post(url, data={}, headers={"x-twilio-signature": _sign(url, {})},
                               timeout=10)
    assert response.status_code == 200 and "<Parameter" not in response.text
    assert live.gateway.admission.reservations() == reservations


def test_the_forgeries_are_refused_for_their_forgery_not_their_shape(live: LiveServer) -> None:
    # The checker: the same requests, correctly signed over what they carry, are served. (The
    # duplicated parameter signed with both values is what Twilio itself would send.)
    url = f"{live.base_url}/twilio/voice"
    pairs = [*FORM.items(), ("CallSid", "CA" + "2" * 32)]
    response = local_http.post(url, content=urlencode(pairs).encode(), timeout=10, headers={
        "content-type": "application/x-www-form-urlencoded", "x-twilio-signature":
        _sign(url, pairs)})
    assert response.status_code == 200 and "<Connect" in response.text
    _clear_reservations(live)


# --- body size --------------------------------------------------------------------------------


async def _raw(live: LiveServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = live.base_url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _status(reader: asyncio.StreamReader, timeout: float) -> tuple[int | None, float]:
    """The response's status code (None if the server closed without one) and when."""
    t0 = time.monotonic()
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (ConnectionError, TimeoutError):
        return None, time.monotonic() - t0
    return (int(line.split()[1]) if line.startswith(b"HTTP/") else None), time.monotonic() - t0


async def test_a_huge_declared_body_gets_413_before_it_is_sent(live: LiveServer) -> None:
    reader, writer = await _raw(live)
    writer.write(b"POST /twilio/voice HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/x-www-form-urlencoded\r\n"
                 b"Content-Length: 50000000\r\n\r\nFrom=")
    await writer.drain()
    status, after = await _status(reader, 5)
    writer.close()
    print(f"\n50 MB declared: {status} after {1000 * after:.0f} ms, 5 bytes sent")
    assert status == 413 and after < 2


async def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(live: LiveServer) -> None:
    reader, writer = await _raw(live)
    writer.write(b"POST /twilio/voice HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/x-www-form-urlencoded\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (8192, b"a" * 8192)
    sent = 0
    status: int | None = None
    t0 = time.monotonic()
    with contextlib.suppress(ConnectionError):
        while sent < 10_000_000 and time.monotonic() - t0 < 10:
            writer.write(chunk)
            await writer.drain()
            sent += 8192
            with contextlib.suppress(TimeoutError):
                line = await asyncio.wait_for(reader.readline(), 0.001)
                if line.startswith(b"HTTP/"):
                    status = int(line.split()[1])
                    break
    if status is None:
        status, _ = await _status(reader, 5)
    writer.close()
    print(f"\nchunked body: {status} after {sent // 1024} KiB sent (limit {MAX_BODY // 1024} KiB)")
    assert status == 413 and sent < 1_000_000


def test_a_body_just_under_the_limit_is_served(live: LiveServer) -> None:
    url = f"{live.base_url}/twilio/voice"
    form = {**FORM, "Padding": "x" * (MAX_BODY - 400)}
    body = urlencode(form).encode()
    assert MAX_BODY - 1000 < len(body) <= MAX_BODY
    response = local_http.post(url, content=body, timeout=10, headers={
        "content-type": "application/x-www-form-urlencoded", "x-twilio-signature":
        _sign(url, form)})
    assert response.status_code == 200 and "<Connect" in response.text
    _clear_reservations(live)


# --- aborted bodies ---------------------------------------------------------------------------


class _Records(logging.Handler):
    """Every record, from the gateway and from uvicorn (whose loggers do not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.aborted = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record not in self.records:
            self.records.append(record)
        if "went away" in record.getMessage():
            self.aborted.set()


@pytest.mark.parametrize("path", ["/twilio/voice", "/twilio/after-stream"])
def test_a_client_gone_mid_body_is_one_short_line_and_a_counter(
        live: LiveServer, path: str) -> None:
    """A client announces a body, sends part of it and disconnects: before, Starlette's
    ClientDisconnect reached uvicorn as an ASGI error (a 68-line traceback, before any
    signature check: 4.6 KB of log per 100-byte request)."""
    handler = _Records()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("gateway")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    registry = live.gateway.metrics.registry

    def aborted() -> float:
        return registry.get_sample_value("gateway_http_aborted_requests_total") or 0.0

    before = aborted()
    try:
        host, port = live.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n"
                         "Content-Type: application/x-www-form-urlencoded\r\n"
                         "Content-Length: 1000\r\n\r\n".encode() + b"CallSid=CA" + b"1" * 90)
        assert handler.aborted.wait(10), [r.getMessage()[:80] for r in handler.records]
        # The server is unharmed; by the time it answers the next request the aborted one's
        # task has long finished (nothing is left to log for it).
        assert local_http.get(f"{live.base_url}/healthz", timeout=10).status_code == 200
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    [line] = [r for r in handler.records if "went away" in r.getMessage()]
    assert line.getMessage() == (f"POST {path} from 127.0.0.1: client went away after 100 of "
                                 "1000 body bytes")
    assert line.levelno == logging.INFO and line.exc_info is None
    loud = [r for r in handler.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage()[:80] for r in loud]
    assert aborted() == before + 1


# --- slow clients -----------------------------------------------------------------------------


async def _held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                trickle: bytes | None, limit_s: float) -> tuple[float, int | None]:
    """Send ``trickle`` a byte every 100 ms (or nothing) until the server closes the socket;
    returns how long it stayed open and the status it answered, if any."""
    t0 = time.monotonic()
    status: int | None = None
    sent = 0
    while time.monotonic() - t0 < limit_s:
        if trickle is not None:
            try:
                writer.write(trickle[sent % len(trickle) : sent % len(trickle) + 1])
                await writer.drain()
            except ConnectionError:
                break
            sent += 1
        try:
            data = await asyncio.wait_for(reader.read(200), 0.1)
        except TimeoutError:
            continue
        except ConnectionError:
            break
        if data.startswith(b"HTTP/"):
            status = int(data.split()[1])
        if not data or status is not None:
            # Closed (EOF), or answered: wait for the close itself.
            with contextlib.suppress(TimeoutError, ConnectionError):
                while await asyncio.wait_for(reader.read(200), max(0.01, limit_s)):
                    pass
            break
    writer.close()
    return time.monotonic() - t0, status


async def test_slow_and_idle_clients_are_cut_off_while_healthy_requests_flow(
    live: LiveServer,
) -> None:
    url = f"{live.base_url}/twilio/voice"
    slowloris_head = (b"POST /twilio/voice HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/x-www-form-urlencoded\r\n"
                      + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 40) for i in range(200)))
    slow_body_head = (b"POST /twilio/voice HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/x-www-form-urlencoded\r\n"
                      b"Content-Length: 1000\r\n\r\n")
    limit_s = 5 * TIMEOUT_S
    latencies: list[float] = []
    failures: list[str] = []
    stop = asyncio.Event()

    async def healthy() -> None:
        form = {**FORM}
        async with httpx.AsyncClient(timeout=5) as client:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    health = await client.get(f"{live.base_url}/healthz")
                    hook = await client.post(url, data=form,
                                             headers={"x-twilio-signature": _sign(url, form)})
                    if health.status_code != 200 or hook.status_code != 200:
                        failures.append(f"{health.status_code}/{hook.status_code}")
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                latencies.append(1000 * (time.monotonic() - t0))
                await asyncio.sleep(0.1)

    async def attacker(kind: str) -> tuple[str, float, int | None]:
        reader, writer = await _raw(live)
        if kind == "idle":
            held, status = await _held(reader, writer, None, limit_s)
        elif kind == "slowloris":
            held, status = await _held(reader, writer, slowloris_head, limit_s)
        else:
            writer.write(slow_body_head)
            await writer.drain()
            held, status = await _held(reader, writer, b"a", limit_s)
        return kind, held, status

    watcher = asyncio.create_task(healthy())
    await asyncio.sleep(0.3)
    kinds = ["idle"] * 20 + ["slowloris"] * 20 + ["slow body"] * 10
    results = await asyncio.gather(*(attacker(kind) for kind in kinds))
    stop.set()
    await watcher
    _clear_reservations(live)
    by_kind: dict[str, list[tuple[float, int | None]]] = {}
    for kind, held, status in results:
        by_kind.setdefault(kind, []).append((held, status))
    for kind, rows in by_kind.items():
        held_s = [h for h, _ in rows]
        print(f"\n{kind} x{len(rows)}: held {min(held_s):.2f}-{max(held_s):.2f} s, answers "
              f"{sorted({s for _, s in rows}, key=str)}", end="")
    print(f"\nhealthy requests meanwhile: {len(latencies)}, p50 {statistics.median(latencies):.0f}"
          f" ms, max {max(latencies):.0f} ms, failures {failures[:3]}")
    # Each slow client lost its socket at the deadline (plus scheduling slack), not at the
    # test's own limit; the slow body got its 408.
    for kind, rows in by_kind.items():
        assert all(held < TIMEOUT_S + 1.5 for held, _ in rows), (kind, rows)
    assert {s for _, s in by_kind["slow body"]} == {408}
    assert not failures and len(latencies) >= 10 and max(latencies) < 2000


async def test_an_endless_header_section_gets_431(live: LiveServer) -> None:
    reader, writer = await _raw(live)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent = 0
    t0 = time.monotonic()
    with contextlib.suppress(ConnectionError):
        while sent < 10 * MAX_HEADER_BYTES:
            writer.write(b"a" * 4096)
            await writer.drain()
            sent += 4096
            await asyncio.sleep(0.001)
    status, _ = await _status(reader, 5)
    writer.close()
    print(f"\nendless header: {status} after {sent // 1024} KiB in "
          f"{1000 * (time.monotonic() - t0):.0f} ms (cap {MAX_HEADER_BYTES // 1024} KiB)")
    # The 431 is best effort: closing a socket with unread bytes in it resets the connection,
    # and the reset may overtake the answer. What counts is where the server stopped reading.
    assert status in (431, None) and sent <= 3 * MAX_HEADER_BYTES


async def test_a_media_stream_outlives_the_header_deadline(live: LiveServer) -> None:
    # The guard is for header sections: once a connection is a WebSocket it is not touched.
    async with FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid="CA" + "5" * 32,
                              stream_sid="MZ" + "5" * 32) as call:
        await call.start()
        await asyncio.sleep(2 * TIMEOUT_S + 0.5)
        assert not call.closed.is_set()
        assert call.events("media")
        await call.send_stop()
        await call.wait_for(lambda: call.closed.is_set(), timeout=10)
    assert call.close_code == 1000


async def test_a_media_stream_is_never_compressed_whatever_the_client_offers(
    live: LiveServer,
) -> None:
    """A client offering permessage-deflate (the websockets library does by default) used to get
    it: zlib state held per stream and a deflate or inflate on every 20 ms message."""
    import websockets

    signature = RequestValidator(AUTH_TOKEN).compute_signature(live.ws_url, {})
    async with websockets.connect(live.ws_url, compression="deflate",
                                  additional_headers={"X-Twilio-Signature": signature}) as ws:
        assert ws.request is not None and "permessage-deflate" in (
            ws.request.headers.get("Sec-WebSocket-Extensions") or "")
        assert ws.response is not None
        assert ws.response.headers.get("Sec-WebSocket-Extensions") is None


async def test_a_media_stream_is_served_by_the_sans_io_websocket_protocol(
    live: LiveServer,
) -> None:
    """``gateway serve`` names uvicorn's Sans-I/O WebSocket protocol for the media streams: it
    delivers a message for less CPU than the legacy one (``bench/media_cpu.py --baseline
    legacy-ws``), which ``auto`` picked before uvicorn 0.50 and a config change could bring
    back for every call."""
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    async with FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid="CA" + "6" * 32,
                              stream_sid="MZ" + "6" * 32) as call:
        await call.start()
        await call.wait_for(lambda: bool(call.events("media")), timeout=10)
        kinds = {type(c).__name__ for c in live.server.server_state.connections}
        assert WebSocketsSansIOProtocol.__name__ in kinds, kinds
        await call.send_stop()
        await call.wait_for(lambda: call.closed.is_set(), timeout=10)
    assert call.close_code == 1000
