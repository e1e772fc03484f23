"""The WebSocket to a bot: the I/O shell around :mod:`gateway.bot.protocol`.

It only pumps: connect (signed, certificates checked), send a message, receive the next one as
a typed message (or the :class:`~gateway.errors.BotMessageError` it is), close. Every way the
bot can be unreachable or gone becomes one :class:`~gateway.errors.BotError` saying which:
refused, TLS certificate not trusted, handshake answered with an HTTP status, no answer to the
upgrade in time, the socket closed or its keepalive pings unanswered.
"""

from __future__ import annotations

import logging
import ssl

import websockets
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from gateway.bot.protocol import (
    MAX_MESSAGE_BYTES,
    SIGNATURE_HEADER,
    BotMessage,
    DtmfOut,
    ErrorOut,
    Interrupt,
    Prompt,
    Setup,
    parse_message,
    signature,
)
from gateway.errors import BotError, BotMessageError

__all__ = ["BotConnection", "OutMessage"]

log = logging.getLogger(__name__)

OutMessage = Setup | Prompt | DtmfOut | Interrupt | ErrorOut

#: Frames up to this size are read (and a message over :data:`MAX_MESSAGE_BYTES` answered with
#: ``error``); a bigger one closes the socket (1009), as websockets enforces it while reading.
_MAX_FRAME = 16 * MAX_MESSAGE_BYTES


class BotConnection:
    """One call's WebSocket to its bot."""

    def __init__(self, url: str, *, auth_token: str | None, ssl_context: ssl.SSLContext | None,
                 open_timeout: float, ping_interval: float | None = 20.0) -> None:
        self.url = url
        self._token = auth_token
        self._ssl = ssl_context
        self._open_timeout = open_timeout
        self._ping_interval = ping_interval
        self._ws: ClientConnection | None = None

    async def connect(self) -> None:
        """Open the socket (BotError when the bot cannot be reached)."""
        headers = {}
        if self._token:
            headers[SIGNATURE_HEADER] = signature(self.url, self._token)
        secure = self.url.startswith("wss:")
        try:
            self._ws = await connect(
                self.url, additional_headers=headers,
                ssl=(self._ssl or ssl.create_default_context()) if secure else None,
                open_timeout=self._open_timeout, max_size=_MAX_FRAME,
                ping_interval=self._ping_interval, ping_timeout=self._ping_interval,
                user_agent_header="qwen3-tts-ivr-gateway", compression=None,
            )
        except InvalidStatus as exc:
            raise BotError(f"the bot at {self.url} refused the connection: HTTP "
                           f"{exc.response.status_code}") from None
        except ssl.SSLCertVerificationError as exc:
            raise BotError(f"the bot at {self.url} has a certificate this gateway does not "
                           f"trust: {exc.verify_message}") from None
        except TimeoutError:
            raise BotError(f"the bot at {self.url} did not answer the connection within "
                           f"{self._open_timeout:g} s") from None
        except (OSError, InvalidHandshake, InvalidURI) as exc:
            raise BotError(f"could not connect to the bot at {self.url}: {exc}") from None

    async def send(self, message: OutMessage) -> None:
        """Send one message (BotError once the socket is gone)."""
        ws = self._ws
        if ws is None:
            raise BotError("not connected to the bot")
        try:
            await ws.send(message.serialize())
        except ConnectionClosed as exc:
            raise BotError(_closed(exc)) from None

    async def receive(self) -> BotMessage | BotMessageError:
        """The bot's next message, or the error it is (answer it with ``error``); BotError once
        the socket is gone."""
        ws = self._ws
        if ws is None:
            raise BotError("not connected to the bot")
        try:
            data = await ws.recv()
        except ConnectionClosed as exc:
            raise BotError(_closed(exc)) from None
        try:
            return parse_message(data)
        except BotMessageError as exc:
            return exc

    async def close(self, code: int = 1000, reason: str = "") -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                await ws.close(code, reason)
            except (ConnectionClosed, OSError):
                pass


def _closed(exc: ConnectionClosed) -> str:
    rcvd = exc.rcvd
    if rcvd is None:
        return "the connection to the bot was lost (no close frame: it went away, or did not " \
               "answer keepalive pings)"
    reason = f", {rcvd.reason!r}" if rcvd.reason else ""
    return f"the bot closed the connection (code {rcvd.code}{reason})"


# websockets logs every failed handshake at INFO with a traceback: the BotError says it once.
logging.getLogger(websockets.__name__ + ".client").setLevel(logging.WARNING)
