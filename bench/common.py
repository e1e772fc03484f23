"""Helpers the engine benchmarks share: turns through the scheduler, percentiles, tables."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.audio.framer import PhonePipeline
from gateway.tts.engine import SpeechRequest
from gateway.tts.service import SpeechService

TEXTS = [
    "Thank you for calling. Press one for billing, two for support.",
    "Your account balance is forty two dollars and ten cents.",
    "Please hold while I transfer you to an agent.",
    "Sorry, I did not get that. Please enter your account number.",
]
SPEAKERS = ["ryan", "vivian", "serena", "aiden", "dylan", "eric", "sohee", "ono_anna"]


@dataclass
class Turn:
    """One turn as a caller hears it."""

    first_frame_s: float
    rtf: float
    gaps: int
    gap_s: float
    audio_s: float


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


async def run_turn(service: SpeechService, text: str, frames: int, seed: int,
                   speaker: str = "ryan") -> Turn:
    """One fixed-length turn; first audio = submission to the first 20 ms mu-law frame."""
    request = SpeechRequest(text=text, speaker=speaker, seed=seed, max_frames=frames,
                            min_frames=frames)
    pipeline = PhonePipeline("pcmu")
    submitted = time.monotonic()
    stream = service.stream(request)
    first: float | None = None
    async for chunk in stream:
        if pipeline.push(chunk) and first is None:
            first = time.monotonic() - submitted
    pipeline.flush()
    await stream.finished.wait()
    assert stream.started_at is not None and stream.finished_at is not None
    generation = stream.finished_at - stream.started_at
    return Turn(first if first is not None else float("nan"),
                generation / max(stream.audio_s, 1e-9), stream.gaps, stream.gap_s, stream.audio_s)


async def run_callers(service: SpeechService, concurrency: int, turns: int,
                      frames: int) -> tuple[list[Turn], float]:
    """``concurrency`` callers speaking ``turns`` turns in all, each one turn at a time.

    Returns the turns and the aggregate audio seconds generated per wall second.
    """
    results: list[Turn] = []

    async def caller(worker: int) -> None:
        for i in range(worker, turns, concurrency):
            results.append(await run_turn(service, TEXTS[i % len(TEXTS)], frames, seed=i,
                                          speaker=SPEAKERS[i % len(SPEAKERS)]))

    t0 = time.monotonic()
    await asyncio.gather(*(caller(w) for w in range(concurrency)))
    wall = time.monotonic() - t0
    return results, sum(t.audio_s for t in results) / wall


def print_table(rows: list[list[str]], headers: list[str], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(title)
        print(" | ".join(headers))
        for row in rows:
            print(" | ".join(row))
        return
    table = Table(title=title)
    for header in headers:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)
