"""Faults: one broken part degrades one call, never the gateway.

Each fault is injected into a real gateway (uvicorn on an ephemeral port, the tiny Qwen3-TTS on
CPU, prompts/demo.yaml from a pre-rendered cache, the company's backend on its own port) and the
caller's experience is checked over a real Twilio socket:

- the engine raising mid-sentence, or hanging inside a step: the caller hears the script's error
  prompt (``sorry``, from the cache) and is transferred; the other engine keeps serving;
- the backend refusing connections, or answering after the webhook's timeout: the webhook's
  ``on_error`` node;
- the prompt cache directory turning unwritable mid-run: calls go on from memory and the write
  error alarm rises;
- a caller that vanishes without a WebSocket close (TCP RST, FIN) or goes silent on a half-open
  socket: the call is reaped, its generation cancelled and its row freed, each timed.

Faults are injected by wrapping the real engine (it raises, blocks on an event, or is asked for a
long sentence), by stopping or slowing the real backend server, by swapping the cache directory
for something the kernel refuses to write into, and by aborting the client's real TCP socket.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from twilio.request_validator import RequestValidator

from gateway.call import Call, Utterance
from gateway.errors import EngineError
from gateway.tts.batched import BatchedQwenEngine
from gateway.tts.engine import SAMPLES_PER_FRAME, EngineRow, SpeechRequest
from gateway.tts.qwen import QwenModel
from gateway.tts.service import SpeechService, SpeechStream
from tests.support import local_http
from tests.support.metrics import metric
from tests.support.paths import DEMO_SCRIPT
from tests.support.servers import AUTH_TOKEN, LiveServer, serve, uvicorn_server
from tests.support.twilio_client import FakeTwilioCall
from tests.support.waiting import never, until

# Real time by nature: the speech service's watchdog, a real backend and real engine steps.
pytestmark = pytest.mark.slow

SORRY = "Sorry, something went wrong on our side."
BALANCE = "Your balance on account"

# --- fault injection --------------------------------------------------------------------------


@dataclass
class FaultPlan:
    """What the next turn whose text contains ``match`` does wrong (each plan fires once).

    ``raise_after``: the step after that many chunks raises (a CUDA error). ``block_after``:
    after that many chunks, hang inside the step until ``release`` is set (0: before the first
    chunk, i.e. in the prefill). ``raise_when``: the raising step first waits (under the
    watchdog's limit) for this event, so a test can make "mid-sentence" mean "after the caller
    has heard the start" on a machine of any speed. ``long_frames``: generate exactly that many
    codec frames (a long sentence, so a test can act while it is still generating).
    ``chunk_delay_s``: a slow but healthy device.
    """

    match: str = ""
    raise_after: int | None = None
    raise_when: threading.Event | None = None
    block_after: int | None = None
    long_frames: int | None = None
    chunk_delay_s: float = 0.0
    release: threading.Event = field(default_factory=threading.Event)
    #: Set when a step starts hanging.
    blocked: threading.Event = field(default_factory=threading.Event)
    fired: int = 0

    def take(self, text: str) -> bool:
        if not self.match or self.match not in text or self.fired:
            return False
        self.fired += 1
        return True


class FaultyEngine(BatchedQwenEngine):
    """The real batched engine (tiny model) that misbehaves as its :class:`FaultPlan` says, on
    the row of the turn the plan matches: a step that raises (a CUDA error) or hangs once that
    row has delivered so many chunks (0: its prefill hangs), a row asked for a long sentence,
    a slow device (each of its chunks late)."""

    def __init__(self, model: QwenModel, plan: FaultPlan) -> None:
        super().__init__(model, max_rows=4, trim_leading_silence=False)
        self.plan = plan
        self.rebuilds = 0
        #: The matched row and the chunks it has delivered.
        self._faulty: Any = None
        self._chunks = 0

    def open(self, request: SpeechRequest) -> EngineRow:
        plan = self.plan
        matched = plan.take(request.text)
        if matched and plan.long_frames is not None:
            request = replace(request, min_frames=plan.long_frames, max_frames=plan.long_frames)
        row = super().open(request)
        if matched:
            self._faulty, self._chunks = row, 0
        return row

    def _hang_here(self, at: int) -> None:
        plan = self.plan
        if plan.block_after == at and not plan.blocked.is_set():
            plan.blocked.set()
            # Hangs inside the engine call (bounded, so a broken test cannot hang the suite).
            plan.release.wait(60)

    def prefill(self, row: EngineRow) -> int:
        if row is self._faulty:
            self._hang_here(0)
        return super().prefill(row)

    def prefill_rows(self, rows: Sequence[EngineRow]) -> int:
        if any(row is self._faulty for row in rows):
            self._hang_here(0)
        return super().prefill_rows(rows)

    def step(self, rows: Sequence[EngineRow]) -> int:
        if any(row is self._faulty for row in rows) and self._chunks:
            self._hang_here(self._chunks)
            if self.plan.raise_after == self._chunks:
                self.plan.raise_after = None  # once
                if self.plan.raise_when is not None:
                    # Bounded well under the watchdog (STEP_TIMEOUT_S): this is a failing
                    # step, not a stuck one.
                    self.plan.raise_when.wait(STEP_TIMEOUT_S / 2)
                raise RuntimeError("injected engine failure")
        return super().step(rows)

    def next_chunks(self, rows: Sequence[EngineRow]) -> list[np.ndarray | None]:
        chunks = super().next_chunks(rows)
        for row, audio in zip(rows, chunks, strict=True):
            if audio is not None and row is self._faulty:
                self._chunks += 1
                if self.plan.chunk_delay_s:
                    time.sleep(self.plan.chunk_delay_s)
        return chunks

    def rebuild(self) -> None:
        super().rebuild()
        self._faulty = None
        self.rebuilds += 1  # counted once the engine is rebuilt


class Backend:
    """The company's account service on a real port; it can be slowed down or taken down."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.delay_s = 0.0
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/accounts/lookup")
        async def lookup(body: dict[str, Any]) -> dict[str, str]:
            self.seen.append(body)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            account = body["variables"]["account_number"]
            return {"first_name": "Dana", "balance": f"{int(account) % 1000}.10",
                    "due_date": "March 3"}

        return app

    def up(self) -> None:
        """Serve (again, on the same port once it had one)."""
        if self._server is not None:
            return
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        started = threading.Event()
        server = uvicorn_server(uvicorn.Config(self._app(), log_level="warning"), started.set)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        assert started.wait(10), "backend did not start"
        self._server, self._thread, self._sock = server, thread, sock

    def down(self) -> None:
        """Stop listening: connections to the port are refused from here on."""
        if self._server is None:
            return
        assert self._thread is not None and self._sock is not None
        self._server.should_exit = True
        self._thread.join(15)
        self._sock.close()
        self._server = self._thread = self._sock = None


@dataclass
class Rig:
    live: LiveServer
    plan: FaultPlan
    engines: list[FaultyEngine]
    backend: Backend

    def arm(self, **kwargs: Any) -> FaultPlan:
        """A fresh plan for the next turn, shared by every engine."""
        plan = FaultPlan(**kwargs)
        for engine in self.engines:
            engine.plan = plan
        self.plan = plan
        return plan


# The gateway's defaults are 3 s and 10 s. A tiny-model step takes under 0.2 s on an idle CPU,
# but this machine's two cores are shared: a limit much tighter than 3 s trips on healthy steps.
STEP_TIMEOUT_S = 3.0
IDLE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path, demo_cache_dir: Path) -> Iterator[Rig]:
    """The demo IVR on two engines that misbehave on demand."""
    backend = Backend()
    backend.up()
    plan = FaultPlan()
    engines: list[FaultyEngine] = []

    def factory(settings: Any) -> list[FaultyEngine]:
        shared = QwenModel(str(settings.model), device="cpu")
        # Two engines (two cores, as on two devices): one can hang while the other serves.
        engines.extend(FaultyEngine(shared, plan) for _ in range(2))
        return engines

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACME_BACKEND_URL", backend.url)
        with serve(
            {
                "model": str(tiny_model_dir),
                "script": str(DEMO_SCRIPT),
                "cache_dir": str(demo_cache_dir),
                "engine_step_timeout_ms": int(STEP_TIMEOUT_S * 1000),
                "twilio_idle_timeout_s": IDLE_TIMEOUT_S,
                # Pacing is not under test here: send prompts at once, the client plays them
                # back 20x faster, and each call takes seconds instead of tens of seconds.
                "twilio_max_lead_ms": 30000,
            },
            factory,
        ) as live:
            yield Rig(live, plan, engines, backend)
    backend.down()


