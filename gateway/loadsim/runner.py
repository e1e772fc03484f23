"""Runs simulated callers against a gateway: scenarios, arrival patterns, levels, workers.

A level is a fixed concurrency (callers redial as their calls end), a Poisson call rate, or a
ramp, held for a duration. Every call is placed the way the network places it: a Twilio caller
POSTs the voice webhook and opens the Media Stream its TwiML names
(:mod:`gateway.loadsim.twilio_caller`), a SIP caller sends an INVITE
(:mod:`gateway.loadsim.sip_caller`). Each call follows a scenario, the same on both transports:

- ``menu``: listen to the greeting, then for each entry of ``digits`` wait ``think`` seconds
  after the prompt starts and press the keys (a key pressed while a prompt still plays is a
  barge-in), then listen ``listen`` seconds and hang up. An entry ``say:PATH.wav`` says that
  recording instead (:mod:`gateway.loadsim.speech`), and its turn is measured from the end of
  the speech, as the gateway's speech gathers measure it;
- ``barge-in``: press a key while the first prompt plays, measuring key -> ``clear`` (Twilio)
  or key -> speech stops (SIP);
- ``hangup``: hang up in the middle of the first utterance;
- ``live``: every turn needs a live sentence, so first audio measures the engine, not the
  prompt cache. Meant for a gateway without a script: its first-call greeter speaks the
  greeting and reads back each key with a sentence generated for that key
  (:func:`gateway.greeter.digit_sentence`). The caller listens to each utterance to its end (its
  ``mark`` on Twilio, the end of speech on SIP), waits ``think`` seconds and presses the next
  key of ``digits`` (one key per turn). The characters of every sentence heard whole are
  counted (the greeting's from ``greeting``, the gateway's default ``GATEWAY_GREETING`` unless
  told otherwise), which gives characters synthesised per second; the gateway's own
  ``gateway_turns_total{source}`` (read from /metrics around the level) shows whether the turns
  really were live.
- ``agent``: the gateway hands the call to a bot, and the bot is the simulator's own
  (:class:`gateway.loadsim.agent.AgentBot`, served on ``bot_port``): each key the caller
  presses goes to it, and it streams its answer at ``token_rate`` tokens a second. The caller
  listens to each answer to its end as in ``live``; each turn also records the bot's first
  token -> the caller's first audio (same process, same clock), which sizes a line of agents.

Refused calls (busy TwiML, a stream closed 1013, SIP 486/503/600) and failed ones are counted
apart (:mod:`gateway.loadsim.model`). A caller whose call was refused or failed waits
``backoff`` seconds (uniformly 0.5x to 1.5x, so refused callers do not redial in lockstep)
before dialling again, as people do: the offered load stays the concurrency asked for instead
of turning into a redial storm, and the placed-call rate is reported. With ``rate``, each
arrival is one caller who tries once.

Past one core, ``workers`` processes each run a share of the callers with their own clock, and
their samples are merged into one result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from gateway.loadsim.model import CallRecord, Level, Turn, percentiles
from gateway.loadsim.speech import is_speech, speech_frames

if TYPE_CHECKING:
    import httpx

    from gateway.loadsim.agent import AgentBot
    from gateway.loadsim.sip_caller import SipCaller
    from gateway.loadsim.twilio_caller import Ticker, TwilioCaller

__all__ = ["GATEWAY_FAILURES", "READYZ_BUDGET_FIELD", "SCENARIOS", "LoadConfig",
           "budget_warning", "new_call_sid", "probe_readyz", "redial_delay", "result_document",
           "run_calls", "run_level", "scrape_metrics", "think_time"]

log = logging.getLogger(__name__)

SCENARIOS = ("menu", "barge-in", "hangup", "live", "agent")
#: How long a caller in the ``live`` scenario waits for a live utterance to end.
UTTERANCE_LIMIT_S = 120.0


def default_greeting() -> str:
    """What the gateway's first-call greeter says on answer unless GATEWAY_GREETING is set."""
    from gateway.config import Settings

    default = Settings.model_fields["greeting"].default
    assert isinstance(default, str)
    return default


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
    withhold_fraction: float = 0.25
    #: Mean seconds a refused (or failed) caller waits before dialling again.
    backoff_s: float = 5.0
    #: The gateway's HTTP base URL for /readyz and /metrics (a Twilio target is its own).
    http: str | None = None
    #: ``live`` scenario: the greeting the gateway speaks on answer (its characters count).
    greeting: str | None = None
    seed: int = 0
    #: Wall-clock start of the whole run: turn times are seconds since it, across levels and
    #: worker processes (set by run_level when unset).
    run_started_wall: float = 0.0
    #: The caller's number (``--from``) and the number dialled (``--to``: it picks the line
    #: of a lines file; Twilio's ``To``, the user of the SIP Request-URI).
    caller_id: str = "+15550000000"
    called: str = "+15550009999"
    #: ``agent`` scenario: the port the simulator's bot listens on (the gateway's bot node
    #: points at it), its tokens per second, its answer, and its delay to the first token.
    bot_port: int = 8765
    token_rate: float = 30.0
    answer: str | None = None
    bot_delay_s: float = 0.0
    #: Spread of the callers' timing, so they do not move in lockstep: each think time is drawn
    #: from ``think_s`` x [1 - jitter, 1 + jitter], and each caller of a level places its first
    #: call after a uniform delay in [0, jitter x (think_s + listen_s)] (seeded by ``seed``).
    jitter: float = 0.5

    def base_url(self) -> str:
        """The gateway's HTTP base (Twilio target), without a trailing slash."""
        target = self.target if "://" in self.target else f"http://{self.target}"
        return target.rstrip("/")

    def voice_url(self) -> str:
        """The number's voice webhook, as Twilio is configured to request it."""
        return f"{self.base_url()}/twilio/voice"

    def http_base(self) -> str | None:
        """Where /readyz and /metrics are (None: unknown, for a SIP target without ``http``)."""
        if self.http:
            return self.http.rstrip("/")
        return self.base_url() if self.transport == "twilio" else None

    def sip_target(self) -> tuple[str, int]:
        parts = urlsplit(self.target if "://" in self.target else f"sip://{self.target}")
        return parts.hostname or "127.0.0.1", parts.port or 5060

    def turns(self) -> list[str]:
        """The keys of each turn after the answer (``live``: one key per turn), or a
        ``say:PATH`` recording."""
        if self.scenario in ("live", "agent"):
            return [key for entry in self.digits
                    for key in ([entry] if is_speech(entry) else entry)]
        if self.scenario == "barge-in":
            return [(self.digits[0][:1] if self.digits and self.digits[0] else "9")]
        return list(self.digits)

    def greeting_text(self) -> str:
        return self.greeting if self.greeting is not None else default_greeting()


