"""Long run: a thousand calls through one real gateway leak nothing.

One gateway (uvicorn on an ephemeral port, the tiny Qwen3-TTS on CPU, prompts/demo.yaml from the
pre-rendered cache, the company's backend on its own port) takes a wave of concurrent calls to
warm up, then ``SEQUENTIAL`` calls one after another, then another concurrent wave. Every call is
a real Twilio Media Stream: connect, start, hear the greeting, press a key, and hang up; some
press 1 and go through the backend to a live sentence (hung up mid-sentence, so its generation
is cancelled), some press 2 and are transferred (and the ``<Connect action>`` is fetched, as
Twilio does). The process's memory (RSS), file descriptors, threads and the server loop's asyncio
tasks are sampled as it goes and printed as a table; memory must stay flat after the warm-up
(under 5% growth over the last 80% of the run), everything else must come back to where it was,
and no call may fail.

Marked ``soak``: left out of the default run; ``./run.sh test -m soak`` runs it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from twilio.request_validator import RequestValidator

from tests.support.paths import DEMO_SCRIPT
from tests.support.servers import AUTH_TOKEN, LiveServer, backend, serve
from tests.support.twilio_client import FakeTwilioCall

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3600)]

#: Sequential calls (SOAK_CALLS overrides, e.g. for a longer run before a release).
SEQUENTIAL = int(os.environ.get("SOAK_CALLS", "1000"))
CONCURRENT = 50
#: Every this many sequential calls, one goes through the backend to a live sentence, and one
#: is transferred to an agent.
EVERY = 50
SAMPLE_EVERY = 50
#: Memory may grow this much over the last 80% of the run (allocator noise, not a leak).
RSS_GROWTH_LIMIT = 0.05
CALL_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, demo_cache_dir: Path) -> Iterator[tuple[LiveServer, list[Any]]]:
    with backend() as (url, seen), pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACME_BACKEND_URL", url)
        with serve({"model": str(tiny_model_dir), "script": str(DEMO_SCRIPT),
                    "cache_dir": str(demo_cache_dir), "max_calls": 2 * CONCURRENT}) as live:
            yield live, seen


class ErrorLog(logging.Handler):
    """Collects every ERROR record the gateway logs during the run."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


# --- calls ------------------------------------------------------------------------------------


