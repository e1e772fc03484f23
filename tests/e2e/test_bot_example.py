"""The example bot (examples/relay_bot.py) runs from the README's commands: the bot started as
the README starts it (a subprocess, checking the handshake's signature), a gateway serving the
README's script (examples/bot.yaml), and a caller who asks for their balance and then for a
person; and the bot's LLM mode streams an OpenAI-compatible server's tokens as text messages."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway.asr.whisper import model_available
from gateway.call import TransferTo
from tests.support.builds import built_once
from tests.support.paths import REPO
from tests.support.readme_samples import documented_commands
from tests.support.servers import AUTH_TOKEN, LiveServer, serve
from tests.support.waiting import until

ROOT = REPO


#: Where the bot's developers are told how to run the example (the README links to it).
BOTS_PAGE = REPO / "docs" / "authors" / "bots.md"


def _readme_bot_command() -> list[str]:
    for line in BOTS_PAGE.read_text().splitlines():
        if "examples/relay_bot.py" in line and line.startswith(".venv/bin/python"):
            return shlex.split(line, comments=True)
    raise AssertionError("docs/authors/bots.md does not show how to start examples/relay_bot.py")


def test_the_readme_starts_the_bot_and_a_gateway_for_it() -> None:
    assert _readme_bot_command()[:2] == [".venv/bin/python", "examples/relay_bot.py"]
    serves = [c.argv for c in documented_commands() if c.argv[:1] == ["serve"]]
    assert any(argv[argv.index("--script") + 1] == "examples/bot.yaml"
               for argv in serves if "--script" in argv)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def example(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[tuple[LiveServer, subprocess.Popen[str]]]:
    port = _port()
    argv = _readme_bot_command()
    log = tmp_path_factory.mktemp("bot") / "bot.log"
    # As the README runs it, on a free port, checking signatures with the gateway's token.
    with open(log, "w") as out:
        bot = subprocess.Popen([sys.executable, *argv[1:], "--port", str(port), "--auth-token",
                                AUTH_TOKEN, "--word-delay", "0.02"],
                               cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while "relay bot listening" not in log.read_text():
            assert bot.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RELAY_BOT_URL", f"ws://127.0.0.1:{port}/relay")
            with serve({"model": str(tiny_model_dir),
                        "script": str(ROOT / "examples" / "bot.yaml"),
                        "cache_dir": str(tmp_path_factory.mktemp("cache")),
                        "asr": "whisper", "asr_threads": 1}) as live:
                yield live, bot
    finally:
        bot.terminate()
        bot.wait(10)


@pytest.fixture(scope="session")
def balance_question(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    def synthesise(path: Path) -> None:
        from gateway.asr.synth import SynthVoice, phone_line, synthesize

        speech = synthesize("what is my balance", SynthVoice("flite", "slt"))
        path.write_bytes(phone_line(speech, lead_s=0.2, tail_s=0.2))

    return built_once(tmp_path_factory, "bot-balance.ulaw", synthesise).read_bytes()


@pytest.mark.skipif(not model_available("tiny.en"), reason="Whisper tiny.en is not installed")
def test_the_example_bot_answers_a_caller_and_hands_them_to_a_person(
        example: tuple[LiveServer, subprocess.Popen[str]], balance_question: bytes) -> None:
    from tests.support.twilio_client import FakeTwilioCall

    live, _ = example

    async def scenario() -> Any:
        call = FakeTwilioCall(live.ws_url, AUTH_TOKEN, playback_speed=20)
        await call.connect()
        await call.start({"From": "+15550001111", "To": "+15550002222"})
        try:
            server = await until(lambda: live.gateway.registry.get(call.call_sid), 30)

            def heard(text: str) -> Any:
                return next((u for u in server.utterances
                             if text in u.text and u.first_frame_at is not None), None)

            await until(lambda: heard("How can I help you?") and
                        heard("How can I help you?").played.is_set(), 60, "the greeting")
            call.speak(balance_question)
            # The answer's amount has reached the gateway (the caller cuts the answer off
            # next: what comes after the key is dropped, so the amount must be in by then).
            answer = await until(lambda: heard("Your balance is $42.10"), 60, "the bot's answer")
            await call.send_dtmf("0")  # a person, please (it cuts the answer off)
            await until(lambda: heard("transfer you"), 60, "the bot's goodbye")
            await until(lambda: call.closed.is_set(), 60, "the transfer")
            return server, answer
        finally:
            await call.close()

    server, answer = asyncio.run(scenario())
    assert answer.text.startswith("Your balance is $42.10")
    assert isinstance(server.outcome, TransferTo) and server.outcome.target == "+15550001234"


def _example_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("relay_bot", ROOT / "examples" / "relay_bot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_an_llms_streamed_tokens_become_text_messages() -> None:
    relay_bot = _example_module()
    asked: list[dict[str, Any]] = []

    async def openai_compatible(reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                                ) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        asked.append(json.loads(await reader.readexactly(length)))
        events = [{"choices": [{"delta": {"role": "assistant"}}]}] + [
            {"choices": [{"delta": {"content": piece}}]}
            for piece in ["Sure", ",", " I will", " put you", " through.", " TRANSFER"]]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n" + body.encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(openai_compatible, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sent: list[dict[str, Any]] = []

    class Ws:
        async def send(self, data: str) -> None:
            sent.append(json.loads(data))

    llm = relay_bot.Llm(f"http://127.0.0.1:{port}/v1", "test-model", None)
    conversation = relay_bot.Conversation(Ws(), llm, 0.0)
    await conversation.handle({"type": "prompt", "voicePrompt": "a person please",
                               "lang": "en-US", "last": True})
    assert conversation.answering is not None
    await asyncio.wait_for(conversation.answering, 10)
    server.close()
    assert asked[0]["stream"] is True and asked[0]["model"] == "test-model"
    assert asked[0]["messages"][-1] == {"role": "user", "content": "a person please"}
    texts = [m for m in sent if m["type"] == "text"]
    assert [m["token"] for m in texts] == ["Sure", ",", " I will", " put you", " through.",
                                          " ", ""]
    assert [m["last"] for m in texts][-1] is True and not any(m["last"] for m in texts[:-1])
    end = sent[-1]
    assert end["type"] == "end"
    assert json.loads(end["handoffData"])["reasonCode"] == "live-agent-handoff"