Progress = Callable[[dict[str, Any]], None]


def new_call_sid() -> str:
    """A CallSid as Twilio writes them (``CA`` + 32 hex digits), random: unique across hosts."""
    return "CA" + uuid.uuid4().hex


def think_time(config: LoadConfig, rng: random.Random) -> float:
    """One think time: ``think_s`` spread by ``jitter`` (uniform), never negative."""
    j = min(max(config.jitter, 0.0), 1.0)
    return max(0.0, config.think_s * rng.uniform(1 - j, 1 + j))


def redial_delay(outcome: str, backoff_s: float, rng: random.Random) -> float:
    """Seconds a caller waits before dialling again after a call that ended with ``outcome``.

    A completed call is followed at once by the next (that is what "N concurrent callers"
    means); after a refusal or a failure the caller waits, as people do, 0.5 to 1.5 times
    ``backoff_s`` (uniform), so callers refused together do not redial together.
    """
    if outcome == "completed" or backoff_s <= 0:
        return 0.0
    return backoff_s * rng.uniform(0.5, 1.5)


class _Counters:
    def __init__(self) -> None:
        self.active = 0
        self.placed = 0
        self.refused = 0
        self.failed = 0


async def run_calls(config: LoadConfig, concurrency: int, level: int,
                    worker: int = 0, progress: Progress | None = None) -> Level:
    """Run one level in this process and return its calls and the clock's lateness."""
    import httpx

    from gateway.loadsim.twilio_caller import Ticker

    # What the calls import, imported before the level's clock starts: a first import inside
    # the first call (scipy through gateway.audio: 1.2 s; gateway.greeter: 1.6 s) stalls every
    # caller of the process and lands in the first turns' latency.
    if config.transport == "sip":
        import gateway.loadsim.sip_caller
    if config.scenario == "live":
        import gateway.greeter  # noqa: F401

        config.greeting_text()
    for turn in config.turns():
        if is_speech(turn):
            speech_frames(turn)  # read and coded once per process
    bot = None
    if config.scenario == "agent":
        from gateway.loadsim.agent import DEFAULT_ANSWER, AgentBot

        bot = AgentBot(port=config.bot_port, rate=config.token_rate,
                       answer=config.answer or DEFAULT_ANSWER, delay_s=config.bot_delay_s)
        await bot.start()
    ticker = Ticker()
    ticker.start()
    rng = random.Random(config.seed * 1000 + worker)
    # Turn times are measured on the monotonic clock from ``started``, which stands for
    # ``offset`` seconds after the run began (so levels line up on one timeline).
    offset = time.time() - (config.run_started_wall or time.time())
    began = time.monotonic()
    started = began - offset
    stop_at = began + config.duration_s
    counters = _Counters()
    calls: list[CallRecord] = []
    ids = itertools.count(1)
    # Callers dial over a short spread, not all in the same millisecond (then in bursts).
    spread = config.jitter * (config.think_s + config.listen_s)
    limits = httpx.Limits(max_connections=max(10, concurrency), max_keepalive_connections=10)
    http = httpx.AsyncClient(timeout=httpx.Timeout(config.turn_timeout_s, connect=5.0),
                             limits=limits)

    async def one_call() -> CallRecord:
        n = next(ids)
        record = CallRecord(id=f"w{worker}-l{level}-c{n}", level=level,
                            transport=config.transport, started_s=time.monotonic() - started)
        counters.active += 1
        counters.placed += 1
        try:
            if config.transport == "sip":
                await _sip_call(config, record, started, rng, bot)
            else:
                # Unique across simulator hosts, processes and runs (as Twilio's are): several
                # hosts' calls may reach one replica, which refuses a second stream of a CallSid.
                call_sid = record.call_id = new_call_sid()
                await _twilio_call(config, record, ticker, http, started, call_sid, rng, bot)
        except Exception as exc:
            from gateway.loadsim.twilio_caller import describe

            record.fail(f"simulator: {describe(exc)}")
            log.debug("call %s failed in the simulator", record.id, exc_info=True)
        finally:
            counters.active -= 1
            counters.refused += record.outcome == "refused"
            counters.failed += record.outcome == "failed"
            record.ended_s = time.monotonic() - started
            calls.append(record)
        return record

    async def redialler() -> None:
        # Every caller of the level dials at least once, however late its task first runs (a
        # busy machine can start it after a short level's end): a level of N callers places
        # at least N calls.
        if spread > 0:
            await asyncio.sleep(max(0.0, min(rng.uniform(0, spread),
                                              stop_at - time.monotonic())))
        while True:
            record = await one_call()
            wait = redial_delay(record.outcome, config.backoff_s, rng)
            if wait:
                await asyncio.sleep(max(0.0, min(wait, stop_at - time.monotonic())))
            if time.monotonic() >= stop_at:
                break

    async def report() -> None:
        while True:
            if progress is not None:
                firsts = sorted(t.first_audio_ms for c in calls for t in c.turns
                                if t.first_audio_ms is not None)
                progress({"level": level, "concurrency": concurrency,
                          "offered": offered_label(config, concurrency),
                          "active": counters.active,
                          "placed": counters.placed, "refused": counters.refused,
                          "failed": counters.failed,
                          "ttfa_p95": firsts[int(0.95 * (len(firsts) - 1))] if firsts else None,
                          "lateness_ms": max(ticker.lateness_ms[-50:], default=0.0),
                          "elapsed": time.monotonic() - began})
            await asyncio.sleep(0.5)

    reporter = asyncio.create_task(report())
    try:
        if config.pattern == "rate":
            arrivals: list[asyncio.Task[CallRecord]] = []
            while not arrivals or time.monotonic() < stop_at:  # at least one arrival
                arrivals.append(asyncio.create_task(one_call()))
                await asyncio.sleep(rng.expovariate(config.rate))
            await asyncio.gather(*arrivals)
        elif config.pattern == "ramp":
            tasks: list[asyncio.Task[None]] = []
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
        await http.aclose()
        if bot is not None:
            await bot.stop()
    return Level(concurrency, calls, lateness_ms=ticker.lateness_ms,
                 withhold_fraction=config.withhold_fraction,
                 duration_s=time.monotonic() - began, pattern=config.pattern,
                 offered=offered_label(config, concurrency))


