"""Engine benchmark: first audio, real-time factor and gaps through the scheduler, and the
streaming engine's throughput against the official qwen-tts path, in the same process.

    python bench/engine.py                                  # CPU, tiny checkpoint (regressions)
    python bench/engine.py --device cuda --model DIR        # GPU, e.g. a full-size random 0.6B
    python bench/engine.py --device cuda --build-random 0.6B --model /tmp/q06b

Every turn is forced to a fixed number of codec frames (random weights would stop at random
points; timing depends on the shapes, not the weights). First audio is measured from the turn's
submission to the first 20 ms 8 kHz mu-law frame coming out of the phone pipeline. A gap is a
chunk that arrives after the previous audio would have finished playing for a listener who
started at the first chunk. The last line is the ratio of the streaming engine's throughput
(audio seconds per wall second, one turn at a time) to the official non-streaming
``generate_custom_voice`` on the same model and device.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import numpy as np

from gateway.audio.framer import PhonePipeline
from gateway.tts.engine import SpeechRequest
from gateway.tts.qwen import QwenEngine, QwenModel
from gateway.tts.service import SpeechService

TEXTS = [
    "Thank you for calling. Press one for billing, two for support.",
    "Your account balance is forty two dollars and ten cents.",
    "Please hold while I transfer you to an agent.",
    "Sorry, I did not get that. Please enter your account number.",
]


@dataclass
class Turn:
    first_frame_s: float
    rtf: float
    gaps: int
    gap_s: float
    audio_s: float


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def run_turn(service: SpeechService, text: str, frames: int, seed: int) -> Turn:
    request = SpeechRequest(text=text, seed=seed, max_frames=frames, min_frames=frames)
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


async def run_level(engines: list[QwenEngine], concurrency: int, turns: int,
                    frames: int) -> tuple[list[Turn], float]:
    service = SpeechService(engines[:concurrency], first_audio_budget_s=0.2)
    service.start()
    try:
        t0 = time.monotonic()
        results: list[Turn] = []
        # ``turns`` turns, ``concurrency`` at a time (each worker loops over its share).
        async def caller(worker: int) -> None:
            for i in range(worker, turns, concurrency):
                results.append(await run_turn(service, TEXTS[i % len(TEXTS)], frames, seed=i))
        await asyncio.gather(*(caller(w) for w in range(concurrency)))
        wall = time.monotonic() - t0
    finally:
        service.stop()
    return results, sum(t.audio_s for t in results) / wall


def official_throughput(shared: QwenModel, turns: int, frames: int) -> float:
    """Audio seconds per wall second of qwen-tts's own (non-streaming) generate_custom_voice."""
    base = shared.base
    audio = 0.0
    t0 = time.monotonic()
    for i in range(turns):
        wavs, rate = base.generate_custom_voice(
            text=TEXTS[i % len(TEXTS)], speaker="ryan", language="English",
            # qwen-tts yields max_new_tokens - 1 frames (the prefill step emits none).
            max_new_tokens=frames + 1, min_new_tokens=frames + 1,
        )
        audio += len(wavs[0]) / rate
    return audio / (time.monotonic() - t0)


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
    Console(width=140).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="model id, directory, or 'tiny'")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--build-random", choices=["0.6B", "1.7B"],
                        help="first build a full-size random-weight checkpoint at --model")
    parser.add_argument("--levels", default="1,2,4,8", help="concurrency levels")
    parser.add_argument("--turns", type=int, default=8, help="turns per level")
    parser.add_argument("--frames", type=int, default=40, help="codec frames per turn (80 ms)")
    parser.add_argument("--official-turns", type=int, default=3)
    parser.add_argument("--chunk-schedule", default="1,2,4,8")
    parser.add_argument("--codec-decode", default="incremental",
                        choices=["incremental", "windowed"])
    args = parser.parse_args()

    import torch

    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.build_random:
        from gateway.tts.tiny import build_random_checkpoint

        t = time.monotonic()
        build_random_checkpoint(args.model, size=args.build_random, device=args.device)
        print(f"built random {args.build_random} at {args.model} in {time.monotonic() - t:.0f} s")

    levels = [int(x) for x in args.levels.split(",")]
    t = time.monotonic()
    shared = QwenModel(args.model, device=args.device)
    engines = [QwenEngine(shared, chunk_schedule=args.chunk_schedule,
                          codec_decode=args.codec_decode) for _ in range(max(levels))]
    for engine in engines:
        engine.warmup()
    setup_s = time.monotonic() - t
    hardware = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    print(f"model {shared.model_id} on {args.device} ({hardware}); {max(levels)} slots loaded "
          f"and warmed in {setup_s:.1f} s; {args.frames} frames/turn, chunks "
          f"{args.chunk_schedule}, codec decode {args.codec_decode}")

    rows = []
    single_throughput = float("nan")
    for level in levels:
        results, throughput = asyncio.run(run_level(engines, level, args.turns, args.frames))
        if level == 1:
            single_throughput = throughput
        firsts = [1000 * r.first_frame_s for r in results]
        rtfs = [r.rtf for r in results]
        rows.append([
            str(level), str(len(results)),
            f"{pct(firsts, 50):.1f}", f"{pct(firsts, 95):.1f}", f"{pct(firsts, 99):.1f}",
            f"{statistics.median(rtfs):.3f}", f"{throughput:.2f}",
            str(sum(r.gaps for r in results)), f"{1000 * sum(r.gap_s for r in results):.0f}",
        ])
    print_table(rows, ["concurrency", "turns", "first audio p50 ms", "p95 ms", "p99 ms",
                       "RTF p50", "audio s / wall s", "gaps", "gap ms"],
                "Streaming engine through the scheduler")

    official = official_throughput(shared, args.official_turns, args.frames)
    print(f"official qwen-tts generate_custom_voice: {official:.2f} audio s / wall s "
          f"({args.official_turns} turns, non-streaming)")
    print(f"streaming engine, one turn at a time:    {single_throughput:.2f} audio s / wall s")
    print(f"RESULT streaming/official throughput = {single_throughput / official:.2f}x")


if __name__ == "__main__":
    main()
