"""Limits an internet-facing HTTP server needs and uvicorn does not impose by itself.

- :class:`RequestLimits` (ASGI middleware): a request body larger than
  ``GATEWAY_MAX_REQUEST_BYTES`` gets 413 without being read (by its Content-Length, or as soon
  as a chunked body passes the limit): Starlette's ``request.form()`` would otherwise buffer any
  size before the signature check could refuse it. A body that does not arrive within
  ``GATEWAY_HTTP_REQUEST_TIMEOUT_S`` gets 408 (a slow-body "R-U-Dead-Yet" client).
- A client that announces a body and goes away before sending it all (a dropped connection,
  a scanner) is one short log line and ``gateway_http_aborted_requests_total``; Starlette's
  ``ClientDisconnect`` from reading the form would otherwise reach uvicorn as an ASGI error, a
  68-line traceback per 100-byte request, before any signature check.
- :func:`guarded_http_protocol`: uvicorn arms its keep-alive timer only after a response, so a
  client that connects and then sends nothing, or its header section one byte at a time
  (slowloris), holds a socket forever, and with httptools a header section may grow without
  bound. The returned protocol class closes a connection whose header section is not complete
  within the same timeout, or passes :data:`MAX_HEADER_BYTES`.
- :func:`server_limits`: the ``uvicorn.Config`` keyword arguments that apply both, for
  ``gateway serve`` and for tests that want the production server.

WebSocket traffic is not touched here: its frames are bounded by ``GATEWAY_WS_MAX_SIZE`` and
``GATEWAY_MAX_MESSAGE_BYTES``, and its liveness by the Twilio session's idle timeout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from gateway.config import Settings
    from gateway.metrics import Metrics

log = logging.getLogger(__name__)

#: uvicorn's WebSocket protocol for the media streams, named rather than left to ``auto``:
#: websockets' Sans-I/O core driven by uvicorn's own ``asyncio.Protocol``. ``auto`` picks it
#: only from uvicorn 0.50 on (hence the pin in pyproject.toml); before, it picked the legacy
#: implementation (deprecated, a websockets server connection with its own reader task and
#: queue per stream), which costs more to deliver each 20 ms Twilio media message: a bare
#: receiving endpoint, 64 streams at 50 messages/s, 38-42 us of server CPU a message against
#: 46-48 us (three runs), paid 50 times a second per call. Flow control is the same: it stops
#: reading a stream until the app has taken what it already holds.
WS_PROTOCOL = "websockets-sansio"

#: Largest header section (request line and header fields) a client may send. Twilio's webhook
#: and WebSocket upgrade requests are under 2 KiB; h11's own default limit is 16 KiB.
MAX_HEADER_BYTES = 32 * 1024


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class RequestLimits:
    """ASGI middleware: cap HTTP request bodies by size (413) and by time to arrive (408)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, timeout_s: float,
                 metrics: Metrics | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await self._refuse(scope, send, _Refused(
                413, f"body of {length} bytes is over the {self.max_body_bytes}-byte limit"))
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        received = 0
        started = body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                # Past the body, receive() only waits for a disconnect: no deadline on that.
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _Refused(408, f"body not received within {self.timeout_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _Refused(413, f"body is over the {self.max_body_bytes}-byte limit")
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _Refused as refused:
            if started:
                raise
            await self._refuse(scope, send, refused)
        except ClientDisconnect:
            # The client is gone: nobody to answer, nothing wrong with the server.
            client = scope.get("client")
            log.info("%s %s from %s: client went away after %d of %s body bytes",
                     scope.get("method"), scope.get("path"), client[0] if client else "?",
                     received, length if length is not None else "?")
            if self.metrics is not None:
                self.metrics.http_aborted.inc()

    async def _refuse(self, scope: Scope, send: Send, refused: _Refused) -> None:
        client = scope.get("client")
        log.warning("%s %s from %s refused with %d: %s", scope.get("method"), scope.get("path"),
                    client[0] if client else "?", refused.status, refused.reason)
        body = (refused.reason + "\n").encode()
        # The rest of the body is never read, so the connection cannot be reused.
        await send({"type": "http.response.start", "status": refused.status, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            # A malformed value never reaches here: the HTTP parser answers it with 400. More
            # than 18 digits is over any limit (and int() refuses past 4,300 digits).
            if not value.isdigit():
                return None
            return int(value) if len(value) <= 18 else 10**18
    return None


def guarded_http_protocol(base: type[asyncio.Protocol], *, header_timeout_s: float,
                          max_header_bytes: int = MAX_HEADER_BYTES) -> type[asyncio.Protocol]:
    """``base`` (a uvicorn HTTP protocol class) with a deadline and a size cap on every
    request's header section.

    Works with uvicorn's httptools and h11 protocols: both replace ``self.cycle`` when a
    request's header section is complete, which is what is watched here. A connection upgraded
    to a WebSocket has another protocol by then and is left alone.
    """

    class HeaderGuard(base):  # type: ignore[valid-type, misc]
        _guard_timer: asyncio.TimerHandle | None = None
        _guard_cycle: Any = None
        _guard_bytes = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._guard_arm()

        def data_received(self, data: bytes) -> None:
            if self._guard_timer is None and (self.cycle is None or self.cycle.response_complete):
                # The first bytes of the next request on a kept-alive connection.
                self._guard_arm()
            if self._guard_timer is not None:
                self._guard_bytes += len(data)
            super().data_received(data)
            if self._guard_timer is None:
                return
            if self.cycle is not self._guard_cycle or not self._guard_owns_transport():
                self._guard_disarm()  # header section complete, or upgraded to a WebSocket
            elif self._guard_bytes > max_header_bytes:
                self._guard_disarm()
                log.warning("HTTP client %s: header section over %d bytes; closing",
                            _peer(self.transport), max_header_bytes)
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                     b"content-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_disarm()
            super().connection_lost(exc)

        def _guard_arm(self) -> None:
            self._guard_cycle = self.cycle
            self._guard_bytes = 0
            self._guard_timer = self.loop.call_later(header_timeout_s, self._guard_expired)

        def _guard_disarm(self) -> None:
            if self._guard_timer is not None:
                self._guard_timer.cancel()
                self._guard_timer = None

        def _guard_owns_transport(self) -> bool:
            transport = self.transport
            return transport is not None and transport.get_protocol() is self

        def _guard_expired(self) -> None:
            self._guard_timer = None
            if (not self._guard_owns_transport() or self.transport.is_closing()
                    or self.cycle is not self._guard_cycle):
                return
            log.warning("HTTP client %s: no complete request within %g s (%d bytes); closing",
                        _peer(self.transport), header_timeout_s, self._guard_bytes)
            self.transport.close()

    HeaderGuard.__name__ = HeaderGuard.__qualname__ = f"HeaderGuard{base.__name__}"
    return HeaderGuard


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else "?"


def server_limits(settings: Settings) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that bound what one client can hold."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return {
        "http": guarded_http_protocol(AutoHTTPProtocol,
                                      header_timeout_s=settings.http_request_timeout_s),
        # An idle kept-alive connection is closed after this (Twilio reconnects as it needs).
        "timeout_keep_alive": 15,
        # h11 only (httptools has no such limit; the guard above covers both).
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        # No permessage-deflate (RFC 7692) on media streams, whatever the client offers: each
        # stream would hold its own zlib state (tens of KiB with websockets' defaults) and every
        # 20 ms message be inflated, every outbound one deflated, for base64 mu-law, which
        # barely shrinks.
        "ws_per_message_deflate": False,
        "ws": WS_PROTOCOL,
    }