def offered_label(config: LoadConfig, concurrency: int) -> str:
    """The load a level offered, as people read it."""
    if config.pattern == "rate":
        return f"{config.rate:g}/s"
    if config.pattern == "ramp":
        return f"×{config.ramp_from}→{concurrency}"
    return f"×{concurrency}"


# --- one scenario, either transport ------------------------------------------------------------


class _Leg(Protocol):
    """What a scenario needs from a call, whatever carries it."""

    answered_at: float
    #: Pause between the keys of one turn.
    key_gap_s: float

    async def first_audio(self, t: float, timeout_s: float) -> float | None:
        """Wait for the first audio answering a turn at ``t``."""

    async def end_of(self, first: float, timeout_s: float) -> float | None:
        """Wait until the utterance that started at ``first`` has been heard to its end."""

    async def press(self, key: str) -> float:
        """Press one key; the time it went out."""

    async def speak(self, frames: tuple[bytes, ...]) -> float:
        """Say these 20 ms mu-law frames; the time the last one went out."""

    def playing(self, now: float) -> bool:
        """Whether the caller is still hearing audio."""

    def gone(self) -> str | None:
        """How the gateway ended the call, if it has."""


def _unanswered(leg: _Leg, what: str, after: str, timeout_s: float) -> str:
    gone = leg.gone()
    if gone is not None:
        return f"{gone} before {what} was heard"
    return f"no audio within {timeout_s:g} s {after}"