# --- helpers ----------------------------------------------------------------------------------

_calls: dict[str, Call] = {}
_numbers = iter(range(1, 10**6))


def _new_call(live: LiveServer) -> FakeTwilioCall:
    n = next(_numbers)
    return FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid=f"CA{n:032x}",
                          stream_sid=f"MZ{n:032x}", playback_speed=20)


def _utterances(live: LiveServer, call: FakeTwilioCall) -> list[Utterance]:
    # The server's Call leaves state.calls when the call ends: remember it.
    server_call = live.gateway.registry.get(call.call_sid) or _calls.get(call.call_sid)
    if server_call is None:
        return []
    _calls[call.call_sid] = server_call
    return list(server_call.utterances)


async def _started(live: LiveServer, call: FakeTwilioCall, text: str,
                   timeout: float = 30) -> Utterance:
    """The utterance containing ``text`` once its first frame has gone to the caller."""
    def find() -> Utterance | None:
        return next((u for u in _utterances(live, call)
                     if text in u.text and u.first_frame_at is not None), None)
    return await until(find, timeout, f"{call.call_sid} never started {text!r}; said "
                       f"{[u.text[:30] for u in _utterances(live, call)]}", every=0.005)


async def _heard(live: LiveServer, call: FakeTwilioCall, text: str,
                 timeout: float = 30) -> Utterance:
    """The utterance containing ``text`` once the caller has played all of it."""
    def find() -> Utterance | None:
        return next((u for u in _utterances(live, call)
                     if text in u.text and u.played.is_set()), None)
    return await until(find, timeout, f"{call.call_sid} never heard {text!r}; said "
                       f"{[(u.text[:30], u.error) for u in _utterances(live, call)]}", every=0.005)


