"""The batched loop behind SpeechService, on CPU with the tiny checkpoint (real engine, threads).

Joining mid-flight, one row stopping (EOS, frame cap, cancel) while the others go on, the queue
of a full batch, a failed step and the rebuild, the watchdog, backpressure, urgency and the
prefill budget. Waits are on events and on the service's condition, never on sleeps.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from clocks import ManualClock

from gateway.errors import EngineError
from gateway.metrics import Metrics
from gateway.tts.batched import BatchedQwenEngine
from gateway.tts.engine import SAMPLES_PER_FRAME, EngineRow, SpeechRequest
from gateway.tts.qwen import QwenModel
from gateway.tts.service import SpeechService, SpeechStream


@pytest.fixture(scope="module")
def shared(tiny_model_dir: Path) -> QwenModel:
    return QwenModel(str(tiny_model_dir), device="cpu")


@pytest.fixture
def service_factory(shared: QwenModel) -> Iterator[Callable[..., SpeechService]]:
    services: list[SpeechService] = []

    def make(engine: BatchedQwenEngine | None = None, **kwargs: Any) -> SpeechService:
        engine = engine or BatchedQwenEngine(shared, max_rows=8, trim_leading_silence=False)
        service = SpeechService([engine], **kwargs)
        service.start()
        services.append(service)
        return service

    yield make
    for service in services:
        service.stop()


def _request(text: str, frames: int, **kwargs: Any) -> SpeechRequest:
    return SpeechRequest(text=text, seed=kwargs.pop("seed", 1), max_frames=frames,
                         min_frames=kwargs.pop("min_frames", frames), **kwargs)


async def _drain(stream: SpeechStream) -> list[np.ndarray]:
    return [chunk async for chunk in stream]


def _frames(chunks: Sequence[np.ndarray]) -> int:
    return sum(len(c) for c in chunks) // SAMPLES_PER_FRAME


async def _until(service: SpeechService, predicate: Callable[[], bool], timeout: float = 20.0,
                 ) -> None:
    """Wait (off the event loop) until ``predicate`` holds; the service re-checks it whenever a
    turn or a core's health changes."""
    assert await asyncio.to_thread(service.wait_for, predicate, timeout), "condition not reached"


