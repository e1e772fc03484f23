"""Engine benchmark: first audio, real-time factor and gaps through the scheduler, and the
streaming engine's throughput against the official qwen-tts path, in the same process.

    python bench/engine.py                                  # CPU, tiny checkpoint (regressions)
    python bench/engine.py --engine slots                   # the slot engine (the baseline)
    python bench/engine.py --device cuda --model DIR        # GPU, e.g. a full-size random 0.6B
    python bench/engine.py --device cuda --build-random 0.6B --model /tmp/q06b \\
        --levels 1,8,64 --markdown gpu.md

Every turn is forced to a fixed number of codec frames (random weights would stop at random
points; timing depends on the shapes, not the weights). ``concurrency`` callers speak at once,
each one turn after another, with different speakers. First audio is measured from the turn's
submission to the first 20 ms 8 kHz mu-law frame coming out of the phone pipeline. A gap is a
chunk that arrives after the previous audio would have finished playing for a listener who
started at the first chunk. RTF is a turn's generation time over its audio time. The last line
is the ratio of the engine's single-turn throughput (audio seconds per wall second) to the
official non-streaming ``generate_custom_voice`` on the same model and device.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from common import TEXTS, pct, print_table, run_callers
from slot_engine import SlotEngine, SlotService

from gateway.tts.batched import BatchedQwenEngine
from gateway.tts.engine import Engine
from gateway.tts.qwen import QwenModel
from gateway.tts.service import SpeechService


async def run_level(engines: list[Engine], concurrency: int, turns: int,
                    frames: int) -> tuple[list, float]:  # type: ignore[type-arg]
    service: SpeechService | SlotService = (
        SpeechService(engines, first_audio_budget_s=0.2)
        if isinstance(engines[0], BatchedQwenEngine) else SlotService(engines))
    service.start()
    try:
        return await run_callers(service, concurrency, turns, frames)
    finally:
        service.stop()


def official_throughput(shared: QwenModel, turns: int, frames: int) -> float:
    """Audio seconds per wall second of qwen-tts's own (non-streaming) generate_custom_voice."""
    base = shared.base
    base.generate_custom_voice(text="Warm up.", speaker="ryan", language="English",
                               max_new_tokens=3, min_new_tokens=3)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="model id, directory, or 'tiny'")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", default="batched", choices=["batched", "slots"])
    parser.add_argument("--build-random", choices=["0.6B", "1.7B"],
                        help="first build a full-size random-weight checkpoint at --model")
    parser.add_argument("--levels", default="1,2,4,8", help="concurrency levels")
    parser.add_argument("--turns", type=int, default=8, help="turns per level (at least one "
                        "per caller)")
    parser.add_argument("--frames", type=int, default=40, help="codec frames per turn (80 ms)")
    parser.add_argument("--official-turns", type=int, default=3, help="0: skip the official path")
    parser.add_argument("--chunk-schedule", default="1,2,4,8")
    parser.add_argument("--codec-decode", default="incremental",
                        choices=["incremental", "windowed"])
    parser.add_argument("--graphs", default="auto", choices=["auto", "on", "off"],
                        help="batched engine's graph mode (on with a CPU: the capture stand-in)")
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--markdown", type=Path, help="also append the table here (Markdown)")
    args = parser.parse_args()

    import logging

    import torch

    # The engine's start-up (graph captures, one line each) belongs in a benchmark's log.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("gateway.tts").setLevel(logging.INFO)

    if args.build_random and not (Path(args.model) / "model.safetensors").exists():
        from gateway.tts.tiny import build_random_checkpoint

        t = time.monotonic()
        build_random_checkpoint(args.model, size=args.build_random, device=args.device)
        print(f"built random {args.build_random} at {args.model} in {time.monotonic() - t:.0f} s")

    levels = [int(x) for x in args.levels.split(",")]
    t = time.monotonic()
    shared = QwenModel(args.model, device=args.device)
    engines: list[Engine]
    if args.engine == "batched":
        engines = [BatchedQwenEngine(shared, max_rows=max(levels),
                                     chunk_schedule=args.chunk_schedule,
                                     codec_decode=args.codec_decode,
                                     max_seq_len=args.max_seq_len,
                                     cuda_graphs={"auto": None, "on": True,
                                                  "off": False}[args.graphs])]
    else:
        engines = [SlotEngine(shared, chunk_schedule=args.chunk_schedule,
                              codec_decode=args.codec_decode) for _ in range(max(levels))]
    for engine in engines:
        engine.warmup()
    setup_s = time.monotonic() - t
    hardware = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    if args.engine == "batched":
        engine = engines[0]
        assert isinstance(engine, BatchedQwenEngine)
        hardware += f", graphs {engine.graph_mode}"
    print(f"model {shared.model_id} on {args.device} ({hardware}); {args.engine} engine, "
          f"{len(engines)} engine(s) loaded and warmed in {setup_s:.1f} s; {args.frames} "
          f"frames/turn, chunks {args.chunk_schedule}, codec decode {args.codec_decode}")

    rows = []
    single_throughput = float("nan")
    for level in levels:
        chosen = engines if args.engine == "batched" else engines[:level]
        results, throughput = asyncio.run(
            run_level(chosen, level, max(args.turns, level), args.frames))
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
    headers = ["concurrency", "turns", "first audio p50 ms", "p95 ms", "p99 ms", "RTF p50",
               "audio s / wall s", "gaps", "gap ms"]
    title = f"{args.engine} engine through the scheduler ({shared.model_id}, {hardware})"
    print_table(rows, headers, title)
    official = float("nan")
    if args.official_turns:
        official = official_throughput(shared, args.official_turns, args.frames)
        print(f"official qwen-tts generate_custom_voice: {official:.2f} audio s / wall s "
              f"({args.official_turns} turns, non-streaming)")
    print(f"{args.engine} engine, one turn at a time:    {single_throughput:.2f} audio s / "
          "wall s")
    if args.markdown is not None:
        with args.markdown.open("a") as out:
            versus = (f"; official path {official:.2f} audio s / wall s"
                      if args.official_turns else "")
            out.write(f"\n{title}; {args.frames} frames per turn{versus}\n\n")
            out.write("| " + " | ".join(headers) + " |\n")
            out.write("|" + "---|" * len(headers) + "\n")
            for row in rows:
                out.write("| " + " | ".join(row) + " |\n")
    if args.official_turns:
        print(f"RESULT {args.engine}/official throughput = {single_throughput / official:.2f}x")
    else:
        print(f"RESULT {args.engine} audio-s per wall-s, one turn = {single_throughput:.2f}")


if __name__ == "__main__":
    main()