async def _scenario(config: LoadConfig, leg: _Leg, t0: float, rng: random.Random,
                    bot: AgentBot | None = None, call_id: str | None = None,
                    ) -> tuple[list[tuple[Turn, float]], str | None]:
    """Run the scenario; returns the turns (with their monotonic times) and, when one went
    unanswered, why."""
    timeout = config.turn_timeout_s
    live = config.scenario in ("live", "agent")
    answered = leg.answered_at
    answer = Turn("answer", at_s=answered - t0)
    turns: list[tuple[Turn, float]] = [(answer, answered)]
    first = await leg.first_audio(answered, timeout)
    if first is None:
        answer.timed_out = leg.gone() is None
        return turns, _unanswered(leg, "the answer", "after the answer", timeout)
    if config.scenario == "hangup":
        await asyncio.sleep(rng.uniform(0.1, 0.6))
        return turns, None
    if live:
        if await leg.end_of(first, UTTERANCE_LIMIT_S) is None:
            gone = leg.gone()
            return turns, (f"{gone} before the greeting ended" if gone else
                           f"the greeting never ended (no end within {UTTERANCE_LIMIT_S:g} s)")
        if config.scenario == "live":
            answer.chars = len(config.greeting_text())
    for number, keys in enumerate(config.turns(), start=2):
        await asyncio.sleep(0.2 if config.scenario == "barge-in" else think_time(config, rng))
        if leg.gone() is not None:
            return turns, f"{leg.gone()} before turn {number} (keys {keys})"
        now = time.monotonic()
        kind = "barge_in" if config.scenario == "barge-in" or (not live and leg.playing(now)) \
            else "dtmf"
        pressed = 0.0
        if is_speech(keys):
            # The turn is the end of the caller's speech (the gateway's turn time too).
            kind = "speech"
            pressed = await leg.speak(speech_frames(keys))
        for index, key in enumerate(keys if kind != "speech" else ""):
            sent = await leg.press(key)
            pressed = sent if index == 0 else pressed
            if leg.key_gap_s and index < len(keys) - 1:
                await asyncio.sleep(leg.key_gap_s)
        turn = Turn(kind, at_s=pressed - t0, keys=keys)
        turns.append((turn, pressed))
        what = f"turn {number} (keys {keys})"
        first = await leg.first_audio(pressed, timeout)
        if first is None:
            turn.timed_out = leg.gone() is None
            return turns, _unanswered(leg, what, f"after pressing {keys} (turn {number})",
                                      timeout)
        if live:
            if await leg.end_of(first, UTTERANCE_LIMIT_S) is None:
                gone = leg.gone()
                return turns, (f"{gone} before the sentence of {what} ended" if gone else
                               f"the sentence of {what} never ended (no end within "
                               f"{UTTERANCE_LIMIT_S:g} s)")
            if bot is not None and call_id is not None:
                # The bot's answer: its characters, and its first token -> first audio.
                from gateway.loadsim.agent import DEFAULT_ANSWER

                turn.chars = len(config.answer or DEFAULT_ANSWER)
                token_at = bot.first_token(call_id, number - 1)
                if token_at is not None:
                    turn.token_audio_ms = 1000 * (first - token_at)
            else:
                from gateway.greeter import digit_sentence  # imported before the clock started

                turn.chars = len(digit_sentence(keys))
    if config.scenario == "barge-in":
        return turns, None
    await asyncio.sleep(config.listen_s)
    return turns, None


