"""The load simulator's bot: a ConversationRelay-compatible WebSocket server that answers every
caller turn by streaming text at a set token rate (the ``agent`` scenario).

The gateway under test runs a script whose bot node points here (``examples/bot.yaml`` with
``RELAY_BOT_URL=ws://SIMULATOR:PORT/relay``, and ``dtmf_detection: true``). Each key a caller
presses reaches this bot as ``dtmf``; after ``delay_s`` (the LLM's time to its first token) it
streams ``answer`` as tokens of about four characters (an English LLM token), ``rate`` tokens a
second, ``last`` on the final one, and records when its first token went out. The simulated
caller, in the same process and on the same clock, records when it first heard the answer:
first token -> first audio per turn, and the playback gaps of the answer, which is what an
operator sizes a line of agents by (a token rate below what the voice speaks shows as gaps: the
engine waits for words). The bot never sends ``end``: the caller hangs up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.audio.pacer import Pacer
from gateway.clock import Clock, SystemClock

__all__ = ["DEFAULT_ANSWER", "AgentBot", "tokens"]

log = logging.getLogger(__name__)

#: What the bot answers every turn (166 characters: two sentences, a number among them).
DEFAULT_ANSWER = ("Thanks for waiting. I can see your last payment of $42.10 arrived on "
                  "December 3rd, so your account is up to date, and nothing else is due "
                  "until the end of next month.")


def tokens(text: str) -> list[str]:
    """``text`` as an LLM streams it: words cut into pieces of at most four characters, each
    with the space before it."""
    out: list[str] = []
    for word in re.findall(r"\s*\S+", text):
        out.extend(word[i:i + 4] for i in range(0, len(word), 4))
    return out


@dataclass
class _Call:
    #: When the first token of each answer went out (the bot's clock: the simulator's
    #: monotonic time, which its callers stamp their audio on).
    first_tokens: list[float] = field(default_factory=list)
    answered: asyncio.Event = field(default_factory=asyncio.Event)


class AgentBot:
    """The bot; start it in the simulator's process before its callers dial."""

    def __init__(self, *, port: int, rate: float, answer: str = DEFAULT_ANSWER,
                 delay_s: float = 0.0, host: str = "0.0.0.0",
                 clock: Clock | None = None) -> None:
        if rate <= 0:
            raise ValueError("the token rate must be positive")
        self.host = host
        self.port = port
        self.rate = rate
        self.answer = answer
        self.delay_s = delay_s
        self.clock: Clock = clock or SystemClock()
        self._calls: dict[str, _Call] = {}
        self._server: Any = None
        #: Sessions and messages seen (a simulator with a gateway that never connects says so).
        self.sessions = 0
        self.turns = 0

    async def start(self) -> None:
        from websockets.asyncio.server import serve

        self._server = await serve(self._session, self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _call(self, call_id: str) -> _Call:
        return self._calls.setdefault(call_id, _Call())

    def first_token(self, call_id: str, turn: int) -> float | None:
        """When the first token of the call's ``turn``-th answer (1, 2, ...) went out. A SIP
        call is known by its Call-ID, which the gateway's ``callSid`` carries as ``sip-ID``."""
        call = self._calls.get(call_id) or self._calls.get(f"sip-{call_id}")
        if call is None or len(call.first_tokens) < turn:
            return None
        return call.first_tokens[turn - 1]

    async def _session(self, ws: Any) -> None:
        import websockets

        self.sessions += 1
        call: _Call | None = None
        answering: asyncio.Task[None] | None = None
        try:
            async for raw in ws:
                message = json.loads(raw)
                kind = message.get("type")
                if kind == "setup":
                    call = self._call(str(message.get("callSid", "")))
                elif kind in ("dtmf", "prompt") and call is not None:
                    self.turns += 1
                    if answering is not None:
                        answering.cancel()
                    answering = asyncio.create_task(self._answer(ws, call))
                elif kind == "interrupt" and answering is not None:
                    answering.cancel()
        except websockets.ConnectionClosed:
            pass
        finally:
            if answering is not None:
                answering.cancel()

    async def _answer(self, ws: Any, call: _Call) -> None:
        if self.delay_s:
            await self.clock.sleep(self.delay_s)
        pieces = tokens(self.answer)
        # Token i is due at first + i / rate, so the rate holds however late a send wakes; a
        # send that stalls is caught up at once (never re-anchored: an LLM's tokens that queued
        # up meanwhile arrive together), as the gateway would see them.
        pacer = Pacer(self.clock, frame_s=1.0 / self.rate, max_lag_frames=None)
        pacer.start()
        for i, piece in enumerate(pieces):
            due = await pacer.wait()
            if i == 0:
                call.first_tokens.append(due)
            await ws.send(json.dumps({"type": "text", "token": piece,
                                      "last": i == len(pieces) - 1}))