async def _to_account_lookup(live: LiveServer, call: FakeTwilioCall) -> float:
    """Menu -> 1 -> account number: returns when the '#' went out."""
    await call.start({"From": "+15550001111"})
    await _started(live, call, "For your account balance")
    await call.send_dtmf("1")
    await _started(live, call, "six digit account number")
    for digit in "123456":
        await call.send_dtmf(digit)
    return await call.send_dtmf("#")


def _after_stream(live: LiveServer, call_sid: str) -> ET.Element:
    url = f"{live.base_url}/twilio/after-stream"
    form = {"CallSid": call_sid, "AccountSid": "AC" + "0" * 32}
    signature = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
    response = local_http.post(url, data=form, headers={"X-Twilio-Signature": signature},
                               timeout=10)
    assert response.status_code == 200
    return ET.fromstring(response.text)


def _metric(live: LiveServer, name: str, default: float | None = None, **labels: str) -> float:
    """A sample from /metrics (``default`` for a labelled series not created yet)."""
    return metric(live.base_url, name, default=default, **labels)


async def _transferred_after_sorry(live: LiveServer, call: FakeTwilioCall) -> Utterance:
    """The caller hears the error prompt, from the cache, then is transferred to an agent."""
    sorry = await _heard(live, call, SORRY)
    assert sorry.cached, "the error prompt must come from the prompt cache"
    await call.wait_for(lambda: call.closed.is_set(), timeout=30)
    dial = _after_stream(live, call.call_sid).find("Dial")
    assert dial is not None and dial.text == "+15555550100"
    return sorry


