"""A simulated Twilio call: the voice webhook, then the Media Stream it names, in real time.

Twilio's side of an inbound call, as the gateway sees it:

1. **Dial**: POST the number's voice webhook with the form Twilio sends
   (https://www.twilio.com/docs/voice/twiml#request-parameters), signed with
   X-Twilio-Signature over the URL and the sorted form (the twilio library's
   ``RequestValidator``). The TwiML answer (:mod:`gateway.loadsim.twiml`) is either the busy
   answer - the call is *refused* - or ``<Connect><Stream>``.
2. **Stream**: open the ``<Stream>`` URL it names (the upgrade signed over that wss:// URL with
   no parameters), send ``connected`` and ``start`` with the ``<Parameter>``s as
   ``customParameters``, stream 20 ms of caller audio every 20 ms from a shared
   :class:`Ticker` (one timer for every caller, paced by the gateway's own
   :class:`~gateway.audio.pacer.Pacer` on a monotonic deadline, whose own lateness is
   measured), send DTMF, echo each ``mark`` when its simulated playback of the audio
   before it would have finished (at once on ``clear``, as Twilio does), and ``stop``.
3. **After the stream**: when the gateway ended the stream with the call still up, request the
   ``<Connect action>`` URL and read what it says (a ``<Dial>`` transfer or a hang-up).

What the caller hears is recorded in :class:`Heard`, in arrival order, and turned into per-turn
measurements afterwards: first audio after each turn, gaps in playback, barge-in latency. A
stream closed by the gateway keeps its close code and reason: they are the real cause of
whatever the caller did not hear afterwards.

*First audio of the answer to a turn at t* (:meth:`Heard.utterance_after`): if the gateway was
still sending an utterance at ``t`` (media arrived after its last ``mark``/``clear``), the media
that follow may be that interrupted utterance's; the answer starts after the next ``clear``
(barge-in) or ``mark`` (the old utterance's end). Otherwise it is the first media after ``t``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets
from twilio.request_validator import RequestValidator
from websockets.asyncio.client import ClientConnection

from gateway.audio.pacer import Pacer
from gateway.clock import Clock, SystemClock
from gateway.loadsim.twiml import (
    AfterStream,
    Busy,
    StreamAnswer,
    TwimlError,
    parse_after_stream,
    parse_voice_answer,
)

__all__ = ["FRAME_S", "DialError", "Heard", "Ticker", "TwilioCaller", "after_stream", "describe",
           "dial", "voice_form"]

from gateway.aio import cancel_and_wait

log = logging.getLogger(__name__)

FRAME_S = 0.02
#: A frame that arrives this little after the audio before it ran out is not a gap (the same
#: tolerance as the gateway's own count, ``gateway.call.playout.UNDERRUN_TOLERANCE_S``).
GAP_TOLERANCE_S = 0.001
_SILENCE = base64.b64encode(b"\xff" * 160).decode()
#: Twilio's REST API version, sent in every webhook request.
API_VERSION = "2010-04-01"
ACCOUNT_SID = "AC" + "0" * 32
#: WebSocket close codes that mean "not now" rather than "broken" (RFC 6455 7.4.1 registry:
#: 1013 Try Again Later, what the gateway sends a stream it has no room for).
REFUSAL_CLOSE_CODES = frozenset({1013})


class Ticker:
    """One 20 ms clock for every caller of a process; records how late each tick ran.

    Its schedule is a :class:`~gateway.audio.pacer.Pacer` on ``clock`` (default: real time):
    ticks due at fixed multiples of ``frame_s``, a short stall caught up, one more than 5 frames
    behind (a stalled loop) re-anchored instead of bursting the backlog.
    """

    def __init__(self, frame_s: float = FRAME_S, clock: Clock | None = None) -> None:
        self.frame_s = frame_s
        self.clock = clock if clock is not None else SystemClock()
        self.callers: set[TwilioCaller] = set()
        self.lateness_ms: list[float] = []
        self._pacer = Pacer(self.clock, frame_s)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loadsim-ticker")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, log=log, what="loadsim ticker")

    async def _run(self) -> None:
        pacer, clock = self._pacer, self.clock
        pacer.start()
        while True:
            deadline = await pacer.wait()
            self.lateness_ms.append(1000 * max(0.0, clock.now() - deadline))
            # Sequential sends: no task per frame (10,000 a second at 200 callers). A caller
            # whose socket applies backpressure delays the tick, and shows up as lateness.
            for caller in list(self.callers):
                await caller.send_media()


# --- dialling: the voice webhook and the <Connect action> ---------------------------------------


class DialError(Exception):
    """The webhook gave no answer a call can follow; the message is the failure's cause."""


