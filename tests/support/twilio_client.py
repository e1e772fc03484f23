"""A test Twilio: signs its upgrade, streams caller audio at 20 ms, echoes marks on playback.

Behaves like Twilio's side of a bidirectional Media Stream closely enough to exercise the
gateway over a real socket: ``connected`` + ``start``, 20 ms inbound ``media`` paced on the
event loop's monotonic clock, ``dtmf``, and ``mark`` echoes sent when the simulated playback of
everything received before the mark has finished (immediately on ``clear``, as Twilio does).

All its times are the event loop's (``loop.time()``): the real monotonic clock on an ordinary
loop, virtual time in a :class:`virtual_time.VirtualTimeLoop` shared with the gateway. Only
:meth:`FakeTwilioCall.wait_for` gives up on real time, so a test never hangs however fast
virtual time runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any

import websockets
from twilio.request_validator import RequestValidator
from websockets.asyncio.client import ClientConnection

FRAME_S = 0.02
SILENCE_FRAME = base64.b64encode(b"\xff" * 160).decode()


@dataclass
class Received:
    at: float
    message: dict[str, Any]


@dataclass
class FakeTwilioCall:
    ws_url: str
    auth_token: str
    call_sid: str = "CA" + "0" * 32
    stream_sid: str = "MZ" + "0" * 32
    sign: bool = True
    signature: str | None = None
    received: list[Received] = field(default_factory=list)
    started_at: float = 0.0
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    close_code: int | None = None
    close_reason: str = ""
    marks_echoed: list[str] = field(default_factory=list)
    media_sent: int = 0
    #: When the last inbound media message started on its way (loop time): the gateway's idle
    #: timer can start no earlier.
    last_media_at: float | None = None
    #: Simulated playback runs this many times faster than real time (marks come back sooner).
    playback_speed: float = 1.0

    def __post_init__(self) -> None:
        self._ws: ClientConnection | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._playout_end = 0.0
        self._pending_marks: list[tuple[float, str]] = []
        self._seq = 0
        self._new_message = asyncio.Event()
        self._marks_changed = asyncio.Event()
        self._speech: list[str] = []

    @staticmethod
    def now() -> float:
        """The event loop's time (virtual in a VirtualTimeLoop)."""
        return asyncio.get_running_loop().time()

    # --- connection ---------------------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        if not self.sign:
            return {}
        signature = self.signature or RequestValidator(self.auth_token).compute_signature(
            self.ws_url, {}
        )
        return {"X-Twilio-Signature": signature}

    async def connect(self) -> None:
        self._ws = await websockets.connect(
            self.ws_url, additional_headers=self.headers(), max_size=2**20
        )
        self._tasks.append(asyncio.create_task(self._reader()))

    async def start(
        self, custom: dict[str, str] | None = None, *, stream_media: bool = True
    ) -> None:
        await self.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        self.started_at = self.now()
        await self.send_json(
            {
                "event": "start",
                "sequenceNumber": self._next_seq(),
                "start": {
                    "accountSid": "AC" + "0" * 32,
                    "streamSid": self.stream_sid,
                    "callSid": self.call_sid,
                    "tracks": ["inbound"],
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                    "customParameters": custom or {},
                },
                "streamSid": self.stream_sid,
            }
        )
        if stream_media:
            self._tasks.append(asyncio.create_task(self._inbound_media()))
        self._tasks.append(asyncio.create_task(self._mark_echoer()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._ws is not None:
            await self._ws.close()

    async def __aenter__(self) -> FakeTwilioCall:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- sending ------------------------------------------------------------------------------

    def _next_seq(self) -> str:
        self._seq += 1
        return str(self._seq)

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.send_raw(json.dumps(message))

    async def send_raw(self, data: str | bytes) -> None:
        assert self._ws is not None
        await self._ws.send(data)

    async def send_dtmf(self, digit: str) -> float:
        await self.send_json(
            {
                "event": "dtmf",
                "streamSid": self.stream_sid,
                "sequenceNumber": self._next_seq(),
                "dtmf": {"track": "inbound_track", "digit": digit},
            }
        )
        return self.now()

    async def send_stop(self) -> None:
        await self.send_json(
            {
                "event": "stop",
                "sequenceNumber": self._next_seq(),
                "streamSid": self.stream_sid,
                "stop": {"accountSid": "AC" + "0" * 32, "callSid": self.call_sid},
            }
        )

    def speak(self, ulaw: bytes) -> None:
        """Queue caller audio (mu-law, 8 kHz); it replaces silence in the 20 ms media stream."""
        for i in range(0, len(ulaw) - len(ulaw) % 160, 160):
            self._speech.append(base64.b64encode(ulaw[i : i + 160]).decode())

    async def _inbound_media(self) -> None:
        """Caller audio every 20 ms against a monotonic deadline (never drifting sleeps)."""
        deadline = self.now()
        chunk = 0
        while not self.closed.is_set():
            chunk += 1
            payload = self._speech.pop(0) if self._speech else SILENCE_FRAME
            self.last_media_at = self.now()
            await self.send_json(
                {
                    "event": "media",
                    "sequenceNumber": self._next_seq(),
                    "streamSid": self.stream_sid,
                    "media": {
                        "track": "inbound",
                        "chunk": str(chunk),
                        "timestamp": str(chunk * 20),
                        "payload": payload,
                    },
                }
            )
            self.media_sent += 1
            deadline += FRAME_S
            await asyncio.sleep(max(0.0, deadline - self.now()))

    # --- receiving ----------------------------------------------------------------------------

    async def _reader(self) -> None:
        assert self._ws is not None
        try:
            async for raw in self._ws:
                now = self.now()
                message = json.loads(raw)
                self.received.append(Received(now, message))
                event = message.get("event")
                if event == "media":
                    frames = len(base64.b64decode(message["media"]["payload"])) / 160
                    self._playout_end = (
                        max(self._playout_end, now) + frames * FRAME_S / self.playback_speed
                    )
                elif event == "mark":
                    self._pending_marks.append((self._playout_end, message["mark"]["name"]))
                    self._marks_changed.set()
                elif event == "clear":
                    # Twilio empties its buffer and returns every outstanding mark at once.
                    self._playout_end = now
                    self._pending_marks = [(now, name) for _, name in self._pending_marks]
                    self._marks_changed.set()
                self._new_message.set()
        except websockets.ConnectionClosed:
            pass
        finally:
            self.close_code = self._ws.close_code
            self.close_reason = self._ws.close_reason or ""
            self.closed.set()
            self._new_message.set()

    async def _mark_echoer(self) -> None:
        """Echo each mark when the simulated playback reaches it (sleeping until then)."""
        while not self.closed.is_set():
            now = self.now()
            due = [m for m in self._pending_marks if m[0] <= now]
            for item in due:
                self._pending_marks.remove(item)
                try:
                    await self.send_json(
                        {
                            "event": "mark",
                            "sequenceNumber": self._next_seq(),
                            "streamSid": self.stream_sid,
                            "mark": {"name": item[1]},
                        }
                    )
                except websockets.ConnectionClosed:
                    return
                self.marks_echoed.append(item[1])
            self._marks_changed.clear()
            later = [m[0] for m in self._pending_marks]
            wait = max(0.0, min(later) - self.now()) if later else None
            try:
                await asyncio.wait_for(self._marks_changed.wait(), wait)
            except TimeoutError:
                pass

    # --- queries ------------------------------------------------------------------------------

    @property
    def response_headers(self) -> dict[str, str]:
        """The headers of the server's answer to the WebSocket upgrade (a proxy's too)."""
        assert self._ws is not None and self._ws.response is not None
        return {name.lower(): value for name, value in self._ws.response.headers.raw_items()}

    def events(self, name: str) -> list[Received]:
        return [r for r in self.received if r.message.get("event") == name]

    async def wait_for(self, predicate: Any, timeout: float = 30.0) -> Any:
        """Wait until ``predicate()`` returns something truthy (checked on every message, and
        every 50 ms of loop time for server state that changes without one); gives up after
        ``timeout`` seconds of *real* time."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"condition not met in {timeout} s; received "
                    f"{[r.message.get('event') for r in self.received][-20:]}"
                )
            self._new_message.clear()
            try:
                await asyncio.wait_for(self._new_message.wait(), min(remaining, 0.05))
            except TimeoutError:
                pass