# --- the engine -------------------------------------------------------------------------------


async def test_an_engine_failure_mid_sentence_plays_the_error_prompt_from_the_cache(
    rig: Rig,
) -> None:
    live = rig.live
    speech = live.gateway.speech_service
    failed, rebuilds = speech.stats.failed, sum(e.rebuilds for e in rig.engines)
    recovered = speech.stats.recovered
    heard = threading.Event()
    rig.arm(match=BALANCE, raise_after=2, raise_when=heard)
    async with _new_call(live) as call:
        await _to_account_lookup(live, call)
        # The step after two chunks fails once the sentence's first frame has gone out (the
        # start buffer holds it a moment, longer on a loaded machine).
        await _started(live, call, BALANCE)
        heard.set()
        await _transferred_after_sorry(live, call)
        balance = next(u for u in _utterances(live, call) if BALANCE in u.text)
        assert balance.error and "injected engine failure" in balance.error
        # Part of it had gone out: the partial sentence was cleared at the caller.
        assert balance.frames_sent > 0 and call.events("clear")
    assert speech.stats.failed == failed + 1
    # Back in service once rebuilt (every turn that shared the failed step was failed or
    # started over): the next call waits for that.
    await until(lambda: speech.stats.recovered == recovered + 1, 20, "recovery", every=0.005)
    assert sum(e.rebuilds for e in rig.engines) == rebuilds + 1
    assert speech.healthy_engines == 2
    # The gateway is unharmed: the next caller hears a balance.
    async with _new_call(live) as call:
        await _to_account_lookup(live, call)
        await _heard(live, call, BALANCE)


@pytest.mark.parametrize("block_after", [0, 2], ids=["first-step", "mid-sentence"])
async def test_a_stuck_engine_step_fails_the_turn_and_the_other_engine_keeps_serving(
    rig: Rig, block_after: int
) -> None:
    live = rig.live
    speech = live.gateway.speech_service
    plan = rig.arm(match=BALANCE, block_after=block_after)
    try:
        async with _new_call(live) as stuck:
            await _to_account_lookup(live, stuck)
            assert await asyncio.to_thread(plan.blocked.wait, 60), "the step never hung"
            blocked_at = time.monotonic()
            # While one engine hangs, another caller's live sentence is served by the other.
            other = _new_call(live)
            await other.connect()
            await _to_account_lookup(live, other)
            assert speech.healthy_engines >= 1
            sorry = await _transferred_after_sorry(live, stuck)
            failed_after = (sorry.first_frame_at or 0) - blocked_at
            print(f"\nstuck step ({'first' if block_after == 0 else 'mid-sentence'}): error "
                  f"prompt {1000 * failed_after:.0f} ms after the step hung "
                  f"(limit {1000 * STEP_TIMEOUT_S:.0f} ms)")
            # blocked_at is taken a moment after the step hung, hence the 0.1 s.
            assert STEP_TIMEOUT_S - 0.1 <= failed_after < STEP_TIMEOUT_S + 2.0
            await _heard(live, other, BALANCE)
            assert not other.closed.is_set()
            # Out of rotation while the step hangs, and the alarm is up.
            assert speech.healthy_engines == 1
            assert _metric(live, "gateway_tts_engines_healthy") == 1.0
            assert _metric(live, "gateway_tts_slots_healthy") == 1.0  # renames_35: keep
            assert _metric(live, "gateway_tts_stuck_steps_total") >= 1.0
            # A third caller is still served, by the healthy engine.
            async with _new_call(live) as third:
                await _to_account_lookup(live, third)
                await _heard(live, third, BALANCE)
            await other.close()
    finally:
        plan.release.set()
    # The hung step returns: the engine is rebuilt and back in service.
    await until(lambda: speech.healthy_engines == 2, 20, "engine back in service")
    assert _metric(live, "gateway_tts_engines_healthy") == 2.0


