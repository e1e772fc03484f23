"""The load simulator's ``agent`` scenario: the simulator is the bot (gateway.loadsim.agent), a
real gateway runs examples/bot.yaml pointed at it, and each caller's turn records the bot's
first token -> the caller's first audio, on both transports."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.clock import VirtualClock
from gateway.loadsim.agent import AgentBot, tokens
from gateway.loadsim.runner import LoadConfig, run_level
from tests.support.paths import REPO
from tests.support.servers import AUTH_TOKEN, LiveServer, serve

ROOT = REPO
ANSWER = "Hello there."


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def agent_line(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[tuple[LiveServer, int]]:
    bot_port = _port()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RELAY_BOT_URL", f"ws://127.0.0.1:{bot_port}/relay")
        with serve({"model": str(tiny_model_dir), "script": str(ROOT / "examples" / "bot.yaml"),
                    "cache_dir": str(tmp_path_factory.mktemp("cache")),
                    "sip": "127.0.0.1:0", "sip_allow": "127.0.0.1/32",
                    "rtp_ports": "28000-28999"}) as live:
            yield live, bot_port


def test_an_llm_streams_words_a_few_characters_at_a_time() -> None:
    assert tokens("Hi there, Alexandra.") == ["Hi", " the", "re,", " Ale", "xand", "ra."]
    assert "".join(tokens(ANSWER * 3)) == ANSWER * 3


async def test_the_bot_keeps_its_token_rate_on_its_clock_and_catches_up_a_stalled_send() -> None:
    clock = VirtualClock(100.0)
    sent: list[float] = []

    class Ws:
        async def send(self, data: str) -> None:
            sent.append(clock.now())
            if len(sent) == 3:
                await clock.sleep(0.1)  # a send that stalls for five tokens' time

    bot = AgentBot(port=0, rate=50, answer="one two three four five six seven", delay_s=0.5,
                   clock=clock)
    call = bot._call("CA1")
    answering = asyncio.create_task(bot._answer(Ws(), call))
    while not answering.done():
        deadline = clock.next_deadline()
        await clock.advance(0.0 if deadline is None else deadline - clock.now())
    await answering
    count = len(tokens(bot.answer))
    assert len(sent) == count
    # Token i is due at the first one's time + i / 50 s; those due during the stall go at
    # once when it ends, and the rest keep the schedule (no drift from the late sends).
    first = 100.5
    assert sent[:3] == pytest.approx([first, first + 0.02, first + 0.04])
    assert sent[3:8] == pytest.approx([first + 0.14] * 5)
    assert sent[8:] == pytest.approx([first + i / 50 for i in range(8, count)])
    assert bot.first_token("CA1", 1) == pytest.approx(first)
    assert bot.first_token("CA1", 2) is None


@pytest.mark.parametrize("transport", ["twilio", "sip"])
def test_each_turn_records_the_bots_first_token_to_the_callers_first_audio(
        agent_line: tuple[LiveServer, int], transport: str) -> None:
    live, bot_port = agent_line
    target = live.base_url
    if transport == "sip":
        endpoint = live.gateway.sip
        assert endpoint is not None and endpoint.local_addr is not None
        target = f"{endpoint.local_addr[0]}:{endpoint.local_addr[1]}"
    config = LoadConfig(target=target, transport=transport, auth_token=AUTH_TOKEN,
                        scenario="agent", digits=["1", "2"], think_s=0.2, listen_s=0.1,
                        duration_s=0.1, turn_timeout_s=20.0, bot_port=bot_port,
                        token_rate=40.0, answer=ANSWER, http=live.base_url)
    level = asyncio.run(_level(config))
    summary = level.summary()
    assert summary["errors"] == 0, summary["failures_by"]
    [call] = level.calls
    answers = [t for t in call.turns if t.kind != "answer"]
    assert len(answers) == 2
    for turn in answers:
        assert turn.chars == len(ANSWER)
        assert turn.token_audio_ms is not None and 0 < turn.token_audio_ms < 10_000
        # The caller's key comes before the bot's first token, which comes before the audio.
        assert turn.first_audio_ms is not None and turn.first_audio_ms >= turn.token_audio_ms
    assert summary["token_audio_ms"]["p50"] is not None


async def _level(config: LoadConfig):  # type: ignore[no-untyped-def]
    return await asyncio.to_thread(run_level, config, 1, 0)
