"""An example bot for the gateway's bot nodes (Twilio ConversationRelay's WebSocket protocol).

Run it beside a gateway whose script hands calls to it (``examples/bot.yaml``)::

    .venv/bin/python examples/relay_bot.py                 # rule-based, no LLM
    .venv/bin/python examples/relay_bot.py --llm http://127.0.0.1:8000/v1 --model my-model

It speaks the protocol a bot written for ConversationRelay speaks, so the same bot serves
Twilio's ConversationRelay and this gateway unchanged:

- ``setup`` tells it about the call; ``prompt`` is what the caller said; ``dtmf`` a key they
  pressed; ``interrupt`` that they cut the bot off, and what they had heard of its answer.
- It answers with ``text`` tokens, streamed as they are written (``last`` on the final one):
  the gateway speaks the first words while the rest are still being written. ``end`` hands the
  call back to the script with ``handoffData`` (here: a transfer to a person).

Without ``--llm`` the answers come from a few rules, streamed a word at a time with a short
pause between words, as an LLM would stream them. With ``--llm URL`` they come from any
OpenAI-compatible chat-completions server (vLLM, llama.cpp's server, Ollama's /v1, OpenAI),
streamed token by token straight into ``text`` messages: that is all it takes to point an LLM's
streamed output at the gateway.

The handshake carries ``X-Twilio-Signature`` (HMAC-SHA1 of the WebSocket URL with the account's
auth token); with ``--auth-token`` (or ``TWILIO_AUTH_TOKEN``) the bot refuses connections whose
signature does not match, exactly as it would behind Twilio.

Only ``websockets``, ``httpx`` and ``twilio`` are needed (the gateway's own dependencies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import httpx
import websockets
from twilio.request_validator import RequestValidator
from websockets.asyncio.server import ServerConnection, serve

log = logging.getLogger("relay_bot")

SYSTEM = ("You are the voice assistant of Acme Energy on a phone call. Answer in one or two "
          "short spoken sentences, no lists or markup. If the caller asks for a person, say "
          "you will transfer them and end your answer with the word TRANSFER; if they are "
          "done, say goodbye and end with the word HANGUP.")
#: Words an answer ends with to hand the call back to the script, and the reason it gets.
ENDINGS = {"TRANSFER": "live-agent-handoff", "HANGUP": "done"}


class Conversation:
    """One call: what was said, and the answer being streamed (cancelled on interrupt)."""

    def __init__(self, ws: ServerConnection, llm: Llm | None, word_delay_s: float) -> None:
        self.ws = ws
        self.llm = llm
        self.word_delay_s = word_delay_s
        self.history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        self.answering: asyncio.Task[None] | None = None
        self.caller = ""

    async def send(self, **message: Any) -> None:
        await self.ws.send(json.dumps(message))

    async def handle(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "setup":
            self.caller = message.get("from", "")
            log.info("call %s from %s (parameters %s)", message.get("callSid"), self.caller,
                     message.get("customParameters"))
        elif kind == "prompt":
            said = message.get("voicePrompt", "")
            log.info("caller: %s", said)
            self.answer(said)
        elif kind == "dtmf":
            digit = message.get("digit")
            log.info("key: %s", digit)
            self.answer("agent" if digit == "0" else f"I pressed {digit}")
        elif kind == "interrupt":
            heard = message.get("utteranceUntilInterrupt", "")
            log.info("interrupted after %s ms; heard %r", message.get("durationUntilInterruptMs"),
                     heard)
            if self.answering is not None:
                self.answering.cancel()
            # Keep the conversation honest: the caller heard only this much of the answer.
            if self.history and self.history[-1]["role"] == "assistant":
                self.history[-1]["content"] = heard
        elif kind == "error":
            log.warning("the gateway refused a message: %s", message.get("description"))

    def answer(self, said: str) -> None:
        if self.answering is not None:
            self.answering.cancel()
        self.history.append({"role": "user", "content": said})
        self.answering = asyncio.create_task(self._answer())

    async def _answer(self) -> None:
        words = self.llm.stream(self.history) if self.llm else self._rules(
            self.history[-1]["content"])
        spoken: list[str] = []
        ending = None
        try:
            async for token in words:
                for word in ENDINGS:
                    if word in token:
                        ending, token = word, token.replace(word, "")
                spoken.append(token)
                await self.send(type="text", token=token, last=False)
            await self.send(type="text", token="", last=True)
        except asyncio.CancelledError:
            raise  # interrupted: the gateway drops the rest of this answer anyway
        finally:
            self.history.append({"role": "assistant", "content": "".join(spoken)})
        if ending is not None:
            # The script goes on with the reason: a transfer, or goodbye.
            await self.send(type="end", handoffData=json.dumps(
                {"reasonCode": ENDINGS[ending], "reason": f"the bot said {ending.lower()}"}))

    async def _rules(self, said: str) -> AsyncIterator[str]:
        """A rule-based answer, streamed a word at a time as an LLM streams its tokens."""
        text = said.lower()
        if re.search(r"\b(agent|person|human|representative)\b", text):
            answer = "Of course, I will transfer you to a colleague now. TRANSFER"
        elif "balance" in text:
            answer = ("Your balance is $42.10, due on December 15. Would you like to pay it "
                      "now, or is there anything else?")
        elif re.search(r"\b(bye|goodbye|no thanks|that's all)\b", text):
            answer = "Thank you for calling Acme Energy. HANGUP"
        else:
            answer = (f"You said: {said.strip() or 'nothing I could hear'}. I can tell you your "
                      "balance, or put you through to a person.")
        for word in re.findall(r"\S+\s*", answer):
            await asyncio.sleep(self.word_delay_s)
            yield word


class Llm:
    """An OpenAI-compatible chat-completions server, streamed (server-sent events)."""

    def __init__(self, url: str, model: str, api_key: str | None) -> None:
        self.url = url.rstrip("/") + "/chat/completions"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=30)

    async def stream(self, history: list[dict[str, str]]) -> AsyncIterator[str]:
        body = {"model": self.model, "messages": history, "stream": True}
        async with self.client.stream("POST", self.url, json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                delta = json.loads(data)["choices"][0].get("delta", {})
                token = delta.get("content")
                if token:
                    yield token


def make_handler(auth_token: str | None, public_url: str | None, llm: Llm | None,
                 word_delay_s: float) -> Any:
    def check(connection: ServerConnection, request: Any) -> Any:
        if not auth_token:
            return None
        base = public_url or f"ws://{request.headers.get('Host', '')}"
        url = base.rstrip("/") + request.path
        signature = request.headers.get("X-Twilio-Signature", "")
        if not RequestValidator(auth_token).validate(url, {}, signature):
            log.warning("refused %s: X-Twilio-Signature does not match", url)
            return connection.respond(HTTPStatus.FORBIDDEN, "bad signature\n")
        return None

    async def handle(ws: ServerConnection) -> None:
        conversation = Conversation(ws, llm, word_delay_s)
        try:
            async for raw in ws:
                await conversation.handle(json.loads(raw))
        except websockets.ConnectionClosed:
            pass
        finally:
            if conversation.answering is not None:
                conversation.answering.cancel()
        log.info("call ended")

    return check, handle


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--auth-token", default=os.environ.get("TWILIO_AUTH_TOKEN"),
                        help="check X-Twilio-Signature with this auth token")
    parser.add_argument("--public-url", help="the URL the gateway dials (wss://bot.example.com) "
                        "when it differs from what this server sees (behind a proxy)")
    parser.add_argument("--llm", help="OpenAI-compatible API base URL (http://host:8000/v1)")
    parser.add_argument("--model", default="default", help="the LLM's model name")
    parser.add_argument("--word-delay", type=float, default=0.05,
                        help="seconds between the rule-based answers' words")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    llm = Llm(args.llm, args.model, os.environ.get("OPENAI_API_KEY")) if args.llm else None
    check, handle = make_handler(args.auth_token, args.public_url, llm, args.word_delay)
    async with serve(handle, args.host, args.port, process_request=check) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"relay bot listening on ws://{args.host}:{port}/relay", flush=True)
        await asyncio.get_running_loop().create_future()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