# --- the backend ------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["refused", "slow"])
async def test_an_unreachable_or_slow_backend_goes_to_the_webhooks_error_node(
    rig: Rig, failure: str
) -> None:
    live, backend = rig.live, rig.backend
    rig.arm()
    seen = len(backend.seen)
    if failure == "refused":
        backend.down()
        with pytest.raises(httpx.ConnectError):
            local_http.post(f"{backend.url}/accounts/lookup", json={}, timeout=2)
    else:
        backend.delay_s = 3.6  # the demo webhook's timeout is 3 s
    try:
        async with _new_call(live) as call:
            typed = await _to_account_lookup(live, call)
            looking_up = await _heard(live, call, "One moment while I look that up.")
            sorry = await _transferred_after_sorry(live, call)
            waited = (sorry.first_frame_at or 0) - (looking_up.first_frame_at or 0)
            print(f"\nbackend {failure}: error prompt {1000 * waited:.0f} ms after the lookup "
                  f"prompt started ({1000 * ((sorry.first_frame_at or 0) - typed):.0f} ms "
                  "after '#')")
            assert not any(BALANCE in u.text for u in _utterances(live, call))
        if failure == "slow":
            assert len(backend.seen) == seen + 1  # it was asked, and gave up on after 3 s
            assert waited >= 3.0
        else:
            assert len(backend.seen) == seen
    finally:
        backend.delay_s = 0.0
        backend.up()


# --- the caller's connection ------------------------------------------------------------------


def _vanish(call: FakeTwilioCall, how: str) -> None:
    """The caller's side disappears without a WebSocket close frame."""
    for task in call._tasks:
        task.cancel()
    assert call._ws is not None
    transport = call._ws.transport
    if how == "rst":
        # Linger 0: close() sends a TCP RST instead of a FIN (the peer crashed / a NAT dropped).
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    elif how == "fin":
        transport.close()
    else:
        # Half-open: the socket stays open, but nothing is read or sent any more.
        transport.pause_reading()


@pytest.mark.parametrize("how", ["rst", "fin", "silent"])
async def test_a_caller_who_vanishes_mid_sentence_is_reaped_and_frees_the_slot(
    rig: Rig, how: str
) -> None:
    live = rig.live
    speech = live.gateway.speech_service
    cancelled = speech.stats.cancelled
    inbound_timeouts = "gateway_calls_inbound_timeouts_total"
    timeouts = _metric(live, inbound_timeouts, default=0.0, transport="twilio")
    # 1,000 codec frames (80 s of speech; an idle core makes about 70 a second, so at least
    # 14 s of generating): still generating when the caller goes and when the idle timeout
    # reaps it. 200 frames finished within the 3 s timeout on an idle machine.
    rig.arm(match=BALANCE, long_frames=1000)
    call = _new_call(live)
    # Another caller who keeps streaming stays connected all along (the reaper's negative).
    async with _new_call(live) as bystander:
        await bystander.start()
        await call.connect()
        await _to_account_lookup(live, call)
        balance = await _started(live, call, BALANCE)
        stream = balance.stream
        assert stream is not None and not balance.generated.is_set()
        gone_at = time.monotonic()
        _vanish(call, how)
        # The idle timer starts when the gateway got the caller's last media message, which
        # left at last_media_at: up to 20 ms before gone_at, more on a busy machine.
        last_media_at = call.last_media_at
        assert last_media_at is not None
        await until(lambda: call.call_sid not in live.gateway.registry, IDLE_TIMEOUT_S + 10,
                    "call reaped", every=0.005)
        reaped_s = time.monotonic() - gone_at
        silent_s = call.now() - last_media_at
        await until(lambda: stream.finished_at is not None, 10, "slot freed", every=0.005)
        freed_s = stream.finished_at - gone_at  # type: ignore[operator]
        print(f"\ncaller vanished ({how}): call reaped after {1000 * reaped_s:.0f} ms, its "
              f"slot free after {1000 * freed_s:.0f} ms")
        assert balance.interrupted and stream.cancelled
        assert speech.stats.cancelled == cancelled + 1
        if how == "silent":
            # Only the idle timeout can tell: the socket is still open.
            assert IDLE_TIMEOUT_S <= silent_s and reaped_s < IDLE_TIMEOUT_S + 1.0, (
                silent_s, reaped_s)
            assert _metric(live, inbound_timeouts, transport="twilio") == timeouts + 1
        else:
            assert reaped_s < 1.0
        assert freed_s < reaped_s + 0.5
        # The other caller is untouched; when the silent one was reaped it had been connected
        # for longer than the idle timeout too, but kept streaming, so it stays.
        if how == "silent":
            assert time.monotonic() - bystander.started_at > IDLE_TIMEOUT_S
        assert bystander.call_sid in live.gateway.registry and not bystander.closed.is_set()
    if call._ws is not None:
        call._ws.transport.abort()
    await until(lambda: speech.busy_slots == 0, 10, "slots idle", every=0.005)


