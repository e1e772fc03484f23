"""What a speech stream tells its consumer of the next chunk (gateway/tts/stream.py): the
engine core's estimate, handed over with each chunk, plus the margin the service measured of
such estimates where consumers take their chunks (``EtaMargin``), on a virtual clock."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from clocks import VirtualClock

from gateway.tts.core import Outbox
from gateway.tts.engine import SpeechRequest
from gateway.tts.stream import EtaMargin, SpeechStream

CHUNK = np.zeros(1920, dtype=np.float32)  # one 80 ms codec frame at 24 kHz


def test_the_margin_is_a_decaying_peak_of_lateness() -> None:
    margin = EtaMargin(decay=0.5)
    margin.observe(-0.01)  # early: no margin
    assert margin.value == 0.0
    margin.observe(0.04)
    assert margin.value == pytest.approx(0.04)
    margin.observe(0.0)
    margin.observe(0.0)
    assert margin.value == pytest.approx(0.01)
    margin.observe(0.03)  # a late one widens it at once
    assert margin.value == pytest.approx(0.03)
    with pytest.raises(ValueError, match="decay"):
        EtaMargin(decay=1.0)


async def test_each_chunk_carries_its_estimate_and_the_second_measures_the_first() -> None:
    clock = VirtualClock(start=100.0)
    margin = EtaMargin()
    loop = asyncio.get_running_loop()
    outbox = Outbox()

    async def turn(late_s: float) -> list[float | None]:
        stream = SpeechStream(SpeechRequest(text="x"), loop, clock.now(), clock.now() + 1,
                              clock, margin)
        seen = []
        # The core hands over the first chunk saying the next comes in 20 ms; the second
        # comes late_s after that (a prefill between the steps, a slow event loop).
        for eta in (0.02, 0.04):
            stream.deliver(CHUNK, clock.now(), outbox, eta)
            outbox.flush()
            await stream.__anext__()
            seen.append(stream.next_chunk_eta_s)
            await clock.advance(0.02 + late_s)
        return seen

    before = margin.value
    assert await turn(0.0) == [pytest.approx(0.02), pytest.approx(0.04)]
    assert margin.value == before == 0.0
    # 30 ms late: the next turns' estimates carry 30 ms more (this turn's second too).
    assert await turn(0.03) == [pytest.approx(0.02), pytest.approx(0.04 + 0.03)]
    assert await turn(0.0) == [pytest.approx(0.02 + 0.03), pytest.approx(0.04 + 0.03 * 0.965)]


async def test_no_estimate_from_the_core_is_no_estimate_for_the_consumer() -> None:
    clock = VirtualClock(start=0.0)
    stream = SpeechStream(SpeechRequest(text="x"), asyncio.get_running_loop(), 0.0, 1.0,
                          clock, EtaMargin())
    outbox = Outbox()
    stream.deliver(CHUNK, 0.0, outbox)
    outbox.flush()
    assert len(await stream.__anext__()) == len(CHUNK)
    assert stream.next_chunk_eta_s is None