class Caller:
    """Calls the gateway; each kind of call checks what the caller hears."""

    def __init__(self, live: LiveServer, seen: list[Any]) -> None:
        self.live = live
        self.seen = seen
        self.number = 0
        self.errors: list[str] = []
        self.calls_at_baseline = 0

    def _new(self) -> FakeTwilioCall:
        self.number += 1
        n = self.number
        return FakeTwilioCall(self.live.ws_url, AUTH_TOKEN, call_sid=f"CA{n:032x}",
                              stream_sid=f"MZ{n:032x}", playback_speed=50)

    async def call(self, kind: str) -> None:
        """One call of ``kind`` (menu, lookup, agent); a failure is recorded, not raised."""
        call = self._new()
        try:
            async with call:
                await asyncio.wait_for(getattr(self, f"_{kind}")(call), CALL_TIMEOUT_S)
        except Exception as exc:
            received = [r.message.get("event") for r in call.received][-10:]
            self.errors.append(f"{call.call_sid} ({kind}): {exc!r}; last received {received}")

    @staticmethod
    async def _greeting_then(call: FakeTwilioCall, digit: str) -> float:
        """Start, hear the greeting begin, press ``digit``; returns when the greeting is cut
        (the server's ``clear``)."""
        await call.start({"From": "+15550001111", "To": "+15550002222"})
        await call.wait_for(lambda: call.events("media"), timeout=30)
        await call.send_dtmf(digit)
        clear = await call.wait_for(lambda: call.events("clear"), timeout=30)
        return float(clear[0].at)

    @staticmethod
    async def _audio_after(call: FakeTwilioCall, t: float) -> None:
        await call.wait_for(lambda: any(r.at > t for r in call.events("media")), timeout=30)

    async def _hang_up(self, call: FakeTwilioCall) -> None:
        await call.send_stop()
        await call.wait_for(lambda: call.closed.is_set(), timeout=30)

    async def _menu(self, call: FakeTwilioCall) -> None:
        # 9 during the greeting: the greeting stops and the menu plays (from the cache).
        cleared = await self._greeting_then(call, "9")
        await self._audio_after(call, cleared)
        await self._hang_up(call)

    async def _lookup(self, call: FakeTwilioCall) -> None:
        cleared = await self._greeting_then(call, "1")
        await self._audio_after(call, cleared)  # "Please say or enter your six digit..."
        asked = len(self.seen)
        for digit in "123456#":
            await call.send_dtmf(digit)
        # "One moment..." plays to the end, then the backend is asked...
        await call.wait_for(lambda: len(self.seen) > asked, timeout=30)
        answered = time.monotonic()
        # ...and the balance, generated live, starts; the caller hangs up in the middle of it.
        await self._audio_after(call, answered)
        await self._hang_up(call)

    async def _agent(self, call: FakeTwilioCall) -> None:
        await self._greeting_then(call, "2")
        # "Please hold while I transfer you": played, then the gateway ends the stream.
        await call.wait_for(lambda: call.closed.is_set(), timeout=30)
        assert call.close_code == 1000, call.close_code
        url = f"{self.live.base_url}/twilio/after-stream"
        form = {"CallSid": call.call_sid, "AccountSid": "AC" + "0" * 32}
        signature = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
        async with httpx.AsyncClient() as client:
            response = await client.post(url, data=form, timeout=10,
                                         headers={"X-Twilio-Signature": signature})
        dial = ET.fromstring(response.text).find("Dial")
        assert dial is not None and dial.text == "+15555550100", response.text


def _kind(index: int) -> str:
    if index % EVERY == EVERY - 1:
        return "lookup"
    if index % EVERY == EVERY // 2:
        return "agent"
    return "menu"


# --- sampling ---------------------------------------------------------------------------------


@dataclass
class Sample:
    label: str
    elapsed_s: float
    rss_mb: float
    fds: int
    os_threads: int
    py_threads: int
    server_tasks: int
    py_objects: int
    calls: int


def _proc_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


async def _server_tasks(live: LiveServer) -> int:
    """asyncio tasks alive on the server's event loop (it runs in its own thread)."""
    loop = live.server.servers[0].get_loop()

    async def count() -> int:
        return len(asyncio.all_tasks()) - 1  # not this one

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(count(), loop))


async def _settle(live: LiveServer) -> None:
    """Until the server has finished with every call (sockets closed, slots idle)."""
    speech = live.gateway.speech_service
    deadline = time.monotonic() + 30
    while live.gateway.registry or speech.busy_slots or speech.queued:
        assert time.monotonic() < deadline, f"calls left: {list(live.gateway.registry)}"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)


async def _sample(live: LiveServer, label: str, t0: float) -> Sample:
    gc.collect()
    return Sample(
        label=label,
        elapsed_s=time.monotonic() - t0,
        rss_mb=_proc_status("VmRSS") / 1024,
        fds=len(os.listdir("/proc/self/fd")),
        os_threads=_proc_status("Threads"),
        py_threads=threading.active_count(),
        server_tasks=await _server_tasks(live),
        py_objects=len(gc.get_objects()),
        calls=len(live.gateway.registry),
    )


def _table(samples: list[Sample]) -> str:
    lines = [f"{'point':<22}{'elapsed s':>10}{'RSS MB':>9}{'fds':>6}{'threads':>9}"
             f"{'py thr':>8}{'srv tasks':>11}{'py objects':>12}{'calls':>7}"]
    for s in samples:
        lines.append(f"{s.label:<22}{s.elapsed_s:>10.1f}{s.rss_mb:>9.1f}{s.fds:>6}"
                     f"{s.os_threads:>9}{s.py_threads:>8}{s.server_tasks:>11}{s.py_objects:>12}"
                     f"{s.calls:>7}")
    return "\n".join(lines)