def voice_form(call_sid: str, caller: str, called: str, status: str = "ringing"
               ) -> dict[str, str]:
    """The form Twilio POSTs to a number's voice webhook for an inbound call."""
    return {
        "AccountSid": ACCOUNT_SID, "ApiVersion": API_VERSION, "CallSid": call_sid,
        "CallStatus": status, "Direction": "inbound", "From": caller, "Caller": caller,
        "FromCountry": "US", "To": called, "Called": called, "ToCountry": "US",
    }


def _signed(url: str, form: dict[str, str], auth_token: str | None) -> dict[str, str]:
    headers = {"User-Agent": "TwilioProxy/1.1"}
    if auth_token:
        headers["X-Twilio-Signature"] = RequestValidator(auth_token).compute_signature(url, form)
    return headers


async def _post(client: httpx.AsyncClient, url: str, form: dict[str, str],
                auth_token: str | None) -> httpx.Response:
    return await client.post(url, data=form, headers=_signed(url, form, auth_token))


def describe(exc: BaseException) -> str:
    """An exception as a cause: its type and message, without per-call detail."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def dial(client: httpx.AsyncClient, voice_url: str, call_sid: str,
               auth_token: str | None, caller: str, called: str) -> StreamAnswer | Busy:
    """POST the voice webhook as Twilio does and read its TwiML.

    Raises :class:`DialError` with the cause when there is no usable answer (HTTP error,
    unexpected status, TwiML the call cannot follow).
    """
    form = voice_form(call_sid, caller, called)
    try:
        response = await _post(client, voice_url, form, auth_token)
    except httpx.HTTPError as exc:
        raise DialError(f"voice webhook: {describe(exc)}") from None
    if response.status_code != 200:
        raise DialError(f"voice webhook answered HTTP {response.status_code}")
    try:
        return parse_voice_answer(response.text)
    except TwimlError as exc:
        raise DialError(f"voice webhook: {exc}") from None


async def after_stream(client: httpx.AsyncClient, answer: StreamAnswer, call_sid: str,
                       auth_token: str | None, caller: str, called: str) -> AfterStream:
    """Request the ``<Connect action>`` as Twilio does once the stream ended, call still up."""
    assert answer.action is not None
    form = voice_form(call_sid, caller, called, status="in-progress")
    try:
        if answer.action_method == "GET":
            response = await client.get(answer.action, params=form,
                                        headers=_signed(answer.action, {}, auth_token))
        else:
            response = await _post(client, answer.action, form, auth_token)
    except httpx.HTTPError as exc:
        raise DialError(f"<Connect action> webhook: {describe(exc)}") from None
    if response.status_code != 200:
        raise DialError(f"<Connect action> webhook answered HTTP {response.status_code}")
    try:
        return parse_after_stream(response.text)
    except TwimlError as exc:
        raise DialError(f"<Connect action> webhook: {exc}") from None



# --- what the caller heard ------------------------------------------------------------------


@dataclass
class Heard:
    """Everything one call received, with arrival times, in arrival order.

    ``media`` holds (arrival, audio seconds). Marks and clears also record how many media
    messages had arrived before them (``boundaries``), so "after the mark" is exact even when
    two messages share an arrival time. Fed through :meth:`add_media`, :meth:`add_mark` and
    :meth:`add_clear` (the caller's reader, or a test's synthetic timeline).
    """

    media: list[tuple[float, float]] = field(default_factory=list)
    clears: list[float] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    #: (arrival, media count before it) of every mark and clear, in arrival order.
    boundaries: list[tuple[float, int]] = field(default_factory=list)
    closed_at: float | None = None
    close_code: int | None = None
    close_reason: str = ""
    #: True when the gateway closed the stream (not our hang-up).
    closed_by_gateway: bool = False
    _arrivals: list[float] = field(default_factory=list, repr=False)
    _boundary_times: list[float] = field(default_factory=list, repr=False)

    def add_media(self, at: float, seconds: float) -> None:
        self.media.append((at, seconds))
        self._arrivals.append(at)

    def add_mark(self, at: float, name: str) -> None:
        self.marks.append((at, name))
        self._boundary(at)

    def add_clear(self, at: float) -> None:
        self.clears.append(at)
        self._boundary(at)

    def _boundary(self, at: float) -> None:
        self.boundaries.append((at, len(self.media)))
        self._boundary_times.append(at)

    def utterance_after(self, t: float, until: float | None = None) -> float | None:
        """Arrival of the first media of the audio that answers a turn at ``t`` (module
        docstring), or None if none arrived before ``until``."""
        index = bisect_left(self._arrivals, t)  # media that arrived before t
        bi = bisect_left(self._boundary_times, t)
        streaming = index > 0 and (bi == 0 or self.boundaries[bi - 1][1] < index)
        if streaming:
            # The old utterance's media may continue: the answer starts after its end.
            if bi >= len(self.boundaries):
                return None
            at, index = self.boundaries[bi]
            if until is not None and at >= until:
                return None
        if index >= len(self.media):
            return None
        arrival = self.media[index][0]
        return arrival if until is None or arrival < until else None

    def mark_after(self, t: float, until: float | None = None) -> float | None:
        """Arrival of the first mark after ``t`` (the end of the utterance playing at t)."""
        for at, _ in self.marks:
            if at >= t and (until is None or at < until):
                return at
        return None

    def clear_after(self, t: float) -> float | None:
        return next((c for c in self.clears if c >= t), None)

    def gaps_between(self, start: float, end: float) -> tuple[int, float, float]:
        """Underruns of a listener who starts playing at the first frame after ``start``.

        Returns (count, total ms, audio seconds received). A gap is a frame that arrives after
        everything before it has finished playing (by more than 1 ms, the tolerance the
        gateway's own count uses: ``gateway.call.playout.UNDERRUN_TOLERANCE_S``); the utterance
        ends at ``end`` (its mark, a clear, or the next turn), after which silence is expected
        and not counted.

        The model of Twilio's buffer: it plays what it is sent in order, from the moment the
        first of it arrives, and silence once it has run out; a mark is echoed once the audio
        before it has played (what Twilio documents for marks). That it keeps no start-up
        buffer of its own is this model's assumption, the strict one: any such buffer would
        only hide gaps. Twilio's media clock sends 20 ms packets on a phase of its own; playing
        from the exact arrival is that phase's worst case (a gap of ``g`` ms is heard, rounded
        up to a whole packet, with probability about ``g / 20`` on a random phase), so the
        count is an upper bound and the gap time its expectation.
        """
        playout_end: float | None = None
        gaps, gap_s, audio = 0, 0.0, 0.0
        for arrival, seconds in self.media:
            if arrival < start or arrival >= end:
                continue
            if playout_end is not None and arrival > playout_end + GAP_TOLERANCE_S:
                gaps += 1
                gap_s += arrival - playout_end
            playout_end = max(playout_end or arrival, arrival) + seconds
            audio += seconds
        return gaps, 1000 * gap_s, audio

    def jitter_ms(self) -> float | None:
        """RFC 3550 A.8 style jitter of media arrivals against their audio timeline (ms)."""
        media = self.media
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


# --- the Media Stream -----------------------------------------------------------------------


class TwilioCaller:
    """One simulated Media Stream, opened at the URL the voice webhook's TwiML named."""

    def __init__(self, stream_url: str, parameters: dict[str, str], auth_token: str | None,
                 call_sid: str, ticker: Ticker,
                 on_event: Callable[[str, float, bytes | str], None] | None = None) -> None:
        self.stream_url = stream_url
        #: Told of every message as it arrives, in order: ("media", arrival, mu-law bytes),
        #: ("mark", arrival, name), ("clear", arrival, ""). The softphone plays and prints from
        #: it; the load simulator leaves it unset and decodes no audio.
        self.on_event = on_event
        self.parameters = dict(parameters)
        self.auth_token = auth_token
        self.call_sid = call_sid
        self.stream_sid = "MZ" + call_sid[2:]
        self.ticker = ticker
        self.heard = Heard()
        self.error: str | None = None
        self._ws: ClientConnection | None = None
        self._seq = 0
        self._chunk = 0
        self._playout_end = 0.0
        self._hanging_up = False
        self._pending_marks: list[tuple[float, str]] = []
        self._reader: asyncio.Task[None] | None = None
        self._echoer: asyncio.Task[None] | None = None
        #: Set on every message from the gateway and when the stream closes.
        self.changed = asyncio.Event()
        # Caller speech to send in place of silence (base64 payloads), and who waits for its end.
        self._speech: list[str] = []
        self._spoken: asyncio.Future[float] | None = None
        self._media_prefix = ('{"event":"media","streamSid":"' + self.stream_sid
                              + '","media":{"track":"inbound","chunk":"')

    # --- connection ---------------------------------------------------------------------------

    async def connect(self, timeout_s: float = 10) -> None:
        """Open the stream and send ``connected`` + ``start``.

        Raises what websockets raises (``InvalidStatus`` for an upgrade answered with an HTTP
        error, ``OSError`` / ``TimeoutError`` when nothing answers).
        """
        headers = {}
        if self.auth_token:
            # Twilio signs the upgrade over the wss:// URL with no parameters.
            signature = RequestValidator(self.auth_token).compute_signature(self.stream_url, {})
            headers["X-Twilio-Signature"] = signature
        self._ws = await asyncio.wait_for(
            websockets.connect(self.stream_url, additional_headers=headers, max_size=2**22,
                               compression=None), timeout_s)
        self._reader = asyncio.create_task(self._read())
        await self._send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self._send({
            "event": "start", "sequenceNumber": self._next_seq(),
            "start": {"accountSid": ACCOUNT_SID, "streamSid": self.stream_sid,
                      "callSid": self.call_sid, "tracks": ["inbound"],
                      "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000,
                                      "channels": 1},
                      "customParameters": self.parameters},
            "streamSid": self.stream_sid,
        })
        self.ticker.callers.add(self)
        self._echoer = asyncio.create_task(self._echo_marks())

    async def hangup(self) -> None:
        """``stop`` and close, as Twilio does when the caller hangs up."""
        self._hanging_up = True
        self.ticker.callers.discard(self)
        if self._ws is not None and self.heard.closed_at is None:
            try:
                await self._send({"event": "stop", "sequenceNumber": self._next_seq(),
                                  "streamSid": self.stream_sid,
                                  "stop": {"accountSid": ACCOUNT_SID, "callSid": self.call_sid}})
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
        assert self._ws is not None
        await self._ws.send(json.dumps(message))

    async def send_media(self) -> None:
        """20 ms of caller audio (silence, or the speech being said), built from a template
        (no json.dumps per frame)."""
        ws = self._ws
        if ws is None or self.heard.closed_at is not None:
            return
        self._chunk += 1
        self._seq += 1
        chunk = str(self._chunk)
        speaking = bool(self._speech)
        payload = self._speech.pop() if speaking else _SILENCE
        text = (self._media_prefix + chunk + '","timestamp":"' + str(self._chunk * 20)
                + '","payload":"' + payload + '"},"sequenceNumber":"' + str(self._seq) + '"}')
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send(text)
        if speaking and not self._speech and self._spoken is not None:
            if not self._spoken.done():
                self._spoken.set_result(time.monotonic())
            self._spoken = None

    async def speak(self, frames: Sequence[bytes]) -> float:
        """Say ``frames`` (20 ms of mu-law each) in place of silence, from the next tick on;
        returns the monotonic time the last one was sent (the end of the caller's speech)."""
        if not frames:
            return time.monotonic()
        self._speech = [base64.b64encode(f).decode() for f in reversed(frames)]
        done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._spoken = done
        return await done

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
        ws = self._ws
        assert ws is not None
        try:
            async for raw in ws:
                now = time.monotonic()
                if isinstance(raw, str) and raw.startswith('{"event":"media"'):
                    # The per-frame path: the audio's length is all the caller needs, read off
                    # the base64 text without decoding (one JSON parse per message would cost
                    # the simulator its own timing at a few hundred callers).
                    start = raw.index('"payload":"') + 11
                    end = raw.index('"', start)
                    padding = raw.count("=", end - 2, end)
                    seconds = ((end - start) * 3 // 4 - padding) / 8000
                    heard.add_media(now, seconds)
                    self._playout_end = max(self._playout_end, now) + seconds
                    if self.on_event is not None:
                        self.on_event("media", now, base64.b64decode(raw[start:end]))
                    self.changed.set()
                    continue
                message = json.loads(raw)
                event = message.get("event")
                if event == "media":
                    audio = base64.b64decode(message["media"]["payload"])
                    heard.add_media(now, len(audio) / 8000)
                    self._playout_end = max(self._playout_end, now) + len(audio) / 8000
                    if self.on_event is not None:
                        self.on_event("media", now, audio)
                elif event == "mark":
                    name = message["mark"]["name"]
                    heard.add_mark(now, name)
                    self._pending_marks.append((self._playout_end, name))
                    if self.on_event is not None:
                        self.on_event("mark", now, name)
                elif event == "clear":
                    heard.add_clear(now)
                    if self.on_event is not None:
                        self.on_event("clear", now, "")
                    self._playout_end = now
                    self._pending_marks = [(now, name) for _, name in self._pending_marks]
                self.changed.set()
        except websockets.ConnectionClosed:
            pass
        except Exception as exc:
            self.error = f"unreadable message from the gateway: {describe(exc)}"
        finally:
            heard.closed_at = time.monotonic()
            heard.close_code = ws.close_code
            heard.close_reason = ws.close_reason or ""
            heard.closed_by_gateway = not self._hanging_up
            self.ticker.callers.discard(self)
            self.changed.set()

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

    # --- waiting ------------------------------------------------------------------------------

    async def _wait(self, probe: Any, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while True:
            found = probe()
            if found is not None or self.heard.closed_at is not None:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.25))

    async def wait_utterance(self, t: float, timeout_s: float) -> float | None:
        """Wait for the first audio answering a turn at ``t`` (None: timeout or stream closed)."""
        return await self._wait(lambda: self.heard.utterance_after(t), timeout_s)

    async def wait_mark(self, t: float, timeout_s: float) -> float | None:
        """Wait for the first mark after ``t``: the utterance heard from then on has been sent
        whole."""
        return await self._wait(lambda: self.heard.mark_after(t), timeout_s)

    @property
    def playout_end(self) -> float:
        """When the simulated playback of everything received so far ends (monotonic)."""
        return self._playout_end

    def playing(self, now: float) -> bool:
        """True while the simulated playback still has received audio to play."""
        return self._playout_end > now
