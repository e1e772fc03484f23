"""A simulated Twilio Media Streams caller: the network side of one phone call, in real time.

Its own client code (it shares nothing with the gateway's server side): it signs the WebSocket
upgrade like Twilio, sends ``connected`` and ``start``, streams 20 ms of caller audio every
20 ms from a shared :class:`Ticker` (one timer for every caller, paced on a monotonic deadline,
whose own lateness is measured), sends DTMF, echoes each ``mark`` when its simulated playback of
the audio before it would have finished (at once on ``clear``, as Twilio does), and ``stop``.

What the caller hears is recorded as (arrival time, event) and turned into per-turn
measurements afterwards: first audio after each turn, gaps in playback, barge-in latency.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import websockets
from twilio.request_validator import RequestValidator

from gateway.aio import cancel_and_wait

log = logging.getLogger(__name__)

FRAME_S = 0.02
_SILENCE = base64.b64encode(b"\xff" * 160).decode()


class Ticker:
    """One 20 ms clock for every caller of a process; records how late each tick ran."""

    def __init__(self, frame_s: float = FRAME_S) -> None:
        self.frame_s = frame_s
        self.callers: set[TwilioCaller] = set()
        self.lateness_ms: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loadsim-ticker")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, log=log, what="loadsim ticker")

    async def _run(self) -> None:
        start = time.monotonic()
        tick = 0
        while True:
            tick += 1
            deadline = start + tick * self.frame_s
            delay = deadline - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            late = time.monotonic() - deadline
            self.lateness_ms.append(1000 * max(0.0, late))
            if late > 5 * self.frame_s:
                # Far behind (a stalled loop): re-anchor instead of bursting the backlog.
                start, tick = time.monotonic(), 0
            # Sequential sends: no task per frame (10,000 a second at 200 callers). A caller
            # whose socket applies backpressure delays the tick, and shows up as lateness.
            for caller in list(self.callers):
                await caller.send_media()


@dataclass
class Heard:
    """Everything one call received, with arrival times."""

    media: list[tuple[float, float]] = field(default_factory=list)  # (arrival, audio seconds)
    clears: list[float] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    closed_at: float | None = None
    close_code: int | None = None


class TwilioCaller:
    """One simulated call to ``ws_url``."""

    def __init__(self, ws_url: str, auth_token: str | None, call_sid: str, ticker: Ticker,
                 *, caller: str = "+15550000000") -> None:
        self.ws_url = ws_url
        self.auth_token = auth_token
        self.call_sid = call_sid
        self.stream_sid = "MZ" + call_sid[2:]
        self.ticker = ticker
        self.caller = caller
        self.heard = Heard()
        self.setup_ms: float | None = None
        self.error: str | None = None
        self._ws: Any = None
        self._seq = 0
        self._chunk = 0
        self._playout_end = 0.0
        self._pending_marks: list[tuple[float, str]] = []
        self._reader: asyncio.Task[None] | None = None
        self._echoer: asyncio.Task[None] | None = None
        self.new_media = asyncio.Event()
        self._media_prefix = ('{"event":"media","streamSid":"' + self.stream_sid
                              + '","media":{"track":"inbound","chunk":"')

    # --- connection ---------------------------------------------------------------------------

    async def connect(self, timeout_s: float = 10) -> None:
        headers = {}
        if self.auth_token:
            signature = RequestValidator(self.auth_token).compute_signature(self.ws_url, {})
            headers["X-Twilio-Signature"] = signature
        t0 = time.monotonic()
        self._ws = await asyncio.wait_for(
            websockets.connect(self.ws_url, additional_headers=headers, max_size=2**22,
                               compression=None), timeout_s)
        self._reader = asyncio.create_task(self._read())
        await self._send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self._send({
            "event": "start", "sequenceNumber": self._next_seq(),
            "start": {"accountSid": "AC" + "0" * 32, "streamSid": self.stream_sid,
                      "callSid": self.call_sid, "tracks": ["inbound"],
                      "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000,
                                      "channels": 1},
                      "customParameters": {"From": self.caller, "To": "+15550009999"}},
            "streamSid": self.stream_sid,
        })
        self.setup_ms = 1000 * (time.monotonic() - t0)
        self.ticker.callers.add(self)
        self._echoer = asyncio.create_task(self._echo_marks())

    async def hangup(self) -> None:
        """``stop`` and close, as Twilio does when the caller hangs up."""
        self.ticker.callers.discard(self)
        if self._ws is not None and self.heard.closed_at is None:
            try:
                await self._send({"event": "stop", "sequenceNumber": self._next_seq(),
                                  "streamSid": self.stream_sid,
                                  "stop": {"accountSid": "AC" + "0" * 32,
                                           "callSid": self.call_sid}})
                await self._ws.close()
            except websockets.ConnectionClosed:
                pass
        await self.close()

    async def close(self) -> None:
        self.ticker.callers.discard(self)
        for task in (self._reader, self._echoer):
            await cancel_and_wait(task, log=log, what=f"loadsim caller {self.call_sid}")
        if self._ws is not None:
            await self._ws.close()

    # --- sending ------------------------------------------------------------------------------

    def _next_seq(self) -> str:
        self._seq += 1
        return str(self._seq)

    async def _send(self, message: dict[str, Any]) -> None:
        await self._ws.send(json.dumps(message))

    async def send_media(self) -> None:
        """20 ms of (silent) caller audio, built from a template (no json.dumps per frame)."""
        ws = self._ws
        if ws is None or self.heard.closed_at is not None:
            return
        self._chunk += 1
        self._seq += 1
        chunk = str(self._chunk)
        text = (self._media_prefix + chunk + '","timestamp":"' + str(self._chunk * 20)
                + '","payload":"' + _SILENCE + '"},"sequenceNumber":"' + str(self._seq) + '"}')
        try:
            await ws.send(text)
        except websockets.ConnectionClosed:
            pass

    async def press(self, digit: str) -> float:
        """Send one DTMF key; returns the monotonic time it was sent."""
        sent = time.monotonic()
        await self._send({"event": "dtmf", "streamSid": self.stream_sid,
                          "sequenceNumber": self._next_seq(),
                          "dtmf": {"track": "inbound_track", "digit": digit}})
        return sent

    # --- receiving ----------------------------------------------------------------------------

    async def _read(self) -> None:
        heard = self.heard
        try:
            async for raw in self._ws:
                now = time.monotonic()
                if isinstance(raw, str) and raw.startswith('{"event":"media"'):
                    # The per-frame path: the audio's length is all the caller needs, read off
                    # the base64 text without decoding (one JSON parse per message would cost
                    # the simulator its own timing at a few hundred callers).
                    start = raw.index('"payload":"') + 11
                    end = raw.index('"', start)
                    padding = raw.count("=", end - 2, end)
                    seconds = ((end - start) * 3 // 4 - padding) / 8000
                    heard.media.append((now, seconds))
                    self._playout_end = max(self._playout_end, now) + seconds
                    self.new_media.set()
                    continue
                message = json.loads(raw)
                event = message.get("event")
                if event == "media":
                    seconds = len(base64.b64decode(message["media"]["payload"])) / 8000
                    heard.media.append((now, seconds))
                    self._playout_end = max(self._playout_end, now) + seconds
                    self.new_media.set()
                elif event == "mark":
                    name = message["mark"]["name"]
                    heard.marks.append((now, name))
                    self._pending_marks.append((self._playout_end, name))
                elif event == "clear":
                    heard.clears.append(now)
                    self._playout_end = now
                    self._pending_marks = [(now, name) for _, name in self._pending_marks]
        except websockets.ConnectionClosed:
            pass
        except Exception as exc:
            self.error = f"unreadable message from the gateway: {exc}"
        finally:
            heard.closed_at = time.monotonic()
            heard.close_code = self._ws.close_code
            self.ticker.callers.discard(self)
            self.new_media.set()

    async def _echo_marks(self) -> None:
        while self.heard.closed_at is None:
            now = time.monotonic()
            due = [m for m in self._pending_marks if m[0] <= now]
            for item in due:
                self._pending_marks.remove(item)
                try:
                    await self._send({"event": "mark", "sequenceNumber": self._next_seq(),
                                      "streamSid": self.stream_sid, "mark": {"name": item[1]}})
                except websockets.ConnectionClosed:
                    return
            await asyncio.sleep(0.01)

    # --- queries ------------------------------------------------------------------------------

    def first_audio_after(self, t: float, until: float | None = None) -> float | None:
        """Arrival of the first frame of the audio that answers a turn at ``t``.

        Frames of an interrupted utterance may still be in flight after a key press; if a
        ``clear`` follows the turn (before the next turn at ``until``), the answer starts after
        it.
        """
        start = t
        limit = t + 2.0 if until is None else min(t + 2.0, until)
        for clear in self.heard.clears:
            if t <= clear < limit:
                start = clear
                break
        for arrival, _ in self.heard.media:
            if arrival >= start:
                return arrival
        return None

    def clear_after(self, t: float) -> float | None:
        return next((c for c in self.heard.clears if c >= t), None)

    async def wait_audio_after(self, t: float, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.first_audio_after(t)
            if found is not None or self.heard.closed_at is not None:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.new_media.clear()
            try:
                await asyncio.wait_for(self.new_media.wait(), min(remaining, 0.25))
            except TimeoutError:
                pass

    def playing(self, now: float) -> bool:
        """True while the simulated playback still has received audio to play."""
        return self._playout_end > now

    def gaps_between(self, start: float, end: float) -> tuple[int, float, float]:
        """Underruns of a listener who starts playing at the first frame after ``start``.

        Returns (count, total ms, audio seconds received). A gap is a frame that arrives after
        everything before it has finished playing; the utterance ends at ``end`` (its mark,
        a clear, or the next turn), after which silence is expected and not counted.
        """
        playout_end: float | None = None
        gaps, gap_s, audio = 0, 0.0, 0.0
        for arrival, seconds in self.heard.media:
            if arrival < start or arrival >= end:
                continue
            if playout_end is not None and arrival > playout_end + 1e-3:
                gaps += 1
                gap_s += arrival - playout_end
            playout_end = max(playout_end or arrival, arrival) + seconds
            audio += seconds
        return gaps, 1000 * gap_s, audio

    def jitter_ms(self) -> float | None:
        """RFC 3550 A.8 style jitter of media arrivals against their audio timeline (ms)."""
        media = self.heard.media
        if len(media) < 2:
            return None
        jitter = 0.0
        timeline = 0.0
        previous_arrival, previous_timeline = media[0][0], 0.0
        for arrival, seconds in media[1:]:
            timeline += seconds
            transit = (arrival - previous_arrival) - (timeline - previous_timeline)
            # Twilio plays from its own buffer: only lateness (frames arriving after their
            # real-time slot) is jitter a listener could hear; early bursts are absorbed.
            jitter += (abs(transit) if transit > 0 else 0.0) / 16 - jitter / 16
            previous_arrival, previous_timeline = arrival, timeline
        return 1000 * jitter
