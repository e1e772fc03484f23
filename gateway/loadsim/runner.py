"""Runs simulated callers against a gateway: scenarios, arrival patterns, levels, workers.

A level is a fixed concurrency (callers redial as their calls end), a Poisson call rate, or a
ramp, held for a duration. Each call follows a scenario:

- ``menu``: listen to the greeting, then for each entry of ``digits`` wait ``think`` seconds
  after the prompt starts and press the keys (the first key of an entry pressed while a prompt
  still plays is a barge-in), then listen ``listen`` seconds and hang up;
- ``barge-in``: press a key while the first prompt plays, measuring key -> ``clear`` (Twilio)
  or key -> speech stops (SIP);
- ``hangup``: hang up in the middle of the first utterance.

Past one core, ``workers`` processes each run a share of the callers with their own clock, and
their samples are merged into one result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gateway.loadsim.model import CallRecord, Level, Turn
from gateway.loadsim.twilio_caller import Ticker, TwilioCaller

log = logging.getLogger(__name__)


@dataclass
class LoadConfig:
    """One load run's settings (picklable: workers get a copy)."""

    target: str  # http(s)://host:port of the gateway (Twilio) or host:port of its SIP endpoint
    transport: str = "twilio"
    auth_token: str | None = None
    scenario: str = "menu"
    digits: list[str] = field(default_factory=lambda: ["9"])
    think_s: float = 1.0
    listen_s: float = 1.0
    turn_timeout_s: float = 15.0
    pattern: str = "concurrency"  # concurrency | rate | ramp
    rate: float = 1.0
    ramp_from: int = 1
    duration_s: float = 10.0
    workers: int = 1
    refuse_fraction: float = 0.25
    seed: int = 0
    #: Wall-clock start of the whole run: turn times are seconds since it, across levels and
    #: worker processes (set by run_level when unset).
    run_started_wall: float = 0.0

    def ws_url(self) -> str:
        parts = urlsplit(self.target if "://" in self.target else f"http://{self.target}")
        scheme = "wss" if parts.scheme == "https" else "ws"
        return f"{scheme}://{parts.netloc}/twilio/media"

    def sip_target(self) -> tuple[str, int]:
        host, _, port = self.target.rpartition(":")
        return host or "127.0.0.1", int(port)


Progress = Callable[[dict[str, Any]], None]


class _Counters:
    def __init__(self) -> None:
        self.active = 0
        self.done = 0
        self.errors = 0


async def run_calls(config: LoadConfig, concurrency: int, level: int,
                    worker: int = 0, progress: Progress | None = None) -> Level:
    """Run one level in this process and return its calls and the clock's lateness."""
    ticker = Ticker()
    ticker.start()
    rng = random.Random(config.seed * 1000 + worker)
    # Turn times are measured on the monotonic clock from ``started``, which stands for
    # ``offset`` seconds after the run began (so levels line up on one timeline).
    offset = time.time() - (config.run_started_wall or time.time())
    started = time.monotonic() - offset
    stop_at = time.monotonic() + config.duration_s
    counters = _Counters()
    calls: list[CallRecord] = []
    ids = itertools.count(1)

    async def one_call() -> None:
        n = next(ids)
        record = CallRecord(id=f"w{worker}-l{level}-c{n}", level=level,
                            transport=config.transport, started_s=time.monotonic() - started)
        counters.active += 1
        try:
            if config.transport == "sip":
                await _sip_call(config, record, started, rng)
            else:
                call_sid = f"CA{worker:04d}{level:04d}{n:024d}"
                await _twilio_call(config, record, ticker, started, call_sid, rng)
        except Exception as exc:
            record.error = record.error or f"{type(exc).__name__}: {exc}"
        finally:
            counters.active -= 1
            counters.done += 1
            counters.errors += 1 if record.error else 0
            record.ended_s = time.monotonic() - started
            calls.append(record)

    async def redialler() -> None:
        while time.monotonic() < stop_at:
            await one_call()

    async def report() -> None:
        while True:
            if progress is not None:
                firsts = [t.first_audio_ms for c in calls for t in c.turns
                          if t.first_audio_ms is not None]
                progress({"level": level, "concurrency": concurrency, "active": counters.active,
                          "done": counters.done, "errors": counters.errors,
                          "ttfa_p95": sorted(firsts)[int(0.95 * (len(firsts) - 1))]
                          if firsts else None,
                          "lateness_ms": max(ticker.lateness_ms[-50:], default=0.0),
                          "elapsed": time.monotonic() - started})
            await asyncio.sleep(0.5)

    reporter = asyncio.create_task(report())
    try:
        if config.pattern == "rate":
            tasks = []
            while time.monotonic() < stop_at:
                tasks.append(asyncio.create_task(one_call()))
                await asyncio.sleep(rng.expovariate(config.rate))
            await asyncio.gather(*tasks)
        elif config.pattern == "ramp":
            tasks = []
            steps = max(1, concurrency - config.ramp_from + 1)
            for i in range(steps):
                for _ in range(config.ramp_from if i == 0 else 1):
                    tasks.append(asyncio.create_task(redialler()))
                await asyncio.sleep(config.duration_s / steps)
            await asyncio.gather(*tasks)
        else:
            await asyncio.gather(*(redialler() for _ in range(concurrency)))
    finally:
        reporter.cancel()
        await ticker.stop()
    return Level(concurrency, calls, lateness_ms=ticker.lateness_ms,
                 refuse_fraction=config.refuse_fraction)


