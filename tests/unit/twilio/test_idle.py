"""The inactivity watch on a Twilio stream: a stream that goes silent is ended exactly one idle
timeout after its last message, a stream that keeps talking is not, and a shutdown's
cancellation is never mistaken for it.

The session runs against a scripted socket (no server, no model) on a virtual clock: what it
receives, and when, is all the watch looks at, and no test here waits in real time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.websockets import WebSocketState

from gateway.call import Admission, CallLifecycle, CallRegistry
from gateway.metrics import Metrics
from gateway.readiness import Readiness
from gateway.twilio.stream import Outcomes, TwilioConfig, TwilioStream
from tests.support.clocks import VirtualClock
from tests.support.paths import GOLDEN as GOLDEN_ROOT

GOLDEN = GOLDEN_ROOT / "twilio"
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


class _NoDialogs:
    def for_call(self, call: Any) -> Any:
        raise AssertionError("no call starts in these tests")


def _session(idle_s: float) -> tuple[TwilioStream, _ScriptedSocket, Metrics, VirtualClock]:
    clock = VirtualClock()
    metrics = Metrics()
    readiness = Readiness(metrics, clock)
    lifecycle = CallLifecycle(admission=Admission(4, readiness, clock, metrics),
                              registry=CallRegistry(metrics), readiness=readiness,
                              dialogs=_NoDialogs(), clock=clock, metrics=metrics)
    socket = _ScriptedSocket()
    session = TwilioStream(socket, lifecycle, TwilioConfig(idle_timeout_s=idle_s),  # type: ignore[arg-type]
                           Outcomes(), metrics)
    return session, socket, metrics, clock


def _timeouts(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value(
        "gateway_calls_inbound_timeouts_total", {"transport": "twilio"})
    return value or 0.0


async def test_a_silent_stream_ends_one_idle_timeout_after_its_last_message() -> None:
    session, socket, metrics, clock = _session(IDLE_S)
    connected = (GOLDEN / "connected.json").read_text()
    runner = asyncio.create_task(session.run())
    await asyncio.sleep(0)
    # Keep talking for three timeouts: the watch must keep re-arming, not fire.
    started = clock.now()
    last = started
    while last - started < 3 * IDLE_S:
        socket.text(connected)
        await clock.advance(0)  # the session reads it now
        last = clock.now()
        await clock.advance(0.02)
    assert not runner.done()
    while not runner.done():
        await clock.advance(0.01)
    await runner  # returns: the watch ended it
    waited = clock.now() - last
    print(f"\nidle watch: ended {1000 * waited:.0f} ms after the last message "
          f"(timeout {1000 * IDLE_S:.0f} ms)")
    assert waited == pytest.approx(IDLE_S, abs=1e-9)
    assert _timeouts(metrics) == 1.0
    assert socket.closed_with == 1000


async def test_a_shutdown_cancel_propagates_and_is_not_counted_as_idle() -> None:
    session, _socket, metrics, clock = _session(IDLE_S)
    runner = asyncio.create_task(session.run())
    await clock.advance(IDLE_S / 3)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert _timeouts(metrics) == 0.0


async def test_a_zero_idle_timeout_never_ends_a_stream() -> None:
    session, socket, metrics, clock = _session(0)
    runner = asyncio.create_task(session.run())
    await clock.advance(3600)
    assert not runner.done()
    socket.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
    await asyncio.wait_for(runner, 5)
    assert _timeouts(metrics) == 0.0