# --- Twilio -----------------------------------------------------------------------------------


class _TwilioLeg:
    key_gap_s = 0.05

    def __init__(self, caller: TwilioCaller) -> None:
        self.caller = caller
        self.answered_at = time.monotonic()

    async def first_audio(self, t: float, timeout_s: float) -> float | None:
        return await self.caller.wait_utterance(t, timeout_s)

    async def end_of(self, first: float, timeout_s: float) -> float | None:
        marked = await self.caller.wait_mark(first, timeout_s)
        if marked is not None:
            # The mark says the gateway sent it all; the caller hears it to the end.
            remaining = self.caller.playout_end - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
        return marked

    async def press(self, key: str) -> float:
        return await self.caller.press(key)

    async def speak(self, frames: tuple[bytes, ...]) -> float:
        return await self.caller.speak(frames)

    def playing(self, now: float) -> bool:
        return self.caller.playing(now)

    def gone(self) -> str | None:
        heard = self.caller.heard
        if heard.closed_at is None:
            return None
        return f"the gateway closed the stream ({_close(heard.close_code, heard.close_reason)})"


def _close(code: int | None, reason: str) -> str:
    return f"{code if code is not None else 'no code'} {reason}".strip()


async def _twilio_call(config: LoadConfig, record: CallRecord, ticker: Ticker,
                       http: httpx.AsyncClient, t0: float, call_sid: str,
                       rng: random.Random, bot: AgentBot | None = None) -> None:
    import websockets

    from gateway.loadsim.twilio_caller import (
        REFUSAL_CLOSE_CODES,
        DialError,
        TwilioCaller,
        after_stream,
        describe,
        dial,
    )
    from gateway.loadsim.twiml import Busy

    dialled = time.monotonic()
    try:
        answer = await dial(http, config.voice_url(), call_sid, config.auth_token,
                            config.caller_id, config.called)
    except DialError as exc:
        record.fail(str(exc))
        return
    if isinstance(answer, Busy):
        record.refuse(f"busy TwiML: {answer.message[:80]}")
        return
    caller = TwilioCaller(answer.url, answer.parameters, config.auth_token, call_sid, ticker)
    turns: list[tuple[Turn, float]] = []
    unanswered: str | None = None
    try:
        try:
            await caller.connect(timeout_s=config.turn_timeout_s)
        except websockets.InvalidStatus as exc:
            record.fail(f"stream upgrade answered HTTP {exc.response.status_code}")
            return
        except (OSError, TimeoutError, websockets.WebSocketException) as exc:
            record.fail(f"stream connect: {describe(exc)}")
            return
        # Twilio's call setup as the caller feels it: webhook, upgrade, start.
        record.setup_ms = 1000 * (time.monotonic() - dialled)
        turns, unanswered = await _scenario(config, _TwilioLeg(caller), t0, rng, bot, call_sid)
    finally:
        await caller.hangup()
    heard = caller.heard
    code = heard.close_code
    if heard.closed_by_gateway and code in REFUSAL_CLOSE_CODES:
        record.refuse(f"stream closed {_close(code, heard.close_reason)}")
    elif heard.closed_by_gateway and code not in (1000, None):
        # The real cause of anything the caller did not hear afterwards.
        record.fail(f"the gateway closed the stream: {_close(code, heard.close_reason)}")
    elif caller.error:
        record.fail(caller.error)
    elif unanswered is not None:
        record.dropped = heard.closed_by_gateway
        record.fail(unanswered)
    if heard.closed_by_gateway and answer.action and record.outcome != "refused":
        try:
            outcome = await after_stream(http, answer, call_sid, config.auth_token,
                                         config.caller_id, config.called)
            record.transferred_to = outcome.transfer_to
        except DialError as exc:
            record.fail(str(exc))
    _measure_twilio(record, caller, turns)


