"""How far ahead of the caller's playback the Twilio transport sends audio.

Twilio buffers whatever it is sent; the transport keeps at most ``max_lead_s`` of unplayed audio
there, estimates playback from its own clock, and corrects the estimate from echoed marks (a
mark comes back once everything sent before it has played) and from ``clear``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from starlette.websockets import WebSocketState

from gateway.twilio.protocol import MediaStreamProtocol
from gateway.twilio.session import TwilioTransport

GOLDEN = Path(__file__).parent / "golden" / "twilio"
FRAME = b"\xff" * 160


class _Socket:
    """The two things the transport uses of a Starlette WebSocket."""

    application_state = WebSocketState.CONNECTED

    def __init__(self) -> None:
        self.sent: list[tuple[float, dict[str, object]]] = []

    async def send_text(self, text: str) -> None:
        self.sent.append((time.monotonic(), json.loads(text)))

    async def close(self, code: int = 1000) -> None:
        self.application_state = WebSocketState.DISCONNECTED


def _transport(max_lead_s: float) -> tuple[TwilioTransport, _Socket]:
    protocol = MediaStreamProtocol()
    for name in ("connected", "start"):
        protocol.receive((GOLDEN / f"{name}.json").read_text())
    socket = _Socket()
    return TwilioTransport(socket, protocol, max_lead_s=max_lead_s), socket  # type: ignore[arg-type]


async def test_sending_is_held_back_to_the_maximum_lead() -> None:
    transport, socket = _transport(max_lead_s=0.1)
    t0 = time.monotonic()
    for _ in range(20):  # 400 ms of audio, 20 ms per message
        await transport.send_frames([FRAME])
    elapsed = time.monotonic() - t0
    # The first 100 ms go out at once; the other 300 ms follow playback.
    assert elapsed >= 0.28
    assert transport.lead_s() <= 0.1 + 0.02 + 0.005
    assert len(socket.sent) == 20


async def test_a_short_prompt_goes_out_at_once() -> None:
    transport, _ = _transport(max_lead_s=1.0)
    t0 = time.monotonic()
    await transport.send_frames([FRAME] * 25)  # 500 ms
    await transport.send_frames([FRAME] * 20)  # 900 ms in all
    assert time.monotonic() - t0 < 0.05
    assert transport.lead_s() == pytest.approx(0.9, abs=0.05)


async def test_an_echoed_mark_says_playback_is_further_along_than_the_clock() -> None:
    """A caller whose playback ran ahead (or a test client playing 20x fast) echoes the mark
    early: the next prompt must not wait for audio the transport thinks is still queued."""
    transport, _ = _transport(max_lead_s=1.0)
    await transport.send_frames([FRAME] * 100)  # 2 s sent; 1 s of it held back
    await transport.send_mark("prompt-1")
    assert transport.lead_s() > 0.9
    transport.mark_played("prompt-1")
    assert transport.lead_s() < 0.01
    t0 = time.monotonic()
    await transport.send_frames([FRAME] * 50)
    await transport.send_frames([FRAME])
    assert time.monotonic() - t0 < 0.05  # no wait: Twilio's buffer is known to be empty


async def test_a_late_mark_never_makes_the_lead_grow() -> None:
    transport, _ = _transport(max_lead_s=1.0)
    await transport.send_frames([FRAME] * 5)  # 100 ms
    await transport.send_mark("short")
    time.sleep(0.15)  # the clock says it has all played...
    await transport.send_frames([FRAME] * 10)  # ...so this restarts playback: 200 ms ahead
    transport.mark_played("short")  # the mark of the old prompt, echoed late
    assert transport.lead_s() == pytest.approx(0.2, abs=0.03)


async def test_clear_empties_the_buffer_and_forgets_outstanding_marks() -> None:
    transport, socket = _transport(max_lead_s=1.0)
    await transport.send_frames([FRAME] * 40)
    await transport.send_mark("old")
    await transport.clear()
    assert transport.lead_s() == 0
    assert socket.sent[-1][1]["event"] == "clear"
    await transport.send_frames([FRAME] * 25)
    transport.mark_played("old")  # Twilio echoes cleared marks at once
    assert transport.lead_s() == pytest.approx(0.5, abs=0.03)


async def test_unknown_mark_names_are_ignored() -> None:
    transport, _ = _transport(max_lead_s=1.0)
    await transport.send_frames([FRAME] * 25)
    transport.mark_played("never-sent")
    assert transport.lead_s() == pytest.approx(0.5, abs=0.03)


async def test_outcomes_left_behind_by_other_replicas_are_bounded() -> None:
    """/twilio/after-stream may reach another replica: its outcome must not stay forever."""
    from gateway.call import HangUp
    from gateway.twilio import session

    outcomes = {f"CA{i:032d}": HangUp() for i in range(session.MAX_OUTCOMES)}
    protocol = MediaStreamProtocol()
    for name in ("connected", "start"):
        protocol.receive((GOLDEN / f"{name}.json").read_text())
    transport = TwilioTransport(_Socket(), protocol, outcomes)  # type: ignore[arg-type]
    transport.call_sid = "CA" + "f" * 32
    await transport.end(HangUp())
    assert len(outcomes) == session.MAX_OUTCOMES
    assert "CA" + "f" * 32 in outcomes and f"CA{0:032d}" not in outcomes