class _Recorder(BatchedQwenEngine):
    """The real engine, with a fault and a trace seam: ``on_step`` runs before each step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.rebuilds = 0
        self.on_step: Callable[[Sequence[EngineRow]], None] | None = None
        #: A prompt whose prefill raises, alone or with others.
        self.poison: str | None = None

    def prefill(self, row: EngineRow) -> int:
        self.calls.append(f"P:{row.request.text}")  # type: ignore[attr-defined]
        if row.request.text == self.poison:  # type: ignore[attr-defined]
            raise RuntimeError("prefill poisoned (injected)")
        return super().prefill(row)

    def prefill_rows(self, rows: Sequence[EngineRow]) -> int:
        self.calls.append(f"G:{len(rows)}")
        if any(row.request.text == self.poison for row in rows):  # type: ignore[attr-defined]
            raise RuntimeError("prefill poisoned (injected)")
        return super().prefill_rows(rows)

    def step(self, rows: Sequence[EngineRow]) -> int:
        self.calls.append("S")
        if self.on_step is not None:
            self.on_step(rows)
        return super().step(rows)

    def rebuild(self) -> None:
        self.rebuilds += 1
        super().rebuild()


# --- joining, leaving ---------------------------------------------------------------------------


async def test_a_turn_joins_mid_flight_and_shares_steps_with_another_speaker(
    service_factory: Callable[..., SpeechService],
) -> None:
    metrics = Metrics()
    service = service_factory(metrics=metrics)
    first = service.stream(_request("The first turn speaks for a while.", 40))
    chunks = [await first.__anext__() for _ in range(3)]
    second = service.stream(_request("A second caller.", 12, speaker="vivian", seed=2))
    rest, other = await asyncio.gather(_drain(first), _drain(second))
    assert _frames(chunks + rest) == 40 and _frames(other) == 12
    assert second.first_chunk_at is not None and first.finished_at is not None
    assert second.first_chunk_at < first.finished_at  # joined while the first was generating
    assert max(service.stats.step_rows) == 2 and service.stats.completed == 2
    assert service.busy_slots == 0 and not service.engine.rows  # type: ignore[attr-defined]
    text = metrics.render().decode()
    for name in ("gateway_tts_batch_size_count", "gateway_tts_step_seconds_count",
                 "gateway_tts_prefill_seconds_count", "gateway_tts_queue_wait_seconds_count"):
        count = float(text.split(f"\n{name} ", 1)[1].split("\n", 1)[0])
        assert count >= 2, name
    assert 'gateway_tts_rows_waiting{reason="backpressure"}' in text


class _EosBias(torch.nn.Module):
    """The talker's codec head with EOS made overwhelming: every row ends by EOS at its first
    frame allowed to (its ``min_frames``): a deterministic EOS from the real model path."""

    def __init__(self, head: torch.nn.Module, eos: int) -> None:
        super().__init__()
        self.head, self.eos = head, eos

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        logits[..., self.eos] += 1e4
        return logits


@pytest.fixture
def eos_biased(shared: QwenModel) -> Iterator[None]:
    # Not monkeypatch: it deletes an nn.Module child on undo (children live in _modules).
    talker = shared.base.model.talker
    head = talker.codec_head
    talker.codec_head = _EosBias(head, int(shared.base.model.config.talker_config
                                           .codec_eos_token_id))
    try:
        yield
    finally:
        talker.codec_head = head


@pytest.mark.usefixtures("eos_biased")
async def test_one_row_stops_at_eos_frame_cap_or_cancel_while_the_others_go_on(
    service_factory: Callable[..., SpeechService],
) -> None:
    service = service_factory()
    long = service.stream(_request("The long one goes on and on.", 36))
    ends = service.stream(_request("Ends by EOS.", 30, min_frames=5))
    capped = service.stream(_request("Capped.", 9))
    doomed = service.stream(_request("Hung up on.", 200))
    long_chunks = asyncio.create_task(_drain(long))
    await doomed.__anext__()
    cancelled_at = time.monotonic()
    doomed.cancel()
    ended, capped_chunks = await asyncio.gather(_drain(ends), _drain(capped))
    assert _frames(ended) == 5 and _frames(capped_chunks) == 9
    assert _frames(await long_chunks) == 36
    await asyncio.wait_for(doomed.finished.wait(), 10)
    assert service.stats.cancelled == 1 and service.stats.completed == 3
    freed = service.stats.cancel_to_free_s[-1]
    assert 0 <= freed <= time.monotonic() - cancelled_at
    print(f"\ncancel -> row free {1000 * freed:.1f} ms; steps took "
          f"{1000 * max(service.stats.step_s):.1f} ms at most")
    assert service.busy_slots == 0 and not service.engine.rows  # type: ignore[attr-defined]


async def test_cancel_frees_the_row_within_a_step_and_the_queue_gets_it_at_once(
    shared: QwenModel, service_factory: Callable[..., SpeechService],
) -> None:
    service = service_factory(BatchedQwenEngine(shared, max_rows=1, trim_leading_silence=False))
    first = service.stream(_request("Cancel me, " * 8, 300))
    waiting = service.stream(_request("Next in line.", 4))
    for _ in range(6):  # past the 1-2-4-8 ramp: 8-frame chunks now
        await first.__anext__()
    assert service.queued == 1
    first.cancel()
    await asyncio.wait_for(first.finished.wait(), 10)
    chunks = await _drain(waiting)
    assert _frames(chunks) == 4
    one_chunk = float(np.max(np.diff(first.chunk_times)))
    freed = service.stats.cancel_to_free_s[-1]
    print(f"\ncancel -> row free {1000 * freed:.1f} ms; one 8-frame chunk {1000 * one_chunk:.1f} "
          f"ms; one step {1000 * float(np.median(service.stats.step_s)):.1f} ms")
    # Free within the step (and decode) in flight, well inside one 8-frame chunk.
    assert freed <= one_chunk
    assert waiting.started_at is not None and first.finished_at is not None
    assert waiting.started_at >= first.finished_at - 1e-3


async def test_a_full_batch_queues_turns_in_deadline_order(
    shared: QwenModel, service_factory: Callable[..., SpeechService],
) -> None:
    service = service_factory(BatchedQwenEngine(shared, max_rows=2, trim_leading_silence=False),
                              first_audio_budget_s=0.2)
    blockers = [service.stream(_request(f"Blocker {i}.", 24, tags={"turn": f"blocker{i}"}))
                for i in range(2)]
    for blocker in blockers:
        await blocker.__anext__()  # both rows are busy from here on
    now = time.monotonic()
    late = service.stream(_request("Late.", 2, tags={"turn": "c"}), turn_started_at=now + 0.3)
    early = service.stream(_request("Early.", 2, tags={"turn": "a"}), turn_started_at=now - 0.5)
    middle = service.stream(_request("Mid.", 2, tags={"turn": "b"}), turn_started_at=now)
    assert service.queued == 3 and service.busy_slots == 2
    await asyncio.gather(*(_drain(s) for s in (*blockers, late, early, middle)))
    assert service.stats.start_order[-3:] == ["a", "b", "c"]


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
async def test_an_exception_inside_a_step_fails_the_heard_turns_and_the_rest_carry_on(
    shared: QwenModel, service_factory: Callable[..., SpeechService], graphs: bool,
) -> None:
    """Eager, and in graph mode through the capture stand-in: there the rebuild captures every
    graph again before the loop serves on."""
    engine = _Recorder(shared, max_rows=4, trim_leading_silence=False, cuda_graphs=graphs,
                       max_seq_len=256)
    if graphs:
        engine.warmup()
    fired = threading.Event()

    def fault(rows: Sequence[EngineRow]) -> None:
        if not fired.is_set() and any(r.request.text == "Poison." for r in rows):  # type: ignore[attr-defined]
            fired.set()
            raise RuntimeError("CUDA error: an illegal memory access (injected)")

    engine.on_step = fault
    service = service_factory(engine)
    heard = service.stream(_request("Already speaking to a caller.", 60))
    received = [await heard.__anext__() for _ in range(2)]
    poison = service.stream(_request("Poison.", 10))
    bystander = service.stream(_request("Arrived with it.", 10, seed=3))
    with pytest.raises(EngineError, match="illegal memory access"):
        async for chunk in heard:
            received.append(chunk)
    assert 2 <= len(received) < 9
    # Not heard yet when the step failed: started over after the rebuild, invisibly.
    assert _frames(await _drain(poison)) == 10 and _frames(await _drain(bystander)) == 10
    # The poisoned turn at least; the bystander too if it was admitted before the failure.
    assert engine.rebuilds == 1 and service.stats.restarted >= 1
    assert service.stats.failed == 1 and service.healthy_slots == 1
    after = service.stream(_request("Later caller.", 6))
    assert _frames(await _drain(after)) == 6
    if graphs:  # warm-up and rebuild each captured all three buckets, serving none
        assert engine.captures == 2 * 3 and len(engine._graphs) == 3


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
async def test_the_watchdog_fails_a_hung_step_and_the_loop_serves_again_once_it_returns(
    shared: QwenModel, service_factory: Callable[..., SpeechService], graphs: bool,
) -> None:
    engine = _Recorder(shared, max_rows=4, trim_leading_silence=False, cuda_graphs=graphs,
                       max_seq_len=256)
    entered, release = threading.Event(), threading.Event()

    def hang(rows: Sequence[EngineRow]) -> None:
        if any(r.request.text == "Hang." for r in rows) and not release.is_set():  # type: ignore[attr-defined]
            entered.set()
            release.wait(30)

    engine.on_step = hang
    engine.warmup()  # the first step's one-off costs are not judged as a hang
    service = service_factory(engine, step_timeout_s=1.0)
    stuck = service.stream(_request("Hang.", 10))
    with pytest.raises(EngineError, match="made no progress"):
        await _drain(stuck)
    assert entered.is_set() and service.healthy_slots == 0 and service.stats.stuck_steps == 1
    with pytest.raises(EngineError, match="no healthy TTS slot"):
        service.stream(_request("Nobody to serve me.", 3))
    release.set()
    await _until(service, lambda: service.healthy_slots == 1)
    assert engine.rebuilds == 1
    assert _frames(await _drain(service.stream(_request("Back.", 4)))) == 4


# --- scheduling ---------------------------------------------------------------------------------


async def test_a_row_whose_consumer_holds_its_chunks_sits_out_until_they_are_taken(
    service_factory: Callable[..., SpeechService],
) -> None:
    service = service_factory(max_backlog=2)
    idle = service.stream(_request("Nobody is listening yet.", 30))
    busy = service.stream(_request("Someone is.", 30, seed=2))
    await _drain(busy)
    # 30 steps later the unread turn has handed over two chunks (1 + 2 frames) and waits.
    assert idle.backlog == 2 and idle.finished_at is None
    assert service.stats.backpressure_waits >= 1
    assert _frames(await _drain(idle)) == 30


async def test_a_turn_far_ahead_yields_to_one_waiting_for_first_audio(
    service_factory: Callable[..., SpeechService],
) -> None:
    service = service_factory(ahead_high_s=0.3, ahead_low_s=0.1)
    long = service.stream(_request("Long. " * 20, 150))
    ahead = asyncio.Event()
    chunks: list[np.ndarray] = []

    async def listen() -> None:
        async for chunk in long:
            chunks.append(chunk)
            if long.audio_ahead(time.monotonic()) > 0.5:
                ahead.set()

    listener = asyncio.create_task(listen())
    await ahead.wait()
    urgent = service.stream(_request("Urgent.", 4))
    first = await urgent.__anext__()
    assert len(first) == SAMPLES_PER_FRAME
    assert urgent.started_at is not None and urgent.first_chunk_at is not None
    # While the urgent turn waited for its first audio the long one sat its steps out (a chunk
    # already decoded may still have been handed over).
    during = [t for t in long.chunk_times if urgent.started_at < t < urgent.first_chunk_at]
    assert len(during) <= 1, during
    assert service.stats.pauses >= 1
    long.cancel()
    await _drain(urgent)
    await listener


async def test_a_burst_of_newcomers_is_prefilled_in_one_call_and_starts_in_one_step(
    shared: QwenModel, service_factory: Callable[..., SpeechService],
) -> None:
    engine = _Recorder(shared, max_rows=4, trim_leading_silence=False)
    service = service_factory(engine)
    # The core's condition is reentrant: holding it, the four are queued before the core can
    # admit any, as when four callers' turns arrive between two of its iterations.
    with service.cores[0]._cond:
        streams = [service.stream(_request(f"Caller number {i} speaks.", 6, seed=i))
                   for i in range(4)]
    outs = await asyncio.gather(*(_drain(stream) for stream in streams))
    assert [_frames(out) for out in outs] == [6, 6, 6, 6]
    assert engine.calls[:2] == ["G:4", "S"] and service.stats.step_rows[0] == 4
    assert not any(call.startswith("P:") for call in engine.calls)


async def test_a_failed_prefill_together_is_retried_one_by_one_and_fails_only_its_turn(
    shared: QwenModel, service_factory: Callable[..., SpeechService],
) -> None:
    engine = _Recorder(shared, max_rows=4, trim_leading_silence=False)
    engine.poison = "Poisoned prompt."
    service = service_factory(engine)
    with service.cores[0]._cond:
        before = service.stream(_request("Arrived first.", 6))
        poisoned = service.stream(_request("Poisoned prompt.", 6))
        after = service.stream(_request("Arrived last.", 6, seed=3))
    with pytest.raises(EngineError, match="prefill poisoned"):
        await _drain(poisoned)
    assert _frames(await _drain(before)) == 6 and _frames(await _drain(after)) == 6
    assert engine.calls[:4] == ["G:3", "P:Arrived first.", "P:Poisoned prompt.",
                                "P:Arrived last."]
    assert service.stats.failed == 1 and engine.rebuilds == 0


async def test_prefill_runs_whole_when_nobody_is_playing_and_chunk_by_chunk_when_rows_are(
    shared: QwenModel, service_factory: Callable[..., SpeechService],
) -> None:
    """The budget is the playing rows' lead. A clock that moves a second on every read makes
    every chunk late by the time anyone looks (lead < 0): then a newcomer's prefill gets one
    chunk per step. With nobody playing, all its chunks run before the first step."""

    fast_clock = ManualClock(0.0, step=1.0)
    engine = _Recorder(shared, max_rows=4, trim_leading_silence=False, prefill_chunk=8)
    service = service_factory(engine, clock=fast_clock, ahead_high_s=1e6, ahead_low_s=1e6)
    playing = service.stream(_request("Already playing for a long time.", 120))
    await playing.__anext__()
    solo_calls = list(engine.calls)
    listener = asyncio.create_task(_drain(playing))  # taken as it comes: no backpressure
    newcomer = service.stream(_request("The newcomer's prompt is chunked.", 4))
    await _drain(newcomer)
    playing.cancel()
    await listener
    first = solo_calls.index("S")
    assert set(solo_calls[:first]) == {"P:Already playing for a long time."} and first >= 4
    newcomer_chunk = "P:The newcomer's prompt is chunked."
    mine = [i for i, call in enumerate(engine.calls) if call == newcomer_chunk]
    assert len(mine) >= 4
    # Every one of its chunks but the first ran after a step of the playing row.
    assert all("S" in engine.calls[a:b] for a, b in itertools.pairwise(mine))