def _measure_twilio(record: CallRecord, caller: TwilioCaller,
                    turns: list[tuple[Turn, float]]) -> None:
    """Per turn: first audio, barge-in, gaps until the next turn."""
    heard = caller.heard
    ends = [at for _, at in turns[1:]] + [time.monotonic()]
    for (turn, at), end in zip(turns, ends, strict=True):
        first = heard.utterance_after(at, until=end)
        if first is not None:
            turn.first_audio_ms = 1000 * (first - at)
            gaps, gap_ms, audio = heard.gaps_between(first, end)
            turn.gaps, turn.gap_ms = gaps, gap_ms
            record.audio_ms += 1000 * audio
        elif not turn.timed_out and turn.kind != "answer" and record.error is None:
            turn.timed_out = True
        if turn.kind == "barge_in":
            clear = heard.clear_after(at)
            turn.barge_in_ms = 1000 * (clear - at) if clear is not None and clear < end else None
        record.turns.append(turn)
    record.jitter_ms = heard.jitter_ms()
    media = heard.media
    for mark_at, _ in heard.marks:
        before = [arrival for arrival, _ in media if arrival <= mark_at]
        if before:
            record.mark_rtt_ms.append(1000 * (mark_at - before[-1]))


# --- SIP --------------------------------------------------------------------------------------


class _SipLeg:
    key_gap_s = 0.0  # send_dtmf returns once the key's last packet is out

    def __init__(self, caller: SipCaller) -> None:
        self.caller = caller
        assert caller.answered_at is not None
        self.answered_at: float = caller.answered_at

    def _hung_up(self) -> bool:
        return self.caller.remote_hangup_at is not None

    async def first_audio(self, t: float, timeout_s: float) -> float | None:
        return await _poll(lambda: self.caller.utterance_after(t), timeout_s, self._hung_up)

    async def end_of(self, first: float, timeout_s: float) -> float | None:
        return await _poll(lambda: self.caller.stream_stopped_after(first), timeout_s,
                           self._hung_up)

    async def press(self, key: str) -> float:
        return await self.caller.send_dtmf(key)

    async def speak(self, frames: tuple[bytes, ...]) -> float:
        return await self.caller.speak(frames)

    def playing(self, now: float) -> bool:
        return self.caller.rtp.speaking_at(now)

    def gone(self) -> str | None:
        return "the gateway hung up (BYE)" if self._hung_up() else None


