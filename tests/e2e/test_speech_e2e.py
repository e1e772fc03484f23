"""Speech menus end to end: a caller's voice over a real Twilio stream and a real SIP call.

The demo gateway (``conftest.demo_virtual``: prompts/demo.yaml, the tiny model, the prompt
cache, the built-in PocketSphinx recogniser in its worker process) and the callers share one
virtual-time loop over real sockets: the Twilio test client streams the caller's mu-law
frames every 20 ms, the SIP caller is the load simulator's phone (SIP over UDP, RTP). What the
caller says is synthesised once per test run (flite, through the G.711 path) and shared by the
test workers. Recognition runs for real in the recogniser's worker process; virtual time
follows real time while it does.

Each scenario runs on both transports: a spoken choice routes the call; an out-of-menu
sentence gets the retry prompt and keys still work; speech during the menu barges in and is
recognised (and the account number said digit by digit is taken); a recogniser that fails
falls back to keys with a logged reason.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.call import Call
from tests.support.servers import VirtualServer
from tests.support.speech_callers import (
    COMMON_SCENARIOS,
    FAILURE,
    broken_pool,
    ivr_trace,
    recognizer_swapped,
    run_scenario,
    said_once,
)

#: What callers say (text, flite voice). Synthesised once per run into ``<name>.ulaw``.
UTTERANCES = {
    "agent": ("agent", "slt"),
    "cancel": ("I would like to cancel my subscription", "slt"),
    "balance": ("check my balance", "kal"),
    # Digit strings are the built-in recogniser's weak spot (bench/asr.py: "six" over the
    # phone band is often "five"); this one it hears, so the test is about the plumbing.
    "account": ("seven eight one oh four two", "kal"),
}


@pytest.fixture(scope="session")
def said(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return said_once(tmp_path_factory, "speech-utterances", UTTERANCES)


@pytest.fixture(scope="module")
def ivr(demo_virtual: tuple[VirtualServer, list[Any]]) -> VirtualServer:
    live = demo_virtual[0]
    recognizer = live.gateway.recognizer
    assert recognizer is not None and recognizer.running, "the demo's speech recogniser"
    return live


SCENARIOS: dict[str, list[tuple[str, str]]] = {
    **COMMON_SCENARIOS,
    # While the menu still plays: the speech stops it and is the answer; then the account
    # number, said digit by digit, goes to the backend as keys would.
    "speech during the menu barges in and is recognised": [
        ("started", "For your account balance"),
        ("say", "balance"),
        ("interrupted", "For your account balance"),
        ("hear", "six digit account number"),
        ("say", "account"),
        ("hear", "One moment while I look that up."),
    ],
}


@pytest.fixture(scope="module")
def broken_recognizer(ivr: VirtualServer) -> Iterator[Any]:
    """A recogniser pool whose every turn fails (in its worker process), started once."""
    with broken_pool(ivr) as pool:
        yield pool


@pytest.mark.parametrize("transport", ["twilio", "sip"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_speech_menus_on_every_transport(request: pytest.FixtureRequest, ivr: VirtualServer,
                                         said: dict[str, bytes],
                                         caplog: pytest.LogCaptureFixture, name: str,
                                         transport: str) -> None:
    failing = name == FAILURE
    with contextlib.ExitStack() as stack:
        if failing:
            broken = request.getfixturevalue("broken_recognizer")
            stack.enter_context(recognizer_swapped(ivr, broken))
        with caplog.at_level(logging.INFO):
            call = ivr.run(_scenario(ivr, said, name, transport))
    trace = ivr_trace(caplog, call.call_id)
    heard = trace["speech"]
    if failing:
        assert [h["result"] for h in heard] == ["failed"]
        assert any("speech recognition failed at menu (the decoder failed on this turn); "
                   "taking keys only" in r.getMessage() for r in caplog.records)
    elif name.startswith("a spoken choice"):
        assert [(h["node"], h["result"], h["branch"]) for h in heard] == [
            ("menu", "match", "agent")]
        # The agent's prompt answers the caller's turn: measured from the end of their speech.
        transfer = next(u for u in call.utterances if "transfer you" in u.text)
        assert transfer.turn_started_at == pytest.approx(call.answered_at + heard[0]["at"],
                                                         abs=0.001)
    elif name.startswith("an out-of-menu"):
        assert [(h["node"], h["result"]) for h in heard] == [("menu", "no match")]
    else:
        assert [(h["node"], h["result"], h["branch"], h["said"]) for h in heard] == [
            ("menu", "match", "account", "check my balance"),
            ("account", "match", None, "781042")]


async def _scenario(live: VirtualServer, said: dict[str, bytes], name: str,
                    transport: str) -> Call:
    n = 300 + sorted(SCENARIOS).index(name) * 2 + (transport == "sip")
    return await run_scenario(live, said, SCENARIOS[name], n, transport)
