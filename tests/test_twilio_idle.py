"""The Twilio idle watchdog: a stream that goes silent is ended after exactly the idle timeout,
a stream that keeps talking is not, and a shutdown's cancellation is never mistaken for it.

The session runs against a scripted socket (no server, no model): what it receives, and when,
is all the watchdog looks at.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.websockets import WebSocketState

from gateway.app import GatewayState
from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.twilio.session import TwilioSession
from gateway.twilio.signature import SignatureChecker

GOLDEN = Path(__file__).parent / "golden" / "twilio"
IDLE_S = 0.3


class _ScriptedSocket:
    """Hands the session the messages put in ``inbox``; waits (like a silent peer) when empty."""

    application_state = WebSocketState.CONNECTED

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.closed_with: int | None = None

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send_text(self, text: str) -> None:
        pass

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed_with = code
        self.application_state = WebSocketState.DISCONNECTED

    def text(self, payload: str) -> None:
        self.inbox.put_nowait({"type": "websocket.receive", "text": payload})


def _session(idle_s: float) -> tuple[TwilioSession, _ScriptedSocket, GatewayState]:
    settings = Settings(insecure=True, twilio_idle_timeout_s=idle_s)
    state = GatewayState(settings=settings, metrics=Metrics(),
                         signatures=SignatureChecker(None, None))
    socket = _ScriptedSocket()
    session = TwilioSession(socket, state, dialog=None)  # type: ignore[arg-type]
    return session, socket, state


def _timeouts(state: GatewayState) -> float:
    value = state.metrics.registry.get_sample_value(
        "gateway_calls_inbound_timeouts_total", {"transport": "twilio"})
    return value or 0.0


async def test_a_silent_stream_ends_one_idle_timeout_after_its_last_message() -> None:
    session, socket, state = _session(IDLE_S)
    connected = (GOLDEN / "connected.json").read_text()
    runner = asyncio.create_task(session.run())
    # Keep talking for three timeouts: the watchdog must keep re-arming, not fire.
    started = time.monotonic()
    last = started
    while last - started < 3 * IDLE_S:
        socket.text(connected)
        last = time.monotonic()
        await asyncio.sleep(0.02)
    assert not runner.done()
    await asyncio.wait_for(runner, 5)  # returns: the watchdog ended it
    waited = time.monotonic() - last
    print(f"\nidle watchdog: ended {1000 * waited:.0f} ms after the last message "
          f"(timeout {1000 * IDLE_S:.0f} ms)")
    assert IDLE_S - 0.02 <= waited < IDLE_S + 0.2
    assert _timeouts(state) == 1.0
    assert socket.closed_with == 1000


async def test_a_shutdown_cancel_propagates_and_is_not_counted_as_idle() -> None:
    session, _socket, state = _session(IDLE_S)
    runner = asyncio.create_task(session.run())
    await asyncio.sleep(IDLE_S / 3)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert _timeouts(state) == 0.0


def test_a_zero_idle_timeout_never_ends_a_stream() -> None:
    async def scenario() -> bool:
        session, socket, state = _session(0)
        runner = asyncio.create_task(session.run())
        await asyncio.sleep(0.5)
        alive = not runner.done()
        socket.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
        await asyncio.wait_for(runner, 5)
        return alive and _timeouts(state) == 0.0

    assert asyncio.run(scenario())