async def _sip_call(config: LoadConfig, record: CallRecord, t0: float,
                    rng: random.Random, bot: AgentBot | None = None) -> None:
    from gateway.loadsim.sip_caller import CallFailed, CallTimeout, SipCaller
    from gateway.sip.sdp import SdpError

    caller = SipCaller(caller_id=config.caller_id.replace(" ", "").lstrip("+") or "loadsim")
    turns: list[tuple[Turn, float]] = []
    try:
        try:
            await caller.call(config.sip_target(), user=config.called.replace(" ", ""),
                              timeout_s=config.turn_timeout_s)
        except CallFailed as exc:
            cause = f"SIP {exc.status} {exc.reason}".strip()
            if exc.refused:
                record.refuse(cause)
            else:
                record.fail(cause)
            return
        except CallTimeout:
            record.fail(f"no final response to the INVITE within {config.turn_timeout_s:g} s")
            return
        except SdpError as exc:
            record.fail(f"unusable SDP answer: {exc}")
            return
        record.setup_ms = caller.setup_ms
        record.call_id = caller.call_id
        leg = _SipLeg(caller)
        turns, unanswered = await _scenario(config, leg, t0, rng, bot, caller.call_id)
        if unanswered is not None:
            record.dropped = leg.gone() is not None
            record.fail(unanswered)
    finally:
        await caller.hangup()
        caller.close()
    record.transferred_to = caller.transferred_to
    ends = [at for _, at in turns[1:]] + [time.monotonic()]
    for (turn, at), end in zip(turns, ends, strict=True):
        first = caller.utterance_after(at, until=end)
        if first is not None:
            turn.first_audio_ms = 1000 * (first - at)
            gaps, gap_ms = caller.gaps(first, end)
            turn.gaps, turn.gap_ms = gaps, gap_ms
            record.audio_ms += 1000 * (end - first)
        if turn.kind == "barge_in":
            stopped = caller.stream_stopped_after(at)
            turn.barge_in_ms = 1000 * (stopped - at) if stopped is not None else None
        record.turns.append(turn)
    record.jitter_ms = caller.jitter_ms
    record.loss_pct = caller.loss_pct


async def _poll(check: Callable[[], float | None], timeout_s: float,
                stop: Callable[[], bool] | None = None) -> float | None:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found is not None or (stop is not None and stop()):
            return found
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.01)


# --- the gateway's own view: /readyz and /metrics ---------------------------------------------

#: Turns the gateway itself failed, by counter in /metrics: (cause, the ``result`` label that
#: means a failure, or None for every sample). Callers cannot always hear these (a speech gather
#: whose recogniser failed prompts again and takes keys), so the simulator reads them there.
GATEWAY_FAILURES: dict[str, tuple[str, str | None]] = {
    "gateway_speech_turns_total": (
        "speech recognition failed (gateway_speech_turns_total{result=failed})", "failed"),
    "gateway_speech_failures_total": (
        "an utterance was not heard: TTS failed (gateway_speech_failures_total)", None),
    "gateway_webhook_failures_total": (
        "a script webhook failed: the call went to its error node "
        "(gateway_webhook_failures_total)", None),
    "gateway_calls_protocol_errors_total": (
        "a call was closed for a malformed message (gateway_calls_protocol_errors_total)", None),
}

#: The /readyz field the simulator reads the replica's call budget from.
READYZ_BUDGET_FIELD = "max_calls"


def probe_readyz(base: str | None, timeout_s: float = 3.0) -> dict[str, Any] | None:
    """GET /readyz; its JSON body (with ``http_status`` added), or None when unreachable."""
    if not base:
        return None
    import httpx

    try:
        response = httpx.get(f"{base}/readyz", timeout=timeout_s)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    return {**body, "http_status": response.status_code}


def budget_warning(readyz: dict[str, Any] | None, concurrency: int) -> str | None:
    """A warning when the offered concurrency is more than the gateway will take."""
    if readyz is None:
        return None
    status = readyz.get("status")
    if readyz.get("http_status") != 200 or (status is not None and status != "ready"):
        return (f"the gateway is not ready (/readyz: {status or readyz.get('http_status')}): "
                "its calls will be refused")
    budget = readyz.get(READYZ_BUDGET_FIELD)
    if isinstance(budget, int) and not isinstance(budget, bool) and concurrency > budget:
        return (f"offered concurrency {concurrency} exceeds the gateway's call budget "
                f"({READYZ_BUDGET_FIELD} {budget} in /readyz): about {concurrency - budget} "
                "caller(s) at a time will be refused and redial after --backoff; raise "
                "GATEWAY_MAX_CALLS on the gateway under test to measure beyond it")
    return None


