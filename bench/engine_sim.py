"""Live turns the engine core holds on a simulated device, without the phone path.

    python bench/engine_sim.py                    # anchor profile, then 10/20/30/40 ms steps
    python bench/engine_sim.py --callers 32 --duration 20 --sweep 20

``bench/capacity_sim.py`` measures a whole gateway (sockets, G.711, pacing, the load
simulator's callers) over the simulated device; this one measures the engine core alone (the
speech service, scheduler, loop and chunk planner over ``SimulatedEngine``), so that a gap can
be put on the engine or on the phone path. Each caller asks for a sentence, takes its chunks as
they come (a listener who starts playing at the first chunk: a gap is a chunk that arrives after
the audio before it has finished playing, as ``SpeechStream`` counts them), listens to the end,
pauses 0.5-1.5 s (the caller's turn) and asks again. Every figure is from a SIMULATED device:
the device's prefill, step and decode take the profile's times; the host side is real.

The last line: first-audio p95 at the anchor profile over the device's own first-chunk time
(what the engine core adds, as a ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity_sim import device_first_chunk_ms
from common import print_table

from gateway.tts.engine import SpeechRequest
from gateway.tts.service import SpeechService
from gateway.tts.simulated import DeviceProfile, SimulatedEngine, load_profile

SENTENCES = (
    "Thanks for calling Acme, how can I help you today?",
    "Your balance is forty two dollars and ten cents.",
    "Please hold while I transfer you to an agent.",
    "Press one for billing, two for support, or stay on the line.",
)


@dataclass(frozen=True, slots=True)
class _Turn:
    first_s: float
    gaps: int
    gap_s: float
    audio_s: float


async def _caller(service: SpeechService, index: int, end: float, out: list[_Turn]) -> None:
    rng = random.Random(index)
    await asyncio.sleep(rng.uniform(0.0, 2.0))  # callers arrive spread over two seconds
    while time.monotonic() < end:
        started = time.monotonic()
        stream = service.stream(SpeechRequest(text=rng.choice(SENTENCES), seed=index),
                                turn_started_at=started)
        first: float | None = None
        audio_s = 0.0
        async for chunk in stream:
            if first is None:
                first = time.monotonic()
            audio_s += len(chunk) / 24000
        if first is None:
            continue
        out.append(_Turn(first - started, stream.gaps, stream.gap_s, audio_s))
        await asyncio.sleep(max(0.0, first + audio_s - time.monotonic()) + rng.uniform(0.5, 1.5))


async def run_level(profile: DeviceProfile, callers: int, duration: float) -> dict[str, float]:
    """One level: ``callers`` listeners for ``duration`` seconds on one simulated device."""
    engine = SimulatedEngine(profile, max_rows=64)
    service = SpeechService([engine])
    service.start()
    turns: list[_Turn] = []
    try:
        end = time.monotonic() + duration
        await asyncio.gather(*(_caller(service, i, end, turns) for i in range(callers)))
    finally:
        service.stop()
    stats = service.stats
    first = sorted(t.first_s for t in turns)
    return {
        "turns": len(turns),
        "gaps": sum(t.gaps for t in turns),
        "gap_ms": 1000 * sum(t.gap_s for t in turns),
        "ttfa_p50": 1000 * first[len(first) // 2],
        "ttfa_p95": 1000 * first[int(0.95 * (len(first) - 1))],
        "rows_mean": statistics.mean(stats.step_rows) if stats.step_rows else 0.0,
        "rows_max": max(stats.step_rows, default=0),
        "step_ms": 1000 * statistics.mean(stats.step_s) if stats.step_s else 0.0,
        "interval_ms": (1000 * statistics.mean(stats.step_interval_s)
                        if stats.step_interval_s else 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h200-0.6b-anchors")
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--sweep", default="10,20,30,40",
                        help="64-row step ms of the scaled profiles ('' for none)")
    args = parser.parse_args()
    base = load_profile(args.profile)
    variants = [base] + [base.scaled((64, float(ms))) for ms in args.sweep.split(",") if ms]
    rows: list[list[str]] = []
    anchor: dict[str, float] = {}
    for profile in variants:
        result = asyncio.run(run_level(profile, args.callers, args.duration))
        if profile is base:
            anchor = result
        device = device_first_chunk_ms(profile, int(result["rows_max"]) or 1)
        rows.append([profile.name, f"{profile.step_ms(64, 512):.1f}", str(args.callers),
                     f"{result['turns']:.0f}", f"{result['gaps']:.0f}",
                     f"{result['gap_ms']:.0f}", f"{result['ttfa_p50']:.0f}",
                     f"{result['ttfa_p95']:.0f}", f"{device:.0f}",
                     f"{result['rows_mean']:.1f}", f"{result['step_ms']:.1f}",
                     f"{result['interval_ms']:.1f}"])
    print_table(rows, ["profile (SIMULATED device)", "64-row step ms", "callers", "turns",
                       "gaps", "gap ms", "ttfa p50 ms", "p95 ms", "device ms", "rows mean",
                       "step ms", "iteration ms"],
                f"live turns on the engine core alone, simulated device ({args.duration:.0f} s "
                "a level; no phone path)")
    device = device_first_chunk_ms(base, int(anchor["rows_max"]) or 1)
    print(f"RESULT first-audio p95 / device's own first chunk, engine core alone at "
          f"{args.callers} live turns (SIMULATED {base.name}) = "
          f"{anchor['ttfa_p95'] / device:.2f}x ({anchor['ttfa_p95'] - device:.0f} ms added; "
          f"gaps {anchor['gaps']:.0f})")


if __name__ == "__main__":
    main()