# --- the run ----------------------------------------------------------------------------------


async def test_a_thousand_calls_leak_nothing(gateway: tuple[LiveServer, list[Any]]) -> None:
    live, seen = gateway
    caller = Caller(live, seen)
    errors = ErrorLog()
    logging.getLogger("gateway").addHandler(errors)
    metrics = live.gateway.metrics
    speech = live.gateway.speech_service
    samples: list[Sample] = []
    t0 = time.monotonic()
    try:
        # Warm-up: a few calls of every kind, then a concurrent wave, so every buffer, pool
        # and lazily built structure has reached its working size.
        for index in range(EVERY):
            await caller.call(_kind(index))
        await asyncio.gather(*(caller.call(_kind(i)) for i in range(CONCURRENT)))
        await _settle(live)
        samples.append(await _sample(live, "after warm-up", t0))

        sequential_t0 = time.monotonic()
        baseline: Sample | None = None
        for index in range(SEQUENTIAL):
            await caller.call(_kind(index))
            done = index + 1
            if done % SAMPLE_EVERY == 0:
                await _settle(live)
                sample = await _sample(live, f"sequential {done}", t0)
                samples.append(sample)
                if baseline is None and done >= SEQUENTIAL // 5:
                    baseline = sample  # the last 80% of the run is judged from here
                    caller.calls_at_baseline = caller.number
        sequential_s = time.monotonic() - sequential_t0

        wave_t0 = time.monotonic()
        await asyncio.gather(*(caller.call(_kind(i)) for i in range(CONCURRENT)))
        wave_s = time.monotonic() - wave_t0
        await _settle(live)
        samples.append(await _sample(live, f"after {CONCURRENT} concurrent", t0))
    finally:
        logging.getLogger("gateway").removeHandler(errors)

    first, last = samples[0], samples[-1]
    assert baseline is not None
    growth = (last.rss_mb - baseline.rss_mb) / baseline.rss_mb
    calls = caller.number
    judged = calls - caller.calls_at_baseline
    objects_per_call = (last.py_objects - baseline.py_objects) / judged
    print(f"\nsoak: {calls} calls ({SEQUENTIAL} sequential in {sequential_s:.0f} s, "
          f"{1000 * sequential_s / SEQUENTIAL:.0f} ms per call; {CONCURRENT} concurrent in "
          f"{wave_s:.1f} s); {len(seen)} backend lookups, {speech.stats.cancelled} live "
          f"sentences cancelled by hang-up, {speech.stats.completed} completed")
    print(_table(samples))
    print(f"over the last {judged} calls: RSS {baseline.rss_mb:.1f} -> {last.rss_mb:.1f} MB "
          f"({100 * growth:+.2f}%, {1024 * (last.rss_mb - baseline.rss_mb) / judged:+.1f} KB "
          f"per call), Python objects {objects_per_call:+.2f} per call; errors: "
          f"{len(caller.errors)} calls, {len(errors.records)} logged")

    assert not caller.errors, caller.errors[:5]
    assert not errors.records, errors.records[:5]
    assert speech.stats.failed == 0 and speech.healthy_engines == len(speech.engines)
    rendered = metrics.render().decode()
    assert "gateway_calls_protocol_errors_total{" not in rendered
    assert "gateway_speech_failures_total{" not in rendered
    # Flat after warm-up. The RSS bound is coarse (the model dominates the process); the object
    # count catches a Python-level leak of even one object per call.
    assert growth < RSS_GROWTH_LIMIT, _table(samples)
    assert objects_per_call < 1.0, _table(samples)
    # Everything per call was given back.
    assert last.calls == 0 and not live.gateway.outcomes
    assert last.server_tasks <= first.server_tasks, _table(samples)
    assert last.fds <= first.fds + 2, _table(samples)
    assert last.py_threads <= first.py_threads, _table(samples)
    assert last.os_threads <= first.os_threads + 2, _table(samples)
