"""A bot server for tests: a real WebSocket server (websockets) on 127.0.0.1 that records what
the gateway sends and sends what the test tells it to, in the test's event loop.

It checks each handshake's ``X-Twilio-Signature`` with the twilio library's validator, as a bot
written for ConversationRelay does, and keeps the verdict per connection.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import websockets
from twilio.request_validator import RequestValidator
from websockets.asyncio.server import Server, ServerConnection, serve


@dataclass
class Session:
    """One connection from the gateway."""

    ws: ServerConnection
    path: str
    signature_valid: bool
    received: list[dict[str, Any]] = field(default_factory=list)
    #: Raw text of every frame received (what a bot's own parser sees).
    raw: list[str] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    close_code: int | None = None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.received if m.get("type") == kind]

    async def send(self, **message: Any) -> None:
        await self.ws.send(json.dumps(message))

    async def send_raw(self, data: str | bytes) -> None:
        await self.ws.send(data)

    async def tokens(self, text: str, *, every: float = 0.0, size: int = 4, last: bool = True,
                     **flags: Any) -> None:
        """Stream ``text`` as ``text`` tokens of about ``size`` characters, ``last`` on the end
        (unless ``last`` is false: the answer goes on)."""
        pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
        for i, piece in enumerate(pieces):
            await self.send(type="text", token=piece, last=last and i == len(pieces) - 1,
                            **flags)
            if every:
                await asyncio.sleep(every)

    async def wait(self, kind: str, count: int = 1, timeout: float = 60.0) -> dict[str, Any]:
        """The ``count``-th message of ``kind`` (waits up to ``timeout`` s of real time)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.of(kind)
            if len(found) >= count:
                return found[count - 1]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {kind!r} #{count} from the gateway in {timeout} s; "
                                     f"got {[m.get('type') for m in self.received]}")
            await asyncio.sleep(0.02)


class RelayTestBot:
    """The server; ``sessions`` in the order the gateway connected."""

    def __init__(self, auth_token: str | None = None, *, ssl_context: ssl.SSLContext | None = None,
                 reject_status: int | None = None) -> None:
        self.auth_token = auth_token
        self.ssl_context = ssl_context
        self.reject_status = reject_status
        self.sessions: list[Session] = []
        self._server: Server | None = None
        self.host = "127.0.0.1"
        self.port = 0

    @property
    def url(self) -> str:
        scheme = "wss" if self.ssl_context is not None else "ws"
        host = "localhost" if self.ssl_context is not None else self.host
        return f"{scheme}://{host}:{self.port}/relay"

    async def start(self) -> RelayTestBot:
        self._server = await serve(self._handle, self.host, 0, ssl=self.ssl_context,
                                   process_request=self._check)
        self.port = self._server.sockets[0].getsockname()[1] if self._server.sockets else 0
        for sock in self._server.sockets:
            self.port = sock.getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _check(self, connection: ServerConnection, request: Any) -> Any:
        if self.reject_status is not None:
            return connection.respond(self.reject_status, "no\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        request = ws.request
        assert request is not None
        signature = request.headers.get("X-Twilio-Signature", "")
        valid = bool(self.auth_token) and RequestValidator(self.auth_token).validate(
            self.url.rsplit("/relay", 1)[0] + request.path, {}, signature)
        session = Session(ws, request.path, valid)
        self.sessions.append(session)
        try:
            async for raw in ws:
                text = raw if isinstance(raw, str) else raw.decode()
                session.raw.append(text)
                session.received.append(json.loads(text))
        except websockets.ConnectionClosed:
            pass
        finally:
            session.close_code = ws.close_code
            session.closed.set()

    async def session(self, n: int = 1, timeout: float = 60.0) -> Session:
        """The ``n``-th connection (waits for it)."""
        deadline = time.monotonic() + timeout
        while len(self.sessions) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"the gateway never connected (#{n}) in {timeout} s")
            await asyncio.sleep(0.02)
        return self.sessions[n - 1]