def scrape_metrics(base: str | None, timeout_s: float = 3.0) -> dict[str, float] | None:
    """The gateway counters the simulator compares against its own view, from /metrics."""
    if not base:
        return None
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(f"{base}/metrics", timeout=timeout_s)
        if response.status_code != 200:
            return None
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError):
        return None
    values: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name == "gateway_turns_total":
                key = f"turns_{sample.labels.get('source', '?')}"
            elif sample.name == "gateway_calls_refused_total":
                key = "refused"
            elif sample.name == "gateway_calls_total":
                key = "calls"
            elif sample.name in GATEWAY_FAILURES:
                cause, result = GATEWAY_FAILURES[sample.name]
                if result is not None and sample.labels.get("result") != result:
                    continue
                key = f"failed:{cause}"
            else:
                continue
            values[key] = values.get(key, 0.0) + sample.value
    return values


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None
                  ) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {key: after[key] - before.get(key, 0.0) for key in after}


# --- levels and workers -----------------------------------------------------------------------


def _worker(config: LoadConfig, concurrency: int, level: int, worker: int) -> dict[str, Any]:
    result = asyncio.run(run_calls(config, concurrency, level, worker))
    return {"calls": [c.to_json() for c in result.calls], "lateness_ms": result.lateness_ms,
            "duration_s": result.duration_s}


def run_level(config: LoadConfig, concurrency: int, level: int,
              progress: Progress | None = None) -> Level:
    """Run one level, split across ``config.workers`` processes when more than one; the
    gateway's /metrics are read before and after (``Level.gateway``)."""
    if not config.run_started_wall:
        config.run_started_wall = time.time()
    before = scrape_metrics(config.http_base())
    if config.workers <= 1:
        result = asyncio.run(run_calls(config, concurrency, level, 0, progress))
    else:
        shares = [concurrency // config.workers + (1 if i < concurrency % config.workers else 0)
                  for i in range(config.workers)]
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=context) as pool:
            futures = [pool.submit(_worker, config, share, level, i)
                       for i, share in enumerate(shares) if share]
            parts = [f.result() for f in futures]
        calls = [CallRecord.from_json(c) for part in parts for c in part["calls"]]
        lateness = [x for part in parts for x in part["lateness_ms"]]
        result = Level(concurrency, calls, lateness_ms=lateness,
                       withhold_fraction=config.withhold_fraction,
                       duration_s=max(part["duration_s"] for part in parts),
                       pattern=config.pattern, offered=offered_label(config, concurrency))
    result.gateway = metrics_delta(before, scrape_metrics(config.http_base()))
    return result


def result_document(config: LoadConfig, levels: list[Level], started: str, duration_s: float,
                    slo: str | None = None, slo_passed: bool | None = None,
                    level_passed: list[bool | None] | None = None,
                    warnings: list[str] | None = None) -> dict[str, Any]:
    """The JSON result document (input of the HTML report and of ``loadsim merge``)."""
    summaries = [lv.summary() for lv in levels]
    for summary, passed in zip(summaries, level_passed or [None] * len(levels), strict=True):
        summary["passed"] = passed
    lateness = [x for lv in levels for x in lv.lateness_ms]
    return {
        "meta": {"version": 2, "target": config.target, "transport": config.transport,
                 "scenario": config.scenario, "started": started, "duration_s": duration_s,
                 "workers": config.workers, "config": asdict(config) | {"auth_token": None},
                 "simulator_lateness_ms": percentiles(lateness), "slo": slo,
                 "slo_passed": slo_passed, "warnings": list(warnings or [])},
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
    summaries = dict(enumerate(document.get("levels", [])))
    levels = []
    for index, calls in sorted(by_level.items()):
        summary = summaries.get(index, {})
        conc = summary.get("concurrency", 0)
        levels.append(Level(conc, calls, lateness_ms=list(lateness.get(str(conc), [])),
                            duration_s=summary.get("duration_s"),
                            pattern=summary.get("pattern", "concurrency"),
                            gateway=summary.get("gateway"), speech=summary.get("speech"),
                            target=summary.get("target"), offered=summary.get("offered")))
    return levels
