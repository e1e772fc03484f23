"""Host time per engine step: everything an engine-core iteration does but the device's work.

    python bench/host_time.py            # simulated device (anchor profile) and the tiny model
    python bench/host_time.py --quick    # fewer frames per turn

At 1, 8, 16, 32 and 64 rows, every row generating (consumers take their audio at once, so no
row sits out), the core's iterations are timed whole and the engine reports the time it spent
on the device (graph replays or eager device work, device-to-host copies; the simulated
device's waits). The difference is the host's share: the scheduler's plans, staging the step's
inputs, per-row bookkeeping, the batched decode's grouping, handing the audio to asyncio. A
fast device (an H200 step of ~10 ms at 64 rows) is fed only if that stays a few milliseconds.

Two engines: the simulated device (its own per-call Python is the host work a real engine does
around its kernels) and the real batched engine on the tiny checkpoint (its host work measured
around its CPU "device" work). The last line is the host time per step at 64 rows over that at
one row on the simulated device (how the host's work grows with the callers), with the 64-row
figure in milliseconds beside it (target: at most 5 ms on this CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table

from gateway.tts.engine import BatchEngine, SpeechRequest
from gateway.tts.service import SpeechService

LEVELS = (1, 8, 16, 32, 64)


async def measure(engine: BatchEngine, rows: int, frames: int) -> tuple[float, float, float]:
    """Host ms per step (median, p95) and device ms per step with ``rows`` rows stepping."""
    service = SpeechService([engine], ahead_high_s=1e9, ahead_low_s=1e9)
    service.start()
    try:
        core = service.cores[0]

        async def turn(i: int) -> None:
            request = SpeechRequest(text=f"Caller {i} hears this sentence now.", seed=i,
                                    speaker="ryan", max_frames=frames, min_frames=frames)
            async for _chunk in service.stream(request):
                pass

        await asyncio.gather(*(turn(i) for i in range(rows)))
        times = core.times
        full = [h for h, n in zip(times.host_s, times.rows, strict=True) if n == rows]
        if not full:
            full = times.host_s
        device = times.device_s / max(1, times.steps)
        cuts = statistics.quantiles(full, n=20) if len(full) >= 2 else full * 19
        return 1000 * statistics.median(full), 1000 * cuts[-1], 1000 * device
    finally:
        service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-tiny", action="store_true", help="the simulated device only")
    args = parser.parse_args()
    frames = 24 if args.quick else 48

    import torch

    torch.set_num_threads(1)
    from gateway.tts.simulated import SimulatedEngine, load_profile

    profile = load_profile("h200-0.6b-anchors")
    simulated: dict[int, tuple[float, float, float]] = {}
    tiny: dict[int, tuple[float, float, float]] = {}
    for rows in LEVELS:
        engine = SimulatedEngine(profile, max_rows=64)
        simulated[rows] = asyncio.run(measure(engine, rows, frames))
    if not args.skip_tiny:
        from gateway.tts.batched import BatchedQwenEngine

        real = BatchedQwenEngine("tiny", device="cpu", max_rows=64, trim_leading_silence=False)
        real.warmup()
        for rows in LEVELS:
            tiny[rows] = asyncio.run(measure(real, rows, frames // 2))
    table = []
    for rows in LEVELS:
        s = simulated[rows]
        t = tiny.get(rows)
        table.append([str(rows), f"{s[0]:.2f}", f"{s[1]:.2f}", f"{s[2]:.1f}",
                      f"{t[0]:.2f}" if t else "-", f"{t[1]:.2f}" if t else "-",
                      f"{t[2]:.1f}" if t else "-"])
    print_table(table, ["rows", "host ms p50 (simulated)", "p95", "device ms (simulated)",
                        "host ms p50 (tiny)", "p95", "device ms (tiny, CPU)"],
                "host time per engine step (everything but the device)")
    top, one = simulated[64][0], simulated[1][0]
    print(f"RESULT host time per step at 64 rows / at 1 row (simulated device) = "
          f"{top / one:.2f}x ({top:.2f} ms at 64 rows; target <= 5 ms)")


if __name__ == "__main__":
    main()