# --- the prompt cache -------------------------------------------------------------------------


async def test_an_unwritable_cache_directory_degrades_to_memory_with_an_alarm(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The cache directory is a symlink; mid-run it is swapped (atomically) for one that points
    at a regular file, so the kernel refuses every write below it (ENOTDIR), root or not: the
    same failure path as a read-only or full filesystem (an OSError from the write)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    link = tmp_path / "cache"
    link.symlink_to(disk, target_is_directory=True)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("the cache directory went away\n")
    with serve({"model": str(tiny_model_dir), "script": str(DEMO_SCRIPT),
                "cache_dir": str(link), "render_lazily": True,
                "twilio_max_lead_ms": 30000}) as live:
        errors = "gateway_prompt_cache_write_errors_total"
        # Healthy first: a prompt rendered live on a miss is stored on disk, no alarm.
        async with _new_call(live) as call:
            await call.start()
            welcome = await _heard(live, call, "Thank you for calling Acme Energy.")
            assert not welcome.cached
        # Committed means the JSON that names the WAV is in place and no temp file is left: the
        # WAV lands first, so a snapshot taken on the WAV alone can catch the JSON mid-write.
        def committed() -> bool:
            files = [p.name for p in disk.rglob("*") if p.is_file()]
            return any(n.endswith(".json") for n in files) and not any(
                n.endswith(".tmp") for n in files
            )

        await until(committed, 10, "welcome stored on disk", every=0.005)
        stored = sorted(p.name for p in disk.rglob("*") if p.is_file())
        assert _metric(live, errors) == 0.0
        # The directory becomes unwritable.
        swap = tmp_path / "swap"
        swap.symlink_to(blocker)
        os.replace(swap, link)
        async with _new_call(live) as call:
            await call.start()
            welcome = await _heard(live, call, "Thank you for calling Acme Energy.")
            assert welcome.cached  # from memory
            await _started(live, call, "For your account balance")
            await call.send_dtmf("1")
            ask = await _heard(live, call, "six digit account number")
            assert not ask.cached  # a miss: rendered live, kept in memory, the write fails
        await until(lambda: _metric(live, errors) >= 1.0, 10, "write error alarm", every=0.005)
        # The next caller hears that prompt from memory, with the disk still gone.
        async with _new_call(live) as call:
            await call.start()
            await _started(live, call, "For your account balance")
            await call.send_dtmf("1")
            ask = await _heard(live, call, "six digit account number")
            assert ask.cached
        assert sorted(p.name for p in disk.rglob("*") if p.is_file()) == stored
        await until(lambda: not live.gateway.registry, 10, "the calls to end", every=0.005)


# --- the watchdog, at the scheduler -----------------------------------------------------------


@pytest.fixture(scope="module")
def shared_model(tiny_model_dir: Path) -> QwenModel:
    return QwenModel(str(tiny_model_dir), device="cpu")


Made = tuple[SpeechService, FaultPlan]


@pytest.fixture
def service(shared_model: QwenModel) -> Iterator[Callable[..., Made]]:
    """A started SpeechService over misbehaving engines (stopped, and released, afterwards)."""
    made: list[Made] = []

    def make(engines_n: int, step_timeout_s: float | None, **plan: Any) -> Made:
        fault = FaultPlan(**plan)
        engines = [FaultyEngine(shared_model, fault) for _ in range(engines_n)]
        for engine in engines:
            engine.warmup()  # as the gateway does: a cold engine's first step is slow on a CPU
        speech = SpeechService(engines, step_timeout_s=step_timeout_s)
        speech.start()
        made.append((speech, fault))
        return speech, fault

    yield make
    for speech, fault in made:
        fault.release.set()
        speech.stop()


async def _drain(stream: SpeechStream) -> int:
    return sum([len(chunk) async for chunk in stream])


async def test_with_every_engine_stuck_queued_and_new_turns_fail_at_once(
    service: Callable[..., Made],
) -> None:
    speech, plan = service(1, 1.0, match="Stuck.", block_after=1)
    stuck = speech.stream(SpeechRequest(text="Stuck.", seed=1, max_frames=20, min_frames=20))
    assert await asyncio.to_thread(plan.blocked.wait, 60)
    queued = speech.stream(SpeechRequest(text="Queued behind it.", seed=1, max_frames=4))
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="no progress"):
        await _drain(stuck)
    with pytest.raises(EngineError, match="no healthy TTS slot"):
        await _drain(queued)
    assert time.monotonic() - t0 < 2.5  # 1 s limit: not held until the step returns
    with pytest.raises(EngineError, match="no healthy TTS slot"):
        speech.stream(SpeechRequest(text="A new turn.", seed=1, max_frames=4))
    assert speech.healthy_engines == 0 and speech.stats.stuck_steps == 1
    plan.release.set()
    # Back once its step returned, it is rebuilt and warm: a liveness bound, not a latency
    # figure (5 s on a quiet box; over 20 s with other jobs on the two cores).
    await until(lambda: speech.healthy_engines == 1, 60, "engine back")
    fresh = speech.stream(SpeechRequest(text="Served again.", seed=1, max_frames=6, min_frames=6))
    assert await _drain(fresh) == 6 * SAMPLES_PER_FRAME
    assert speech.engines[0].rebuilds == 1  # type: ignore[attr-defined]