async def _twilio_call(config: LoadConfig, record: CallRecord, ticker: Ticker, t0: float,
                       call_sid: str, rng: random.Random) -> None:
    caller = TwilioCaller(config.ws_url(), config.auth_token, call_sid, ticker)
    timeout = config.turn_timeout_s
    try:
        await caller.connect()
        record.setup_ms = caller.setup_ms
        turns: list[tuple[Turn, float]] = []
        answered = time.monotonic()
        turns.append((Turn("answer", at_s=answered - t0), answered))
        first = await caller.wait_audio_after(answered, timeout)
        if first is None:
            turns[-1][0].timed_out = True
            record.error = "no audio after the answer"
        elif config.scenario == "hangup":
            await asyncio.sleep(rng.uniform(0.1, 0.6))
        elif config.scenario == "barge-in":
            await asyncio.sleep(0.2)
            pressed = await caller.press(config.digits[0][:1] if config.digits else "9")
            turns.append((Turn("barge_in", at_s=pressed - t0), pressed))
            await caller.wait_audio_after(pressed, timeout)
        else:
            for keys in config.digits:
                await asyncio.sleep(config.think_s)
                if caller.heard.closed_at is not None:
                    break
                kind = "barge_in" if caller.playing(time.monotonic()) else "dtmf"
                pressed = 0.0
                for index, key in enumerate(keys):
                    sent = await caller.press(key)
                    pressed = sent if index == 0 else pressed
                    await asyncio.sleep(0.05)
                turns.append((Turn(kind, at_s=pressed - t0), pressed))
                if await caller.wait_audio_after(pressed, timeout) is None:
                    turns[-1][0].timed_out = True
                    record.error = record.error or f"no audio after pressing {keys}"
                    break
            await asyncio.sleep(config.listen_s)
        if caller.heard.closed_at is not None and caller.heard.close_code not in (1000, None):
            record.error = record.error or f"gateway closed the stream ({caller.heard.close_code})"
    finally:
        await caller.hangup()
    if caller.error:
        record.error = record.error or caller.error
    # Measurements, per turn: first audio, barge-in, gaps until the next turn.
    ends = [at for _, at in turns[1:]] + [time.monotonic()]
    for (turn, at), end in zip(turns, ends, strict=True):
        first = caller.first_audio_after(at, until=end)
        if first is not None and first < end:
            turn.first_audio_ms = 1000 * (first - at)
            gaps, gap_ms, audio = caller.gaps_between(first, end)
            turn.gaps, turn.gap_ms = gaps, gap_ms
            record.audio_ms += 1000 * audio
        elif not turn.timed_out and turn.kind != "answer":
            turn.timed_out = first is None
        if turn.kind == "barge_in":
            clear = caller.clear_after(at)
            turn.barge_in_ms = 1000 * (clear - at) if clear is not None and clear < end else None
        record.turns.append(turn)
    record.jitter_ms = caller.jitter_ms()
    media = caller.heard.media
    for mark_at, _ in caller.heard.marks:
        before = [arrival for arrival, _ in media if arrival <= mark_at]
        if before:
            record.mark_rtt_ms.append(1000 * (mark_at - before[-1]))


