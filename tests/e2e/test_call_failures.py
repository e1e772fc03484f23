"""A call never goes silent: any failure of an utterance ends in the script's error prompt.

The real gateway (uvicorn on virtual time, the tiny model on CPU, a small IVR script) and a
test Twilio over a real WebSocket. The engine is a real tiny-model slot with one bug injected:
for chosen sentences it yields its audio as a ``(1, n)`` array instead of 1-D samples, so the
phone-audio path raises a plain ``ValueError`` inside the utterance's task, not the engine's
``EngineError`` (that path is covered by test_faults.py and test_twilio_e2e.py).

- the sentence breaks: the caller hears the error prompt, then the script's hang-up; the
  failure is logged once, with its traceback and the call id;
- the error prompt breaks too: the call is hung up instead of left open in silence.
"""

from __future__ import annotations

import logging
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest
from twilio.request_validator import RequestValidator

from gateway.tts.batched import BatchedQwenEngine
from gateway.tts.engine import EngineRow
from tests.support.servers import AUTH_TOKEN, VirtualServer, on_virtual_time, serve_virtual
from tests.support.twilio_client import FakeTwilioCall

BALANCE = "your balance is ready"
SORRY = "something went wrong"

SCRIPT = textwrap.dedent(
    """\
    name: failures
    voice:
      speaker: ryan
      language: English
    start: balance
    error: sorry
    nodes:
      balance:
        say: "Hello {caller}, your balance is ready."
        next: goodbye
      goodbye:
        say: "Goodbye."
        hangup: true
      sorry:
        say: "Sorry {caller}, something went wrong."
        transfer: "+15555550100"
    """
)


class BuggyEngine(BatchedQwenEngine):
    """The real tiny-model engine, handing out 2-D chunks for sentences containing ``broken``."""

    broken: ClassVar[set[str]] = set()

    def next_chunks(self, rows: Sequence[EngineRow]) -> list[np.ndarray | None]:
        chunks = super().next_chunks(rows)
        return [audio[None, :] if audio is not None and any(
                    part in row.request.text for part in self.broken)  # type: ignore[attr-defined]
                else audio for row, audio in zip(rows, chunks, strict=True)]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[VirtualServer]:
    folder = tmp_path_factory.mktemp("failures")
    script = folder / "failures.yaml"
    script.write_text(SCRIPT)

    def factory(settings: Any) -> list[BatchedQwenEngine]:
        return [BuggyEngine(str(tiny_model_dir), device="cpu", max_rows=4,
                            trim_leading_silence=False)]

    with serve_virtual({"model": str(tiny_model_dir), "script": str(script),
                        "cache_dir": str(folder / "cache")},
                       factory) as server:
        yield server


_numbers = iter(range(1, 10**6))


def _call(live: VirtualServer) -> FakeTwilioCall:
    n = next(_numbers)
    return FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid=f"CA{n:032x}",
                          stream_sid=f"MZ{n:032x}", playback_speed=20)


async def _after_stream(live: VirtualServer, call_sid: str) -> ET.Element:
    url = f"{live.base_url}/twilio/after-stream"
    form = {"CallSid": call_sid, "AccountSid": "AC" + "0" * 32}
    signature = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(url, data=form, headers={"X-Twilio-Signature": signature})
    assert response.status_code == 200
    return ET.fromstring(response.text)


def _failure_records(caplog: pytest.LogCaptureFixture, call_sid: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.levelno >= logging.WARNING and call_sid in r.getMessage()
            and "failed" in r.getMessage()]


@on_virtual_time("live")
async def test_a_bug_in_an_utterance_plays_the_error_prompt_and_is_logged_once(
    live: VirtualServer, caplog: pytest.LogCaptureFixture
) -> None:
    BuggyEngine.broken = {BALANCE}
    caplog.set_level(logging.INFO)
    async with _call(live) as call:
        await call.start({"From": "+15550001111"})
        server_call = await call.wait_for(lambda: live.gateway.registry.get(call.call_sid))
        sorry = await call.wait_for(
            lambda: next((u for u in server_call.utterances if SORRY in u.text), None), timeout=60)
        # The caller hears all of the error prompt (its mark comes back), then the transfer.
        await call.wait_for(lambda: sorry.id in call.marks_echoed, timeout=60)
        await call.wait_for(lambda: call.closed.is_set(), timeout=60)
    balance = server_call.utterances[0]
    assert BALANCE in balance.text and balance.error is not None
    assert [u.text for u in server_call.utterances][1:] == [sorry.text]
    dial = (await _after_stream(live, call.call_sid)).find("Dial")
    assert dial is not None and dial.text == "+15555550100"
    failures = _failure_records(caplog, call.call_sid)
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert failures[0].levelno == logging.ERROR and failures[0].exc_info is not None
    assert balance.id in failures[0].getMessage()


@on_virtual_time("live")
async def test_when_the_error_prompt_fails_too_the_call_is_hung_up(
    live: VirtualServer, caplog: pytest.LogCaptureFixture
) -> None:
    BuggyEngine.broken = {BALANCE, SORRY}
    caplog.set_level(logging.INFO)
    async with _call(live) as call:
        await call.start({"From": "+15550001111"})
        server_call = await call.wait_for(lambda: live.gateway.registry.get(call.call_sid))
        await call.wait_for(lambda: call.closed.is_set(), timeout=60)
    assert call.close_code == 1000
    said = [(u.text, u.error is not None) for u in server_call.utterances]
    assert [failed for _, failed in said] == [True, True] and SORRY in said[1][0]
    assert (await _after_stream(live, call.call_sid)).find("Hangup") is not None
    assert len(_failure_records(caplog, call.call_sid)) == 2  # one per failed utterance