async def test_a_slow_turn_that_keeps_making_progress_is_not_tripped(
    service: Callable[..., Made],
) -> None:
    """The watchdog judges each step, not the turn: 1 s per chunk under a 3 s limit, for longer
    than the limit in all (8 frames: at least 4 chunks), completes."""
    speech, _ = service(1, 3.0, match="Slow.", chunk_delay_s=1.0)
    t0 = time.monotonic()
    samples = await _drain(speech.stream(SpeechRequest(text="Slow.", seed=1, max_frames=8,
                                                       min_frames=8)))
    assert samples == 8 * SAMPLES_PER_FRAME and time.monotonic() - t0 > 3.0
    assert speech.stats.stuck_steps == 0 and speech.healthy_engines == 1


async def test_without_the_watchdog_a_stuck_step_holds_its_turn(
    service: Callable[..., Made],
) -> None:
    """What the watchdog prevents: with it off, the caller waits as long as the step hangs."""
    speech, plan = service(1, None, match="Stuck.", block_after=1)
    stuck = speech.stream(SpeechRequest(text="Stuck.", seed=1, max_frames=8, min_frames=8))
    drained = asyncio.ensure_future(_drain(stuck))
    assert await asyncio.to_thread(plan.blocked.wait, 60)
    # Watched over the 1 s the watchdog tests above give a step: with the watchdog on, the turn
    # fails and the slot goes out of service within it.
    await never(lambda: drained.done() or speech.healthy_engines != 1, 1.0,
                "the stuck turn given up without a watchdog")
    plan.release.set()
    assert await asyncio.wait_for(drained, 20) == 8 * SAMPLES_PER_FRAME