async def _sip_call(config: LoadConfig, record: CallRecord, t0: float,
                    rng: random.Random) -> None:
    from gateway.loadsim.sip_caller import SipCaller

    caller = SipCaller()
    timeout = config.turn_timeout_s
    try:
        await caller.call(config.sip_target(), timeout_s=timeout)
        record.setup_ms = caller.setup_ms
        if caller.status != 200 or caller.answered_at is None:
            record.error = f"call not answered: {caller.status}"
            return
        answered = caller.answered_at
        turns: list[tuple[Turn, float]] = [(Turn("answer", at_s=answered - t0), answered)]
        first = await _poll(lambda: caller.first_audio_after(answered), timeout)
        if first is None:
            turns[0][0].timed_out = True
            record.error = "no audio after the answer"
        elif config.scenario == "hangup":
            await asyncio.sleep(rng.uniform(0.1, 0.6))
        else:
            digits = config.digits if config.scenario == "menu" else config.digits[:1]
            for keys in digits:
                await asyncio.sleep(config.think_s if config.scenario == "menu" else 0.2)
                pressed = 0.0
                for index, key in enumerate(keys):
                    sent = await caller.send_dtmf(key)
                    pressed = sent if index == 0 else pressed
                kind = "barge_in" if config.scenario == "barge-in" else "dtmf"
                turns.append((Turn(kind, at_s=pressed - t0), pressed))
                # The first 300 ms after a key may still carry the interrupted prompt.
                got = await _poll(functools.partial(caller.first_audio_after, pressed + 0.3),
                                  timeout)
                if got is None:
                    turns[-1][0].timed_out = True
                    record.error = record.error or f"no audio after pressing {keys}"
                    break
            await asyncio.sleep(config.listen_s)
    finally:
        await caller.hangup()
        caller.close()
    ends = [at for _, at in turns[1:]] + [time.monotonic()]
    for (turn, at), end in zip(turns, ends, strict=True):
        first = caller.first_audio_after(at)
        if first is not None and first < end:
            turn.first_audio_ms = 1000 * (first - at)
            gaps, gap_ms = caller.gaps(first, end)
            turn.gaps, turn.gap_ms = gaps, gap_ms
            record.audio_ms += 1000 * (end - first)
        if turn.kind in ("barge_in", "dtmf"):
            stopped = caller.stream_stopped_after(at)
            if turn.kind == "barge_in":
                turn.barge_in_ms = 1000 * (stopped - at) if stopped is not None else None
        record.turns.append(turn)
    record.jitter_ms = caller.jitter_ms
    record.loss_pct = caller.loss_pct


async def _poll(check: Callable[[], float | None], timeout_s: float) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found is not None:
            return found
        await asyncio.sleep(0.01)
    return None


# --- levels and workers -----------------------------------------------------------------------


def _worker(config: LoadConfig, concurrency: int, level: int, worker: int) -> dict[str, Any]:
    result = asyncio.run(run_calls(config, concurrency, level, worker))
    return {"calls": [c.to_json() for c in result.calls], "lateness_ms": result.lateness_ms}


def run_level(config: LoadConfig, concurrency: int, level: int,
              progress: Progress | None = None) -> Level:
    """Run one level, split across ``config.workers`` processes when more than one."""
    if not config.run_started_wall:
        config.run_started_wall = time.time()
    if config.workers <= 1:
        return asyncio.run(run_calls(config, concurrency, level, 0, progress))
    shares = [concurrency // config.workers + (1 if i < concurrency % config.workers else 0)
              for i in range(config.workers)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=context) as pool:
        futures = [pool.submit(_worker, config, share, level, i)
                   for i, share in enumerate(shares) if share]
        parts = [f.result() for f in futures]
    calls = [CallRecord.from_json(c) for part in parts for c in part["calls"]]
    lateness = [x for part in parts for x in part["lateness_ms"]]
    return Level(concurrency, calls, lateness_ms=lateness,
                 refuse_fraction=config.refuse_fraction)


def result_document(config: LoadConfig, levels: list[Level], started: str, duration_s: float,
                    slo: str | None = None, slo_passed: bool | None = None,
                    level_passed: list[bool | None] | None = None) -> dict[str, Any]:
    """The JSON result document (input of the HTML report and of ``loadsim merge``)."""
    summaries = [lv.summary() for lv in levels]
    for summary, passed in zip(summaries, level_passed or [None] * len(levels), strict=True):
        summary["passed"] = passed
    lateness = [x for lv in levels for x in lv.lateness_ms]
    from gateway.loadsim.model import percentiles

    return {
        "meta": {"target": config.target, "transport": config.transport,
                 "scenario": config.scenario, "started": started, "duration_s": duration_s,
                 "workers": config.workers, "config": asdict(config) | {"auth_token": None},
                 "simulator_lateness_ms": percentiles(lateness), "slo": slo,
                 "slo_passed": slo_passed},
        "levels": summaries,
        "calls": [c.to_json() for lv in levels for c in lv.calls],
        "lateness_ms": {str(lv.concurrency): lv.lateness_ms for lv in levels},
    }


def levels_from_document(document: dict[str, Any]) -> list[Level]:
    """Rebuild levels from a result document (for merging files from several hosts)."""
    by_level: dict[int, list[CallRecord]] = {}
    for data in document.get("calls", []):
        record = CallRecord.from_json(data)
        by_level.setdefault(record.level, []).append(record)
    lateness = document.get("lateness_ms", {})
    concurrency = {i: s["concurrency"] for i, s in enumerate(document.get("levels", []))}
    levels = []
    for index, calls in sorted(by_level.items()):
        conc = concurrency.get(index, 0)
        levels.append(Level(conc, calls, lateness_ms=list(lateness.get(str(conc), []))))
    return levels
